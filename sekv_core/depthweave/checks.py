"""What a depthweave pack's tensors must be before the memory (memory.py) or describe() reads them.

The layout is codec.py's table; the config tensor says the ranks, units, levels and bit widths, and every
other tensor's dtype and shape follows from it and the token count.  Checked here: the config against the
document and the model, and each field's range (at least one compressed token, ranks <= head_dim, residual channels + rank <= head_dim,
levels that start at 0, increase and are multiples of the first non-zero one, bit widths the codec has); every
tensor's dtype and shape (codes, scales and bases: their lengths from the ranks, units and block/group sizes);
values the memory indexes or takes logs of (levels in range, delimiter flags 0/1, router features finite and
>= 0, floats finite); and that the pack's own budget is above the floor it implies.  PackError on any of them.
"""

from __future__ import annotations

import torch

from ..errors import PackError
from . import codec

P = "depthweave."
#: config fields (codec.Spec, in order) that must equal the document's and model's
_MODEL_FIELDS = {"n_tokens": "N", "n_layers": "L", "n_kv_heads": "Hkv", "head_dim": "d"}
_MAX_LEVELS = 64
_MAX_GROUPS = 255  # groups per token are stored as uint8 (codec.group_offsets)


def _bad(what: str) -> PackError:
    return PackError(f"{what}; the pack is damaged or was not written by sekv, re-ingest the document")


def checked_spec(store, shape, n_tokens: int) -> codec.Spec:
    """The pack's codec.Spec, each field range-checked against the document and the model."""
    from ..pack import TensorSpec as T, check_tensors, model_dims

    check_tensors(store, [T(P + "config", ("int64",), (16,)), T(P + "levels", ("int64",), ("NL",))], model_dims(shape, n_tokens))
    names = [f for f in codec.Spec.__dataclass_fields__ if f != "levels"]
    c = dict(zip(names, (int(x) for x in store.get(P + "config").tolist())))
    levels = tuple(int(x) for x in store.get(P + "levels").tolist())
    want = {"n_tokens": n_tokens, "n_layers": shape.n_layers, "n_kv_heads": shape.n_kv_heads, "head_dim": shape.head_dim}
    for k, v in want.items():
        if c[k] != v:
            raise _bad(f"tensor '{P}config': {k} is {c[k]}, the document and model have {v}")
    d = shape.head_dim
    ranges = {"n_exact": (0, n_tokens - 1), "rank_k": (1, d), "rank_v": (1, d), "depth_window": (1, 1 << 20), "depth_overlap": (0, 1 << 20),
              "unit_k": (0, d), "unit_v": (0, d), "coef_block": (1, 1 << 20)}
    for k, (lo, hi) in ranges.items():
        if not lo <= c[k] <= hi:
            raise _bad(f"tensor '{P}config': {k} = {c[k]} is outside [{lo}, {hi}]")
    for k, allowed in (("coef_bits", (0, 8)), ("res_bits", (0, 4)), ("pre_rope", (0, 1)), ("gate", (0, 1))):
        if c[k] not in allowed:
            raise _bad(f"tensor '{P}config': {k} = {c[k]} is not one of {allowed}")
    if not (1 <= len(levels) <= _MAX_LEVELS and levels[0] == 0 and all(b > a for a, b in zip(levels, levels[1:])) and levels[-1] <= d
            and (len(levels) == 1 or all(x % levels[1] == 0 for x in levels))):
        raise _bad(f"tensor '{P}levels' is not a list of residual levels (0, then increasing multiples of the first, <= head_dim)")
    spec = codec.Spec(**c, levels=levels)
    if spec.max_groups > _MAX_GROUPS:
        raise _bad(f"tensor '{P}levels': {spec.max_groups} residual groups per token, more than {_MAX_GROUPS}")
    for z in "kv":
        if spec.rank(z) + spec.channels(z) > d:
            raise _bad(f"tensor '{P}config': rank + residual channels of the {'keys' if z == 'k' else 'values'} exceed head_dim {d}")
        if spec.res_bits and spec.channels(z) and spec.group(z) % 2:
            raise _bad(f"tensor '{P}config': 4-bit residual groups of odd width {spec.group(z)}")
    return spec


def tensor_specs(spec: codec.Spec, shape) -> list:
    """Every tensor of a pack made with ``spec`` (pack.TensorSpec), shapes in terms of the spec's numbers."""
    from ..pack import FLOATS, TensorSpec as T

    hkv, nc, d, M, NL = spec.n_kv_heads, spec.n_compressed, spec.head_dim, spec.n_windows, len(spec.levels)
    basis = ("float16",) if spec.coef_bits else ("float32",)
    f16, f32 = ("float16",), ("float32",)
    out = [T(P + "rope", f32, (d // 2 + 1,), optional=not spec.pre_rope, finite=True)]
    for z in "kv":
        r, ch = spec.rank(z), spec.channels(z)
        out += [T(f"{P}basis.{z}.{m}", basis, (hkv, r, d), finite=True) for m in range(M)]
        out.append(T(f"{P}resbasis.{z}.{{l}}", basis, (hkv, ch, d), finite=True))
        if spec.coef_bits:
            out += [T(f"{P}coef.{z}.{{l}}", ("int8",), (hkv, nc, r)), T(f"{P}coef_scale.{z}.{{l}}", f16, (hkv, nc, r // spec.block(z)), finite=True)]
        else:
            out.append(T(f"{P}coef.{z}.{{l}}", f32, (hkv, nc, r), finite=True))
        if spec.res_bits and ch:
            out += [T(f"{P}res.{z}.{{l}}", ("uint8",), (hkv, nc, ch // 2)),
                    T(f"{P}res_scale.{z}.{{l}}", f16, (hkv, nc, spec.max_groups), finite=True)]
        else:
            out.append(T(f"{P}res.{z}.{{l}}", f32, (hkv, nc, ch), finite=True))
        out.append(T(f"{P}exact.{z}.{{l}}", FLOATS, (hkv, spec.n_exact, d), finite=True))
    out += [T(f"{P}feat.{k}", f16, (M, hkv, nc), finite=True) for k in ("mass", "spike", "energy")]
    out += [T(P + "feat.delim", ("uint8",), (nc,), values=(0, 1)), T(P + "level", ("uint8",), (M, hkv, nc), values=(0, NL - 1)),
            T(P + "tau", f32, (1,), finite=True)]
    return out


def validate(store, params: dict, shape, n_tokens: int) -> codec.Spec:
    """Raise PackError where the pack is not what memory.py / describe() may use (the module docstring's list)."""
    from ..pack import check_tensors, model_dims

    spec = checked_spec(store, shape, n_tokens)
    check_tensors(store, tensor_specs(spec, shape), model_dims(shape, n_tokens), shape.n_layers)
    for k in ("mass", "spike", "energy"):  # the router takes their logs
        t = store.get(f"{P}feat.{k}")
        if t.numel() and bool((t < 0).any()):
            raise _bad(f"tensor '{P}feat.{k}' holds negative values")
    budget = float(params["budget"])
    full = spec.n_tokens * shape.kv_bytes_per_token()
    itemsize = torch.empty(0, dtype=shape.dtype).element_size()
    floor = sum(codec.fixed_bytes(spec, itemsize).values()) + codec.transient_bytes(spec, int(params["chunk"]))
    if budget < 1 and budget * full < floor:
        raise _bad(f"the pack's budget {budget:g} is below the floor its ranks need ({floor / max(full, 1):.3f})")
    return spec
