"""Hostile packs: mutated header, manifest and tensors, with every checksum recomputed, through the paths a user runs
(inspect, and ask: open + a question + its evidence).  The only error that may come out is PackError.

SEKV_FUZZ_CASES (default 100) and SEKV_FUZZ_SEED (default 0) set the run, SEKV_FUZZ_METHODS (comma-separated)
limits it to some methods; a long run:
    SEKV_FUZZ_CASES=10000 python -m pytest -q tests/test_pack_fuzz.py -s
prints its tally.  Mutations that once crashed are replayed from tests/fuzz_regressions.json.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import struct
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import SAMPLE_MD
from sekv_core import models, pack as packmod
from sekv_core.errors import PackError
from sekv_core.ingest import ingest
from sekv_core.session import Session, inspect_pack

REGRESSIONS = Path(__file__).with_name("fuzz_regressions.json")
METHODS = ("sekv", "full", "streamingllm", "sentencekv", "kvzip", "depthweave", "rag")
#: depthweave's floor (bases + coefficients) is 0.59 of this small document's KV: above it, the routing still has a choice
BUDGETS = {"depthweave": 0.8}
ODD_VALUES = [None, True, False, 0, -1, 1, 2, 3, 7, 2**31, 2**62, -(2**40), 0.5, 1e300, -1e-9, "", "x", "../../etc/passwd",
              "\x1b[2J", [], [0], [1, 2, 3], [[0, 0, 1]], {}, {"a": 1}, "qwen2.5-0.5b", "/tmp", "0" * 64]


@pytest.fixture(scope="module")
def base(tiny_qwen, tmp_path_factory):
    """Small real packs of each fuzzed method: (manifest, tensors) to mutate, and the model to ask with."""
    lm = models.load(str(tiny_qwen), device="cpu")
    d = tmp_path_factory.mktemp("fuzz_base")
    doc = d / "doc.md"
    doc.write_text(SAMPLE_MD.read_text()[:1500])
    out = {}
    for m in METHODS:
        r = ingest(doc, d / f"{m}.sekv", lm=lm, method=m, params={} if m == "full" else {"budget": BUDGETS.get(m, 0.3)})
        p = packmod.read_pack(r.pack_path)
        out[m] = (p.manifest, {k: p.get(k).clone() for k in p.keys()})
        p.close()
    return lm, out


def craft(path: Path, manifest: dict, tensors: dict[str, torch.Tensor], table_edit=None, header_edit=None) -> None:
    """Write a pack as write_pack does but with the manifest verbatim (magic, version, tensor list included), an
    optional edit of the tensor table / raw header, and the checksums recomputed over whatever results."""
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    man = copy.deepcopy(manifest)
    if isinstance(man, dict) and isinstance(man.get("tensors"), dict):
        for k, v in tensors.items():
            if isinstance(man["tensors"].get(k), dict):
                man["tensors"][k] = {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape),
                                     "sha256": packmod.tensor_digest(packmod._raw_bytes(v))}
    header = {"__metadata__": {"sekv": json.dumps(man), "sekv_header_sha256": "0" * 64}}
    off = 0
    for k, v in tensors.items():
        n = v.numel() * v.element_size()
        header[k] = {"dtype": packmod._CODE[v.dtype], "shape": list(v.shape), "data_offsets": [off, off + n]}
        off += n
    if table_edit:
        table_edit(header)
    body = json.dumps(header, separators=(",", ":")).encode()
    if header_edit:
        body = header_edit(body)
    body += b" " * (-(8 + len(body)) % 8)
    head = struct.pack("<Q", len(body)) + body
    field = b'"sekv_header_sha256":"' + b"0" * 64 + b'"'
    if field in head:
        head = head.replace(field, b'"sekv_header_sha256":"' + hashlib.sha256(head).hexdigest().encode() + b'"', 1)
    with open(path, "wb") as f:
        f.write(head)
        for v in tensors.values():
            f.write(packmod._raw_bytes(v))


def _paths(x, prefix=()):
    yield prefix
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(x, list) and x:
        for i in {0, len(x) - 1, len(x) // 2}:
            yield from _paths(x[i], prefix + (i,))


def mutate(rng: random.Random, manifest: dict, tensors: dict) -> tuple[dict, dict, dict]:
    """One random mutation: (manifest, tensors, craft kwargs) and a description is in the returned kwargs' 'what'."""
    man, ten = copy.deepcopy(manifest), {k: v.clone() for k, v in tensors.items()}
    kind = rng.choice(["manifest", "manifest", "values", "values", "values", "shape", "tensor_set", "table", "header_bytes"])
    what = {"kind": kind}
    kw: dict = {}
    if kind == "manifest":
        paths = [p for p in _paths(man) if p and p[0] != "tensors"]
        p = rng.choice(paths)
        parent = man
        for k in p[:-1]:
            parent = parent[k]
        if rng.random() < 0.2 and isinstance(parent, dict):
            del parent[p[-1]]
            what["op"] = ["del", list(map(str, p))]
        else:
            old = parent[p[-1]]
            new = rng.choice(ODD_VALUES + ([old + rng.choice([-1, 1, 10**6])] if type(old) is int else []))
            parent[p[-1]] = new
            what["op"] = ["set", list(map(str, p)), new]
    elif kind == "values":
        name = rng.choice(sorted(ten))
        t = ten[name]
        if t.numel():
            flat = t.view(-1)
            n = manifest.get("n_tokens", 100)
            for _ in range(rng.choice([1, 1, 3, 50])):
                i = rng.randrange(flat.numel())
                if t.is_floating_point():
                    flat[i] = rng.choice([float("nan"), float("inf"), -1e30, 0.0, 1e4])
                elif t.dtype == torch.bool:
                    flat[i] = not bool(flat[i])
                else:
                    info = torch.iinfo(t.dtype)
                    v = rng.choice([-1, 0, n - 1, n, n + 1, 10**9, info.max, info.min, int(flat[i]) + 1, int(flat[i]) - 1])
                    flat[i] = max(info.min, min(info.max, v))
        what["op"] = ["values", name]
    elif kind == "shape":
        name = rng.choice(sorted(ten))
        t = ten[name]
        op = rng.choice(["trim", "grow", "flatten", "dtype", "empty"])
        if op == "trim" and t.numel():
            ten[name] = t.reshape(-1)[: max(0, t.numel() - rng.choice([1, 2, 16]))].clone()
        elif op == "grow":
            ten[name] = torch.cat([t.reshape(-1), t.reshape(-1)[:1].repeat(rng.choice([1, 16])) if t.numel() else torch.zeros(3, dtype=t.dtype)])
        elif op == "flatten":
            ten[name] = t.reshape(-1).clone()
        elif op == "dtype":
            ten[name] = t.to(rng.choice([torch.float32, torch.int64, torch.int16, torch.uint8, torch.bfloat16]))
        else:
            ten[name] = t.reshape(-1)[:0].clone()
        what["op"] = ["shape", name, op]
    elif kind == "tensor_set":
        name = rng.choice(sorted(ten))
        if rng.random() < 0.6:
            del ten[name]
            man["tensors"].pop(name, None)
            what["op"] = ["drop", name]
        else:
            ten[name + ".x"] = ten[name].clone()
            man["tensors"][name + ".x"] = {}
            what["op"] = ["extra", name]
    elif kind == "table":
        name = rng.choice(sorted(ten))
        field = rng.choice(["dtype", "shape", "data_offsets"])
        val = rng.choice(ODD_VALUES + ["F8_E4M3", "I64", "U64", [1, 2**40], [0, 8]])

        def table_edit(h, name=name, field=field, val=val):
            h[name][field] = val

        kw["table_edit"] = table_edit
        what["op"] = ["table", name, field, val]
    else:
        pos, byte = rng.random(), rng.randrange(256)

        def header_edit(b, pos=pos, byte=byte):
            i = int(pos * (len(b) - 1))
            return b[:i] + bytes([byte]) + b[i + 1 :]

        kw["header_edit"] = header_edit
        what["op"] = ["header_byte", pos, byte]
    kw["what"] = what
    return man, ten, kw


