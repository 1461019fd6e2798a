"""Span factor blocks in host memory, fetched by the compute device without a host round trip.

The pack's factors are ragged (sekv/factorize.py): gathering a set of spans from
them needs the span ids on the host, i.e. a device->host sync per layer and step.
For decoding on an accelerator one layer's K and V factors are re-laid out at
open time as **one fixed-stride block per (KV head g, span i)** in pinned host
memory, with fixed sections (r = the layer's largest rank, n = its longest span;
padding is zero, so padded components add nothing to a product):

    Vt [2, r, d] | vt_scale [2, r] | us_scale [n, 2] | U*sigma [n, 2, r]      (K and V side by side)

(scales only for int8 factors).  A block's *used* part ends after its own n_i
rows of U*sigma, so a fetch moves the block up to there and nothing of the
padding past it.  The kept (g, i) pairs of a layer are fetched with **one**
gather of whole rows whose indices live on the device: on CUDA the pinned buffer
is mapped into the device's address space (unified virtual addressing) and the
gather is an ordinary ``index_select`` kernel reading host memory over PCIe, on
the current stream, with no sync and no host-side staging (46.6 GB/s against
55.3 GB/s for a plain pinned copy on the H200, benchmarks/gpu_micro.py).  Words
past a block's used part re-read its last word.  On the CPU (tests) the same code
reads the plain tensor.

Where they are first: on one CUDA device the build keeps them in device memory (up
to a share of it, sekv/gpu_step.py build_blocks), where the same gather reads them
at once, and :class:`HostPinning` moves them to page-locked host memory in a pause
between questions; page-locking every layer before the first question was most of
its wait (docs/gpu.md, "The factor blocks before the first question").

``unpack`` is then views and two multiplies: (U*sigma [P, 2, n, r], Vt [P, 2, r, d]).
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass

import torch

from . import factorize as fz

_A = 8  # alignment of every section, bytes


class _UVA:
    """A CUDA view of pinned host memory through __cuda_array_interface__ (the same pointer under UVA)."""

    def __init__(self, t: torch.Tensor):
        self._t = t
        self.__cuda_array_interface__ = {"shape": (t.numel(),), "typestr": "<i8", "data": (t.data_ptr(), False), "version": 2, "strides": None}


def device_view(words: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A tensor on ``device`` aliasing the pinned host tensor ``words`` (int64, 1-D), or None where that is not possible."""
    if device.type != "cuda" or not words.is_pinned():
        return None
    try:
        v = torch.as_tensor(_UVA(words), device=device)
    except Exception:
        return None
    return v if v.device.type == "cuda" and v.data_ptr() == words.data_ptr() else None


@dataclass
class Blocks:
    """One layer's K+V factor blocks."""

    words: torch.Tensor  # [Hkv * S * stride] int64, host (pinned on CUDA)
    src: torch.Tensor  # what the gather reads: the device alias of ``words`` on CUDA, else ``words``
    stride: int  # words per block
    last: torch.Tensor  # [Hkv * S] int32: each block's last used word (its used words - 1), on the device
    sections: tuple[int, int, int, int]  # byte offsets of Vt, vt_scale, us_scale, U*sigma
    dtype: torch.dtype  # factor element type
    int8: bool
    r_max: int
    n_max: int
    d: int
    uva: bool
    cols: torch.Tensor  # [1, stride] 0..stride-1 on the device (a fetch's word offsets; a constant, not a table), int32
    # where every word's index fits (a fetch's index tensor is as large as the words it gathers: half of it in int32)

    @property
    def used(self) -> torch.Tensor:
        """[Hkv * S] int32 used words per block (a fetch reads a block's words up to its last)."""
        return self.last + 1

    def index_bytes(self) -> int:
        """Device bytes of the block table (counted as resident)."""
        return self.last.numel() * self.last.element_size()


