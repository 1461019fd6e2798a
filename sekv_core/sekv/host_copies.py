"""Pack tensors computed on an accelerator -> host memory, overlapped with the compression of the next layer."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

#: page-locked bytes that copies into a pageable arena go through (two halves: a layer group's results in one while
#: the other's are copied on into the arena): DMA at page-locked speed, then a host memcpy on the worker thread.  A
#: copy from the device straight into pageable memory holds the CUDA driver for its whole length and stalls the
#: compute thread's launches (docs/gpu.md, "H200, compress at 128K": compress 6.68 s with a pageable arena, 3.37 s
#: page-locked); page-locking the whole arena instead costs the prefill as much.  0: no staging (the direct copies)
STAGING_BYTES = 256 << 20
_STAGING: dict = {}
_STAGING_LOCK = threading.Lock()


def staging_buffer(nbytes: int | None = None) -> torch.Tensor | None:
    """The process's page-locked staging memory (made once, on first use; None without CUDA or with STAGING_BYTES 0)."""
    nbytes = STAGING_BYTES if nbytes is None else nbytes
    if nbytes <= 0 or not torch.cuda.is_available():
        return None
    with _STAGING_LOCK:
        buf = _STAGING.get(nbytes)
        if buf is None:
            buf = _STAGING[nbytes] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return buf