def exercise(path: Path, lm) -> str:
    """inspect, then ask (open + a one-token answer + its evidence): 'ok', or the PackError's class of message."""
    from sekv_core.evidence import evidence_rows

    try:
        inspect_pack(path)[0].close()
        s = Session.open(path, lm=lm)
        a = s.ask("When was the lamp lit?", max_new_tokens=1)
        evidence_rows(s, (a.stats.extra or {}).get("span_zoom_counts") or {}, span_order=(a.stats.extra or {}).get("span_order"))
        s.pack.close()
        return "ok"
    except PackError as e:
        return "net" if "contents are inconsistent" in str(e) else "checked"


def run_cases(base, tmp_path, n: int, seed: int, methods=METHODS) -> tuple[Counter, list]:
    lm, packs = base
    rng = random.Random(seed)
    tally, crashes = Counter(), []
    for i in range(n):
        m = rng.choice(methods)
        man, ten, kw = mutate(rng, *packs[m])
        what = kw.pop("what")
        path = tmp_path / "case.sekv"
        craft(path, man, ten, **kw)
        try:
            tally[exercise(path, lm)] += 1
        except Exception as e:  # anything but PackError: a crash
            tally["crash"] += 1
            crashes.append({"seed": seed, "case": i, "method": m, "what": what, "error": f"{type(e).__name__}: {e}"[:300]})
    return tally, crashes


def test_mutated_packs_give_only_pack_errors(base, tmp_path):
    n = int(os.environ.get("SEKV_FUZZ_CASES", "100"))
    seed = int(os.environ.get("SEKV_FUZZ_SEED", "0"))
    only = tuple(x for x in os.environ.get("SEKV_FUZZ_METHODS", "").split(",") if x) or METHODS
    tally, crashes = run_cases(base, tmp_path, n, seed, only)
    print(f"\nfuzz: {n} cases (seed {seed}): {dict(tally)}")
    if crashes and os.environ.get("SEKV_FUZZ_SAVE"):
        Path(os.environ["SEKV_FUZZ_SAVE"]).write_text(json.dumps(crashes, indent=1))
    assert not crashes, json.dumps(crashes[:5], indent=1)
    assert tally["checked"] > n // 3  # the mutations mostly break the pack, and the checks say so


