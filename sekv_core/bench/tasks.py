"""Benchmark tasks, generated offline and deterministically from a seed.

A task turns (tokenizer, length, depth, seed) into a :class:`Context`: one document
that is prefilled once, and one or more :class:`Probe` questions asked of it.

* ``niah``    needle in a haystack: one passphrase sentence at a depth of an essay haystack.
* ``mk_niah`` multi-key NIAH: several "special magic number for KEY" needles, one is asked
              (the asked one at the depth, the others at seeded random depths).
* ``mn_niah`` multi-needle NIAH: four passphrase needles (the first at the depth, the others at seeded random
              depths), each asked: the share of needles found.
* ``corpus_niah`` NIAH over a corpus: the haystack as several documents of one pack (each under its
              ``## file: NAME`` line, as `sekv ingest a b c -o pack` joins them); the needle in the one its
              depth falls in, at that depth within it.
* ``mv_niah`` multi-value NIAH: one key with several values scattered; all must be returned.
* ``vt``      variable tracking: a chain VAR A = 12345, VAR B = VAR A, ... hidden in filler
              text (plus one distractor chain); name every variable that holds the number.
* ``cwe``     common-word extraction: a numbered list of made-up words where a few words
              are frequent; name the most frequent ones.
* ``qa``      the sample documents' questions (``sample_docs/QUESTIONS.md``); ``qa_heldout`` more of
              them (``sample_docs/QUESTIONS_HELDOUT.md``), not used to choose any default.
* ``qa_long`` one long real document (the GNU Bash Reference Manual, ~93K tokens, made by
              ``python -m benchmarks.long_doc fetch``; ``--doc-file`` or ``$SEKV_LONG_DOC``) as ONE context,
              with the questions of ``benchmarks/long_doc_questions.md`` spread over its length.

Lengths are in model tokens of the whole document prefix (``prompt.document_prefix``,
system prompt and chat template included); the haystack is cut to the whole sentences
that fit, then words of the next sentence fill the rest (closed with a period), so a
document lands within a word of the target, never above it.  Depth is the share of the haystack's tokens
that lie before the needle (0 = first sentence, 100 = after the last), and the needle
goes in at the sentence boundary nearest to it.  ``mv_niah``, ``vt`` and ``cwe`` place
their items at seeded random depths, so their contexts have no depth (``None``).

The texts (needles, filler, word lists, questions) are our own; they mirror the
shape of RULER's synthetic tasks, not its code.
"""

from __future__ import annotations

import bisect
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .. import prompt
from ..errors import SekvError

# ---------------------------------------------------------------------------------------------
# data classes


@dataclass
class Probe:
    """One question asked of a context, with how to score the answer."""

    item: str  # distinguishes questions of one context ("" when a context has one question)
    question: str
    expected: list[str]  # answer strings
    match: str = "any"  # "any": one expected string suffices; "all": every one must appear
    whole_word: bool = False  # match expected strings as whole words
    max_new_tokens: int = 32


@dataclass
class Context:
    """A document that is prefilled once, and the questions asked of it."""

    task: str
    length: int  # target length in tokens (qa: the document's real length)
    depth: float | None  # percent, for tasks that place the needle at a depth
    seed: int
    document: str
    probes: list[Probe]
    n_tokens: int = 0  # tokens of prompt.document_prefix(document)
    meta: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# word material (ours)

NOUNS = (
    "anchor apple arrow badger bamboo basket beacon biscuit blanket bottle bracelet bridge bucket "
    "cabbage camera candle canyon carpet castle cedar chimney cinnamon clover comet compass copper "
    "cricket crystal dolphin dragon drum eagle ember falcon feather fern fiddle forest fossil fountain "
    "garnet glacier goblet granite harbor hazel helmet heron honey island ivory jasmine jigsaw kettle "
    "lantern lemon lighthouse lizard magnet mango marble meadow mirror mitten monsoon nectar needle "
    "nutmeg oasis orchid otter paddle pebble pepper pigeon pillow pine planet pocket quartz quill "
    "rabbit raven ribbon river rocket saddle saffron satchel scarf shovel signal silver sparrow "
    "spindle spruce sundial tablet teapot thimble thistle thunder tiger timber tulip tunnel turnip "
    "velvet violin walnut whistle willow window wizard zephyr"
).split()

