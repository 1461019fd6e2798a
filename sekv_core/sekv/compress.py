"""Ingest: the document's full KV cache -> the tensors of a sekv pack (sekv/layout.py).

surprisal -> anchors + spans (sekv/segment.py) -> coarse means (sekv/summarize.py) -> per-span SVD factors of
pre-RoPE keys and of values (sekv/factorize.py, sekv/rope.py), coded 4-bit (sekv/codec.py) -> router W, norms, tau
(sekv/router.py) and the scout's document profile, word terms and optional KVzip prior (sekv/scout.py, sekv/lexical.py,
sekv/prior.py).  Runs on the
prefill's device; only the results move to the host (sekv/host_copies.py).  A document prefilled in windows
(sekv_core/windows.py) is compressed a window at a time (:func:`compress_window`) and merged (sekv/merge.py).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch

from ..methods.base import ModelShape, PrefillResult
from . import codec
from . import factorize as fz
from . import layout, merge, numbers, prior, rope, router, router_file, scout, zoom_tier
from .host_copies import HostCopies, to_host
from .params import SekvParams
from .segment import Segmentation, auto_lengths, fixed_segment, keep_exact, segment, zoom_blocks
from .summarize import span_weights, weighted_means


#: the float32 factor inputs (keys and values in span order) of the layers decomposed together (sekv/factorize.py):
#: few launches and host syncs per layer, a bounded transient (a few times this: their copy in one batch, its padded
#: blocks; the 0.5B: all 24 layers at 4K, 3 a group at 32K; the 8B shape: one layer a group from 16K)
FACTOR_GROUP_BYTES = 128 << 20
#: the CPU decomposes a layer at a time: its cost is the arithmetic, not launches, and larger batches only add copies
GROUP_ON_CPU = False
#: what compress leaves of an accelerator's free memory: the allocator's fragmentation, cuBLAS / cuSOLVER workspaces
MARGIN_BYTES = 1 << 30
#: the most bytes compress holds at once per byte of a chunk's float32 factor inputs (its keys and values in span
#: order): the inputs, RoPE undone, their copy in one batch, the padded blocks, Grams (d x d a block: on CUDA about
#: three alive in the subspace iteration, float64), U*sigma, packing.  tests/test_compress_memory.py measures the CPU
#: path under it (below 3 fails there); the CUDA path's count from the code is ~10
FACTOR_WORK = 16
#: per document token, what compress keeps on the device for the whole window (span order, span ids, weights, the
#: scout profile's span of each token: int64s and floats)
WINDOW_BYTES_PER_TOKEN = 64
#: times a window's compress starts again under half its bound when the device runs out of memory all the same
OOM_RETRIES = 3
#: per query row and key, the float32 tensors of the scout profile's attention (scores, softmax, the in-span copy)
PROFILE_WORK = 4
#: None, or a callable(event, **info) told where compress is (benchmarks/big_model.py's stage log): "window" (a
#: window's prefill done, its plan made), "profile" (its scout profiles made), "layers" (a layer group's factors made:
#: ``done`` layers of ``of``), "window_done", "merge" (``done`` layers merged), "merge_done".  It may raise to stop
#: compress there (a benchmark's time cap): the exception propagates as any other
PROGRESS = None


def _progress(event: str, **info) -> None:
    if PROGRESS is not None:
        PROGRESS(event, **info)


def free_bytes(device: torch.device) -> int | None:
    """The bytes compress may hold at once on ``device``: its free memory (torch's cached blocks counted as free)
    less :data:`MARGIN_BYTES`; None on the CPU (no bound).  Read once per window, after its prefill (tests replace it
    to bound compress on the CPU)."""
    if device.type != "cuda":
        return None
    free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return max(0, free - MARGIN_BYTES)


@dataclass
class Plan:
    """How a window's compress holds its device memory under a bound (:func:`plan`)."""

    group: int  # layers whose factors come from one batched decomposition
    chunks: list[tuple[int, int, int, int]]  # (first span, end span, first row, end row) in span order: one = the whole layer
    profile_rows: int | None = None  # query rows of the scout profile scored at once (None: all, every head together)
    in_flight: int | None = None  # device bytes of results on their way to the host before compress waits for them


def plan(prefill: PrefillResult, seg: Segmentation, bound: int | None, device: torch.device) -> Plan:
    """The layer group and span chunks of a window's compress.  ``bound`` None: as many layers a group as
    FACTOR_GROUP_BYTES allows (one on the CPU), every layer at once.  Otherwise, out of ``bound`` bytes: the layer
    read onto the device (when the KV is elsewhere: the host), an eighth for results on their way to the host, the
    window's per-token tensors, and the rest for factor work (FACTOR_WORK times the float32 inputs): whole layers,
    as many as fit (at most FACTOR_GROUP_BYTES of inputs), or one layer's spans in chunks of as many rows as fit
    (one span at least)."""
    shape = prefill.shape
    hkv, d, n = shape.n_kv_heads, shape.head_dim, prefill.n_tokens
    span_len = seg.span_len.long()
    rows = int(span_len.sum())
    s = int(span_len.numel())
    per_layer = 2 * hkv * rows * d * 4  # float32 factor inputs of a layer (keys and values)
    whole = [(0, s, 0, rows)]
    group = min(shape.n_layers, max(1, FACTOR_GROUP_BYTES // max(per_layer, 1))) if device.type != "cpu" or GROUP_ON_CPU else 1
    if bound is None:
        return Plan(group, whole)
    isz = torch.empty(0, dtype=shape.dtype).element_size()
    read = 2 * hkv * n * d * isz if _reads_layers(prefill, device) else 0
    in_flight = bound // 8
    avail = max(0, bound - read - in_flight - WINDOW_BYTES_PER_TOKEN * n)
    fit = (avail + read) // max(FACTOR_WORK * per_layer + read, 1)  # a group holds each of its layers as read until it is factorised
    q = _query_rows(prefill)
    profile_rows = min(q, max(1, (avail - n * d * 4) // (PROFILE_WORK * n * 4 + 4 * max(s, 1)))) if q else None
    if profile_rows == q and avail >= hkv * n * d * 4 + q * (PROFILE_WORK * n * 4 + 4 * max(s, 1)):
        profile_rows = None  # every head's rows at once fit (their keys in float32 too): the unbounded path's launches
    if fit >= 1:
        return Plan(min(group, fit), whole, profile_rows, in_flight)
    budget_rows = avail // (FACTOR_WORK * 2 * hkv * d * 4)
    chunks, s0, p0 = [], 0, 0
    ends = torch.cumsum(span_len, 0).tolist()
    for i in range(s):
        if i > s0 and ends[i] - p0 > budget_rows:  # span i starts the next chunk (a chunk holds one span at least)
            chunks.append((s0, i, p0, ends[i - 1]))
            s0, p0 = i, ends[i - 1]
    chunks.append((s0, s, p0, rows))
    return Plan(1, chunks, profile_rows, in_flight)


def _reads_layers(prefill: PrefillResult, device: torch.device) -> bool:
    """Whether reading a layer's keys puts a copy on ``device`` (the KV on the host, or on another device)."""
    keys = prefill.keys
    return _lazy(keys) and any(h.device != device for h in keys.host)


def _query_rows(prefill: PrefillResult) -> int:
    """The recorded observation queries per layer (all heads), 0 when none."""
    q = prefill.scores.get("obs_queries") if prefill.scores else None
    return int(q[0].shape[0] * q[0].shape[1]) if q else 0


def _lazy(keys) -> bool:
    """Whether a prefill's per-layer KV is read onto the device when indexed (kv_offload.LayersOn)."""
    return hasattr(keys, "host") and hasattr(keys, "devices")


def _kv_dtype(prefill: PrefillResult) -> torch.dtype:
    keys = prefill.keys
    return keys.host[0].dtype if _lazy(keys) else keys[0].dtype


def _device_of(prefill: PrefillResult) -> torch.device:
    """Where compress runs: the prefill's device (a layer read there when the KV is elsewhere), without reading one."""
    keys = prefill.keys
    return keys.devices[0] if _lazy(keys) else keys[0].device


def lengths(n_tokens: int, params: SekvParams) -> tuple[int, int, int]:
    """(min_span, max_span, window): the explicit parameters, or the budget-driven defaults."""
    mn, mx, w = auto_lengths(n_tokens, params.layout_budget)
    mn = params.min_span or mn
    mx = params.max_span or 2 * mn
    w = params.window if params.window >= 0 else w
    return mn, mx, w


def segmentation(prefill: PrefillResult, params: SekvParams) -> Segmentation:
    """The spans of a prefill's tokens (local indices).  A window of a windowed ingest (sekv_core/windows.py) is
    segmented on its own, so no span straddles two windows: the sinks only in the document's first window, the
    full-resolution recent window only in its last; span lengths from the whole document's token count.  With
    ``number_share`` > 0 the number tokens the share allows are then taken out of the spans (sekv/numbers.py)."""
    seg = _spans(prefill, params)
    if params.number_share <= 0:
        return seg
    text = (prefill.scores or {}).get("token_text")
    if text is None:
        raise ValueError("sekv: number_share > 0 needs the tokens' text (prefill scores 'token_text')")
    flags = numbers.number_flags(text[prefill.start : prefill.start + prefill.n_tokens])
    cap = numbers.number_cap(params.number_share, params.layout_budget, prefill.n_tokens)
    return keep_exact(seg, numbers.exact_positions(flags, cap))


def _spans(prefill: PrefillResult, params: SekvParams) -> Segmentation:
    n = prefill.n_tokens
    n_doc = prefill.doc_tokens or n
    mn, mx, w = lengths(n_doc, params)
    n_sink = params.n_sink if prefill.start == 0 else 0
    w = w if prefill.start + n == n_doc else 0
    s = prefill.surprisal if prefill.surprisal is not None else torch.zeros(n)
    seg = segment(s, alpha=params.alpha, min_span=mn, max_span=mx, n_sink=n_sink, window=w, anchors=params.anchors)
    if params.segmentation == "surprisal":
        return seg
    chunk = params.chunk or (float(seg.span_len.float().mean()) if seg.n_spans else 0.0)
    return fixed_segment(n, chunk=chunk, n_sink=n_sink, window=w, anchors=params.anchors)


def host_bound(n: int, shape: ModelShape, params: SekvParams) -> int:
    """An upper bound of the pack's tensor bytes for n tokens (spans at least min_span long)."""
    mn, _, w = lengths(n, params)
    L, hkv, d = shape.n_layers, shape.n_kv_heads, shape.head_dim
    isz = torch.empty(0, dtype=shape.dtype).element_size()
    s = n // max(mn, 1) + 2
    f = min(n, w + params.n_sink + 2 * s + mn)
    r = params.rank_max
    es = 1 if params.factors_8bit else torch.empty(0, dtype=getattr(torch, params.factor_dtype)).element_size()
    per_kind = hkv * n * r * es + hkv * s * r * d * es + 2 * hkv * n + 2 * hkv * s * r + 2 * hkv * s
    per_layer = 2 * per_kind + 2 * hkv * (f + s) * d * isz + hkv * params.d_r * d * 4 + hkv * s * 4
    if params.zoom_tier != "factors":  # sekv/zoom_tier.py: every span token's K and V
        per_layer += 2 * hkv * n * (d + 2 if params.zoom_tier == "int8" else d * isz)
    return L * (per_layer + 64 * 16)


def trained_router(prefill: PrefillResult, params: SekvParams, shape: ModelShape):
    """The trained router file ``params.router`` resolves to for this model, or None (untrained)."""
    spec = router_file.resolve(params.router, prefill.model_fingerprint, shape, prefill.model_id)
    return None if spec == "untrained" else router_file.load(spec)


def codec_configs(params: SekvParams) -> tuple[dict, dict]:
    """The 4-bit code of the key factors and of the value factors (sekv/codec.py)."""
    kcfg = dict(codec.DEFAULT, scales="log8" if params.scale_bits == 8 else "fp16")
    vcfg = dict(codec.VALUES_3BIT, scales=kcfg["scales"]) if params.value_bits == 3 else kcfg
    return kcfg, vcfg


class Prepared:
    """What compress needs that no prefill result decides, made on a thread of its own while the prefill runs
    (SekvMethod.reserve_host, on a GPU): nothing in a layer's factors can start before the prefill ends (the spans
    come from the whole document's surprisal, the last layer's logits), but two costs of the first layer group can.

    - **RoPE's cos / sin of every document position** (rope.cos_sin of 0..n-1 at the model's dtype; page-locked on
      CUDA).  A window's span tokens' rows are then indexed out of them on the device (:func:`_rot_tables`): the same
      values as rope.cos_sin of those positions (elementwise arithmetic, tests/test_compress_prepared.py), where
      compress used to make them on the host after the segmentation (0.38 s for 129K rows on one thread here).
    - **The factorisation's and codec's kernels, once** (:func:`warm_compress`, CUDA: on a stream of its own, tiny
      inputs): the libraries' load (cuSOLVER), their handles and the kernels' lazy loading are paid beside the
      prefill, not in the first layer group (0.87 s against 0.155 s for each later one in the 8B 128K run).

    :meth:`result` waits for the thread (its library handles go back to torch's pool for compress's thread)."""

    def __init__(self, n_tokens: int, shape: ModelShape, params: SekvParams, device: torch.device | None = None, warm: bool | None = None):
        self.n, self.shape, self.params = int(n_tokens), shape, params
        self.device = torch.device(device) if device is not None else None
        self.warm = (self.device is not None and self.device.type == "cuda") if warm is None else warm
        self.tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self.error: BaseException | None = None  # what the thread raised (compress then makes its own tables)
        self.thread = threading.Thread(target=self._run, name="sekv-compress-prepare", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            inv = rope.inv_freq_of(self.shape)
            if inv is not None and self.params.key_space == "pre_rope":
                c, s = rope.cos_sin(torch.arange(self.n), inv, self.shape.rope_attention_scaling, dtype=self.shape.dtype)
                if self.device is not None and self.device.type == "cuda":
                    c, s = c.pin_memory(), s.pin_memory()
                self.tables = (c, s)
            if self.warm and self.device is not None:
                warm_compress(self.shape, self.params, self.device)
        except Exception as e:  # noqa: BLE001 - an optional head start: compress does without it
            self.error = e

    def result(self) -> "Prepared":
        self.thread.join()
        return self

    def rot_tables(self, inv: torch.Tensor | None, scaling: float, dtype: torch.dtype, n_needed: int):
        """The cos / sin tables of positions 0..n-1 (host) when they are the ones compress would make (the same
        frequencies, scaling and dtype, every position covered), else None."""
        self.result()
        if self.tables is None or inv is None or n_needed > self.n or dtype != self.shape.dtype:
            return None
        if scaling != self.shape.rope_attention_scaling or not torch.equal(inv, rope.inv_freq_of(self.shape)):
            return None
        return self.tables


def warm_compress(shape: ModelShape, params: SekvParams, device: torch.device, spans: int = 4) -> None:
    """A layer's factorisation (factorize_many: the Gram, the subspace iteration's Cholesky QR and k x k
    eigensolver, the packing) and coding (codec.encode_factors) once on made-up keys and values of ``spans`` spans
    of rank_max + 8 rows on ``device`` (on CUDA on a stream of its own, synchronised at the end); nothing is kept."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)  # drawn where they are used: no copy from pageable memory
    rows = max(params.rank_max, 32) + 8
    hkv, d = shape.n_kv_heads, shape.head_dim
    span_len = torch.full((spans,), rows, dtype=torch.long)
    opts = dict(rank_max=params.rank_max, int8=params.factors_8bit, dtype=getattr(torch, params.factor_dtype), method=params.svd)
    side = torch.cuda.Stream(dev) if dev.type == "cuda" else None
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        x = [torch.randn(hkv, spans * rows, d, generator=g, device=dev) for _ in range(2)]
        fs = fz.factorize_many(x, span_len, energies=[params.energy_k, params.energy_v], keeps=[None, None], **opts)
        if params.coded:
            for f, cfg in zip(fs, codec_configs(params)):
                codec.encode_factors(f, span_len, d, **dict(cfg, scales="fp16"))
    if side is not None:
        side.synchronize()


def compress(prefill: PrefillResult, params: SekvParams, arena: torch.Tensor | None = None, emit=None,
             prepared: Prepared | None = None) -> dict[str, torch.Tensor]:
    """The pack's tensors (host memory) of a document prefilled at once; ``arena``: host memory to copy them into
    (sekv/host_copies.py).  The one-window case of :func:`compress_windows`."""
    return compress_windows([prefill], params, arena, emit, prepared)


def compress_windows(windows, params: SekvParams, arena: torch.Tensor | None = None, emit=None,
                     prepared: Prepared | None = None) -> dict[str, torch.Tensor]:
    """The pack's tensors of a document given as window prefills (at global positions, one at a time): each window
    compressed on its own (:func:`compress_window`), then merged (sekv/merge.py).  ``emit(tensors)``: a document of
    one window with coded factors hands each layer's final tensors that need no other layer (merge.final_layer) to
    it as they are made, a callable that waits for their copy to the host and returns them (the pipelined ingest
    writes them into the pack while compress goes on); they are left out of what this returns.  ``prepared``: what
    was made during the prefill (:class:`Prepared`)."""
    pieces, trained, lex, moments, rest = [], None, None, [], arena
    for prefill in windows:
        if not pieces:
            trained = trained_router(prefill, params, prefill.shape)
        if prefill.scores and prefill.scores.get("lex_terms") is not None:
            lex = prefill.scores["lex_terms"]
        # a window that is the whole document codes its factors where it makes them (merge passes them on)
        whole = not pieces and prefill.start == 0 and prefill.n_tokens == (prefill.doc_tokens or prefill.n_tokens)
        with fz.single_thread():  # many small tensor ops: intra-op threads cost more than they give (the prefill keeps them)
            on = {"emit": emit} if whole and emit is not None else {}
            if prepared is not None:
                on["prepared"] = prepared
            piece = compress_window(prefill, params, trained, rest, code=whole, **on)
        rest = arena_after(rest, piece.arena_bytes)  # every window's results in the host arena, one after the other
        if params.prior == "kvzip":  # KVzip's reconstruction passes: model forwards, with the prefill's threads
            piece.tensors["prior.kvzip"] = prior.window_prior(prefill, params.layout_budget)
        m = [piece.tensors.pop(f"moment.{li}") for li in range(prefill.shape.n_layers)]  # summed as they come
        moments = m if not moments else [a + b for a, b in zip(moments, m)]
        pieces.append(piece)
        shape, n_doc, dev = prefill.shape, prefill.doc_tokens or prefill.n_tokens, _device_of(prefill)
        del prefill  # one window's KV at a time
    with fz.single_thread():
        out = merge.merge(pieces, moments, params, shape, n_doc, lex, trained, dev, on_layer=lambda li: _progress("merge", done=li + 1, of=shape.n_layers))
    _progress("merge_done")
    return out


def arena_after(arena: torch.Tensor | None, used: int) -> torch.Tensor | None:
    """What is left of a host arena (uint8) after ``used`` bytes, from a 64-byte boundary (its views hold any dtype);
    None when nothing is."""
    if arena is None:
        return None
    o = (used + 63) // 64 * 64
    return arena[o:] if o < arena.numel() else None


def compress_window(prefill: PrefillResult, params: SekvParams, trained=None, arena: torch.Tensor | None = None, code: bool = False,
                    emit=None, prepared: Prepared | None = None) -> merge.Piece:
    """One window's spans, full-resolution tokens, coarse entries, factors and key moments, on the host; global
    positions from prefill.start.  The factors are not yet coded (the merge codes the windows' together), unless
    ``code`` (the window is the whole document) and the pack codes them (params.coded): then they are coded where
    they are made, on the device, before they travel to the host (:func:`_code_factors`: half the bytes over the
    bus, no second trip for the merge's codec), their row scales left in float16 for the merge's host-side code.  Its working tensors on the device stay within :func:`free_bytes`
    (:func:`plan`): layers batched while they fit, a layer's spans in chunks when one does not.  Should the device
    run out of memory all the same (the plan's counts are estimates), the step that failed (the scout profiles, or
    one layer group) runs again under half the bound, up to OOM_RETRIES times a window: the same tensors, smaller
    chunks; the layer groups already made are kept."""
    dev = _device_of(prefill)
    if dev.type == "cuda":  # the prefill's cached blocks back to the driver: compress's own sizes, less fragmentation
        torch.cuda.empty_cache()
    code = code and params.coded
    return _compress_window(prefill, params, trained, arena, dev, free_bytes(dev), code, emit if code else None, prepared)


def _out_of_memory(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in text.lower() or "ALLOC_FAILED" in text


def _compress_window(prefill: PrefillResult, params: SekvParams, trained, arena: torch.Tensor | None, dev: torch.device,
                     bound: int | None, code: bool = False, emit=None, prepared: Prepared | None = None) -> merge.Piece:
    shape = prefill.shape
    seg = segmentation(prefill, params)
    pos, sid = seg.span_tokens()
    inv = rope.inv_freq_of(shape)
    pre = params.key_space == "pre_rope" and inv is not None
    todo = plan(prefill, seg, bound, dev)
    _progress("window", start=prefill.start, tokens=prefill.n_tokens, bound=bound, group=todo.group, span_chunks=len(todo.chunks),
              profile_rows=todo.profile_rows)
    copies = HostCopies(dev, arena if dev.type == "cuda" else None)
    retries = OOM_RETRIES

    def smaller(e: BaseException) -> bool:  # whether a step that raised e runs again (under half the bound)
        return bound is not None and retries > 0 and _out_of_memory(e)

    def shrink() -> Plan:  # after the failed step's tensors went with its exception
        nonlocal bound, retries
        copies.wait(0)  # the results still on their way to the host: their device memory back first
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        bound, retries = bound // 2, retries - 1
        p = plan(prefill, seg, bound, dev)
        _progress("retry", bound=bound, group=p.group, span_chunks=len(p.chunks), profile_rows=p.profile_rows)
        return p

    out, emitted = None, set()
    while out is None:
        try:
            out = _window_tensors(prefill, params, seg, todo.profile_rows)
        except Exception as e:  # noqa: BLE001 - only running out of memory is retried
            if not smaller(e):
                raise
        if out is None:
            todo = shrink()
    _progress("profile")
    weights = span_weights(prefill.surprisal, pos, sid, seg.n_spans, params.weighting).to(dev)
    rot = None
    if pre:  # the keys are at their global positions: RoPE's cos / sin of rows p0:p1 (span order) on the device
        gpos, scaling, dt, whole = pos + prefill.start, shape.rope_attention_scaling, _kv_dtype(prefill), []
        n_needed = int(gpos.max()) + 1 if gpos.numel() else 0
        tables = prepared.rot_tables(inv, scaling, dt, n_needed) if prepared is not None else None

        def rot(p0: int, p1: int) -> tuple[torch.Tensor, torch.Tensor]:
            if p0 == 0 and p1 == gpos.numel():  # whole layers: the window's made once (a chunk's with its inputs)
                if not whole:
                    whole.extend(_rot_tables(tables, gpos, dev) if tables is not None else (t.to(dev) for t in rope.cos_sin(gpos, inv, scaling, dtype=dt)))
                return whole[0], whole[1]
            if tables is not None:  # a layer in span chunks (device memory is short): the chunk's rows indexed on the host
                return tuple(t.index_select(0, gpos[p0:p1].long()).to(dev) for t in tables)
            c, s_ = rope.cos_sin(gpos[p0:p1], inv, scaling, dtype=dt)
            return c.to(dev), s_.to(dev)
    host = {k: t for k, t in out.items() if t.device.type == "cpu"}
    if params.zoom_tier != "factors":
        host["zoom.idx"] = pos.long().cpu()  # the tier's tokens (local positions, span order = document order)
    ctx = (pos.to(dev), sid.to(dev), weights, seg.full_idx.to(dev), seg.span_len, rot, trained)
    l0 = 0
    try:
        while l0 < shape.n_layers:
            l1 = min(shape.n_layers, l0 + todo.group)
            out = None
            try:
                out = _group_tensors(prefill, params, range(l0, l1), todo.chunks, seg.span_len, ctx)
                if code:
                    _code_factors(out, range(l0, l1), seg.span_len, shape.head_dim, params)
            except Exception as e:  # noqa: BLE001 - only running out of memory is retried
                if not smaller(e):
                    raise
            if out is None:
                todo = shrink()
                continue
            landed = copies.submit(out)  # to the host while the next group computes; the device tensors go when they are there
            if emit is not None and seg.n_spans:  # the group's final tensors into the pack as soon as they are on the host
                emit(lambda landed=landed, layers=range(l0, l1): {k: v for li in layers for k, v in merge.final_layer(landed(), li, params).items()})
                emitted.update(range(l0, l1))
            host.update({k: t for k, t in out.items() if t.device.type == "cpu"})
            copies.wait(todo.in_flight)
            del out
            l0 = l1
            _progress("layers", done=l1, of=shape.n_layers)
    except BaseException:
        copies.wait(0)  # nothing still writing into the arena when the error propagates
        raise
    piece = merge.Piece(prefill.start, prefill.n_tokens, seg, to_host(host, copies), copies.off, emitted)
    _progress("window_done")
    return piece


def _rot_tables(tables: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``positions`` of :class:`Prepared`'s cos / sin tables, on ``dev`` (the tables go up whole, page-locked on
    CUDA, and are indexed there; the whole tables go when indexed): rope.cos_sin of those positions, value for value."""
    idx = positions.long().to(dev)
    return tuple(t.to(dev).index_select(0, idx) for t in tables)


def _group_tensors(prefill: PrefillResult, params: SekvParams, layers: range, chunks, span_len: torch.Tensor, ctx) -> dict[str, torch.Tensor]:
    """The tensors of a group of layers (:func:`_layer_tensors` and their factors): the group's factors from one
    batched decomposition, or, a layer in span chunks, each chunk's in turn."""
    out, units = {}, []
    for li in layers:
        tensors, inputs = _layer_tensors(prefill, params, li, chunks, *ctx)
        out.update(tensors)
        units += [(li, c, x) for c, x in inputs]
        if len(chunks) > 1:  # a layer in span chunks: each chunk's factors made (and its inputs freed) in turn
            out.update(_factors(units, chunks, span_len, params))
            units = []
    if units:
        out.update(_factors(units, chunks, span_len, params))
    return out


def _window_tensors(prefill: PrefillResult, params: SekvParams, seg: Segmentation, rows: int | None = None) -> dict[str, torch.Tensor]:
    """A window's scout profiles: its spans' and zoom blocks' attention from its last queries (sekv/scout.py);
    ``rows``: query rows scored at once (None: every head's at once)."""
    out = {"scout.profile": scout.document_profile(prefill, seg.span_start, seg.span_end, rows)}
    unit = max(0, params.zoom_unit)
    if unit > 0 and seg.n_spans:  # the profile of the zoom blocks the pack is made for (another unit at ask time: the span's)
        _, b0, b1 = zoom_blocks(seg.span_start, seg.span_end, unit)
        out["scout.profile_blocks"] = scout.document_profile(prefill, b0, b1, rows)
    return out


def _layer_tensors(prefill: PrefillResult, params: SekvParams, li: int, chunks, pos, sid, weights, full_idx, span_len, rot, trained):
    """One layer's full-resolution tokens, coarse entries and key moments (for the router), and what its factors
    are made from: (tensors, [(chunk, inputs)] with inputs() -> ((pre-RoPE keys, energy, gate), (values, energy,
    gate)) of the chunk's spans, in span order, made when called).  ``chunks``: (first span, end span, first row,
    end row) in span order; one chunk, every span: the whole layer at once."""
    L = prefill.shape.n_layers
    k, v = prefill.keys[li], prefill.values[li]
    sdt = layout.store_dtype(params, k.dtype)
    out = {f"full.k.{li}": k[:, full_idx].to(sdt).contiguous(), f"full.v.{li}": v[:, full_idx].to(sdt).contiguous()}
    one = len(chunks) == 1

    def means(x, s0, s1, p0, p1):
        return weighted_means(x, pos[p0:p1], sid[p0:p1] - s0 if s0 else sid[p0:p1], weights[p0:p1], s1 - s0)

    kbar = means(k, *chunks[0]) if one else torch.cat([means(k, *c) for c in chunks], 1)
    out[f"coarse.k.{li}"] = kbar  # float32: the router's PCA scale is read off it (sekv/merge.py)
    vbar = means(v, *chunks[0]) if one else torch.cat([means(v, *c) for c in chunks], 1)
    out[f"coarse.v.{li}"] = vbar.to(sdt)
    out[f"moment.{li}"] = _second_moment(k, chunks)
    if params.zoom_tier != "factors":  # the span tokens' own K / V, what a zoomed block holds at ask time (sekv/zoom_tier.py)
        undo = None if rot is None else (lambda x, p0, p1: rope.undo(x, *rot(p0, p1)))
        out.update(zoom_tier.window_tensors(params.zoom_tier, k, v, pos, undo, chunks, sdt, li))
    if span_len.numel() == 0:
        out[f"keys.{li}"] = k.float()  # no span to scale the router on: the keys themselves (router.pca_init)
    depth = li / max(L - 1, 1)
    gated = trained is not None and span_len.numel() > 0  # the trained rank gate G chooses each block's components (sekv/rank_gate.py)
    vbar = out[f"coarse.v.{li}"].float() if gated else None

    def inputs(s0, s1, p0, p1):
        kx = k[:, pos[p0:p1]].float()
        if rot is not None:  # RoPE undone: cos / sin of the rows (compress's rot)
            kx = rope.undo(kx, *rot(p0, p1))
        keep_k = keep_v = None
        if gated:
            keep_k = trained.gate.keep(kbar[:, s0:s1].float(), span_len[s0:s1], False, depth)
            keep_v = trained.gate.keep(vbar[:, s0:s1], span_len[s0:s1], True, depth)
        return (kx, params.energy_k, keep_k), (v[:, pos[p0:p1]].float(), params.energy_v, keep_v)

    return out, [(c, (lambda c=c: inputs(*c))) for c in chunks]


def _second_moment(k: torch.Tensor, chunks) -> torch.Tensor:
    """router.second_moment of a layer's keys: at once, or (a layer in span chunks) summed over token blocks no
    longer than the longest chunk."""
    if len(chunks) == 1:
        return router.second_moment(k)
    step = max(p1 - p0 for _, _, p0, p1 in chunks)
    return sum(router.second_moment(k[:, t : t + step]) for t in range(0, k.shape[1], step))


def _factors(todo, chunks, span_len: torch.Tensor, params: SekvParams) -> dict[str, torch.Tensor]:
    """Key and value factors of the units in ``todo`` ((layer, chunk, inputs) each).  Whole layers: one batched
    decomposition of them all (sekv/factorize.py factorize_many: each block on its own, the factors those of separate
    calls).  A layer in span chunks: each chunk's in turn (its inputs made, decomposed, packed and freed), the
    chunks' packed factors concatenated per KV head (sekv/merge.py merge_factors)."""
    opts = dict(rank_max=params.rank_max, int8=params.factors_8bit, dtype=getattr(torch, params.factor_dtype), method=params.svd)
    out = {}
    if len(chunks) == 1:
        mats = [m for _, _, make in todo for m in make()]
        fs = fz.factorize_many([x for x, _, _ in mats], span_len, energies=[e for _, e, _ in mats], keeps=[k for _, _, k in mats], **opts)
        for j, (li, _, _) in enumerate(todo):
            out.update(fs[2 * j].tensors(f"fk.{li}"))
            out.update(fs[2 * j + 1].tensors(f"fv.{li}"))
        return out
    d = None
    parts: dict[tuple[int, str], list] = {}
    for li, (s0, s1, _, _), make in todo:
        mats = make()
        d = mats[0][0].shape[-1]
        n = span_len[s0:s1]
        fs = fz.factorize_many([x for x, _, _ in mats], n, energies=[e for _, e, _ in mats], keeps=[k for _, _, k in mats], **opts)
        del mats
        for kind, f in zip(("fk", "fv"), fs):
            parts.setdefault((li, kind), []).append((_parts_of(f), n))
    for (li, kind), p in parts.items():
        out.update(merge.merge_factors(p, d).tensors(f"{kind}.{li}"))
    return out


def _code_factors(out: dict[str, torch.Tensor], layers: range, span_len: torch.Tensor, d: int, params: SekvParams) -> None:
    """A whole document's factors of ``layers`` in ``out`` (``fk.l.us`` ...) replaced by their codes
    (codec.encode_factors, where they are: ``fk.l.us.q4`` ..., ``fk.l.vt.lead``, ``fk.l.rank``), the float16 row
    scales kept (``fk.l.us_scale``, ``fk.l.vt_scale``; merge codes them on the host: codec.code_scales).  The codes
    of merging this one window's factors and coding them there (sekv/merge.py)."""
    for li in layers:
        for kind, cfg in zip(("fk", "fv"), codec_configs(params)):
            f = fz.Factors(*(out.pop(f"{kind}.{li}.{k}", None) for k in merge._FACTOR_PARTS))
            coded = codec.encode_factors(f, span_len, d, **dict(cfg, scales="fp16"))
            out.update({f"{kind}.{li}.{k}": v for k, v in coded.items()})


def _parts_of(f: fz.Factors) -> dict[str, torch.Tensor]:
    return {k: getattr(f, k) for k in merge._FACTOR_PARTS if getattr(f, k) is not None}