def apply_op(op: list, manifest: dict, tensors: dict) -> tuple[dict, dict, dict]:
    """A recorded mutation, exactly: ["set", path, value] in the manifest, ["to_dtype", tensor, dtype], or
    ["table", tensor, field, value] in the tensor table."""
    man, ten, kw = copy.deepcopy(manifest), {k: v.clone() for k, v in tensors.items()}, {}
    if op[0] == "set":
        parent = man
        for k in op[1][:-1]:
            parent = parent[k]
        parent[op[1][-1]] = op[2]
    elif op[0] == "to_dtype":
        ten[op[1]] = ten[op[1]].to(getattr(torch, op[2]))
    elif op[0] == "table":
        kw["table_edit"] = lambda h: h[op[1]].__setitem__(op[2], op[3])
    return man, ten, kw


def test_regressions(base, tmp_path):
    """Mutations that once made something other than PackError come out (tests/fuzz_regressions.json), replayed."""
    for c in json.loads(REGRESSIONS.read_text()):
        man, ten, kw = apply_op(c["op"], *base[1][c["method"]])
        path = tmp_path / "reg.sekv"
        craft(path, man, ten, **kw)
        assert exercise(path, base[0]) in ("ok", "checked", "net"), c


def test_unmutated_packs_pass(base, tmp_path):
    """The crafting itself is faithful: the base packs, rewritten, open and answer."""
    lm, packs = base
    for m, (man, ten) in packs.items():
        path = tmp_path / f"{m}.sekv"
        craft(path, man, ten)
        assert exercise(path, lm) == "ok", m


@pytest.mark.parametrize("edit, message", [
    (lambda t: t["depthweave.level"].view(-1).__setitem__(0, 200), "depthweave.level' holds values outside [0, 3]"),
    (lambda t: t["depthweave.feat.delim"].view(-1).__setitem__(0, 2), "depthweave.feat.delim' holds values outside [0, 1]"),
    (lambda t: t["depthweave.config"].__setitem__(5, 10**6), "rank_k = 1000000 is outside"),
    (lambda t: t["depthweave.config"].__setitem__(0, 7), "n_tokens is 7"),
    (lambda t: t["depthweave.config"].__setitem__(1, int(t["depthweave.config"][0])), "n_exact = "),
    (lambda t: t["depthweave.config"].__setitem__(12, 4), "coef_bits = 4 is not one of"),
    (lambda t: t["depthweave.levels"].__setitem__(2, 3), "is not a list of residual levels"),
    (lambda t: t.__setitem__("depthweave.coef.k.1", t["depthweave.coef.k.1"][:, :-1].clone()), "depthweave.coef.k.1' has shape"),
    (lambda t: t.__setitem__("depthweave.res_scale.v.0", t["depthweave.res_scale.v.0"][..., :1].clone()), "depthweave.res_scale.v.0' has shape"),
    (lambda t: t["depthweave.feat.mass"].view(-1).__setitem__(3, -1.0), "depthweave.feat.mass' holds negative values"),
    (lambda t: t["depthweave.exact.k.0"].view(-1).__setitem__(0, float("nan")), "NaN or infinite"),
])
def test_depthweave_checks_name_the_problem(base, tmp_path, edit, message):
    """Each of depthweave's checks (sekv_core/depthweave/checks.py), on a crafted pack whose checksums are right."""
    from sekv_core.session import inspect_pack

    man, ten = base[1]["depthweave"]
    ten = {k: v.clone() for k, v in ten.items()}
    edit(ten)
    path = tmp_path / "dw.sekv"
    craft(path, man, ten)
    for run_it in (lambda: inspect_pack(path), lambda: Session.open(path, lm=base[0])):
        with pytest.raises(PackError, match=None) as e:
            run_it()
        assert message in str(e.value) and "inconsistent" not in str(e.value), str(e.value)


def test_depthweave_pack_budget_below_its_floor_is_a_pack_error(base, tmp_path):
    man, ten = base[1]["depthweave"]
    man = copy.deepcopy(man)
    man["method_params"]["budget"] = 0.05
    craft(tmp_path / "dw.sekv", man, ten)
    with pytest.raises(PackError, match="below the floor"):
        inspect_pack(tmp_path / "dw.sekv")


@pytest.mark.parametrize("manifest", [None, [], "SEKV-PACK", 4])
def test_a_manifest_that_is_not_an_object_is_a_pack_error(base, tmp_path, manifest):
    """The manifest JSON is null, a list, a string or a number, under a correct header checksum (issue: 'null' gave
    an AttributeError in read_pack)."""
    craft(tmp_path / "m.sekv", manifest, base[1]["full"][1])
    with pytest.raises(PackError, match="not a sekv pack"):
        packmod.read_pack(tmp_path / "m.sekv")
    assert exercise(tmp_path / "m.sekv", base[0]) == "checked"
