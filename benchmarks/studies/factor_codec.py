"""The at-rest factor codec (sekv/codec.py): pack bytes by tensor group, and the error of 4-bit factors.

``breakdown PACK...``: bytes of every tensor group of sekv packs (factors us / vt / scales / ranks,
full-resolution tokens, coarse entries, router tensors, the rest) and the pack / raw fp16 KV ratio.
Reads the packs with safetensors only.

``errors``: the measurement of benchmarks/studies/rope_factors.py (a ~4K-token essay prefix in sekv's chat
prompt, a question's post-RoPE queries, sekv's segmentation at b = 0.10; errors over the compressed
spans only), with the default rank rule (energy 0.99 / 0.99, pre-RoPE keys, rank <= 32) and the
factors stored as int8 (today's packs) or through the codec.  Per variant: factor bytes / raw fp16
bytes of the spans, relative key error (post-RoPE), value error, and the relative attention-output
error of the question's queries when every span is its reconstruction, averaged over layers.
Variants: ``int8``, or ``LEVELS-gGROUP-ORDER[-leadK]`` (e.g. ``nf4-g32-col-lead1``: codec.LEVELS, group
size, ``us`` order, leading ``vt`` rows per block kept int8, ``-s8``: row scales log8; sekv/codec.py), optionally
``@k`` / ``@kus`` / ``@kvt`` / ``@v``: only the keys' factors / the keys' us / the keys' vt / the values' factors
coded; or ``KVARIANT+VVARIANT``: the keys' factors through one variant, the values' through another
(e.g. ``nf4-g32-col-lead1+nf3-g32-col-lead1``).  A plain ``fp16`` row is the unquantised reference.

``essay N FILE``: the first N qwen tokens of pg_essays/worked.txt as a text file (temporary documents);
``packs DOC... --out DIR [--bits 8,4] [--set TAG:KEY=VALUE,...]``: ingest each document with sekv at each
factor_bits (one shared prefill), with the defaults and each further set of integer parameters (e.g.
``--set .v4s16:value_bits=4,scale_bits=16``, the storage of ``sekv:4bit-factors``).

Usage:
    python -m benchmarks.studies.factor_codec essay 4000 /tmp/pg4k.txt
    python -m benchmarks.studies.factor_codec packs sample_docs/halden_hx40_manual.pdf /tmp/pg4k.txt --out /tmp/fc
    python -m benchmarks.studies.factor_codec breakdown /tmp/fc/*.sekv
    python -m benchmarks.studies.factor_codec errors [--model qwen2.5-0.5b] [--tokens 4096] [--variants ...]
"""

from __future__ import annotations

import argparse
import math
import re
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.studies.rope_factors import DEFAULTS, attn, load_case

from sekv_core.sekv import codec, rope
from sekv_core.sekv import factorize as fz
from sekv_core.sekv.segment import auto_lengths, segment

