"""The batched zoom-in step for accelerators: no host sync, fixed shapes, one fetch per layer.

The reference step (sekv/cpu_step.py) learns on the host which blocks were kept (``nonzero`` + ``.cpu()``),
gathers their ragged factors on the CPU and places them per KV group: a device->host sync and a CPU gather per
layer.  Here every decision stays on the device:

* routing as in the reference; the budget cap is :func:`attention.select_topk`, a fixed-size top-P of the
  (group, span) priorities (P = the most pairs the cap can hold), so no shape depends on the data;
* the kept pairs' factor blocks are fetched with one gather from pinned host memory (sekv/blocks.py),
  dequantised and rebuilt with one batched product, RoPE re-applied, and written into a **flat, preallocated**
  buffer of U token slots per layer (all KV groups together; slot -> group and span ids);
* one float32 softmax over the resident memory and the flat slots, each query head seeing its own group's
  slots of the spans it expanded (:func:`attention.flat_attention`).

Under a ranking (scout routing, zoom all) the kept set does not depend on the step's query: it is a *fixed
set* (sekv/fixed_set.py), rebuilt once per ranking into the annex of the resident buffers and attended with
one SDPA call.

Budget: the flat buffers are sized once from the cap (U = what the per-layer cap holds once this step's own
tables are counted, so the size stays within the budget for the whole ask) and they, their slot tables and
the block tables are all counted as resident, allocated or not filled.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

from . import blocks as fb
from . import rope, router, scout
from .attention import build_mask, flat_attention, route, select_topk
from .budget import ZoomLedger
from .fixed_set import FixedSets
from .residents import Residents
from .scout import Ranking


#: the scout pass's chunk of rebuilt keys and logits, bytes per float32 work tensor: few launches, a bounded
#: transient (the 0.5B at 4K: 8 layers a chunk; at 30K: a layer in two chunks; the 8B shape at 128K: a layer in
#: many); with the fused kernel (SCOUT_FUSED), bytes of a chunk's staged block rows; also the question's chunk of
#: queries in a per-layer-routed forward
SCOUT_CHUNK_BYTES = 64 << 20

#: the scout's block scoring by one fused Triton kernel a layer and chunk (sekv/scout_kernel.py: it reads the chunk's
#: factor-block rows themselves and dequantises their key side in registers; the factors, keys, their rotation and
#: logits never materialised, so a chunk's memory is its staged rows and its output) instead of the PyTorch path's
#: ~19 kernels a chunk.  Used on CUDA where triton imports (and on the CPU under TRITON_INTERPRET=1:
#: the tests; without triton the PyTorch path); on by default since its H200 run (docs/gpu.md "Now": the scout 0.36-0.47 s against 0.47-0.52 s)
SCOUT_FUSED = True
_SCOUT_KERNEL: list = []  # [the module, or None where triton does not import], once tried


def scout_kernel(device, d: int):
    """sekv/scout_kernel.py where SCOUT_FUSED is on and its kernel runs on ``device`` for head_dim ``d``; else None."""
    device = torch.device(device)
    if not SCOUT_FUSED or not (device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")):
        return None
    if not _SCOUT_KERNEL:
        try:
            from . import scout_kernel as sk
        except Exception:  # no triton, or one that does not work here: the PyTorch path
            sk = None
        _SCOUT_KERNEL.append(sk)
    sk = _SCOUT_KERNEL[0]
    return sk if sk is not None and sk.supported(d) else None


#: BlockBuild on one CUDA device: the factor blocks that may stay in device memory after their build, as a share of
#: the document's full KV bytes (not of the device: the ask's device memory beyond the weights is the budget, these,
#: and the step's bounded transients; docs/gpu.md "Device memory during an ask"), while FREE_SHARE of the device
#: stays free beside them.  The rest are page-locked by the build itself, on a thread of its own and in pieces
#: (blocks.Locker, blocks.PIN_PIECE) beside the device's decoding of the next layers, from the pack's read on (in
#: `sekv ask` / `chat`: while the model loads), and the scout streams them from there (BatchedStep.scout_masses).
#: Kept layers move to pinned host memory in pauses between questions (sekv/blocks.py HostPinning).
KEEP_SHARE = 0.0
FREE_SHARE = 0.25

#: the build's layers that may wait on the device for their page-locked host memory (the device's decoding runs
#: ahead of the page-locking by at most this many layers' blocks).  A first question asked before the build ends
#: holds them beside its own (the 8B at 128K: ~0.19 GiB a layer); one is enough while page-locking a layer (~70 ms
#: there) is faster than decoding one (~0.2 s)
LOCK_AHEAD = 1


def build_blocks(res: Residents, keep: float = 0.0) -> list[fb.Blocks]:
    """Every layer's factor blocks (sekv/blocks.py): the factors decoded and re-laid on the accelerator, kept in
    pinned host memory there; on a model placed across devices, each layer's on its layer's device.  ``keep``: on
    one CUDA device, layers stay in device memory (``words`` there) while all kept take at most this share of the
    document's full KV bytes and FREE_SHARE of the device stays free."""
    if res.split:
        return _build_blocks_per_layer(res)
    wd = res.device if res.cuda else None
    total = torch.cuda.mem_get_info(res.device)[1] if res.cuda and keep > 0 else 0
    allow = keep * res.n_doc * res.shape.kv_bytes_per_token()
    out, kept = [], 0
    locker = fb.Locker(res.device) if res.cuda else None
    waiting: list = []  # (layer's blocks on the device, the future of its page-locked host memory)
    try:
        for i in range(res.shape.n_layers):
            b = fb.build(res.factors.on_device(i), res.span_len, res.shape.head_dim, res.device, pin=res.cuda, work_device=wd,
                         r_max=res.factors.rank_max(i), wait=not res.cuda, keep=res.cuda, rank_host=_rank_host(res, i))
            out.append(b)
            if not res.cuda:
                continue
            n = b.words.numel() * 8
            if kept + n <= allow and torch.cuda.mem_get_info(res.device)[0] >= FREE_SHARE * total:
                kept += n
                continue
            waiting.append((b, locker.submit(b.words.numel())))
            while waiting and (waiting[0][1].done() or len(waiting) > LOCK_AHEAD):
                _to_locked(*waiting.pop(0), res.device)
        for w in waiting:
            _to_locked(*w, res.device)
    finally:
        if locker is not None:
            locker.close()
    if res.cuda:  # every layer's copy to pinned memory was left in flight: one wait for all of them
        torch.cuda.current_stream(res.device).synchronize()
    return out


def _rank_host(res, i: int) -> torch.Tensor | None:
    """Layer i's ranks on the host where the pack's factors give them (the re-layout fills a run of blocks at a time
    with them: bounded temporaries, nothing read back from the device), else None."""
    f = getattr(res, "factors", None)
    return f.rank_host(i) if hasattr(f, "rank_host") else None


def _to_locked(b: fb.Blocks, host, device) -> None:
    """A layer's blocks copied from the device into their page-locked host memory (a future), the copy left in flight
    on the current stream; the device copy is dropped (its memory reused after the copy, on that stream)."""
    host = host.result()
    fb.copy_pieces(host, b.words, non_blocking=True)
    fb.install(b, host, torch.device(device))