class HostArena:
    """Host memory for a pack's tensors, allocated in a background thread while the prefill runs.

    ``pinned``: page-locked.  Measured on the H200 (docs/gpu.md): compress halves, but page-locking holds the
    CUDA driver and the prefill grows by as much.  Otherwise ordinary memory is allocated and every page
    touched (no CUDA call), so the copies into it do not page-fault."""

    def __init__(self, nbytes: int, pinned: bool = False):
        self.pool = ThreadPoolExecutor(1)
        if pinned:
            self.future = self.pool.submit(lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
        else:  # and the staging memory the copies into it go through (HostCopies), small enough to lock meanwhile
            self.future = self.pool.submit(lambda: (staging_buffer(), torch.zeros(nbytes, dtype=torch.uint8))[1])

    def take(self) -> torch.Tensor:
        self.pool.shutdown(wait=False)
        return self.future.result()


class HostCopies:
    """Pack tensors computed on an accelerator -> host memory, each layer's while the next one computes.

    Without an arena a worker thread copies into ordinary memory (page faults bound it: 1.5 GB/s on the H200
    machine, against 2.8 GB/s to page-lock and 55 GB/s to copy into locked memory, benchmarks/gpu_micro.py).
    With an ``arena`` (``HostArena``) a finished layer's tensors go into views of it, on a side
    stream that waits only for that layer's work: DMA copies issued from this thread when it is page-locked;
    when it is ordinary memory already faulted in, DMA copies into a half of the page-locked ``staging`` memory
    (:func:`staging_buffer`) that the worker thread then copies into the arena, or, what does not fit a half, the
    worker thread copies straight from the device (a pageable copy blocks its caller).  On the CPU it does nothing.
    """

    def __init__(self, device: torch.device, arena: torch.Tensor | None = None, staging: torch.Tensor | None = None):
        self.on = device.type == "cuda"
        self.done: set[str] = set()
        self.jobs = []
        self.arena, self.off = arena, 0
        self.pending: list[tuple[int, object]] = []  # (device bytes, what finishes them: an event or a job) in order
        if self.on:
            self.stream = torch.cuda.Stream(device)
            self.pool = ThreadPoolExecutor(1)
            pageable = arena is not None and not arena.is_pinned()
            self.staging = (staging if staging is not None else staging_buffer()) if pageable else None
            self.halves: list = [None, None]  # the worker's job that last read each half of the staging memory
            self.turn = 0

    def _slot(self, t: torch.Tensor) -> torch.Tensor | None:
        if self.arena is None:
            return None
        nb = t.numel() * t.element_size()
        o = (self.off + 63) // 64 * 64
        if o + nb > self.arena.numel():
            return None
        self.off = o + nb
        return self.arena[o : o + nb].view(t.dtype).view(t.shape)

    def submit(self, out: dict[str, torch.Tensor]):
        """Start the copies of ``out``'s device tensors; returns a callable that waits for them and gives ``out`` on
        the host (what the pipelined ingest writes into the pack as compress goes, sekv/compress.py)."""
        if not self.on:
            return lambda: dict(out)
        todo = {k: t for k, t in out.items() if k not in self.done and t.device.type != "cpu"}
        self.done.update(todo)
        ev = torch.cuda.Event()
        ev.record()
        rest = {}
        pinned = self.arena is not None and self.arena.is_pinned()
        slots = {}
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ev)
            got = {}
            for k, t in todo.items():
                t = t.contiguous()
                dst = self._slot(t)
                if dst is None:
                    rest[k] = t
                elif pinned:
                    dst.copy_(t, non_blocking=True)
                    t.record_stream(self.stream)
                    got[k] = dst
                else:
                    slots[k] = (dst, t)
            staged = self._stage(slots)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.jobs.append(got)
        nbytes = sum(t.numel() * t.element_size() for t in todo.values())
        cpu = {k: t for k, t in out.items() if t.device.type == "cpu"}
        job = None
        if rest or slots:

            def work():
                # the thread's own grad mode is not the caller's: in inference mode here, an arena or staging memory
                # made in inference mode (an inference tensor) takes the in-place copies too
                with torch.inference_mode():
                    if staged:  # the DMA into the staging half is done: a host memcpy into the arena
                        done.synchronize()
                        host = {k: dst.copy_(src) for k, (dst, src) in staged.items()}
                        with torch.cuda.stream(self.stream):
                            return host | {k: t.to("cpu") for k, t in rest.items()}
                    with torch.cuda.stream(self.stream):
                        host = {k: dst.copy_(t) for k, (dst, t) in slots.items()}
                        return host | {k: t.to("cpu") for k, t in rest.items()}

            job = self.pool.submit(work)
            if staged:
                self.halves[self.turn ^ 1] = job  # _stage flipped the turn: this job reads the half it filled
            self.jobs.append(job)
            self.pending.append((nbytes, job))
        else:
            self.pending.append((nbytes, done))

        def result() -> dict[str, torch.Tensor]:
            done.synchronize()
            return cpu | got | (job.result() if job is not None else {})

        return result

    def _stage(self, slots: dict) -> dict:
        """On the side stream: DMA ``slots``' device tensors ({name: (arena view, device tensor)}) into the next half of
        the staging memory, once the worker has copied that half's previous contents on -> {name: (arena view, staged
        view)}; {} (the direct copies) when there is no staging memory or they do not fit a half."""
        if not slots or self.staging is None:
            return {}
        half = self.staging.numel() // 2
        where, o = {}, 0
        for k, (dst, t) in slots.items():
            o = (o + 63) // 64 * 64
            where[k] = o
            o += t.numel() * t.element_size()
        if o > half:
            return {}
        prev = self.halves[self.turn]
        if prev is not None:
            prev.result()  # that half's bytes are in the arena: it may be written again
        base = self.turn * half
        out = {}
        for k, (dst, t) in slots.items():
            a = base + where[k]
            src = self.staging[a : a + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            src.copy_(t, non_blocking=True)
            t.record_stream(self.stream)
            out[k] = (dst, src)
        self.turn ^= 1
        return out

    def wait(self, limit: int | None) -> None:
        """Block until the device tensors still on their way to the host take ``limit`` bytes at most (None: never
        block): what bounds compress's results on the device when they are made faster than they travel."""
        if not self.on or limit is None:
            return
        while self.pending and sum(b for b, _ in self.pending) > limit:
            _, w = self.pending.pop(0)
            w.synchronize() if isinstance(w, torch.cuda.Event) else w.result()

    def finish(self, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not self.on:
            return out
        self.submit(out)
        host = dict(out)
        for j in self.jobs:
            host.update(j if isinstance(j, dict) else j.result())
        self.stream.synchronize()
        self.pool.shutdown()
        return host


def to_host(out: dict[str, torch.Tensor], copies: "HostCopies | None" = None) -> dict[str, torch.Tensor]:
    """Pack tensors -> host memory (what ``copies`` has not moved yet, then everything it moved)."""
    if copies is None:
        copies = HostCopies(next((t.device for t in out.values() if t.device.type != "cpu"), torch.device("cpu")))
    return copies.finish(out)