PLACES = (
    "Halden Varnmoor Kestrel Oberlin Tavistock Morrow Quillan Ashcombe Brennick Corrow Dunmere Elsworth "
    "Fairhollow Glenmark Harrowgate Ivelport Jorvik Kelso Lindqvist Marrowby Northam Ostrava Pellinor "
    "Ravensholm Saltmarsh Thornbury Umberleigh Valderen Westcliff Yarrowdale"
).split()

_SYLLABLES = (
    "ba be bi bo bu da de di do du fa fe fi fo ga ge go ka ke ki ko la le li lo lu ma me mi mo "
    "na ne ni no pa pe pi po ra re ri ro ru sa se si so ta te ti to va ve vi vo za ze zo"
).split()

_FILLER_SUBJECTS = ("The grass", "The old bridge", "The morning sky", "A quiet street", "The river", "The garden",
                    "The market square", "A small boat", "The hillside", "The village clock", "The library",
                    "A gentle wind", "The harbor", "The orchard", "The kitchen window")
_FILLER_PREDICATES = ("was green and still", "looked the same as yesterday", "stayed calm all day",
                      "was covered in light rain", "glowed in the evening sun", "had nothing new to report",
                      "was busy as usual", "seemed larger than before", "was quiet after noon",
                      "smelled of fresh bread", "was painted a pale blue", "slowly filled with people")


def _rng(*parts: Any) -> random.Random:
    """A generator seeded from the parts (str seeding is stable across runs and machines)."""
    return random.Random(":".join(str(p) for p in parts))


def _magic_number(rng: random.Random, used: set[str]) -> str:
    while True:
        v = str(rng.randint(1_000_000, 9_999_999))
        if v not in used:
            used.add(v)
            return v


def _pseudo_words(rng: random.Random, n: int) -> list[str]:
    """n distinct made-up words of 2-3 syllables."""
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        w = "".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((2, 3))))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def _var_names(rng: random.Random, n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        v = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(5))
        if v not in out:
            out.append(v)
    return out


# ---------------------------------------------------------------------------------------------
# haystack


def default_haystack_dir() -> Path:
    """$SEKV_HAYSTACK, else shared/data/haystack/pg_essays beside the repository."""
    env = os.environ.get("SEKV_HAYSTACK")
    if env:
        return Path(env).expanduser()
    import sekv_core

    return Path(sekv_core.__file__).resolve().parents[1].parent / "shared" / "data" / "haystack" / "pg_essays"


_FOOTNOTE = re.compile(r"\[\d+\]")
_JOINED = re.compile(r"([a-z0-9\)][.!?])([A-Z])")  # "accelerating.We" (line breaks lost in the essays)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    text = _FOOTNOTE.sub("", text)
    text = _JOINED.sub(r"\1 \2", text)
    text = re.sub(r"\s+", " ", text).strip()
    return [s.strip() for s in _SENTENCE_END.split(text) if len(s.strip()) > 2]


def load_haystack(directory: str | Path | None) -> list[list[str]]:
    """The .txt files of a directory, each as a list of sentences (files sorted by name)."""
    d = Path(directory).expanduser() if directory else default_haystack_dir()
    if not d.is_dir():
        raise SekvError(f"haystack directory {d} does not exist; pass --haystack DIR (a folder of .txt files) or set SEKV_HAYSTACK")
    files = sorted(d.glob("*.txt"))
    essays = [s for s in (split_sentences(f.read_text(encoding="utf-8", errors="replace")) for f in files) if s]
    if not essays:
        raise SekvError(f"haystack directory {d} holds no .txt files with text; pass --haystack DIR (a folder of .txt files)")
    return essays


def haystack_sentences(essays: list[list[str]], rng: random.Random, at_least: int) -> list[str]:
    """Essays in a seeded order, concatenated to at least `at_least` sentences; past the last essay (the shared
    haystack holds ~160K tokens) they come again, each pass in a new seeded order, so a 256K-token haystack does
    not repeat one sequence of essays."""
    order = list(range(len(essays)))
    out: list[str] = []
    while len(out) < at_least:
        rng.shuffle(order)
        for i in order:
            out.extend(essays[i])
            if len(out) >= at_least:
                break
    return out