def _build_blocks_per_layer(res: Residents) -> list[fb.Blocks]:
    """:func:`build_blocks` with each layer's factors decoded, re-laid and mapped (UVA) on its own device: the
    current device set to it, so that the copies' streams and the mapped view are that device's."""
    out = []
    for i, dev in enumerate(res.layer_devices):
        cuda = dev.type == "cuda"
        with torch.cuda.device(dev) if cuda else contextlib.nullcontext():
            out.append(fb.build(res.factors.on_device(i, dev), res.span_len, res.shape.head_dim, dev, pin=cuda, work_device=dev if cuda else None,
                                r_max=res.factors.rank_max(i), wait=not cuda, rank_host=_rank_host(res, i)))
    for dev in dict.fromkeys(d for d in res.layer_devices if d.type == "cuda"):  # one wait a device
        torch.cuda.current_stream(dev).synchronize()
    return out


def device_groups(devices: list) -> list[tuple[torch.device, list[int]]]:
    """The layers of each device, in the order the devices first appear: [(device, [layer, ...]), ...]."""
    groups: dict = {}
    for layer, dev in enumerate(devices):
        groups.setdefault(torch.device(dev), []).append(layer)
    return list(groups.items())


#: on CUDA, after the factor blocks are built on their thread (BlockBuild), run the question path's kinds of kernels
#: once on small inputs of the pack's and the model's shapes (:func:`warm_kernels`), so that their first use (lazy
#: kernel loading, cuBLAS and cuDNN set-up) is paid beside the model load rather than in the first question;
#: benchmarks/cli_probe.py turns it off with $SEKV_PROBE_WARM=0 (to compare)
WARM_KERNELS = True

#: with the ask's params known before the model loads (start_blocks), the warm-up is the question's own way through
#: the memory on the pack's first layer (sekv/memory.py rehearse_layer) rather than warm_kernels' made-up imitation
REHEARSE_LAYER = True