_SIZES = {"F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8}
GROUPS = [
    (r"sekv\.f[kv]\.\d+\.(us|us\.q[34])$", "factors us"),
    (r"sekv\.f[kv]\.\d+\.(vt|vt\.q[34])$", "factors vt"),
    (r"sekv\.f[kv]\.\d+\.(us|vt)\.q[34]m$", "factors group absmax"),
    (r"sekv\.f[kv]\.\d+\.vt\.lead$", "factors vt leading rows (int8)"),
    (r"sekv\.f[kv]\.\d+\.(us|vt)_scale(\.l8p?)?$", "factors row scales"),
    (r"sekv\.f[kv]\.\d+\.rank$", "factors ranks"),
    (r"sekv\.full\.", "full-resolution K/V"),
    (r"sekv\.coarse\.", "coarse K/V"),
    (r"sekv\.router\.w\.", "router W (per-document PCA)"),
    (r"sekv\.router\.tw\.", "router W (trained copy)"),
    (r"sekv\.router\.norm\.", "router norms"),
]


def _group(name: str) -> str:
    g = next((g for rx, g in GROUPS if re.match(rx, name)), "other")
    if g.startswith("factors") and g != "factors ranks":  # keys' and values' factors apart (their codes may differ)
        g += " (K)" if name.startswith("sekv.fk.") else " (V)"
    return g


def breakdown(paths: list[Path]) -> None:
    import json

    from safetensors import safe_open

    for path in paths:
        groups: dict[str, int] = defaultdict(int)
        with safe_open(str(path), "pt") as f:
            manifest = json.loads(f.metadata()["sekv"])
            for k in f.keys():
                sl = f.get_slice(k)
                nb = math.prod(sl.get_shape()) * _SIZES[sl.get_dtype()]
                groups[_group(k)] += nb
            names = set(f.keys())
            cfg = codec.parse_config(f.get_tensor(codec.CONFIG)) if codec.CONFIG in names else None
            vname = codec.config_name("fv")
            if vname in names:
                cfg = {"keys": cfg, "values": codec.parse_config(f.get_tensor(vname))}
        total = sum(groups.values())
        raw = manifest["sizes"]["raw_kv_fp16_bytes"]
        codec_s = f"factor_bits={manifest['method_params'].get('factor_bits', 8)}" + (f", {cfg}" if cfg else "")
        print(f"\n### {path} ({manifest['n_tokens']} tokens, {codec_s})\n")
        print(f"pack tensors {total:,} B = {total / raw:.4f} of the raw fp16 KV ({raw:,} B); file {path.stat().st_size:,} B\n")
        print("| group | bytes | share of pack | / raw fp16 KV |")
        print("|---|---|---|---|")
        for g, nb in sorted(groups.items(), key=lambda x: -x[1]):
            print(f"| {g} | {nb:,} | {nb / total:.3f} | {nb / raw:.4f} |")
        if cfg:  # what opening the pack adds: decoding every layer's factors to int8 (SekvMemory._factors)
            import time

            from sekv_core.pack import read_pack

            pack = read_pack(path)
            names = set(pack.keys())
            t = time.perf_counter()
            for li in range(int(pack.get("sekv.config")[1])):
                for kind in ("fk", "fv"):
                    codec.read_factors(pack, names, f"sekv.{kind}.{li}")
            print(f"\ndecoding every layer's factors to int8: {time.perf_counter() - t:.2f} s")


def essay(n_tokens: int, out: Path, model: str) -> None:
    """The first n_tokens model tokens of pg_essays/worked.txt as a text file (the 4K / 8K documents of docs/experiments/sekv-notebook.md §7)."""
    from benchmarks.studies.rope_factors import ESSAYS

    from sekv_core import models

    tok = models.load(model).tokenizer
    ids = tok((ESSAYS / "worked.txt").read_text(), add_special_tokens=False)["input_ids"][:n_tokens]
    out.write_text(tok.decode(ids))
    print(f"{out}: {len(ids)} tokens of worked.txt")


def packs(docs: list[Path], out_dir: Path, model: str, bits: list[int], sets: list[tuple[str, dict]] | None = None) -> None:
    """Ingest each document once per factor_bits value and parameter set (one prefill per document, shared): packs
    in out_dir; ``sets``: (tag added to the file name, further sekv parameters), default one empty set."""
    from sekv_core import ingest as ing
    from sekv_core import models

    lm = models.load(model)
    cache: dict = {}
    real = ing.prefill

    def shared(model_, ids, **kw):  # the same prompt ids -> the same prefill (compress does not modify it)
        key = tuple(ids.tolist())
        if key not in cache:
            cache.clear()
            cache[key] = real(model_, ids, **kw)
        return cache[key]

    ing.prefill = shared
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        for doc in docs:
            for b, (tag, extra) in ((b, st) for b in bits for st in (sets or [("", {})])):
                r = ing.ingest(doc, out_dir / f"{doc.stem}.b{b}{tag}.sekv", lm=lm, method="sekv", params={"factor_bits": b, **extra})
                print(f"{r.pack_path}: {r.n_tokens} tokens, factor_bits={b}, file {r.pack_bytes:,} B = {r.pack_bytes / r.raw_kv_fp16_bytes:.4f} of raw fp16 KV, "
                      f"prefill {r.prefill_s:.1f} s, compress {r.compress_s:.2f} s")
    finally:
        ing.prefill = real


def parse_variant(variant: str) -> dict:
    """``LEVELS-gGROUP-ORDER[-leadK][-s8]`` -> codec keyword arguments (lead 0 when not given; ``-s8``: row scales
    ``log8``, else fp16)."""
    parts = variant.split("-")
    kw = {"levels": parts[0], "group": int(parts[1].removeprefix("g")), "order": parts[2], "lead": 0, "scales": "fp16"}
    for x in parts[3:]:
        if x.startswith("lead"):
            kw["lead"] = int(x.removeprefix("lead"))
        elif x == "s8":
            kw["scales"] = "log8"
        else:
            raise SystemExit(f"variant {variant!r}: unknown part {x!r}")
    return kw


def roundtrip(f: fz.Factors, span_len: torch.Tensor, d: int, variant: str, parts: tuple[str, ...] = ("us", "vt")) -> tuple[fz.Factors, int]:
    """int8 factors -> (the factors after the codec variant, their stored bytes); ``parts``: which of us / vt
    go through the codec (the others stay int8)."""
    if variant == "int8" or not parts:
        return f, f.nbytes()
    kw = parse_variant(variant)
    t = codec.encode_factors(f, span_len, d, **kw)
    g = codec.decode_factors(t, span_len, d, **kw)
    size = lambda *ks: sum(t[k].numel() * t[k].element_size() for k in ks)  # noqa: E731
    cus, mus, cvt, mvt = codec.code_names(kw["levels"])
    nbytes = size("rank", *codec.scale_names(kw["scales"]))
    nbytes += size(cus, mus) if "us" in parts else f.us.numel()
    nbytes += size(cvt, mvt, "vt.lead") if "vt" in parts else f.vt.numel()
    us = g.us if "us" in parts else f.us
    vt = g.vt if "vt" in parts else f.vt
    return fz.Factors(us, vt, f.rank, g.us_scale, g.vt_scale), nbytes


#: ``VARIANT@WHAT``: code only these tensors (K's us / vt, V's us / vt); without ``@``: all four
ONLY = {"k": (("us", "vt"), ()), "kus": (("us",), ()), "kvt": (("vt",), ()), "v": ((), ("us", "vt"))}


def errors(case, variants: list[str], budget: float = 0.10, energy_k: float | None = None, energy_v: float | None = None, rank_max_v: int = 32) -> None:
    shape = case["shape"]
    d = shape.head_dim
    s = case["surprisal"]
    mn, mx, w = auto_lengths(s.numel(), budget)
    seg = segment(s, min_span=mn, max_span=mx, window=w)
    pos, _ = seg.span_tokens()
    span_len = seg.span_len
    inv = rope.inv_freq_of(shape)
    cos, sin = rope.cos_sin(pos, inv, shape.rope_attention_scaling, dtype=case["keys"][0].dtype)
    ek = DEFAULTS["energy_k"] if energy_k is None else energy_k
    ev = DEFAULTS["energy_v"] if energy_v is None else energy_v
    rows = ["fp16"] + variants
    acc = {v: defaultdict(float) for v in rows}
    L = shape.n_layers
    print(f"N={s.numel()}  spans={seg.n_spans}  compressed tokens={pos.numel()}  energy {ek} / {ev}, rank <= 32 (values <= {rank_max_v}), pre-RoPE keys\n")
    for li in range(L):
        kpost, vall = case["keys"][li].float(), case["values"][li].float()
        kp, vp = kpost[:, pos], vall[:, pos]
        kpre = rope.undo(kp, cos, sin)
        raw = kp.shape[0] * kp.shape[1] * d * 2
        q = case["queries"][li]
        o = attn(q, kpost, vall, d**-0.5)
        with fz.single_thread():
            base = {
                "fp16": (fz.factorize(kpre, span_len, energy=ek, rank_max=32), fz.factorize(vp, span_len, energy=ev, rank_max=rank_max_v)),
                "int8": (fz.factorize(kpre, span_len, energy=ek, rank_max=32, int8=True), fz.factorize(vp, span_len, energy=ev, rank_max=rank_max_v, int8=True)),
            }
        for v in rows:
            if v == "fp16":
                (fk, bk), (fv, bv) = ((f, f.nbytes()) for f in base["fp16"])
            elif "+" in v:  # KEYS_VARIANT+VALUES_VARIANT
                nk, nv = v.split("+")
                (fk, bk), (fv, bv) = roundtrip(base["int8"][0], span_len, d, nk), roundtrip(base["int8"][1], span_len, d, nv)
            else:
                name, _, only = v.partition("@")
                pk, pv = ONLY[only] if only else (("us", "vt"), ("us", "vt"))
                (fk, bk), (fv, bv) = roundtrip(base["int8"][0], span_len, d, name, pk), roundtrip(base["int8"][1], span_len, d, name, pv)
            kh = rope.apply(fz.reconstruct_all(fk, span_len, d), cos, sin)
            vh = fz.reconstruct_all(fv, span_len, d)
            k2, v2 = kpost.clone(), vall.clone()
            k2[:, pos], v2[:, pos] = kh, vh
            o2 = attn(q, k2, v2, d**-0.5)
            a = acc[v]
            a["bk"] += bk / raw / L
            a["bv"] += bv / raw / L
            a["ek"] += float((kh - kp).norm() / kp.norm()) / L
            a["ev"] += float((vh - vp).norm() / vp.norm()) / L
            a["eo"] += float(((o2 - o).norm(dim=-1) / o.norm(dim=-1)).mean()) / L
    print("| factors | bytes K / raw | bytes V / raw | key err | value err | attn-out err |")
    print("|---|---|---|---|---|---|")
    for v in rows:
        a = acc[v]
        print(f"| {v} | {a['bk']:.3f} | {a['bv']:.3f} | {a['ek']:.4f} | {a['ev']:.4f} | {a['eo']:.4f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("breakdown", help="pack bytes by tensor group")
    b.add_argument("packs", nargs="+", type=Path)
    t = sub.add_parser("essay", help="write the first N model tokens of worked.txt to a text file")
    t.add_argument("tokens", type=int)
    t.add_argument("out", type=Path)
    t.add_argument("--model", default="qwen2.5-0.5b")
    p = sub.add_parser("packs", help="ingest documents with sekv at each factor_bits (one prefill per document)")
    p.add_argument("docs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=Path("/tmp/factor_codec_packs"))
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--bits", default="8,4")
    p.add_argument("--set", action="append", default=None,
                   help="TAG:KEY=VALUE,...: one more pack per document and bits with these sekv parameters, TAG added to its "
                        "name (e.g. .v4s16:value_bits=4,scale_bits=16); repeatable; none: the defaults only")
    e = sub.add_parser("errors", help="factor error, int8 vs codec variants")
    e.add_argument("--model", default="qwen2.5-0.5b")
    e.add_argument("--tokens", type=int, default=4096)
    e.add_argument("--budget", type=float, default=0.10)
    e.add_argument("--cache", type=Path, default=Path("/tmp/sekv_bench"))
    e.add_argument("--energy-k", type=float, default=None, help="rank rule for keys (default: sekv's, 0.99)")
    e.add_argument("--energy-v", type=float, default=None, help="rank rule for values (default: sekv's, 0.99)")
    e.add_argument("--rank-max-v", type=int, default=32, help="largest value rank (sekv: rank_max = 32 for both)")
    e.add_argument("--variants", default="int8,int4-g32-row,nf4-g32-row,nf4-g32-col,nf4-g32-col-lead1,int4-g32-col-lead1,nf4-g16-col-lead1,nf4-g64-col-lead1,nf4-g32-col-lead2")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    if args.cmd == "breakdown":
        breakdown(args.packs)
        return
    if args.cmd == "essay":
        essay(args.tokens, args.out, args.model)
        return
    if args.cmd == "packs":
        sets = None
        if args.set:
            sets = [("", {})] + [(t, {k: int(v) for k, v in (x.split("=") for x in kv.split(",") if x)}) for t, _, kv in (a.partition(":") for a in args.set)]
        packs(args.docs, args.out, args.model, [int(b) for b in args.bits.split(",")], sets)
        return
    case = load_case(args.model, args.tokens, args.cache)
    print(f"## {args.model}, {args.tokens} tokens\n")
    errors(case, args.variants.split(","), args.budget, args.energy_k, args.energy_v, args.rank_max_v)


if __name__ == "__main__":
    main()
