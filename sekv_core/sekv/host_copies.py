"""Pack tensors computed on an accelerator -> host memory, overlapped with the compression of the next layer."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


class HostArena:
    """Host memory for a pack's tensors, allocated in a background thread while the prefill runs.

    ``pinned``: page-locked.  Measured on the H200 (docs/gpu.md): compress halves, but page-locking holds the
    CUDA driver and the prefill grows by as much.  Otherwise ordinary memory is allocated and every page
    touched (no CUDA call), so the copies into it do not page-fault."""

    def __init__(self, nbytes: int, pinned: bool = False):
        self.pool = ThreadPoolExecutor(1)
        if pinned:
            self.future = self.pool.submit(lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
        else:
            self.future = self.pool.submit(lambda: torch.zeros(nbytes, dtype=torch.uint8))

    def take(self) -> torch.Tensor:
        self.pool.shutdown(wait=False)
        return self.future.result()


class HostCopies:
    """Pack tensors computed on an accelerator -> host memory, each layer's while the next one computes.

    Without an arena a worker thread copies into ordinary memory (page faults bound it: 1.5 GB/s on the H200
    machine, against 2.8 GB/s to page-lock and 55 GB/s to copy into locked memory, benchmarks/gpu_micro.py).
    With an ``arena`` (``HostArena``) a finished layer's tensors go into views of it, on a side
    stream that waits only for that layer's work: DMA copies issued from this thread when it is page-locked;
    when it is ordinary memory already faulted in, the worker thread copies (a pageable copy blocks its caller).
    On the CPU it does nothing.
    """

    def __init__(self, device: torch.device, arena: torch.Tensor | None = None):
        self.on = device.type == "cuda"
        self.done: set[str] = set()
        self.jobs = []
        self.arena, self.off = arena, 0
        self.pending: list[tuple[int, object]] = []  # (device bytes, what finishes them: an event or a job) in order
        if self.on:
            self.stream = torch.cuda.Stream(device)
            self.pool = ThreadPoolExecutor(1)

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
            done = torch.cuda.Event()
            done.record(self.stream)
        self.jobs.append(got)
        nbytes = sum(t.numel() * t.element_size() for t in todo.values())
        cpu = {k: t for k, t in out.items() if t.device.type == "cpu"}
        job = None
        if rest or slots:

            def work():
                with torch.cuda.stream(self.stream):
                    host = {k: dst.copy_(t) for k, (dst, t) in slots.items()}
                    return host | {k: t.to("cpu") for k, t in rest.items()}

            job = self.pool.submit(work)
            self.jobs.append(job)
            self.pending.append((nbytes, job))
        else:
            self.pending.append((nbytes, done))

        def result() -> dict[str, torch.Tensor]:
            done.synchronize()
            return cpu | got | (job.result() if job is not None else {})

        return result

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