def warm_kernels(blocks: list[fb.Blocks], shape, device, n_spans: int, n_q: int = 32) -> None:
    """The kernels of a question's scout pass and first forward, each run once on made-up inputs on ``device``: a
    fetch, dequantisation and rebuild of a layer's real factor blocks (the model dtype and float32), the routing's
    gates and top-P, the slots' tables, a rotation, the flat attention, the scout's segmented logsumexp and z-scores,
    and the fixed sets' masked SDPA for several question tokens and for one.  Nothing it makes is kept; the
    stream is synchronised at the end (the caller's thread waits, not the question)."""
    if not blocks:
        return
    dev, dt = torch.device(device), shape.dtype
    h, hkv, d = shape.n_heads, shape.n_kv_heads, shape.head_dim
    g = torch.Generator().manual_seed(0)

    def rand(*size, dtype=torch.float32):
        return torch.randn(*size, generator=g).to(dev, dtype)

    b = blocks[0]
    s = max(1, min(n_spans, 512))
    pairs = min(hkv * s, 64)
    pair = torch.arange(pairs, device=dev)
    rows, _ = fb.fetch(b, pair, pair < pairs - 1)
    for dtype in (dt, torch.float32):
        us, vt = fb.unpack(b, rows, dtype)
        rec = torch.matmul(us, vt).view(-1, d)
    q = rand(1, h, n_q, d, dtype=dt)
    logits = router.gate_logits(q[0], rand(hkv, 8, d, dtype=dt), rand(hkv, s, d, dtype=dt), rand(hkv, s).abs(), rand(s))
    cand, prio = route(logits, rand(h), hkv)
    top, ok = select_topk(prio, torch.full((s,), 16, device=dev), 16 * pairs, pairs)
    ends = torch.cumsum(torch.where(ok, 16, 0), 0)
    t = torch.arange(16 * pairs, device=dev)
    p_of = torch.searchsorted(ends, t, right=True).clamp_max_(pairs - 1)
    src = torch.where(t < ends[-1], t - (ends - 16)[p_of], 0)
    cos, sin = rope.cos_sin(src, torch.rand(d // 2, generator=g).to(dev), dtype=dt)
    krows = rope.apply_swapped(rec.index_select(0, src.clamp_max(rec.shape[0] - 1)).float(), *rope.swapped(cos, sin))
    T = 256
    keys, values = rand(1, hkv, T, d, dtype=dt), rand(1, hkv, T, d, dtype=dt)
    mask = torch.zeros(1, h, n_q, T, device=dev)
    flat_attention(q, keys, values, mask, krows.to(dt), krows.to(dt), cand.index_select(1, p_of.remainder(s)), 0.125)
    lse = torch.logsumexp(rand(2, pairs, n_q, 16), dim=-1)
    sums = torch.zeros(2, pairs, n_q, 4, device=dev).scatter_add_(3, torch.zeros(2, pairs, n_q, 16, dtype=torch.long, device=dev), rand(2, pairs, n_q, 16).exp_())
    scout.zscore(scout.block_masses(torch.cat([lse.view(2, 1, pairs, n_q), sums.log()[..., 0].view(2, 1, pairs, n_q)], 2), rand(2, 1, n_q)))
    for n in (n_q, 1):  # the fixed sets' SDPA: the question's forward and a single-token step
        m = torch.zeros(1, h, n, T, dtype=dt, device=dev)
        torch.nn.functional.scaled_dot_product_attention(q[:, :, :n], keys, values, attn_mask=m, scale=0.125, enable_gqa=hkv != h)
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()


class BlockBuild:
    """:func:`build_blocks` on a second thread, started when the pack opens, so that the first question finds the
    blocks made (or waits only for the rest) instead of building them inside its scout pass: in `sekv chat` they
    are made while the question is typed, in `sekv ask` while the question is prepared (:func:`start_blocks`: from
    the pack's read, while the model loads).  On one CUDA device layers stay in device memory up to KEEP_SHARE of the
    document's full KV (none by default; the rest page-locked by the build) and ``pinning`` moves them to pinned host
    memory later.  ``result()`` joins; an
    error of the build (a damaged pack) is raised there, in the first forward, where it was raised before."""

    def __init__(self, res, rehearse=None):
        """res: the opened pack (Residents), or a function run first on the thread that returns what build_blocks
        reads of one (start_blocks: the checks of the pack, then its factors).  rehearse: on CUDA, run after the
        build with the blocks instead of :func:`warm_kernels` (start_blocks: the question's way on the pack's first
        layer, sekv/memory.py rehearse_layer); None: warm_kernels."""
        self.rehearse = rehearse
        self.rehearsal_s: float | None = None
        #: a question asked for the blocks before the build ended: then no warm-up after it (it would only run beside
        #: that question, each slowing the other's launches; the question meets the first uses itself)
        self.waited = False
        self._blocks: list[fb.Blocks] | None = None
        #: what moves the layers kept in device memory to pinned host memory (None: none kept)
        self.pinning: fb.HostPinning | None = None
        self._error: BaseException | None = None
        self.warm_error: Exception | None = None  # what warm_kernels raised (the blocks are built; nothing else depends on it)
        self._built = threading.Event()  # set once the blocks are built or failed (the warm-up after them is not waited for)
        self._thread = threading.Thread(target=self._run, args=(res,), name="sekv-blocks")
        self._thread.start()

    def _run(self, res) -> None:
        try:
            if callable(res):
                res = res()
            # as inside the forward that would otherwise build them; a thread starts on the first GPU: the pack's
            with torch.inference_mode(), (torch.cuda.device(res.device) if res.cuda else contextlib.nullcontext()):
                blocks = build_blocks(res, keep=KEEP_SHARE if res.cuda and not res.split else 0.0)
            kept = [i for i, b in enumerate(blocks) if b.words.device.type != "cpu"]
            self.pinning = fb.HostPinning(blocks, kept, res.device) if kept else None
            self._blocks = blocks
        except BaseException as e:  # noqa: BLE001 - handed to result()
            self._error = e
            return
        finally:
            self._built.set()
        if res.cuda and WARM_KERNELS and not self.waited:
            try:
                with torch.inference_mode(), torch.cuda.device(res.device):
                    if self.rehearse is not None:
                        self.rehearsal_s = self.rehearse(self._blocks)
                    else:
                        warm_kernels(self._blocks, res.shape, res.device, int(res.span_len.numel()))
            except Exception as e:  # noqa: BLE001 - a warm-up only saves time: the question runs (and meets any error) as before
                self.warm_error = e

    def result(self) -> list[fb.Blocks]:
        self.waited = True
        self._built.wait()
        if self._error is not None:
            raise self._error
        return self._blocks

    def result_or_none(self) -> list[fb.Blocks] | None:
        """The blocks, or None where the build failed (the caller builds them itself, and meets the error there)."""
        self.waited = True
        self._built.wait()
        return None if self._error is not None else self._blocks

    def join(self) -> None:
        """Wait for the thread itself (the build and the warm-up after it)."""
        self._thread.join()


def _device(device) -> torch.device:
    d = torch.device(device)
    return torch.device(d.type, torch.cuda.current_device()) if d.type == "cuda" and d.index is None else d


#: factor-block builds started before a memory opens (start_blocks): (the store, its device, the build), by id(store)
_EARLY: dict[int, tuple[object, torch.device, "BlockBuild"]] = {}


class _Source:
    """What build_blocks reads of a Residents, made from the pack alone (the manifest's attention shape)."""

    def __init__(self, store, shape, device, n_doc: int = 0):
        from . import layout

        self.device, self.shape, self.n_doc = device, shape, n_doc
        self.cuda = device.type == "cuda"
        self.split = False  # started only for a model on one device (Session.open)
        self.span_len = (store.get("sekv.span_end") - store.get("sekv.span_start")).long()
        self.factors = layout.PackFactors(store, set(store.keys()), shape.n_layers, self.span_len, shape.head_dim, device)


def start_blocks(store, shape, n_tokens: int, device, params=None) -> None:
    """The factor blocks of a pack that is about to be opened on CUDA ``device``, built on a second thread from now
    (in `sekv ask` / `chat`: while the model loads), after the tensors it reads pass the checks open() relies on
    (sekv/layout.py validate, factors_only, with the manifest's shape; a pack that fails them is not built: the open
    raises the error).  :meth:`take_blocks` hands the build to the memory opened for the same store and device."""
    device = _device(device)
    if device.type != "cuda":
        return

    def source():
        from . import layout

        layout.validate(store, shape, n_tokens, factors_only=True)
        return _Source(store, shape, device, n_tokens)

    rehearse = None
    if params is not None and REHEARSE_LAYER:
        from .memory import rehearse_layer

        def rehearse(blocks):
            return rehearse_layer(store, params, shape, device, blocks)

    _EARLY[id(store)] = (store, device, BlockBuild(source, rehearse))


def take_blocks(store, device) -> "BlockBuild | None":
    """The build start_blocks started for this store on this device (once), else None."""
    got = _EARLY.pop(id(store), None)
    if got is None or got[0] is not store:
        return None
    if got[1] != _device(device):
        got[2].result_or_none()  # a build for another device: let it end, unused
        return None
    return got[2]


class BatchedStep:
    def __init__(self, res: Residents, ledger: ZoomLedger, ranking: Ranking | None, blocks: list[fb.Blocks] | None = None):
        self.res, self.ledger, self.ranking = res, ledger, ranking
        self.fused_scout = True  # the scout's Triton kernel where it runs (scout_kernel); ZoomMemory sets it a question
        sh = res.shape
        self.d, self.hkv, self.L = sh.head_dim, sh.n_kv_heads, sh.n_layers
        self.blocks = build_blocks(res) if blocks is None else blocks
        self.table_bytes = sum(b.index_bytes() for b in self.blocks)
        self.uva = all(b.uva for b in self.blocks)
        self.min_len = int(res.span_len.min()) if res.n_spans else 1
        self.span_tokens = int(res.span_len.sum())
        self.U = -1  # token slots per layer (-1: not sized yet)
        self.P = 0  # the most (group, span) pairs U slots hold
        self.rk: list[torch.Tensor] = []
        self.rv: list[torch.Tensor] = []
        self.head_group = res.head_group  # query head -> KV group (each device's: res.at(device).head_group)
        self.fixed = FixedSets(res, ledger, ranking, self.blocks) if ranking is not None else None
        if self.fixed is not None and not res.split and self.blocks:
            # every layer's block table a view of one [L, Hkv * S] tensor (the same bytes): a fixed set's fetch reads
            # each pair's last word for all layers at once
            # (each row copied, a device-to-device memcpy, rather than torch.stack: the stack's cat kernel ran nowhere
            # else on a question's way, and a first question loaded it lazily after the rehearsals on the H200)
            last = self.blocks[0].last.new_empty((len(self.blocks), *self.blocks[0].last.shape))
            for i, b in enumerate(self.blocks):
                last[i].copy_(b.last)
            for i, b in enumerate(self.blocks):
                b.last = last[i]
            self.fixed.last_all = last
        self.g_len = torch.zeros((), dtype=torch.long, device=res.device)  # static steps: the visible length
        self.base: torch.Tensor | None = None  # re-positioned: the last routed layer's rotated base keys (the scout reads them)

    def new_ask(self) -> None:
        if self.fixed is not None:
            self.fixed.reset_stats()

    # -- budget ---------------------------------------------------------------------------------------------

    def _slots(self) -> int | None:
        """Token slots per layer the cap holds (None: no cap)."""
        r = self.res
        overhead = self.table_bytes + self.L * self.hkv * (r.n_blocks + 8)  # block tables, the fixed sets' tables
        per_slot = r.entry_bytes
        if self.fixed is not None:  # the fixed sets' masks: the resident columns, plus a column per group's row
            overhead += self.fixed.mask_bytes(r.kv.k[-1].shape[-2], 0)
            per_slot += self.fixed.mask_bytes(0, 1) // (self.L * self.hkv)
        cap = self.ledger.layer_cap(overhead)
        return None if cap is None else cap // per_slot

    def begin_forward(self, n_new: int) -> None:
        r = self.res
        for layer in range(self.L):  # the capacity this forward needs, now (a fixed set's mask is sized by it)
            r.kv.reserve(layer, r.kv.len[layer] + n_new)
        now = self._slots()
        if now is None:
            want = self.hkv * self.span_tokens
        else:
            want = None if 0 <= self.U <= now else now
        if r.n_spans == 0:
            want = 0 if self.U < 0 else None
        if want is not None and want != self.U:
            self._allocate(want)
        self.ledger.resident = self.ledger.persistent + self.resident_bytes()

    def _allocate(self, u: int) -> None:
        r = self.res
        self.rk = self.rv = []
        if self.fixed is not None:  # U / Hkv rows per group, after the resident capacity
            u -= u % self.hkv
            self.fixed.allocate(u // self.hkv)
        self.U = u
        self.P = 0 if u == 0 else min(self.hkv * r.n_spans, u // max(1, self.min_len) + 1)
        if self.fixed is None:
            self.rk = [torch.zeros(u, self.d, dtype=r.shape.dtype, device=dev) for dev in r.layer_devices]
            self.rv = [torch.zeros_like(t) for t in self.rk]

    def resident_bytes(self) -> int:
        """Device bytes beyond the resident KV + router: block tables, slot buffers (capacity), slot tables and
        the fixed sets' masks (at the size they will have)."""
        r = self.res
        b = self.table_bytes + self.L * (max(0, self.U) * r.entry_bytes + self.hkv * (r.n_blocks + 8))
        if self.fixed is not None and self.U > 0:
            b += self.fixed.mask_bytes(r.kv.k[-1].shape[-2], self.U // self.hkv)
        return b

    def fixed_key(self):
        """Identity of this forward's fixed set, None where the kept set depends on the query."""
        return None if self.fixed is None or self.U <= 0 else self.fixed.key(self.U)

    def fold_stats(self) -> None:
        if self.fixed is not None:
            self.fixed.fold_stats()

    def kept(self, layer: int) -> torch.Tensor | None:
        """Under a ranking, the (KV group, zoom block) pairs the layer's fixed set holds [Hkv, B] bool (a view,
        refilled in place by the next fill): none where no slot is left; None where the set depends on the query
        (per-layer routing)."""
        r = self.res.at_layer(layer)
        if self.U <= 0:
            return torch.zeros(self.hkv, r.n_blocks, dtype=torch.bool, device=r.device)
        return self.fixed.keep[layer] if self.fixed_key() is not None else None

    # -- the step -------------------------------------------------------------------------------------------

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
        r = self.res.at_layer(layer)
        if r.kv.static:  # one token, inside a whole-step graph (static_begin ran on the host)
            kb, vb = r.kv.append(layer, key, value)
            with _tf32(query.is_cuda and query.dtype != torch.float32):
                return self._core(layer, query, kb, vb, self._length_mask(query.shape[1], kb.shape[-2]), scaling, self.g_len)
        keys, values = r.kv.append(layer, key, value)
        h, q = query.shape[1], query.shape[2]
        n_tail = r.kv.len[layer] - r.n_base
        base = self._open_mask(r, h, q, n_tail)

        def resident_mask(expanded):
            # build_mask's: the coarse entries of the expanded spans hidden in a copy of the forward's mask with none
            m = base.clone()
            m[0, :, :, r.n_full : r.n_base].masked_fill_(expanded.unsqueeze(1), float("-inf"))
            return m

        resident_mask.open, resident_mask.coarse = base, (r.n_full, r.n_base)  # flat_attention hides them itself (_routed)

        with _tf32(query.is_cuda and query.dtype != torch.float32):
            return self._core(layer, query, keys, values, resident_mask, scaling, r.kv.len[layer])

    def _open_mask(self, r: Residents, h: int, q: int, n_tail: int) -> torch.Tensor:
        """build_mask with no span expanded [1, H, q, T] (float32): the same for every layer of a forward (one device),
        made by its first layer; a layer's mask hides its expanded spans' coarse entries in a copy of it, and the
        full-resolution columns hidden for the question (sekv/residents.py HiddenColumns) are hidden in it."""
        key = (h, q, r.n_full, n_tail, r.hidden.key)
        masks = self.__dict__.setdefault("_open_masks", {})  # by device (a model placed across devices: each its own)
        held = masks.get(r.device)
        if held is None or held[0] != key:
            none = torch.zeros(h, r.n_spans, dtype=torch.bool, device=r.log_n.device)
            m = build_mask(n_heads=h, n_q=q, n_full=r.n_full, log_n=r.log_n, expanded=none, n_tail=n_tail, slot_span=None, dtype=torch.float32,
                           hidden=r.hidden.row(r.device))
            held = masks[r.device] = (key, m)
        return held[1]

    def _core(self, layer, query, keys, values, resident_mask, scaling, lim) -> torch.Tensor:
        """Route, cap, fetch, rebuild, attend, count: shapes depend only on the memory, never on the data.
        lim: the resident length after this forward's tokens (an int, or a device scalar for one token)."""
        h, s, d, dev = query.shape[1], self.res.n_spans, self.d, query.device
        if self.U <= 0:
            expanded = torch.zeros(h, s, dtype=torch.bool, device=dev)
            if self.res.layout is not None:
                keys, _ = self._placed(layer, keys, torch.zeros(self.hkv, self.res.n_blocks, dtype=torch.bool, device=dev))
            empty = keys.new_zeros(0, d)
            return flat_attention(query, keys, values, resident_mask(expanded), empty, empty, torch.zeros(h, 0, dtype=torch.bool, device=dev), scaling)
        fixed = self.fixed_key()
        if fixed is not None:  # a fixed set in the annex: every head of a kept group sees it
            return self.fixed.attend(layer, query, scaling, lim, fixed)
        return self._routed(layer, query, keys, values, resident_mask, scaling)

    def _routed(self, layer, query, keys, values, resident_mask, scaling) -> torch.Tensor:
        """Per-layer routing (the router's gates for this forward's queries) into the flat slots."""
        r = self.res.at_layer(layer)
        h, hkv, s, d, u, dev = query.shape[1], self.hkv, r.n_spans, self.d, self.U, query.device
        lay = r.layout  # re-positioned (sekv/positions.py): the gates read the coarse keys at their slots with nothing zoomed
        cand, prio = r.gate_priorities(layer, query, None if lay is None else r.base_keys(layer, lay.place(torch.zeros(hkv, r.n_blocks, dtype=torch.bool, device=dev))[0]))
        pair, ok = select_topk(prio, r.span_len_dev, u, self.P)
        g, i = pair // s, pair % s
        keep = torch.zeros(hkv * s, dtype=torch.bool, device=dev).index_put_((pair,), ok).view(hkv, s)
        if lay is not None:  # the window is the cap; then every key goes to its slot
            keep = lay.cap(keep, prio, r.span_len_dev)
            ok = ok & keep.view(-1)[pair]
            keys, slots = self._placed(layer, keys, keep if r.whole_spans else keep[:, r.block_span_dev])
        expanded = keep.index_select(0, r.head_group)  # each query head its group's row
        if r.head_masks:
            expanded = expanded & cand
        # the scout pass's zoom stats are not kept (the ask's ledger is reset after it): nothing counted there
        counted = self.ranking is None or not self.ranking.scouting
        b = self.blocks[layer]
        rows, words = fb.fetch(b, pair, ok, count=counted)
        # dequantised and multiplied in the model dtype (bf16 on GPU: tensor cores; int8 levels are exact in bf16,
        # and the factors' quantisation error dominates bf16 rounding)
        us, vt = fb.unpack(b, rows, r.shape.dtype)
        rec = torch.matmul(us, vt).view(-1, d)  # [P, 2, n_max, d] as rows; rows past n_i unused
        # fill the flat slots by gathering rows (slot t <- pair p(t), row j(t)); a scatter would pile the unused
        # rows onto one sink row, which serialises on the GPU
        n_ok = torch.where(ok, r.span_len_dev[i], 0)
        ends = torch.cumsum(n_ok, 0)
        t = self._slot_ids(u, dev)
        p_of = torch.searchsorted(ends, t, right=True).clamp_max_(pair.numel() - 1)  # slot -> pair
        j_of = t - (ends - n_ok)[p_of]  # slot -> row within its span
        slot_ok = (t < ends[-1]).view(-1, 1)
        src = torch.where(slot_ok.view(-1), torch.add(j_of, p_of, alpha=2 * b.n_max), 0)  # its K row in rec (V: n_max on)
        kx = rec.index_select(0, src)
        vx = rec.index_select(0, src + b.n_max)
        if r.zoom_tier is not None and counted:  # the pack's zoom tier replaces the rows it covers (sekv/zoom_tier.py);
            # not in the scout pass, which ranks by the factors (its rows are per layer: each read would wait for the device)
            hit, tk, tv = r.zoom_tier.lookup(layer, g[p_of], r.span_start_dev[i][p_of] + j_of, slot_ok.view(-1))
            kx = torch.where(hit.view(-1, 1), tk.to(kx.dtype), kx)
            vx = torch.where(hit.view(-1, 1), tv.to(vx.dtype), vx)
        if lay is None:
            krows = r.rotate_doc(kx, r.span_start_dev[i][p_of] + j_of)
        else:  # a kept span's tokens are consecutive from its first block's slot
            krows = r.rotate(kx, slots[g[p_of], lay.span_first_block.to(dev)[i[p_of]]] + j_of)
        # empty slots' rows come from an unfetched block: any bits, so select zeros
        if self.fixed is not None:  # a per-layer-routed forward of a fixed-set memory (the scout pass): workspace rows
            rk = torch.where(slot_ok, krows.to(r.shape.dtype), 0)
            rv = torch.where(slot_ok, vx, 0)
        else:
            rk, rv = self.rk[layer][:u], self.rv[layer][:u]
            empty = ~slot_ok
            rk.copy_(krows.masked_fill_(empty, 0))
            rv.copy_(vx)
            rv.masked_fill_(empty, 0)
        # head h sees slot t iff t is filled, t's group is h's and h itself wanted t's span
        mine = r.head_group.view(1, -1) == g.view(-1, 1)  # [P, H]
        if r.head_masks:
            mine = mine & cand.t()[i]
        visible = (mine.index_select(0, p_of) & slot_ok).t()  # [H, U]
        # the question's tokens in as few chunks as keep each float32 score tensor [H, chunk, T | U] near SCOUT_CHUNK_BYTES
        # (at most two of each alive in flat_attention; at 128K tokens of the 8B shape, U ~ 74K slots: 7 tokens a chunk)
        q_chunk = max(1, SCOUT_CHUNK_BYTES // max(1, 4 * h * max(keys.shape[-2], u)))
        opened = getattr(resident_mask, "open", None)
        if opened is not None:  # the forward's mask with nothing expanded, the expanded coarse entries hidden in the scores
            out = flat_attention(query, keys, values, opened, rk, rv, visible, scaling, q_chunk=q_chunk, coarse_hidden=(*resident_mask.coarse, expanded))
        else:
            out = flat_attention(query, keys, values, resident_mask(expanded), rk, rv, visible, scaling, q_chunk=q_chunk)
        if counted:
            self.ledger.count(layer, keep, expanded, words * 8)
        return out

    def _slot_ids(self, u: int, dev) -> torch.Tensor:
        """0..u-1 on dev (the flat slots' ids), made once."""
        held = getattr(self, "_slot_t", None)
        if held is None or held.numel() != u or held.device != torch.device(dev):
            held = self._slot_t = torch.arange(u, device=dev)
        return held

    def _placed(self, layer: int, keys: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Re-positioned: keys [1, Hkv, T, d] with the base entries rotated to the slots of the kept blocks keep
        [Hkv, B] (a copy: the buffer keeps them de-rotated), and each block's first slot [Hkv, B]."""
        r = self.res.at_layer(layer)
        base_slots, slots = r.layout.place(keep)
        self.base = r.base_keys(layer, base_slots)
        out = keys.clone()
        out[0, :, : r.n_base] = self.base
        self.ledger.count_positions(r.layout.tokens(keep))
        return out, slots

    # -- static single-token steps (sekv_core/graphed_step.py) ------------------------------------------------

    def static_begin(self) -> None:
        """Host side of a static single-token step: buffers and the visible length."""
        self.begin_forward(1)
        self.g_len.fill_(self.res.kv.len[0] + 1)
        if self.fixed is not None:
            self.fixed.static_begin(self.fixed_key())

    def static_key(self) -> tuple:
        """What a captured step fixed: the slot buffers, the slot count, fixed set or per-layer routing and, per
        layer, whether its set is reused."""
        reuse = tuple(self.fixed.reusable_layers(self.fixed_key())) if self.fixed is not None else ()
        p0 = None if self.res.layout is None else self.res.layout.p0  # re-positioned: the layout's constants
        hiding = self.res.hidden.key is not None  # the length mask reads the hidden columns' buffer, or not
        return (self.U, tuple(t.data_ptr() for t in self.rk), self.fixed_key() is not None, p0, hiding) + reuse

    def _length_mask(self, h: int, t: int):
        """resident_mask over a whole buffer of capacity t: entries at or past g_len hidden (a device scalar), and the
        full-resolution columns hidden for the question (read from its buffer, refilled in place per question: a
        captured step sees the question's; whether any is hidden is part of static_key)."""
        r = self.res
        hidden = r.hidden.row(r.device)

        def resident_mask(expanded):
            p = torch.arange(t, device=expanded.device)
            mask = torch.where(p < self.g_len, 0.0, float("-inf")).view(1, t).repeat(h, 1)
            mask[:, r.n_full : r.n_base] = torch.where(expanded, float("-inf"), r.log_n.float().view(1, -1))
            if hidden is not None:  # the full-resolution columns are all below g_len: 0 until now
                mask[:, : r.n_full] = hidden.view(1, -1)
            return mask.view(1, h, 1, t)

        return resident_mask

    # -- the scout pass -------------------------------------------------------------------------------------

    @staticmethod
    def scout_exact(q: torch.Tensor, exact: torch.Tensor, scaling: float) -> torch.Tensor:
        """One layer's part of the scout pass that reads its full-resolution keys, made in its forward: the logsumexp
        of the question's queries q [Hkv, M, d] (float32) over the keys exact [Hkv, F+A, d] -> [Hkv, M].  Only this is
        kept for :meth:`scout_masses` (not every layer's keys and their scores at once: at 128K tokens those were
        hundreds of MiB alive at the scout's start)."""
        return torch.logsumexp(torch.matmul(q, exact.float().transpose(-1, -2)) * scaling, dim=-1)

    def scout_masses(self, qs: list[torch.Tensor], others: list[torch.Tensor], scaling: float) -> torch.Tensor:
        """The scout pass's attention masses of every zoom block, for all layers at once (after the question's
        forward): qs / others per layer, the question's queries [Hkv, M, d] (float32) and their logsumexp over the
        layer's full-resolution keys [Hkv, M] (:meth:`scout_exact`) -> [L, n_blocks] (:func:`scout.block_masses` of
        each layer).

        Nothing here depends on the previous layer, so layers are batched: a chunk of layers (or a run of one layer's
        spans of every KV group, at long contexts) is rebuilt, rotated and scored together, its float32 work tensors
        near SCOUT_CHUNK_BYTES each (at most two of them alive: the keys and their rotation's two half-size products,
        or the keys and the logits); blocks in host memory are streamed a chunk at a time (ScoutRows).  The per-layer
        work is only the view of its blocks and their keys' dequantisation (each layer has its own ranks); rotation,
        logits, the segmented logsumexp and the masses run once per chunk.  On a
        model placed across devices the layers of each device are scored together there, and their masses ([layers,
        n_blocks] a device) gathered on the ranking's device: no host sync.  Its products run on tensor cores (TF32,
        :class:`_tf32`) for a 16-bit model on CUDA, as the step's do: in full float32 they were a seventh of the pass's
        device time at 128K on the H200."""
        with _tf32(self.res.device.type == "cuda" and self.res.shape.dtype.itemsize < 4):
            return self._scout_all(qs, others, scaling)

    def _scout_all(self, qs: list[torch.Tensor], others: list[torch.Tensor], scaling: float) -> torch.Tensor:
        if not self.res.split:
            return self._scout_masses(self.res, list(range(self.L)), qs, others, scaling)
        home, parts = self.res.device, []
        for dev, layers in device_groups(self.res.layer_devices):
            m = self._scout_masses(self.res.at(dev), layers, [qs[i] for i in layers], [others[i] for i in layers], scaling)
            parts.append((layers, m.to(home, non_blocking=home.type == "cuda")))
        out = torch.empty(self.L, parts[0][1].shape[1], dtype=parts[0][1].dtype, device=home)
        for layers, m in parts:
            out[torch.tensor(layers, device=home)] = m
        return out

    def _scout_masses(self, r: Residents, ids: list[int], qs: list[torch.Tensor], others: list[torch.Tensor], scaling: float) -> torch.Tensor:
        """:meth:`scout_masses` of the layers ``ids`` (on r's device; qs / others theirs, in order) -> [len(ids), n_blocks].

        A chunk is a run of spans i0..i1-1 of every KV group of one or more layers (:meth:`_scout_jobs`), so that
        every table it reads is a slice (the queries of its layers, each row's rotation, block and end): nothing is
        gathered per chunk, the logits of all its groups are one batched product, and each chunk writes its part of
        its layers' block logsumexps in place."""
        S, L, hkv = r.n_spans, len(ids), self.hkv
        q_all = torch.stack(qs).mul_(scaling)  # [L, Hkv, M, d], scaled here once (not every chunk's logits)
        if r.pre_rope:  # the keys are made with each RoPE pair side by side (:meth:`_scout_lse`): the queries alike
            q_all = q_all[..., self._pairs_order(r.device)]
        other = torch.stack(others)  # [L, Hkv, M]
        m, n_max = q_all.shape[2], max(b.n_max for b in self.blocks)
        fused = scout_kernel(r.device, self.d) if self.fused_scout else None
        jobs = self._scout_jobs(ids, S, m, n_max, fused is not None)
        held = self._scout_tables(r, n_max)
        if fused is not None and "start" not in held:  # each (span, block)'s rows, what the kernel reads
            held["start"], held["length"] = fused.block_tables(held["row_block"], held["per_span"])
        tables = dict(held)
        if r.pre_rope:  # every row's rotation once for the pass where it is small, else a chunk's at a time
            tables.update(self._scout_rotation(r, tables["pos"]))
        stream = ScoutRows(self.blocks, jobs, S, r.device)
        out, lse = [], None
        for k, (layers, i0, i1) in enumerate(jobs):
            l0 = ids.index(layers[0])
            if i0 == 0:  # the layers' block logsumexps [Lc, Hkv, S, blocks per span, M], filled by their chunks
                lse = torch.empty(len(layers), hkv, S, tables["per_span"], m, device=r.device)
            self._scout_lse(r, layers, q_all[l0 : l0 + len(layers)], i0, i1, tables, stream.rows(k), lse[:, :, i0:i1], fused)
            stream.done(k)
            if i1 == S:  # the layers' last spans
                out.append(scout.block_masses(lse.view(len(layers), hkv, -1, m), other[l0 : l0 + len(layers)])[:, tables["block_row"]])
                lse = None
        return torch.cat(out) if len(out) > 1 else out[0]

    def _pairs_order(self, dev) -> torch.Tensor:
        """rope.pairs_order of the head dimension on dev, made once a device."""
        held = self.__dict__.setdefault("_pairs", {})
        if dev not in held:
            held[dev] = rope.pairs_order(self.d, device=dev)  # made there: no copy from the host, no sync
        return held[dev]

    def _scout_chunk(self, n_pairs: int, per_pair: int) -> tuple[int, int]:
        """(pairs, layers) per chunk of the scout's scoring: work tensors (the fused kernel's: its staged rows) near
        SCOUT_CHUNK_BYTES (at least as many pairs as a step may fetch); whole layers together where a layer's pairs fit
        in one chunk."""
        pairs = max(self.P, 64, SCOUT_CHUNK_BYTES // max(per_pair, 1))
        return pairs, max(1, pairs // max(n_pairs, 1))

    def _scout_jobs(self, ids: list[int], S: int, m: int, n_max: int, fused: bool = False) -> list[tuple[list[int], int, int]]:
        """The scoring's chunks: (layers, i0, i1), spans i0..i1-1 of every KV group of the layers, about the pairs
        :meth:`_scout_chunk` allows (whole layers where they fit, else a layer's spans in equal runs).  A pair's work
        tensors: its keys and logits (each near the bound), or with the fused kernel (``fused``) its block row alone,
        K and V as stored (the chunk's staged rows near the bound, in each of ScoutRows's two buffers; the kernel
        reads them as they are)."""
        if fused:  # the pair's block row, as staged (K and V: ScoutRows copies whole rows)
            per_pair = 8 * max(b.stride for b in self.blocks)
        else:
            per_pair = 4 * n_max * max(self.d, m, 2 * max(b.r_max for b in self.blocks))
        pairs, n_layers = self._scout_chunk(self.hkv * S, per_pair)
        if n_layers > 1 or pairs >= self.hkv * S:
            return [(ids[l0 : l0 + n_layers], 0, S) for l0 in range(0, len(ids), n_layers)]
        runs = -(-S // max(1, pairs // self.hkv))
        ns = -(-S // runs)
        return [([layer], i0, min(S, i0 + ns)) for layer in ids for i0 in range(0, S, ns)]

    def _scout_lse(self, r: Residents, layers: list[int], q: torch.Tensor, i0: int, i1: int, t: dict,
                   staged: dict, out: torch.Tensor, fused=None) -> None:
        """Logsumexps of the zoom blocks of spans i0..i1-1 of every group, for the layers' queries q [Lc, Hkv, M, d]
        (scaled by the attention's scaling; in RoPE's pairs order for a pre-RoPE pack, as the keys are made), written into out [Lc, Hkv, i1 - i0, blocks per span, M]; a span's rows past its blocks give -inf.  r: the pack
        on the layers' device; staged: the layers' block rows of those spans already on it ([Hkv * (i1 - i0), stride],
        ScoutRows), by layer; the others are read where they are.  ``fused``: sekv/scout_kernel.py, one kernel a layer
        reading the block rows themselves (:func:`scout_kernel`, :meth:`_scout_rows`), else the PyTorch path."""
        if fused is not None:
            phase = self._scout_phase(r, t, i0, i1) if r.pre_rope else None
            start, length = t["start"][i0:i1], t["length"][i0:i1]
            for j, layer in enumerate(layers):
                rows = self._scout_rows(r, layer, i0, i1, staged)
                fused.block_lse_rows(self.blocks[layer], rows, q[j], start, length, out[j], phase=phase, pairs=r.pre_rope)
            return
        lc, hkv, ns = len(layers), self.hkv, i1 - i0
        n_max = t["row_block"].shape[1]
        ragged = any(self.blocks[layer].n_max != n_max for layer in layers)
        keys = (torch.zeros if ragged else torch.empty)(lc, hkv, ns, n_max, self.d, device=r.device)
        flat = keys.view(lc, hkv * ns, n_max, self.d)  # the pairs in the blocks' order (group-major)
        for j, layer in enumerate(layers):
            us, vt = self._scout_factors(r, layer, i0, i1, staged)
            if ragged:
                flat[j, :, : self.blocks[layer].n_max] = torch.matmul(us, vt)
            else:
                torch.matmul(us, vt, out=flat[j])  # rows past a span's n_i are masked below
            del us, vt
        del staged, flat
        if r.pre_rope:  # each row at its token's position (re-positioned: where its block sits zoomed alone)
            phase = self._scout_phase(r, t, i0, i1)
            rope.apply_pairs_(keys, phase)  # in place, one pass over the keys (made in RoPE's pairs order)
            del phase
        # [Lc, Hkv, ns * n_max, M]: one product for every group (no query gathered), the chunk's one big tensor; the
        # queries came scaled
        made = torch.matmul(keys.view(lc, hkv, ns * n_max, self.d), q.transpose(-1, -2))
        del keys  # worked in place from here
        logits = made.view(lc, hkv, ns, n_max, -1).masked_fill_(t["past"][i0:i1].unsqueeze(-1), float("-inf"))  # rows past each span's end
        if r.whole_spans:
            torch.logsumexp(logits, dim=3, keepdim=True, out=out)
            return
        # one segmented logsumexp: each row's exp (against its pair's max: every pair has a row) summed into its
        # block of the span; rows past the span are exp(-inf) = 0 (summed into block 0)
        mx = logits.amax(3, keepdim=True)  # [Lc, Hkv, ns, 1, M]
        ex = logits.sub_(mx).exp_()
        sums = torch.zeros_like(out).scatter_add_(3, t["row_block0"][i0:i1].unsqueeze(-1).expand_as(ex), ex)
        torch.add(sums.log_(), mx, out=out)  # a span's missing blocks: log 0 = -inf

    def _scout_rows(self, r: Residents, layer: int, i0: int, i1: int, staged: dict) -> torch.Tensor:
        """The layer's block rows of spans i0..i1-1 of every group [Hkv, ns, stride] (int64 words, group-major), what
        the fused kernel reads: the staged ones (ScoutRows), else a view of the blocks where they lie (device memory, or
        page-locked host memory through its mapped view: read in place by the kernel), else (host memory with no mapped
        view, not staged) copied to r's device.  staged: as :meth:`_scout_lse`."""
        b = self.blocks[layer]
        rows = staged.get(layer)
        if rows is not None:
            return rows.view(self.hkv, i1 - i0, b.stride)
        return b.src.view(self.hkv, -1, b.stride)[:, i0:i1].to(r.device, non_blocking=True)

    def _scout_factors(self, r: Residents, layer: int, i0: int, i1: int, staged: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys' factors of spans i0..i1-1 of every group, float32 (U*sigma [Hkv * ns, n_max, r], Vt
        [Hkv * ns, r, d], group-major); for a pre-RoPE pack Vt's columns in RoPE's pairs order (x1_j, x2_j side by
        side), converted into it: the keys come out so, rotated by one complex product.  staged: as :meth:`_scout_lse`."""
        b = self.blocks[layer]
        rows = self._scout_rows(r, layer, i0, i1, staged).reshape(self.hkv * (i1 - i0), b.stride)
        return fb.unpack(b, rows, torch.float32, side=0, pairs=r.pre_rope)

    @staticmethod
    def _scout_phase(r: Residents, t: dict, i0: int, i1: int) -> torch.Tensor:
        """The rotation of the rows of spans i0..i1-1 [ns, n_max, d / 2, 2] (rope.pairs_phase): the pass's table's
        slice where it was made (:meth:`_scout_rotation`; 16-bit: exact as float32), else made for these spans."""
        if "phase" in t:
            return t["phase"][i0:i1]
        pos = t["pos"][i0:i1]
        return rope.pairs_phase(*rope.cos_sin_half(pos.flatten(), r.inv_freq, r.rope_scaling, dtype=r.shape.dtype)).view(*pos.shape, -1, 2)

    def _scout_tables(self, r: Residents, n_max: int) -> dict:
        """What the scout's scoring reads and no question changes, computed once: each row's block within its span
        [S, n_max] (-1 past the span), the most blocks a span has, where each zoom block's row is in the
        [S * blocks per span] layout, and (pre-RoPE packs) each row's position [S, n_max] (re-positioned: the layout's,
        so these follow it), on r's device."""
        key = (n_max, None if r.layout is None else (id(r.layout), r.layout.p0, r.layout.room))
        cached = getattr(self, "_scout_t", None)
        if cached is not None and r.device in cached and cached[r.device]["key"] == key:
            return cached[r.device]
        first, counts, per_span, row_block = self._span_blocks(r)
        if r.whole_spans:
            per_span, row_block = 1, torch.where(row_block >= 0, 0, -1)
            block_row = torch.arange(r.n_spans, device=r.device)
        else:
            bs = r.block_span_dev
            block_row = bs * per_span + (torch.arange(r.n_blocks, device=r.device) - first[bs])
        row_block = torch.nn.functional.pad(row_block, (0, n_max - row_block.shape[1]), value=-1)
        # a chunk reads slices of these: each row's block (0 past the span: its exp is 0), the rows past the span
        t = {"key": key, "row_block": row_block, "per_span": per_span, "block_row": block_row, "row_block0": row_block.clamp_min(0),
             "past": row_block < 0}
        if r.pre_rope:
            if r.layout is None:
                pos = r.span_start_dev.view(-1, 1) + torch.arange(n_max, device=r.device).view(1, -1)
            else:  # each block where it would sit were it the only one zoomed
                blk = first.view(-1, 1) + row_block.clamp_min(0)
                blk = torch.minimum(blk, (first + counts - 1).view(-1, 1))
                pos = r.layout.scout_positions()[blk] - r.block_off_dev[blk] + torch.arange(n_max, device=r.device).view(1, -1)
                pos = torch.where(row_block >= 0, pos, 0)
            t["pos"] = pos
        self._scout_t = {**(cached or {}), r.device: t}
        return t

    def _scout_rotation(self, r: Residents, pos: torch.Tensor) -> dict:
        """The rotation of every row of the scout's layout (pos [S, n_max]) for one pass, where the table takes at most
        SCOUT_CHUNK_BYTES: {"phase": [S, n_max, d / 2, 2]} (rope.pairs_phase: each (cos, sin) pair side by side, a chunk's
        rows one float32 copy from the complex factor its rotation multiplies by), held in the model's dtype where that is
        16-bit (rope.cos_sin_half's values are that dtype's: exact there, half the bytes); else {} (a chunk's at a time)."""
        dt = r.shape.dtype if r.shape.dtype.itemsize < 4 else torch.float32
        if pos.numel() * self.d * dt.itemsize > SCOUT_CHUNK_BYTES:
            return {}
        cos, sin = rope.cos_sin_half(pos.flatten(), r.inv_freq, r.rope_scaling, dtype=r.shape.dtype)
        return {"phase": rope.pairs_phase(cos.to(dt), sin.to(dt)).view(*pos.shape, -1, 2)}

    def _span_blocks(self, r: Residents) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """(first zoom block of each span [S], its number of blocks [S], the most blocks a span has, the block-within-
        span of each row of each span [S, n_max] (-1 past its end)), on r's device; computed once a device."""
        tables = getattr(self, "_span_block_tables", None)
        if tables is None:
            counts = torch.bincount(r.block_span, minlength=r.n_spans)
            first = torch.cumsum(counts, 0) - counts
            n_max = int(r.span_len.max())
            row_block = torch.full((r.n_spans, n_max), -1, dtype=torch.long)
            for k in range(int(counts.max())):  # the k-th block of each span that has one
                b = (first + k)[counts > k]
                rows = r.block_off[b].view(-1, 1) + torch.arange(n_max).view(1, -1)
                inside = rows < (r.block_off[b] + r.block_len[b]).view(-1, 1)
                sp = r.block_span[b].view(-1, 1).expand_as(rows)
                row_block[sp[inside], rows[inside]] = k
            # made on the host; each device's copy sent without a stream sync (pageable memory is staged at once)
            tables = self._span_block_tables = {None: (first, counts, int(counts.max()), row_block)}
        if r.device not in tables:
            first, counts, most, row_block = tables[None]
            up = lambda x: x.to(r.device, non_blocking=True)  # noqa: E731
            tables[r.device] = (up(first), up(counts), most, up(row_block))
        return tables[r.device]


#: the scout's reads of factor blocks in host memory: True, copied a chunk at a time into a device buffer on a side
#: stream, the next chunk's copy beside this chunk's scoring (ScoutRows); False, read in place (through their mapped
#: view on CUDA: a dequantising kernel reading host memory); None, True on CUDA
SCOUT_STAGING: bool | None = None
#: a staged chunk of a layer's spans (every KV group's run of them) read by one kernel through the blocks' mapped view
#: (True), or by one DMA copy per group run (False)
SCOUT_MAPPED_COPY = True


class ScoutRows:
    """The scout pass's factor-block rows, chunk by chunk, for the blocks in host memory: ``jobs[k]`` = (layers, i0,
    i1) reads the blocks of spans i0..i1-1 of every KV group of each of its layers (``S`` spans a group).  Each chunk's
    host rows are copied into one of two device buffers on a side stream, chunk k+1's copy issued before chunk k's
    scoring, so the copies run beside the scoring; a buffer is written again only after the scoring that read it
    (events, no host sync).  A layer's copy is one: its rows where they are one run (whole layers), else one strided
    copy from the blocks' mapped view (a kernel reading page-locked host memory, as a fetch does); without a mapped view
    (the CPU, tests), a DMA copy of each group's run, in pieces within one page-locked registration.  Blocks in device
    memory are read in place (``rows(k)`` leaves them out).  On the CPU the same copies run in order (tests:
    SCOUT_STAGING True)."""

    def __init__(self, blocks: list[fb.Blocks], jobs: list[tuple[list[int], int, int]], n_spans: int, device):
        self.blocks, self.jobs, self.S, self.device = blocks, jobs, n_spans, torch.device(device)
        on = SCOUT_STAGING if SCOUT_STAGING is not None else self.device.type == "cuda"
        host = {i for i, b in enumerate(blocks) if b.words.device.type == "cpu"} if on else set()
        self.hkv = blocks[0].last.numel() // max(1, n_spans) if blocks else 0
        need = [sum(self.hkv * (i1 - i0) * blocks[i].stride for i in layers if i in host) for layers, i0, i1 in jobs]
        self.host = host
        self.words = max(need, default=0)
        self.cuda = self.device.type == "cuda"
        self.buf: list[torch.Tensor] = []
        if self.words:
            self.buf = [torch.empty(self.words, dtype=torch.int64, device=self.device) for _ in range(2)]
            self.side = torch.cuda.Stream(self.device) if self.cuda else None
            self.copied: list = [None, None]
            self.freed: list = [None, None]
            self._issue(0)

    def _issue(self, k: int) -> None:
        if k >= len(self.jobs) or not self.words:
            return
        layers, i0, i1 = self.jobs[k]
        buf, hkv, ns, S = self.buf[k % 2], self.hkv, i1 - i0, self.S
        ctx = torch.cuda.stream(self.side) if self.cuda else contextlib.nullcontext()
        with ctx:
            if self.cuda:
                if self.freed[k % 2] is None:  # the buffer was made on the compute stream
                    self.side.wait_stream(torch.cuda.current_stream(self.device))
                else:  # its last chunk's scoring is done with it
                    self.side.wait_event(self.freed[k % 2])
            at = 0
            for i in layers:
                if i not in self.host:
                    continue
                b = self.blocks[i]
                w = ns * b.stride  # a group's run of words
                if ns < S and b.uva and SCOUT_MAPPED_COPY:  # every group's run at once, read through the mapped view
                    buf[at : at + hkv * w].view(hkv, w).copy_(b.src.view(hkv, S * b.stride)[:, i0 * b.stride : i1 * b.stride])
                else:
                    for g in range(1 if ns == S else hkv):
                        a0 = (g * S + i0) * b.stride
                        n = hkv * w if ns == S else w
                        for x, y in fb.pieces(b.words, a0, a0 + n):  # each piece inside one registration
                            buf[at + x - a0 : at + y - a0].copy_(b.words[x:y], non_blocking=self.cuda)
                        at += n
                    continue
                at += hkv * w
            if self.cuda:
                ev = torch.cuda.Event()
                ev.record(self.side)
                self.copied[k % 2] = ev

    def rows(self, k: int) -> dict[int, torch.Tensor]:
        """Chunk k's staged rows on the device, by layer ([Hkv * (i1 - i0), stride] int64, group-major); the next
        chunk's copy is issued."""
        if not self.words:
            return {}
        layers, i0, i1 = self.jobs[k]
        self._issue(k + 1)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.copied[k % 2])
        out, at, buf = {}, 0, self.buf[k % 2]
        for i in layers:
            if i in self.host:
                b = self.blocks[i]
                n = self.hkv * (i1 - i0)
                out[i] = buf[at : at + n * b.stride].view(n, b.stride)
                at += n * b.stride
        return out

    def done(self, k: int) -> None:
        """Chunk k's scoring is queued: its buffer may be written again after it."""
        if self.words and self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self.freed[k % 2] = ev


class _tf32:
    """float32 products on tensor cores (TF32) inside the step: the inputs are bf16 / int8-times-scale values,
    which TF32's 10-bit mantissa holds (bf16: 7 bits) or rounds far below their quantisation error.  The setting is
    the process's, and steps run on two threads at once (a question and the blocks' rehearsal beside it,
    sekv/memory.py rehearse_layer): one count for all, so that it is on while any step is inside and set back when
    the last one leaves (each setting it back on its own exit turned it off under the other's products)."""

    _lock = threading.Lock()
    _inside = 0
    _old = False

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        if self.on:
            with _tf32._lock:
                if _tf32._inside == 0:
                    _tf32._old = torch.backends.cuda.matmul.allow_tf32
                    torch.backends.cuda.matmul.allow_tf32 = True
                _tf32._inside += 1

    def __exit__(self, *exc):
        if self.on:
            with _tf32._lock:
                _tf32._inside -= 1
                if _tf32._inside == 0:
                    torch.backends.cuda.matmul.allow_tf32 = _tf32._old
