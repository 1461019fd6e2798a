"""The tensors of a sekv pack: what compress writes and open reads (all prefixed ``sekv.``; L layers).

  config [8] int64: N, L, Hkv, d, min_span, max_span, window, n_sink
  key_space [1] int64: 1 = keys factorised before RoPE, 0 = after
  rope_inv_freq [d/2] float32, rope_scaling [1] float32 (pre-RoPE packs)
  span_start / span_end [S] int64, full_idx [F] int64, anchor_idx [A] int64
  full.k.l / full.v.l     [Hkv, F, d]  store dtype (sekv/params.py store_dtype)
  coarse.k.l / coarse.v.l [Hkv, S, d]  store dtype
  router.w.l [Hw, d_r, d] store dtype, router.norm.l [Hw, S] float32, router.tau [L, H] float32: the untrained router
  router.ttau [L, H] float32, router.sha256 [32] uint8: the trained router the pack was made with (its W is read
                   from the router file at open, sekv/router.py)
  scout.profile [S] float32, scout.profile_blocks [B] float32, scout.profile_unit [1] int64: the document end's
                   span / zoom-block profile (sekv/scout.py)
  lex.terms [N] int32: the tokens' word terms (sekv/lexical.py)
  prior.kvzip [N] float32 in [0, 1]: with prior "kvzip", the share of (layer, KV head) pairs KVzip would keep of
                   each token (sekv/prior.py)
  fk.l.* / fv.l.*  key / value factors (sekv/factorize.py); with factor_bits 4 coded at rest (sekv/codec.py,
                   factor_codec [4-5] int64, + factor_codec.fv where the values' code differs), decoded to int8 at open
  zoom.idx [P] int64, zoom.k.l / zoom.v.l [Hkv, P, d] store dtype, or int8 with zoom.ks.l / zoom.vs.l [Hkv, P]
                   float16: the zoom tier, every span token's (the pipelined ingest: every token's) own K (pre-RoPE
                   where the factors are) and V, what a
                   zoomed block holds (sekv/zoom_tier.py)
  factor_segments [K+1] int64: a pack `sekv add` extended, its coded factors in K segments of spans (sekv/codec.py)
"""

from __future__ import annotations

import torch

from . import codec
from . import factorize as fz
from .params import SekvParams
from .segment import span_token_index

CONFIG_FIELDS = ("n_tokens", "n_layers", "n_kv_heads", "head_dim", "min_span", "max_span", "window", "n_sink")


def read_config(store) -> dict[str, int]:
    return dict(zip(CONFIG_FIELDS, store.get("sekv.config").tolist()))