def filler_sentences(rng: random.Random, n: int) -> list[str]:
    """Neutral filler (for variable tracking): short sentences that say nothing in particular."""
    return [f"{rng.choice(_FILLER_SUBJECTS)} {rng.choice(_FILLER_PREDICATES)}." for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# fitting a document to a token length, inserting items at depths


class _Fitter:
    """Build the document of the first k sentences (+ a cut sentence) with items inserted; fit it to a token length.

    The haystack is cut to whole sentences, then words of the next sentence fill the
    rest (closed with a period), so a document lands within a word of the target.
    Items go in at sentence boundaries only.
    """

    def __init__(self, tokenizer, sentences: list[str], inserts: list[tuple[float, str]], joiner: str = " "):
        self.tok, self.sentences, self.inserts, self.joiner = tokenizer, sentences, inserts, joiner
        lens = [len(x) for x in tokenizer([" " + s for s in sentences], add_special_tokens=False)["input_ids"]]
        self.cum = [0]
        for n in lens:
            self.cum.append(self.cum[-1] + n)

    def _parts(self, k: int, tail: str | None) -> tuple[list[str], list[int]]:
        if not tail:
            return self.sentences[:k], self.cum[: k + 1]
        n_tail = len(self.tok(" " + tail, add_special_tokens=False)["input_ids"])
        return self.sentences[:k] + [tail], self.cum[: k + 1] + [self.cum[k] + n_tail]

    @staticmethod
    def boundaries(cum: list[int], fracs: list[float]) -> list[int]:
        """Sentence index before which each insert goes: the boundary whose token share is nearest its depth."""
        k = len(cum) - 1
        out = []
        for frac in fracs:
            target = frac * cum[k]
            j = bisect.bisect_left(cum, target)
            cands = [c for c in (j - 1, j) if 0 <= c <= k]
            out.append(min(cands, key=lambda c: (abs(cum[c] - target), c)))
        return out

    def build(self, k: int, tail: str | None = None) -> tuple[str, list[int]]:
        """(document text, char offset of each insert)."""
        sents, cum = self._parts(k, tail)
        at: dict[int, list[int]] = {}
        for i, b in enumerate(self.boundaries(cum, [f for f, _ in self.inserts])):
            at.setdefault(b, []).append(i)
        pieces: list[str] = []
        offsets = [0] * len(self.inserts)
        pos = 0

        def add(text: str) -> None:
            nonlocal pos
            if pieces:
                pieces.append(self.joiner)
                pos += len(self.joiner)
            pieces.append(text)
            pos += len(text)

        for j in range(len(sents) + 1):
            for i in at.get(j, []):
                offsets[i] = pos + (len(self.joiner) if pieces else 0)
                add(self.inserts[i][1])
            if j < len(sents):
                add(sents[j])
        return "".join(pieces), offsets

    def n_tokens(self, text: str) -> int:
        return len(prompt.encode(self.tok, prompt.document_prefix(self.tok, text)))

    def _largest(self, lo: int, hi: int, fits: Callable[[int], bool]) -> int:
        """Largest x in [lo, hi] with fits(x), given fits(lo) (or lo is the floor)."""
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def fit(self, target: int) -> tuple[str, list[int], int, int]:
        """The longest document within `target` tokens: (text, insert offsets, whole sentences, n_tokens)."""
        hi = min(len(self.sentences), bisect.bisect_right(self.cum, target) + 1)
        while hi < len(self.sentences) and self.n_tokens(self.build(hi)[0]) <= target:
            hi = min(len(self.sentences), 2 * hi)
        k = self._largest(0, hi, lambda x: self.n_tokens(self.build(x)[0]) <= target)
        tail = None
        if k < len(self.sentences):
            words = self.sentences[k].split()

            def cut(m: int) -> str:
                t = " ".join(words[:m]).rstrip(",;:")
                return t if t.endswith((".", "!", "?")) else t + "."

            m = self._largest(0, len(words) - 1, lambda x: x == 0 or self.n_tokens(self.build(k, cut(x))[0]) <= target)
            tail = cut(m) if m else None
        text, offsets = self.build(k, tail)
        n = self.n_tokens(text)
        if n > target:
            raise SekvError(f"length {target} tokens is too short for the prompt and the needles ({n} tokens)")
        return text, offsets, k, n


def _enough_sentences(tokenizer, sentences_for: Callable[[int], list[str]], target: int) -> list[str]:
    """Grow the sentence supply until it holds more than `target` tokens."""
    n = max(64, target // 8)
    while True:
        s = sentences_for(n)
        ids = tokenizer(" ".join(s), add_special_tokens=False)["input_ids"]
        if len(ids) > target * 1.1 + 64:
            return s
        n *= 2


# ---------------------------------------------------------------------------------------------
# the tasks


def gen_niah(tokenizer, length: int, depth: float, seed: int, essays: list[list[str]]) -> Context:
    rng = _rng("niah", seed, length, depth)
    place = rng.choice(PLACES)
    value = f"{rng.choice(NOUNS)}-{rng.randint(1000, 9999)}"
    needle = f"The secret passphrase for the {place} archive is {value}."
    sents = _enough_sentences(tokenizer, lambda n: haystack_sentences(essays, _rng("hay", seed, length, depth), n), length)
    text, offsets, k, n = _Fitter(tokenizer, sents, [(depth / 100.0, needle)]).fit(length)
    probe = Probe("", f"What is the secret passphrase for the {place} archive? Answer with the passphrase only.", [value],
                  max_new_tokens=24)
    return Context("niah", length, depth, seed, text, [probe], n, {"needles": [needle], "needle_offsets": offsets, "sentences": k})


def gen_corpus_niah(tokenizer, length: int, depth: float, seed: int, essays: list[list[str]], n_docs: int = 4) -> Context:
    """NIAH over a corpus of ``n_docs`` documents of the haystack's sentences, each about the same length, joined as
    documents.load_corpus joins files (``## file: essay_k.txt`` lines); depth is the needle's share of the whole
    corpus: document k = floor(depth * n_docs) holds it, at the rest of that share within it."""
    from ..documents import PART_HEADING, PART_SEPARATOR

    rng = _rng("corpus_niah", seed, length, depth)
    place = rng.choice(PLACES)
    value = f"{rng.choice(NOUNS)}-{rng.randint(1000, 9999)}"
    needle = f"The secret passphrase for the {place} archive is {value}."
    names = [f"essay_{i + 1}.txt" for i in range(n_docs)]
    k = min(n_docs - 1, int(depth / 100.0 * n_docs))
    inner = min(1.0, depth / 100.0 * n_docs - k)

    def n_tok(text: str) -> int:
        return len(prompt.encode(tokenizer, prompt.document_prefix(tokenizer, text)))

    head = n_tok("")  # the prompt around the corpus
    per = max(0, (length - head) // n_docs - n_tok(PART_SEPARATOR + f"{PART_HEADING}{names[-1]}\n\n") + head - 2)  # a document's text
    sents = _enough_sentences(tokenizer, lambda n: haystack_sentences(essays, _rng("hay", seed, length, depth), n), length)
    texts, at = [], 0
    for i in range(n_docs):
        inserts = [(inner, needle)] if i == k else []
        text, _, used, _ = _Fitter(tokenizer, sents[at:], inserts).fit(per + head)
        texts.append(text)
        at += used + 1
    document = PART_SEPARATOR.join(f"{PART_HEADING}{name}\n\n{text}" for name, text in zip(names, texts))
    n = n_tok(document)
    if n > length:
        raise SekvError(f"length {length} tokens is too short for a corpus of {n_docs} documents and the needle ({n} tokens)")
    probe = Probe("", f"What is the secret passphrase for the {place} archive? Answer with the passphrase only.", [value],
                  max_new_tokens=24)
    return Context("corpus_niah", length, depth, seed, document, [probe], n,
                   {"needles": [needle], "needle_offsets": [document.index(needle)], "documents": names, "needle_document": names[k]})


def gen_mk_niah(tokenizer, length: int, depth: float, seed: int, essays: list[list[str]], n_keys: int = 4) -> Context:
    rng = _rng("mk_niah", seed, length, depth)
    keys = rng.sample(NOUNS, n_keys)
    used: set[str] = set()
    values = [_magic_number(rng, used) for _ in keys]
    needles = [f"The special magic number for {k} is: {v}." for k, v in zip(keys, values)]
    depths = [depth / 100.0] + [rng.random() for _ in keys[1:]]  # the asked key (keys[0]) at the depth
    sents = _enough_sentences(tokenizer, lambda n: haystack_sentences(essays, _rng("hay", seed, length, depth), n), length)
    text, offsets, k, n = _Fitter(tokenizer, sents, list(zip(depths, needles))).fit(length)
    probe = Probe("", f"What is the special magic number for {keys[0]} mentioned in the document? Answer with the number only.",
                  [values[0]], max_new_tokens=24)
    return Context("mk_niah", length, depth, seed, text, [probe], n, {"needles": needles, "needle_offsets": offsets, "sentences": k})


def gen_mn_niah(tokenizer, length: int, depth: float, seed: int, essays: list[list[str]], n_needles: int = 4) -> Context:
    """Multi-needle NIAH: n_needles passphrases of different archives, the first at the depth, the others at seeded
    random depths; each is asked (one probe per needle, item = its archive), so a context scores the share found."""
    rng = _rng("mn_niah", seed, length, depth)
    places = rng.sample(PLACES, n_needles)
    values = [f"{rng.choice(NOUNS)}-{rng.randint(1000, 9999)}" for _ in places]
    needles = [f"The secret passphrase for the {p} archive is {v}." for p, v in zip(places, values)]
    depths = [depth / 100.0] + [rng.random() for _ in places[1:]]
    sents = _enough_sentences(tokenizer, lambda n: haystack_sentences(essays, _rng("hay", seed, length, depth), n), length)
    text, offsets, k, n = _Fitter(tokenizer, sents, list(zip(depths, needles))).fit(length)
    probes = [Probe(p, f"What is the secret passphrase for the {p} archive? Answer with the passphrase only.", [v], max_new_tokens=24)
              for p, v in zip(places, values)]
    return Context("mn_niah", length, depth, seed, text, probes, n,
                   {"needles": needles, "needle_offsets": offsets, "needle_depths": [round(100 * d, 1) for d in depths], "sentences": k})


def gen_mv_niah(tokenizer, length: int, depth: float | None, seed: int, essays: list[list[str]], n_values: int = 4) -> Context:
    rng = _rng("mv_niah", seed, length)
    key = rng.choice(NOUNS)
    used: set[str] = set()
    values = [_magic_number(rng, used) for _ in range(n_values)]
    needles = [f"One of the special magic numbers for {key} is: {v}." for v in values]
    depths = sorted(rng.random() for _ in values)
    sents = _enough_sentences(tokenizer, lambda n: haystack_sentences(essays, _rng("hay", seed, length), n), length)
    text, offsets, k, n = _Fitter(tokenizer, sents, list(zip(depths, needles))).fit(length)
    probe = Probe("", f"What are all the special magic numbers for {key} mentioned in the document? Answer with the numbers only.",
                  values, match="all", max_new_tokens=48)
    return Context("mv_niah", length, None, seed, text, [probe], n, {"needles": needles, "needle_offsets": offsets, "sentences": k})


def gen_vt(tokenizer, length: int, depth: float | None, seed: int, essays=None, n_hops: int = 4) -> Context:
    rng = _rng("vt", seed, length)
    names = _var_names(rng, 2 * (n_hops + 1))
    chain, distractor = names[: n_hops + 1], names[n_hops + 1 :]
    number, other = (str(x) for x in rng.sample(range(10_000, 100_000), 2))
    statements = []
    for vars_, num in ((chain, number), (distractor, other)):
        statements.append(f"VAR {vars_[0]} = {num}.")
        statements += [f"VAR {b} = VAR {a}." for a, b in zip(vars_, vars_[1:])]
    # Each chain keeps its order; the two chains interleave at seeded depths.
    d_chain = sorted(rng.random() for _ in chain)
    d_dist = sorted(rng.random() for _ in distractor)
    depths = d_chain + d_dist
    sents = _enough_sentences(tokenizer, lambda n: filler_sentences(_rng("filler", seed, length), n), length)
    text, offsets, k, n = _Fitter(tokenizer, sents, list(zip(depths, statements))).fit(length)
    probe = Probe("", f"Which variables are assigned the value {number} in the document, directly or through other variables? "
                  "Answer with the variable names only.", chain, match="all", whole_word=True, max_new_tokens=48)
    return Context("vt", length, None, seed, text, [probe], n, {"needles": statements, "needle_offsets": offsets, "sentences": k})


def _cwe_list(seed: int, length: int, n_words: int, k: int) -> tuple[str, list[str]]:
    rng = _rng("cwe", seed, length, n_words)
    pool = _pseudo_words(rng, k + n_words)
    common, rare = pool[:k], pool[k:]
    f_common = max(4, round(0.25 * n_words / k))  # common words: a quarter of the list
    words = [w for w in common for _ in range(f_common)]
    i = 0
    while len(words) < n_words:  # rare words: once or twice each
        words += [rare[i]] * min(rng.choice((1, 2)), n_words - len(words))
        i += 1
    rng.shuffle(words)
    return "\n".join(f"{j + 1}. {w}" for j, w in enumerate(words)), common


def gen_cwe(tokenizer, length: int, depth: float | None, seed: int, essays=None, k: int = 5) -> Context:
    def n_tok(text: str) -> int:
        return len(prompt.encode(tokenizer, prompt.document_prefix(tokenizer, text)))

    per_word = max(1, n_tok(_cwe_list(seed, length, 200, k)[0]) - n_tok("")) / 200
    lo, hi = 0, int(length / per_word * 1.5) + 8
    while lo < hi:  # largest word count that fits
        mid = (lo + hi + 1) // 2
        if n_tok(_cwe_list(seed, length, mid, k)[0]) <= length:
            lo = mid
        else:
            hi = mid - 1
    if lo < 4 * k + 2:
        raise SekvError(f"length {length} tokens is too short for the common-word task")
    text, common = _cwe_list(seed, length, lo, k)
    probe = Probe("", f"Above is a numbered list of words. Which {k} words appear most often in the list? "
                  f"Answer with the {k} words only, separated by commas.", common, match="all", whole_word=True, max_new_tokens=48)
    return Context("cwe", length, None, seed, text, [probe], n_tok(text), {"common_words": common, "n_words": lo})


# ---------------------------------------------------------------------------------------------
# qa: the sample documents


def sample_docs_dir() -> Path:
    import sekv_core

    return Path(sekv_core.__file__).resolve().parents[1] / "sample_docs"


def _joined_lines(markdown: str) -> list[str]:
    """The lines of a questions file, each wrapped note line joined onto its bullet."""
    lines: list[str] = []
    for line in markdown.splitlines():
        if lines and line.startswith("  ") and line.strip() and lines[-1].lstrip().startswith("- "):
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
    return lines


def parse_questions(markdown: str) -> list[tuple[str, int, str, list[str]]]:
    """(document file, question number, question, accepted answers) from QUESTIONS.md.

    Accepted answers: the table's expected answer, plus every quoted string a note
    `- Qn: ... accept "X" ...` names for that question.
    """
    out: list[tuple[str, int, str, list[str]]] = []
    doc = None
    index: dict[tuple[str, int], list[str]] = {}
    for line in _joined_lines(markdown):
        h = re.match(r"^##\s+(\S+)", line)
        if h:
            doc = h.group(1)
            continue
        row = re.match(r"^\|\s*(\d+)\s*\|(.+?)\|(.+?)\|", line)
        if row and doc:
            n, q, a = int(row.group(1)), row.group(2).strip(), row.group(3).strip()
            answers = [a]
            out.append((doc, n, q, answers))
            index[(doc, n)] = answers
            continue
        note = re.match(r"^-\s*Q(\d+):(.*)", line)
        if note and doc and (doc, int(note.group(1))) in index:
            for alt in re.findall(r'accept\s+"([^"]+)"', note.group(2)):
                if alt not in index[(doc, int(note.group(1)))]:
                    index[(doc, int(note.group(1)))].append(alt)
    return out


def gen_qa(tokenizer, seed: int, questions: str = "QUESTIONS.md", task: str = "qa") -> list[Context]:
    from ..documents import load_document

    d = sample_docs_dir()
    qfile = d / questions
    if not qfile.is_file():
        raise SekvError(f"{qfile} not found: the qa task needs the repository's sample_docs/")
    by_doc: dict[str, list[Probe]] = {}
    for doc, n, q, answers in parse_questions(qfile.read_text(encoding="utf-8")):
        # whole words: the notes accept "7" for "seven", which must not match inside "17"
        by_doc.setdefault(doc, []).append(Probe(f"{doc}#{n}", q, answers, whole_word=True, max_new_tokens=32))
    out = []
    for doc, probes in by_doc.items():
        text = load_document(d / doc).text
        n = len(prompt.encode(tokenizer, prompt.document_prefix(tokenizer, text)))
        out.append(Context(task, n, None, seed, text, probes, n, {"document": doc}))
    return out


# ---------------------------------------------------------------------------------------------
# qa_long: one long real document, not in the repository


LONG_DOC_ENV = "SEKV_LONG_DOC"
LONG_DOC_MAKE = "make it with `python -m benchmarks.long_doc fetch --out DIR`"


def long_questions_file() -> Path:
    import sekv_core

    return Path(sekv_core.__file__).resolve().parents[1] / "benchmarks" / "long_doc_questions.md"


@dataclass(frozen=True)
class LongQuestion:
    """One question of benchmarks/long_doc_questions.md."""

    number: int
    question: str
    answers: list[str]  # the expected answer, then the accepted alternatives
    offset: int  # character offset of the evidence in the document
    depth: float  # percent of the document's tokens before the evidence (qwen2.5-0.5b's tokenizer)
    evidence: str  # verbatim text of the document at `offset` that holds the answer


def _cells(line: str) -> list[str]:
    """A Markdown table row's cells; ``\\|`` is a literal pipe inside a cell."""
    cells, cur, i = [], [], 0
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    while i < len(body):
        if body.startswith("\\|", i):
            cur.append("|")
            i += 2
        elif body[i] == "|":
            cells.append("".join(cur).strip())
            cur = []
            i += 1
        else:
            cur.append(body[i])
            i += 1
    if "".join(cur).strip():
        cells.append("".join(cur).strip())
    return cells


def parse_long_questions(markdown: str) -> list[LongQuestion]:
    """The rows ``| # | question | expected answer | offset | depth % | evidence |`` of long_doc_questions.md, plus every
    quoted string a note ``- Qn: accept "X"`` names.  In the evidence ``⏎`` stands for a line break."""
    rows: dict[int, LongQuestion] = {}
    for line in _joined_lines(markdown):
        c = _cells(line) if line.lstrip().startswith("|") else []
        if len(c) >= 6 and c[0].isdigit():
            try:
                offset, depth = int(c[3].replace(",", "")), float(c[4].rstrip("% "))
            except ValueError:
                raise SekvError(f"long_doc_questions.md: question {c[0]}: offset '{c[3]}' or depth '{c[4]}' is not a number") from None
            evidence = re.sub(r"[ \t]*⏎[ \t]*", "\n", c[5])
            rows[int(c[0])] = LongQuestion(int(c[0]), c[1], [c[2]], offset, depth, evidence)
            continue
        note = re.match(r"^-\s*Q(\d+):(.*)", line)
        if note and int(note.group(1)) in rows:
            answers = rows[int(note.group(1))].answers
            answers += [a for a in re.findall(r'accept\s+"([^"]+)"', note.group(2)) if a not in answers]
    return [rows[n] for n in sorted(rows)]


def long_doc_path(doc_file: str | Path | None = None) -> Path:
    """qa_long's document: doc_file, else $SEKV_LONG_DOC; a one-line SekvError when neither names a file."""
    given = doc_file or os.environ.get(LONG_DOC_ENV)
    if not given:
        raise SekvError(f"qa_long needs its document: pass --doc-file FILE or set {LONG_DOC_ENV} ({LONG_DOC_MAKE})")
    path = Path(given).expanduser()
    if not path.is_file():
        raise SekvError(f"qa_long's document {path} not found ({LONG_DOC_MAKE})")
    return path


def gen_long_qa(tokenizer, seed: int, doc_file: str | Path | None = None, task: str = "qa_long") -> Context:
    """The whole document as one context, every question of long_doc_questions.md asked of it.

    Each question's evidence must be at its recorded offset (else the file is not the document the questions were
    written for: a one-line error).  A document cut short (for a small run) keeps the questions whose evidence lies in
    it; the context's meta says how many were left out."""
    from ..documents import load_document

    path = long_doc_path(doc_file)
    text = load_document(path).text
    qfile = long_questions_file()
    if not qfile.is_file():
        raise SekvError(f"{qfile} not found: qa_long needs the repository's benchmarks/")
    probes, left_out = [], 0
    for q in parse_long_questions(qfile.read_text(encoding="utf-8")):
        if q.offset + len(q.evidence) > len(text):
            left_out += 1
            continue
        if text[q.offset : q.offset + len(q.evidence)] != q.evidence:
            raise SekvError(f"{path}: question {q.number}'s evidence is not at character {q.offset}: not the document "
                            f"{qfile.name} was written for ({LONG_DOC_MAKE})")
        probes.append(Probe(f"Q{q.number}@{q.depth:.0f}%", q.question, q.answers, whole_word=True, max_new_tokens=32))
    if not probes:
        raise SekvError(f"{path}: it ends before the evidence of every question in {qfile.name} ({LONG_DOC_MAKE})")
    n = len(prompt.encode(tokenizer, prompt.document_prefix(tokenizer, text)))
    meta = {"document": path.name, "questions": len(probes), "left_out": left_out}
    if left_out:
        meta["note"] = f"{path.name} is cut short: {left_out} of {left_out + len(probes)} questions left out"
    return Context(task, n, None, seed, text, probes, n, meta)


# ---------------------------------------------------------------------------------------------
# registry


GRID_TASKS: dict[str, Callable[..., Context]] = {
    "niah": gen_niah,
    "corpus_niah": gen_corpus_niah,
    "mk_niah": gen_mk_niah,
    "mn_niah": gen_mn_niah,
    "mv_niah": gen_mv_niah,
    "vt": gen_vt,
    "cwe": gen_cwe,
}
DEPTH_TASKS = ("niah", "corpus_niah", "mk_niah", "mn_niah")  # tasks whose contexts span the depth grid
HAYSTACK_TASKS = ("niah", "corpus_niah", "mk_niah", "mn_niah", "mv_niah")
GROUPS = {"ruler": ["mk_niah", "mv_niah", "vt", "cwe"], "all": ["niah", "mk_niah", "mv_niah", "vt", "cwe", "qa"]}
#: the sample documents' question files: `qa` (the README's and QUESTIONS.md's), `qa_heldout` (questions written
#: after sekv's scout defaults were chosen on `qa`, to check them on questions they were not tuned on)
QA_TASKS = {"qa": "QUESTIONS.md", "qa_heldout": "QUESTIONS_HELDOUT.md"}
#: one long document given at run time (not part of `all`: its document is not in the repository)
LONG_TASKS = ("qa_long",)
TASK_NAMES = [*GRID_TASKS, *QA_TASKS, *LONG_TASKS]


def expand_tasks(spec: str) -> list[str]:
    """'niah,ruler' -> ['niah', 'mk_niah', 'mv_niah', 'vt', 'cwe'] (order kept, no repeats)."""
    out: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        names = GROUPS.get(part, [part])
        for n in names:
            if n not in TASK_NAMES:
                raise SekvError(f"unknown benchmark task '{part}'; choose from {', '.join(TASK_NAMES + list(GROUPS))}")
            if n not in out:
                out.append(n)
    if not out:
        raise SekvError("no benchmark task given")
    return out


def generate(
    task: str,
    tokenizer,
    *,
    lengths: list[int],
    depths: list[float],
    seed: int,
    haystack: str | Path | None = None,
    essays: list[list[str]] | None = None,
    doc_file: str | Path | None = None,
) -> list[Context]:
    """Every context of one task, in grid order (length-major, then depth)."""
    if task in LONG_TASKS:
        return [gen_long_qa(tokenizer, seed, doc_file, task)]
    if task in QA_TASKS:
        return gen_qa(tokenizer, seed, QA_TASKS[task], task)
    gen = GRID_TASKS.get(task)
    if gen is None:
        raise SekvError(f"unknown benchmark task '{task}'; choose from {', '.join(TASK_NAMES)}")
    if task in HAYSTACK_TASKS and essays is None:
        essays = load_haystack(haystack)
    out = []
    for length in lengths:
        for depth in depths if task in DEPTH_TASKS else [None]:
            out.append(gen(tokenizer, length, depth, seed, essays))
    return out
