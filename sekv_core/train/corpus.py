"""Training text: real long English prose that shares nothing with evaluation text.

Default source (``debian``): the English manuals that Debian ships as
documentation packages -- ``debian-reference-en`` (GPL-2+), ``developers-reference``
(GPL-2), ``debian-policy`` (GPL-2+ and others), ``debian-faq`` (verbatim-copy
permission notice) and ``maint-guide`` (GPL-2+ / MIT).  They are fetched once
with ``apt-get download`` into ``$SEKV_HOME/train-data/debian`` (package
archives are the only network this tool's machines have), unpacked with
``dpkg-deb -x``, and their HTML is reduced to text.  Nothing of them is
shipped; router files record the package names, versions and sha256.  The
evaluation text (the PG essays haystack, sample_docs/, the bench generators'
words) is disjoint from this.

Any directory of ``.txt`` / ``.md`` / ``.html`` files can be used instead
(``--data DIR``).

``contexts`` cuts the concatenated token stream into training contexts; each
context's document part is what the memory compresses.
"""

from __future__ import annotations

import hashlib
import html.parser
import random
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import SekvError
from ..models import sekv_home

DEBIAN_PACKAGES = ("debian-reference-en", "developers-reference", "debian-policy", "debian-faq", "maint-guide")
TEXT_SUFFIXES = (".txt", ".md", ".html", ".htm")
MIN_DOC_CHARS = 2000


class _Text(html.parser.HTMLParser):
    """HTML -> paragraphs of visible text (script/style/navigation dropped)."""

    SKIP = {"script", "style", "nav", "head", "title"}
    BLOCK = {"p", "div", "li", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "br", "dt", "dd", "table", "section", "blockquote"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.skip += 1
        elif tag in self.BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in self.SKIP:
            self.skip = max(0, self.skip - 1)
        elif tag in self.BLOCK:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self.skip:
            self.parts.append(data)


def html_to_text(raw: str) -> str:
    p = _Text()
    p.feed(raw)
    return normalise("".join(p.parts))


def normalise(text: str) -> str:
    lines = [re.sub(r"[ \t\r\f\v]+", " ", ln).strip() for ln in text.splitlines()]
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def read_documents(root: Path) -> list[tuple[str, str]]:
    """(relative name, text) of every text/HTML file under root, sorted by name, short ones dropped."""
    docs = []
    for p in sorted(root.rglob("*")):
        if not p.is_file() or p.suffix.lower() not in TEXT_SUFFIXES:
            continue
        raw = p.read_text(encoding="utf-8", errors="replace")
        text = html_to_text(raw) if p.suffix.lower() in (".html", ".htm") else normalise(raw)
        if len(text) >= MIN_DOC_CHARS:
            docs.append((str(p.relative_to(root)), text))
    return docs


def fetch_debian(dest: Path | None = None) -> tuple[Path, list[dict]]:
    """Download + unpack the Debian manuals once; return (text root, [{package, file, sha256}])."""
    dest = dest or sekv_home() / "train-data" / "debian"
    debs, tree = dest / "debs", dest / "tree"
    debs.mkdir(parents=True, exist_ok=True)
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        raise SekvError("the default training text needs apt-get and dpkg-deb (Debian); pass --data DIR with .txt/.html files instead")
    have = {p.name.split("_")[0]: p for p in debs.glob("*.deb")}
    for pkg in DEBIAN_PACKAGES:
        if pkg not in have:
            r = subprocess.run(["apt-get", "download", pkg], cwd=debs, capture_output=True, text=True)
            if r.returncode != 0:
                raise SekvError(f"could not download Debian package {pkg} ({(r.stderr or r.stdout).strip().splitlines()[-1:]}); pass --data DIR instead")
    sources = []
    for deb in sorted(debs.glob("*.deb")):
        pkg = deb.name.split("_")[0]
        if pkg not in DEBIAN_PACKAGES:
            continue
        out = tree / pkg
        if not out.is_dir():
            tmp = tree / f".{pkg}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], check=True, capture_output=True)
            tmp.rename(out)
        sources.append({"package": pkg, "file": deb.name, "sha256": hashlib.sha256(deb.read_bytes()).hexdigest()})
    return tree, sources


@dataclass
class Context:
    doc_ids: list[int]  # the document tokens the memory holds (chat template included)
    source: str  # where the text came from (file names)
    text: str  # the document text (for building recall queries)


def contexts(tokenizer, docs: list[tuple[str, str]], n_tokens: int, count: int, seed: int) -> list[Context]:
    """``count`` contexts of about ``n_tokens`` template+document tokens, cut from the shuffled documents.

    Documents are concatenated (in a seeded order) and cut at paragraph
    boundaries; each context is wrapped in the same chat template ingest uses,
    so the router sees the layout it will meet at ask time.
    """
    from .. import prompt

    rng = random.Random(seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    paras: list[tuple[str, str]] = [(docs[i][0], p) for i in order for p in docs[i][1].split("\n\n") if p.strip()]
    if not paras:
        raise SekvError("the training text is empty")
    out: list[Context] = []
    k = rng.randrange(len(paras))
    overhead = len(prompt.encode(tokenizer, prompt.document_prefix(tokenizer, "")))
    target = n_tokens - overhead
    guard = 0
    while len(out) < count and guard < 10 * count + 100:
        guard += 1
        chunk, names, size = [], [], 0
        while size < target:
            name, p = paras[k % len(paras)]
            k += 1
            ids = tokenizer(p, add_special_tokens=False)["input_ids"]
            if size + len(ids) > target:  # the last paragraph is cut to fill the context exactly
                ids = ids[: target - size]
                p = tokenizer.decode(ids)
            chunk.append(p)
            names.append(name)
            size += len(ids)
        text = "\n\n".join(chunk)
        ids = prompt.encode(tokenizer, prompt.document_prefix(tokenizer, text))
        if 0.8 * n_tokens <= len(ids) <= 1.1 * n_tokens:
            out.append(Context(ids, ",".join(sorted(set(names)))[:200], text))
    return out