def store_dtype(params: SekvParams, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the pack's full-resolution tokens, coarse entries and PCA W: the model's when it is 16-bit, else
    float16 (a float32 model on a CPU without bf16 would double them: the 3.2K manual's pack 0.228 -> 0.19 of the raw
    fp16 KV); ``store_dtype="model"`` keeps the model's (exactness tests)."""
    if params.store_dtype == "model" or model_dtype in (torch.float16, torch.bfloat16):
        return model_dtype
    return torch.float16


def read_factors(store, names: set[str], prefix: str, device=None, to_host: bool = True) -> fz.Factors:
    """One layer's key or value factors; coded (factor_bits 4) factors are decoded to int8 here, on ``device``
    (``to_host`` False: left there, for a re-layout on that device)."""
    coded = codec.read_factors(store, names, prefix, device=device, to_host=to_host)
    if coded is not None:
        return coded
    scaled = f"{prefix}.us_scale" in names
    return fz.Factors(
        store.get(f"{prefix}.us"),
        store.get(f"{prefix}.vt"),
        store.get(f"{prefix}.rank"),
        store.get(f"{prefix}.us_scale") if scaled else None,
        store.get(f"{prefix}.vt_scale") if scaled else None,
    )


class PackFactors:
    """A pack's factors per layer, K and V stacked (``fz.stack_kv``), read from the pack (sha256-checked) and decoded
    when first asked for rather than at open.

    ``factors[i]`` -> (host Factors, Layout): what the reference step reads, kept once made.  ``on_device(i)`` ->
    the stacked factors decoded on the accelerator and left there, not kept: the batched step re-lays them into
    its host blocks (sekv/blocks.py) there, so a pack opened on CUDA no longer decodes every layer at open, copies
    the int8 factors to the host and back to the device, then to pinned memory.  ``load_all()`` reads every layer
    now (the CPU's open: its damage shows at open, as before)."""

    def __init__(self, store, names: set[str], n_layers: int, span_len: torch.Tensor, head_dim: int, device):
        self.store, self.names, self.span_len, self.d = store, names, span_len, head_dim
        self.device = torch.device(device)
        self._host: list[tuple[fz.Factors, fz.Layout] | None] = [None] * n_layers

    def __len__(self) -> int:
        return len(self._host)

    def __getitem__(self, i: int) -> tuple[fz.Factors, fz.Layout]:
        if self._host[i] is None:
            f = self._read(i, to_host=True)
            self._host[i] = (f, fz.Layout.of(f, self.span_len, self.d))
        return self._host[i]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def on_device(self, i: int, device=None) -> fz.Factors:
        """Layer i's factors decoded on ``device`` (default: the pack's; a layer's own on a model placed across devices)."""
        return self._host[i][0] if self._host[i] is not None else self._read(i, to_host=False, device=device)

    def rank_max(self, i: int) -> int:
        """Layer i's largest rank, K and V, from the pack's rank tensors (host memory: no device read)."""
        return max((int(self.store.get(f"sekv.{kind}.{i}.rank").max()) for kind in ("fk", "fv") if self.span_len.numel()), default=0)

    def rank_host(self, i: int) -> torch.Tensor:
        """Layer i's ranks, K then V stacked as ``on_device`` stacks them [2 Hkv, S], from the pack's tensors (host)."""
        return torch.cat([self.store.get(f"sekv.{kind}.{i}.rank") for kind in ("fk", "fv")])

    def load_all(self) -> "PackFactors":
        for i in range(len(self)):
            self[i]
        return self

    def _read(self, i: int, to_host: bool, device=None) -> fz.Factors:
        dev = self.device if device is None else torch.device(device)
        return fz.stack_kv(*(read_factors(self.store, self.names, f"sekv.{kind}.{i}", device=dev, to_host=to_host) for kind in ("fk", "fv")))


def router_sha256(store, names: set[str]) -> str:
    """The sha256 of the trained router the pack was made with, "" for an untrained one."""
    if "sekv.router.sha256" not in names:
        return ""
    return bytes(store.get("sekv.router.sha256").tolist()).hex()


def sha256_tensor(hex_digest: str) -> torch.Tensor:
    return torch.tensor(list(bytes.fromhex(hex_digest)), dtype=torch.uint8)


def _bad(what: str):
    from ..errors import PackError

    return PackError(f"{what}; the pack is damaged or was not written by sekv, re-ingest the document")


#: what the factor blocks' build reads (sekv/gpu_step.py start_blocks: ``validate(factors_only=True)``)
_FACTOR_SPECS = ("sekv.span_start", "sekv.span_end", "sekv.full_idx", codec.SEGMENTS, "sekv.fk.{l}.rank", "sekv.fv.{l}.rank")


def validate(store, shape, n_tokens: int, factors_only: bool = False) -> None:
    """Every tensor the memory (sekv/memory.py) and describe() read, against the table above: dtypes, shapes against
    N / S / F and the model, spans inside the document and disjoint, indices in range, ranks <= min(span length, d),
    and the factors' and codes' lengths.  Raises PackError (the parameters were checked by SekvParams).
    ``factors_only``: only what the factor blocks' build reads (the config, the spans, the factors and their codes),
    not the full-resolution tokens, coarse entries, router and tables the open checks too."""
    from ..pack import FLOATS, TensorSpec as T, check_tensors, model_dims

    L, N = shape.n_layers, n_tokens
    dims = check_tensors(store, [T("sekv.config", ("int64",), (8,)), T("sekv.key_space", ("int64",), (1,), values=(0, 1))], model_dims(shape, N))
    c = [int(x) for x in store.get("sekv.config").tolist()]
    if c[:4] != [N, L, shape.n_kv_heads, shape.head_dim] or not (1 <= c[4] <= c[5] < 2**31 and 0 <= c[6] < 2**31 and 0 <= c[7] < 2**31):
        raise _bad("tensor 'sekv.config' does not match the document and model")
    pre = int(store.get("sekv.key_space")[0]) == 1
    f32 = ("float32",)
    specs = [
        T("sekv.rope_inv_freq", f32, (shape.head_dim // 2,), optional=not pre, finite=True),
        T("sekv.rope_scaling", f32, (1,), optional=not pre, finite=True),
        T("sekv.span_start", ("int64",), ("S",), values=(0, N - 1), increasing=True),
        T("sekv.span_end", ("int64",), ("S",), values=(1, N), increasing=True),
        T("sekv.full_idx", ("int64",), ("F",), values=(0, N - 1)),
        T("sekv.anchor_idx", ("int64",), ("A",), values=(0, N - 1)),
        *(T(f"sekv.{p}.{kv}.{{l}}", FLOATS, ("Hkv", n, "d"), finite=True) for p, n in (("full", "F"), ("coarse", "S")) for kv in "kv"),
        T("sekv.router.w.{l}", FLOATS, ("Hw", "dr", "d"), finite=True),
        T("sekv.router.norm.{l}", f32, ("Hw", "S"), finite=True),
        T("sekv.router.tau", f32, ("L", "H"), finite=True),
        T("sekv.router.ttau", f32, ("L", "H"), optional=True, finite=True),
        T("sekv.router.sha256", ("uint8",), (32,), optional=True),
        T("sekv.lex.terms", ("int32",), ("N",), optional=True, values=(-1, 2**31 - 1)),
        T("sekv.scout.profile", f32, ("S",), optional=True, finite=True),
        T("sekv.scout.profile_blocks", f32, ("B",), optional=True, finite=True),
        T("sekv.scout.profile_unit", ("int64",), (1,), optional=True, values=(0, N)),
        T(codec.SEGMENTS, ("int64",), ("K1",), optional=True, values=(0, N), increasing=True),
        T("sekv.prior.kvzip", f32, ("N",), optional=True, finite=True, values=(0, 1)),
        *(T(f"sekv.{k}.{{l}}.rank", ("int16",), ("Hkv", "S"), values=(0, shape.head_dim)) for k in ("fk", "fv")),
        T("sekv.zoom.idx", ("int64",), ("P",), optional=True, values=(0, N - 1), increasing=True),
    ]
    dims = check_tensors(store, [t for t in specs if t.name in _FACTOR_SPECS] if factors_only else specs, dims, L)
    if not factors_only and (dims["Hw"] not in (shape.n_heads, shape.n_kv_heads) or not 1 <= dims["dr"] <= 4096):
        raise _bad("the router's shape does not match the model")
    start, end = store.get("sekv.span_start"), store.get("sekv.span_end")
    n = end - start
    if bool((n <= 0).any()) or bool((start[1:] < end[:-1]).any()) or dims["F"] + int(n.sum()) != N:
        raise _bad("the spans are empty, overlap, or do not cover the document with the full-resolution tokens")
    names = set(store.keys())
    if not factors_only and ("sekv.router.sha256" in names) != ("sekv.router.ttau" in names):
        raise _bad("the trained router's tensors 'sekv.router.sha256' and 'sekv.router.ttau' come only together")
    hkv, d, T_ = shape.n_kv_heads, shape.head_dim, int(n.sum())
    if factors_only:  # the factor blocks' build reads no zoom tier
        pass
    elif "sekv.zoom.idx" in names:  # the zoom tier (sekv/zoom_tier.py): every span token at least, in order, its rows per layer
        idx, pos = store.get("sekv.zoom.idx"), span_token_index(start, end)[0]
        at = torch.searchsorted(idx, pos).clamp_max(max(dims["P"] - 1, 0))
        if dims["P"] < T_ or (T_ and not torch.equal(idx[at], pos)):
            raise _bad("tensor 'sekv.zoom.idx' does not cover the spans' tokens")
        int8 = "sekv.zoom.ks.0" in names
        check_tensors(store, [
            T("sekv.zoom.k.{l}", ("int8",) if int8 else FLOATS, ("Hkv", "P", "d")),  # not read at open: its sha256 checked on a thread (sekv/zoom_tier.py)
            T("sekv.zoom.v.{l}", ("int8",) if int8 else FLOATS, ("Hkv", "P", "d")),
            *((T("sekv.zoom.ks.{l}", ("float16",), ("Hkv", "P"), finite=True), T("sekv.zoom.vs.{l}", ("float16",), ("Hkv", "P"), finite=True)) if int8 else ()),
        ], {**dims, "Hkv": hkv, "d": d}, L)
    elif any(x.startswith("sekv.zoom.") for x in names):
        raise _bad("the zoom tier's tensors come without 'sekv.zoom.idx'")
    for i in range(L):
        for kind in ("fk", "fv"):
            check_tensors(store, _factor_specs(store, names, f"sekv.{kind}.{i}", kind, n, hkv, d, T_), {})


def _factor_specs(store, names: set[str], p: str, kind: str, n: torch.Tensor, hkv: int, d: int, T_: int) -> list:
    """The tensors of one layer's key or value factors (float, int8, or 4-bit coded), with their lengths."""
    from ..pack import FLOATS, TensorSpec as T

    r = store.get(f"{p}.rank").long()
    if bool((r > n.view(1, -1)).any()):
        raise _bad(f"tensor '{p}.rank' holds ranks above their span's length")
    rs, n_us, n_vt = int(r.sum()), int((r * n.view(1, -1)).sum()), int(r.sum()) * d
    cfg = None
    if codec.CONFIG in names or codec.config_name("fv") in names:
        for cn in {codec.CONFIG, codec.config_name(kind)} & names:
            ct = store.get(cn)
            v = [int(x) for x in ct.tolist()] if ct.dtype == torch.int64 and ct.dim() == 1 and ct.numel() in (4, 5) else None
            if v is None or not (2 <= v[0] <= 4096 and v[0] % 2 == 0 and 0 <= v[1] < len(codec.LEVELS) and 0 <= v[2] < len(codec.ORDERS)
                                 and 0 <= v[3] <= d and (len(v) == 4 or 0 <= v[4] < len(codec.SCALES))):
                raise _bad(f"tensor '{cn}' is not a factor codec")
        cfg = codec.kind_config(store, names, kind)
    if cfg is not None and f"{p}.{codec.code_names(cfg['levels'])[0]}" in names:
        segs = codec.segments(store, names) or [0, int(n.numel())]
        if segs[0] != 0 or segs[-1] != n.numel() or any(a > b for a, b in zip(segs, segs[1:])):
            raise _bad(f"tensor '{codec.SEGMENTS}' does not cut the spans into segments")
        return [x for j, (a, b) in enumerate(zip(segs, segs[1:])) for x in _coded_specs(cfg, lambda k, j=j: codec.segment_name(p, j, k), r[:, a:b], n[a:b], hkv, d)]
    if f"{p}.us_scale" in names:
        return [T(f"{p}.us", ("int8",), (n_us,)), T(f"{p}.vt", ("int8",), (n_vt,)),
                T(f"{p}.us_scale", ("float16",), (hkv * T_,), finite=True), T(f"{p}.vt_scale", ("float16",), (rs,), finite=True)]
    return [T(f"{p}.us", FLOATS, (n_us,), finite=True), T(f"{p}.vt", FLOATS, (n_vt,), finite=True)]


def _coded_specs(cfg: dict, name, r: torch.Tensor, n: torch.Tensor, hkv: int, d: int) -> list:
    """The coded tensors of one factor segment (sekv/codec.py) with their lengths; name(part) -> tensor name."""
    from ..pack import TensorSpec as T

    rs, n_us, n_vt, T_ = int(r.sum()), int((r * n.view(1, -1)).sum()), int(r.sum()) * d, int(n.sum())
    b, g, lead = codec.bits_of(cfg["levels"]), cfg["group"], cfg["lead"]
    n_lead = int(torch.minimum(r, torch.tensor(lead)).sum()) * d
    m = n_vt - n_lead
    cu, mu, cv, mv = codec.code_names(cfg["levels"])
    want = {cu: (n_us * b + 7) // 8, mu: codec.n_groups(n_us, g), cv: (m * b + 7) // 8, mv: codec.n_groups(m, g)}
    specs = [T(name(k), ("uint8",), (v,)) for k, v in want.items()] + [T(name("vt.lead"), ("int8",), (n_lead,))]
    if cfg["scales"] == "log8":
        return specs + [T(name("us_scale.l8"), ("uint8",), (hkv * T_,)), T(name("vt_scale.l8"), ("uint8",), (rs,)),
                        *(T(name(f"{k}_scale.l8p"), ("float32",), (2,), finite=True) for k in ("us", "vt"))]
    return specs + [T(name("us_scale"), ("float16",), (hkv * T_,), finite=True), T(name("vt_scale"), ("float16",), (rs,), finite=True)]