def build(f: fz.Factors, span_len: torch.Tensor, d: int, device, pin: bool, work_device=None, r_max: int | None = None,
          wait: bool = True, keep: bool = False, rank_host: torch.Tensor | None = None) -> Blocks:
    """Re-lay one layer's packed factors, K and V stacked (``fz.stack_kv``: rank [2 Hkv, S], V blocks are
    heads Hkv..2Hkv-1), as fixed-stride blocks (see module doc).

    ``work_device``: where the re-layout runs (the accelerator when there is one; the result lands on the host).
    ``r_max``: the largest rank, read by the caller where the ranks are on the host (the pack's); with it and
    ``span_len`` on the host, the re-layout on an accelerator reads nothing back from it until the blocks' copy
    to the host.  ``wait`` False: that copy into pinned memory is left in flight on the current stream (the caller
    synchronises once for all layers before the host or another stream reads them: gpu_step.build_blocks).
    ``keep``: the blocks stay where they were re-laid (``work_device``: device memory the step gathers from
    directly, no pinning); :class:`HostPinning` moves them to pinned host memory later.  ``rank_host``: ``f.rank``
    on the host (the pack's), where ``f`` is on the device: the padded tensors are filled a run of blocks at a time
    (bounded temporaries, :data:`SCATTER_ELEMS`), with nothing read back from the device.
    """
    device = torch.device(device)
    wd = torch.device(work_device) if work_device is not None else torch.device("cpu")
    h2, s = f.rank.shape
    hkv = h2 // 2
    int8 = f.us_scale is not None
    dt = f.us.dtype
    es = f.us.element_size()
    nm = int(span_len.max()) if s else 0  # where span_len is (the residents': the host)
    n = span_len.long().to(wd, non_blocking=True)  # from pageable memory: staged at once, no stream sync
    r = f.rank.long().to(wd)
    rm = r_max if r_max is not None else (int(r.max()) if r.numel() else 0)
    # the packed order is (kind, g, i, row, col): fill zero-padded tensors with boolean masks in that order
    # (masked_scatter_: the masked elements in order from the packed ones, no count read back as indexing would),
    # a run of (kind, g, i) blocks at a time where the ranks are on the host (_scatter_runs)
    rh = rank_host if rank_host is not None else f.rank if f.rank.device.type == "cpu" else None
    rh = None if rh is None else rh.long()
    nh = span_len.long().cpu() if rh is not None else None
    rows_ok = (torch.arange(nm, device=wd).view(1, 1, -1) < n.view(1, -1, 1)).expand(h2, -1, -1)  # [2Hkv, S, nm]
    cols_ok = torch.arange(rm, device=wd).view(1, 1, -1) < r.unsqueeze(-1)  # [2Hkv, S, rm]
    us = torch.zeros(h2, s, nm, rm, dtype=dt, device=wd)
    hs = h2 * s
    us_mask = lambda a, b: rows_ok.reshape(hs, nm)[a:b].unsqueeze(-1) & cols_ok.reshape(hs, rm)[a:b].unsqueeze(1)  # noqa: E731
    _scatter_runs(us.view(hs, nm, rm), us_mask, f.us.to(wd), None if rh is None else (rh * nh.view(1, -1)).flatten())
    vt = torch.zeros(h2, s, rm, d, dtype=dt, device=wd)
    vt_mask = lambda a, b: cols_ok.reshape(hs, rm)[a:b].unsqueeze(-1).expand(-1, -1, d)  # noqa: E731
    _scatter_runs(vt.view(hs, rm, d), vt_mask, f.vt.to(wd), None if rh is None else (rh * d).flatten())
    sc = 2 if int8 else 0
    la, lb, lc, ld = 2 * rm * d * es, 2 * rm * sc, nm * 2 * sc, nm * 2 * rm * es
    oa = 0
    ob = oa + _al_i(la)
    oc = ob + _al_i(lb)
    od = oc + _al_i(lc)
    stride = max(1, _al_i(od + ld) // _A)
    nb = hkv * s
    buf = torch.zeros(nb, stride * _A, dtype=torch.uint8, device=wd)
    # each section written from a permuted view of its padded tensor (no contiguous copy of it first)
    if la:
        buf[:, oa : oa + la].view(dt).view(hkv, s, 2, rm, d).copy_(vt.view(2, hkv, s, rm, d).permute(1, 2, 0, 3, 4))  # [2, r, d] per block
    del vt
    if ld:
        buf[:, od : od + ld].view(dt).view(hkv, s, nm, 2, rm).copy_(us.view(2, hkv, s, nm, rm).permute(1, 2, 3, 0, 4))  # [n, 2, r] per block
    del us
    if int8:
        uss = torch.zeros(h2, s, nm, dtype=torch.float16, device=wd)
        _scatter_runs(uss.view(hs, nm), lambda a, b: rows_ok.reshape(hs, nm)[a:b], f.us_scale.to(wd), None if nh is None else nh.repeat(h2))
        vts = torch.zeros(h2, s, rm, dtype=torch.float16, device=wd)
        _scatter_runs(vts.view(hs, rm), lambda a, b: cols_ok.reshape(hs, rm)[a:b], f.vt_scale.to(wd), None if rh is None else rh.flatten())
        if lb:
            buf[:, ob : ob + lb].view(torch.float16).view(hkv, s, 2, rm).copy_(vts.view(2, hkv, s, rm).permute(1, 2, 0, 3))  # [2, r]
        if lc:
            buf[:, oc : oc + lc].view(torch.float16).view(hkv, s, nm, 2).copy_(uss.view(2, hkv, s, nm).permute(1, 2, 3, 0))  # [n, 2]
    used = (od + n.view(1, -1).expand(hkv, -1) * 2 * rm * es + _A - 1) // _A  # [Hkv, S] words
    words = buf.view(-1).view(torch.int64)
    if not keep and (wd.type != "cpu" or pin):
        words = to_host(words, pin, non_blocking=pin and not wait and words.is_cuda)
    view = device_view(words, device) if device.type == "cuda" else None
    return Blocks(
        words=words,
        src=view if view is not None else words,
        stride=stride,
        last=(used.flatten().clamp_min(1) - 1).to(device, torch.int32),
        sections=(oa, ob, oc, od),
        dtype=dt,
        int8=int8,
        r_max=rm,
        n_max=nm,
        d=d,
        uva=view is not None,
        cols=torch.arange(stride, device=device, dtype=torch.int32 if nb * stride < 2**31 else torch.long).view(1, -1),
    )


#: the most destination elements one masked_scatter_ of the re-layout takes (_scatter_runs): on CUDA it makes an int64
#: running count of its whole destination (8 bytes an element: 8x an int8 padded factor tensor, over a GiB for an 8B
#: model's layer at 128K tokens, made while a first question may wait for the build); 4M elements: 32 MiB of it
SCATTER_ELEMS = 4 << 20


def _scatter_runs(dst: torch.Tensor, mask, src: torch.Tensor, counts: torch.Tensor | None) -> None:
    """``dst.masked_scatter_(mask(0, B), src)`` for dst [B, ...] and mask(a, b) the mask of dst[a:b], a run of
    whole rows of dst at a time (at most SCATTER_ELEMS elements, at least one row): each run takes the next
    counts[a:b].sum() elements of src (counts [B], the masked elements of each row, on the host).  counts None: one
    masked_scatter_ (no sizes on the host: none is read back from the device)."""
    rows = dst.shape[0]
    per = max(1, dst[0].numel()) if rows else 1
    if counts is None or rows * per <= SCATTER_ELEMS:
        if dst.numel():
            dst.masked_scatter_(mask(0, rows), src)
        return
    step = max(1, SCATTER_ELEMS // per)
    ends = torch.cumsum(counts.long(), 0).tolist()
    o = 0
    for a in range(0, rows, step):
        b = min(rows, a + step)
        e = ends[b - 1]
        dst[a:b].masked_scatter_(mask(a, b), src[o:e])
        o = e


def to_host(words: torch.Tensor, pin: bool, non_blocking: bool = False) -> torch.Tensor:
    """A copy of the block words in host memory, page-locked where ``pin`` (non_blocking: the copy from the device
    is left in flight on the current stream)."""
    host = page_locked(words.numel()) if pin else torch.empty(words.numel(), dtype=torch.int64)
    copy_pieces(host, words, non_blocking=non_blocking)
    return host


def copy_pieces(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """dst.copy_(src) for 1-D tensors of the same size, one of them page-locked by :func:`page_locked`: in pieces
    that each stay inside one of its registrations (:func:`pieces`), so every piece is a direct DMA copy."""
    host = dst if dst.device.type == "cpu" else src
    for a, b in pieces(host, 0, host.numel()):
        dst[a:b].copy_(src[a:b], non_blocking=non_blocking)


#: page-lock block words at their own size (:func:`page_locked`); False: torch's pinned allocator
EXACT_PINNING = True

#: :func:`page_locked` registers memory in pieces of at most this many bytes, cut at addresses that are multiples of
#: it (page-aligned: no page in two pieces): page-locking holds the CUDA driver for its whole call (2.8 GB/s on the
#: H200), so another thread's CUDA call (the model load's copies, a question's launches) waits one piece at most
#: (64 MiB: ~25 ms), not a whole layer's blocks.  Copies to and from such memory go piece by piece (copy_pieces).
PIN_PIECE = 64 << 20


def pieces(t: torch.Tensor, a: int, b: int) -> list[tuple[int, int]]:
    """The element ranges [a, b) of the 1-D tensor t split where its addresses cross a multiple of PIN_PIECE."""
    if b <= a:
        return []
    es, base = t.element_size(), t.data_ptr()
    out, x = [], a
    while x < b:
        nxt = ((base + x * es) // PIN_PIECE + 1) * PIN_PIECE  # the next boundary's address
        y = min(b, max(x + 1, (nxt - base) // es))
        out.append((x, y))
        x = y
    return out


def page_locked(n: int) -> torch.Tensor:
    """int64 [n] in page-locked host memory.  torch's pinned allocator rounds every allocation up to a power of two
    (one layer's 284 MiB of blocks would lock 512 MiB) and faults the pages in inside the CUDA call, which holds the
    driver; here ordinary memory is allocated and every page touched first (CPU work, no CUDA call), then registered
    with CUDA at its own size, in pieces of PIN_PIECE (cudaHostRegister, portable and mapped: under unified
    addressing each piece is read by the device at its host address, so the pieces read as one range; unregistered
    when the tensor goes).  Falls back to torch's pinned allocator where registering fails."""
    if EXACT_PINNING and n and torch.cuda.is_available():
        t = torch.zeros(n, dtype=torch.int64)
        rt = torch.cuda.cudart()
        done: list[int] = []
        ok = True
        for a, b in pieces(t, 0, n):
            p = t.data_ptr() + 8 * a
            try:  # portable and mapped (1 | 2): every device reads it through the same pointer (UVA, device_view)
                ok = int(rt.cudaHostRegister(p, 8 * (b - a), 3)) == 0
            except Exception:  # noqa: BLE001 - a runtime without the binding
                ok = False
            if not ok:
                break
            done.append(p)
        if ok and t.is_pinned():
            weakref.finalize(t, _unregister, rt, done).atexit = False
            return t
        _unregister(rt, done)
    return torch.empty(n, dtype=torch.int64, pin_memory=True)


def _unregister(rt, ptrs: list[int]) -> None:
    for p in ptrs:
        rt.cudaHostUnregister(p)


class Locker:
    """Page-locked host memory (:func:`page_locked`) made on a thread of its own, so that the build's device work
    (decoding and re-laying the next layers) runs beside the page-locking: ``submit(n)`` -> a future of int64 [n]."""

    def __init__(self, device):
        from concurrent.futures import ThreadPoolExecutor

        self.device = torch.device(device)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="sekv-lock")

    def submit(self, n: int):
        return self.pool.submit(self._lock, n)

    def _lock(self, n: int) -> torch.Tensor:
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):  # a thread's CUDA calls go to device 0 unless told: no context there
                return page_locked(n)
        return torch.empty(n, dtype=torch.int64)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _al_i(x: int) -> int:
    return (x + _A - 1) // _A * _A


def fetch(b: Blocks, pair: torch.Tensor, ok: torch.Tensor, count: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of the blocks ``pair`` [P] (flat g * S + i) -> (fetched words [P, stride] on the compute device,
    words actually transferred, a 0-d device tensor; None where not ``count``).  Pairs with ``ok`` False read one
    word.  Five ops (a forward makes it once a layer): each pair's last word, each word's offset clamped to it, the
    block's start added in place, one gather."""
    last = torch.where(ok, b.last[pair], 0)
    return gather(b, pair, last), (last.sum() + last.numel()) if count else None


def gather(b: Blocks, pair: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """:func:`fetch`'s gather: the words 0..last[p] of each block pair[p] (the last one repeated to the stride)."""
    idx = torch.minimum(b.cols, last.view(-1, 1).to(b.cols.dtype)).add_(pair.view(-1, 1).to(b.cols.dtype), alpha=b.stride)
    if b.uva or b.src.device == pair.device:
        rows = b.src.index_select(0, idx.flatten())
    else:  # no mapped view (not pinned, or the runtime refused it): gather on the host, one copy
        rows = b.src.index_select(0, idx.flatten().cpu()).to(pair.device, non_blocking=True)
    return rows.view(-1, b.stride)


def unpack(b: Blocks, rows: torch.Tensor, dtype=torch.float32, side: int | None = None, pairs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Fetched rows -> dequantised (U*sigma [P, 2, n_max, r_max], Vt [P, 2, r_max, d]) in ``dtype``; ``side`` 0
    (K) or 1 (V): that side's alone, (U*sigma [P, n_max, r_max], Vt [P, r_max, d]), the other not converted.
    ``pairs`` (with ``side``): Vt's columns in RoPE's pairs order (rope.pairs_order), laid out so by the conversion
    itself (no copy more), so U*sigma @ Vt gives the rows in that order.

    Rows of U*sigma past a block's own length hold whatever the fetch repeated there (not zero): callers
    discard them.
    """
    p = rows.shape[0]
    nm, rm, d, dt = b.n_max, b.r_max, b.d, b.dtype
    es = dt.itemsize
    oa, ob, oc, od = b.sections
    by = rows.view(torch.uint8)
    if side is not None:  # the scales multiply in place in float32 (a half-precision factor: the same values as a copy)
        vt = by[:, oa : oa + 2 * rm * d * es].view(dt).reshape(p, 2, rm, d)[:, side]
        if pairs:  # [P, r, 2, d/2] read as [P, r, d/2, 2]: column j of each half side by side
            vt = torch.empty(p, rm, d // 2, 2, dtype=dtype, device=vt.device).copy_(vt.view(p, rm, 2, d // 2).transpose(-1, -2)).view(p, rm, d)
        else:
            vt = vt.to(dtype)
        us = by[:, od : od + nm * 2 * rm * es].view(dt).reshape(p, nm, 2, rm)[:, :, side].to(dtype)
        if b.int8:
            vt.mul_(by[:, ob : ob + 2 * rm * 2].view(torch.float16).reshape(p, 2, rm, 1)[:, side])
            us.mul_(by[:, oc : oc + nm * 2 * 2].view(torch.float16).reshape(p, nm, 2, 1)[:, :, side])
        return us, vt
    vt = by[:, oa : oa + 2 * rm * d * es].view(dt).reshape(p, 2, rm, d).to(dtype)
    us = by[:, od : od + nm * 2 * rm * es].view(dt).reshape(p, nm, 2, rm).to(dtype)
    if b.int8:  # scaled in place: the int8 words were copied into new tensors just above (the same values as a product)
        vt.mul_(by[:, ob : ob + 2 * rm * 2].view(torch.float16).reshape(p, 2, rm, 1).to(dtype))
        us.mul_(by[:, oc : oc + nm * 2 * 2].view(torch.float16).reshape(p, nm, 2, 1).to(dtype))
    return us.transpose(1, 2), vt


def move_to_host(b: Blocks, device, pin: bool, non_blocking: bool = False) -> None:
    """Blocks kept on the device (``build(keep=True)``) -> host memory, in place (the words, what the gather reads)."""
    install(b, to_host(b.words, pin, non_blocking=non_blocking), torch.device(device))


def install(b: Blocks, host: torch.Tensor, device: torch.device) -> bool:
    """Make ``host`` (a finished host copy of ``b.words``) the blocks' words, read through its mapped view on CUDA;
    False (nothing changed) where CUDA cannot map it: a gather from the device's copy beats one staged on the host."""
    view = device_view(host, device) if device.type == "cuda" else None
    if device.type == "cuda" and view is None and b.words.is_cuda:
        return False
    b.words, b.src, b.uva = host, view if view is not None else host, view is not None
    return True


#: seconds without a forward before :class:`HostPinning` page-locks the next layer's blocks: page-locking holds the
#: CUDA driver (docs/gpu.md: the prefill beside a page-locked arena grew by as much), so it waits for a pause
#: between questions instead of slowing one
IDLE_S = 2.0


class HostPinning:
    """Factor blocks kept in device memory after their build (so the first question gathers from them at once, not
    after every layer's page-locking) moved to pinned host memory while the memory is idle.

    A thread copies one layer at a time, and only after ``idle_s`` without a :meth:`touch` (the memory touches it in
    every forward's layers and single-token steps); its copy stays aside until :meth:`settle`, called by the memory
    between forwards, installs it (the layer's ``words`` / ``src`` replaced in place, the device copy dropped), so no
    forward sees a layer change under it.  :meth:`settle` first waits for a copy in flight (a layer at most), so no
    page-locking runs beside a CUDA-graph capture.  :meth:`key` changes with every installed layer (a captured step
    that read the device copies is not replayed).  Layers not moved (a `sekv ask` that ends before a pause) stay on
    the device until the memory goes."""

    def __init__(self, blocks: list[Blocks], layers: list[int], device, pin: bool = True, idle_s: float | None = None):
        self.blocks, self.device, self.pin = blocks, torch.device(device), pin
        self.idle_s = IDLE_S if idle_s is None else idle_s
        self.todo = list(layers)  # the layers still on the device, in order
        self.ready: dict[int, torch.Tensor] = {}  # copied, not installed yet
        self.installed = 0
        self.lock = threading.Lock()  # held while a layer is copied
        self.last = time.monotonic()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self._stream = None

    def device_bytes(self) -> int:
        """Bytes of blocks still on the device (copied or not)."""
        return sum(self.blocks[i].words.numel() * 8 for i in range(len(self.blocks)) if self.blocks[i].words.device.type != "cpu")

    def pending(self) -> int:
        """Layers not installed yet."""
        with self.lock:
            return len(self.todo) + len(self.ready)

    def touch(self) -> None:
        """The memory is in use now; the first touch starts the thread (never before the first question)."""
        self.last = time.monotonic()
        if self.thread is None and self.todo:
            self.thread = threading.Thread(target=_pin_loop, args=(weakref.ref(self),), name="sekv-pin", daemon=True)
            self.thread.start()
            # when the memory goes, and at exit: no copy starts, the one in flight ends first
            weakref.finalize(self, _stop, self.stop, self.lock)

    def settle(self) -> None:
        """Between forwards: touch, wait for a copy in flight, install the finished ones."""
        self.touch()
        with self.lock:
            ready, self.ready = self.ready, {}
        for layer, host in ready.items():
            if install(self.blocks[layer], host, self.device):
                self.installed += 1

    def key(self) -> tuple:
        return ("pinned", self.installed)

    def finish(self) -> None:
        """Copy and install every layer now (tests; a caller that wants the device memory back)."""
        with self.lock:
            while self.todo:
                self._copy_next()
        self.settle()

    def _copy_next(self) -> None:  # under self.lock
        layer = self.todo[0]
        words = self.blocks[layer].words
        if words.is_cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream(words.device)
            with torch.cuda.stream(self._stream):  # the build finished its stream's work before handing the blocks over
                host = to_host(words, self.pin, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._stream)
            while not done.query():  # polled, not a stream sync (none that torch's sync debug mode would count)
                time.sleep(0.001)
        else:
            host = to_host(words, self.pin)
        self.ready[layer] = host
        self.todo.pop(0)


def _pin_loop(ref) -> None:
    while True:
        p = ref()
        if p is None or p.stop.is_set():
            return
        wait = p.idle_s - (time.monotonic() - p.last)
        if wait <= 0:
            with p.lock:
                if not p.todo:
                    return
                if time.monotonic() - p.last >= p.idle_s and not p.stop.is_set():
                    try:
                        with torch.inference_mode():
                            p._copy_next()
                    except Exception:  # noqa: BLE001 - e.g. no host memory to lock: the layers stay on the device
                        return
            wait = 0.0
        stop = p.stop
        del p  # the thread holds no reference while it waits: the memory's end ends it
        stop.wait(max(wait, 0.001))


def _stop(stop: threading.Event, lock: threading.Lock) -> None:
    stop.set()
    with lock:
        pass
