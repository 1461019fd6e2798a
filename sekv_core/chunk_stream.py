"""Pack tensors made a layer's prefill rows at a time and written while the prefill runs (sekv_core/ingest.py's
pipelined ingest).

A layer's K / V of a chunk's tokens are final once that layer has attended them (causal attention): the forward's
later layers and chunks change them no more.  A stream places its tensors in the pack before the prefill
(pack.PackWriter.reserve: [Hkv, N, ...] each, N the document's tokens), makes each layer's rows of each chunk on the
prefill's device as soon as that layer has appended them (``layer_rows``: a subclass's arithmetic), and hands them
to the pack's writer thread, which copies them to the host (CUDA: into page-locked staging memory on a stream of its
own, once the kernels that made them are done) and writes each tensor's rows of each KV head where they belong; the
forward goes on meanwhile.  So a document prefilled in one forward (prefill.default_chunk on a GPU) is written while
it runs all the same.  Subclasses: sekv's zoom tier (sekv/zoom_tier.py TierStream), full KV (methods/full.py
FullStream).

Called as the prefill's ``on_rows(layer, a, b, rows)`` (:meth:`ChunkStream.layer`): global tokens [a, b) of one
layer, each layer's in token order, ``rows()`` -> (post-RoPE keys, values) [Hkv, b - a, d] at global positions.
"""

from __future__ import annotations

import torch

from .pack import _raw_bytes


class ChunkStream:
    def __init__(self, shape, n_tokens: int):
        self.shape, self.n = shape, int(n_tokens)
        self.writer = None
        self.covered = [0] * shape.n_layers  # each layer's tokens made so far (in order)
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
        """Tokens [a, b) of every layer at once (``rows(layer)``)."""
        for li in range(self.shape.n_layers):
            self.layer(li, a, b, lambda li=li: rows(li))

    def layer(self, li: int, a: int, b: int, rows) -> None:
        """Layer li's tokens [a, b) (``rows()`` -> its keys, values), made and handed to the writer."""
        if b <= a:
            return
        if a != self.covered[li] or b > self.n:
            raise ValueError(f"a prefill stream got layer {li}'s tokens [{a}, {b}) after [0, {self.covered[li]}) of {self.n}")
        self.covered[li] = b
        k, v = rows()
        made = self.layer_rows(li, k, v, a, b)
        del k, v
        if not made:
            return
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
        if any(c != self.n for c in self.covered):
            raise ValueError(f"a prefill stream covered {min(self.covered)} of {self.n} tokens")
        for name, t in self.finish_tensors().items():
            self.writer.put(name, t)
