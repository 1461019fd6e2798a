"""Pack tensors made a prefill chunk at a time and written while the prefill runs (sekv_core/ingest.py's pipelined
ingest).

A chunk's tokens' K / V are final once the chunk has passed every layer (causal attention).  A stream places its
tensors in the pack before the prefill (pack.PackWriter.reserve: [Hkv, N, ...] each, N the document's tokens), makes
their rows of each chunk on the prefill's device as the chunk completes (``rows_of``: a subclass's arithmetic), and
hands them to the pack's writer thread, which copies them to the host (CUDA: into page-locked staging memory on a
stream of its own, once the kernels that made them are done) and writes each tensor's rows of each KV head where
they belong.  Subclasses: sekv's zoom tier (sekv/zoom_tier.py TierStream), full KV (methods/full.py FullStream).

Called as the prefill's ``on_chunk(a, b, rows)``: global tokens [a, b) in order, ``rows(layer)`` -> (post-RoPE
keys, values) [Hkv, b - a, d] at global positions.
"""

from __future__ import annotations

import torch

from .pack import _raw_bytes


class ChunkStream:
    def __init__(self, shape, n_tokens: int):
        self.shape, self.n = shape, int(n_tokens)
        self.writer = None
        self.covered = 0  # tokens made so far (in order)
        self.staging = None  # page-locked host memory the device's rows are copied into (CUDA), reused chunk after chunk
        self.side = None
        self.bytes = 0  # bytes handed to the writer

    # -- what a subclass says -------------------------------------------------------------------------------------

    def tensors(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """The stream's pack tensors: name -> (dtype, shape), shape [Hkv, N, ...]."""
        raise NotImplementedError

    def layer_rows(self, li: int, k: torch.Tensor, v: torch.Tensor, a: int, b: int) -> list[tuple[str, torch.Tensor]]:
        """Layer li's rows of tokens [a, b): [(tensor name, rows [Hkv, b - a, ...])] on k's device."""
        raise NotImplementedError

    def finish_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors to append after the prefill (host)."""
        return {}

    # -- the stream -----------------------------------------------------------------------------------------------

    def start(self, writer) -> None:
        """Place the stream's tensors in the pack (pack.PackWriter.reserve)."""
        self.writer = writer
        for name, (dt, shape) in self.tensors().items():
            writer.reserve(name, dt, shape)

    def __call__(self, a: int, b: int, rows) -> None:
        if b <= a:
            return
        if a != self.covered or b > self.n:
            raise ValueError(f"a prefill stream got tokens [{a}, {b}) after [0, {self.covered}) of {self.n}")
        self.covered = b
        made = []
        for li in range(self.shape.n_layers):
            k, v = rows(li)
            made += self.layer_rows(li, k, v, a, b)
        dev = made[0][1].device
        nbytes = sum(t.numel() * t.element_size() for _, t in made)
        self.bytes += nbytes
        event = None
        if dev.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self.writer.submit(lambda: self._pieces(made, a, b, event), nbytes, reused=dev.type == "cuda")

    def _pieces(self, made, a: int, b: int, event):
        """On the writer thread: the chunk's rows on the host -> the pack pieces, one per tensor and KV head."""
        host = [t for _, t in made]
        if event is not None:
            total = sum(t.numel() * t.element_size() for t in host)
            if self.staging is None or self.staging.numel() < total:
                self.staging = torch.empty(total, dtype=torch.uint8, pin_memory=True)
                self.side = self.side or torch.cuda.Stream(device=host[0].device)
            self.side.wait_event(event)
            outs, o = [], 0
            with torch.cuda.stream(self.side):
                for t in host:
                    nb = t.numel() * t.element_size()
                    dst = self.staging[o : o + nb].view(t.dtype).view(t.shape)
                    dst.copy_(t, non_blocking=True)
                    outs.append(dst)
                    o += nb
            self.side.synchronize()
            host = outs
        pieces = []
        for (name, _), t in zip(made, host):
            t = t.contiguous()
            row = t[0].numel() // max(b - a, 1) * t.element_size()  # bytes a token of one head
            for h in range(t.shape[0]):
                pieces.append((name, (h * self.n + a) * row, _raw_bytes(t[h])))
        made.clear()  # the device rows go (after their copy)
        return pieces

    def finish(self) -> None:
        """After the prefill: every token covered; the tensors made after it appended."""
        if self.covered != self.n:
            raise ValueError(f"a prefill stream covered {self.covered} of {self.n} tokens")
        for name, t in self.finish_tensors().items():
            self.writer.put(name, t)
