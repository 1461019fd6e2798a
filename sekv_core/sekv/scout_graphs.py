"""The scout's scoring chunks replayed as one captured CUDA graph per layer (long contexts).

At long contexts the scout's scoring (sekv/gpu_step.py ``BatchedStep.scout_masses``) works through each layer's
(group, span) pairs a chunk at a time (the chunk's float32 work tensors near SCOUT_CHUNK_BYTES): the 8B shape at
128K makes ~15 chunks a layer, ~480 in all, of ~30 small launches each, and the host's launching, not the device,
took its time.  Every full chunk of a layer has the same shapes and reads the same tensors (the question's queries,
the pass's tables); only the chunk's first pair and its block rows change.  So each layer's full chunks are one
graph, captured at its first full chunk, that reads the chunk's first pair from a device scalar and its rows from a
fixed buffer, and replayed for each of them: a chunk is then four launches (the scalar, the rows' copy, the replay,
the result's copy) and a layer's capture about one eager chunk's launches.  The pass's very first full chunk runs
eagerly on the captures' stream (its set-up there: cuBLAS's workspace, the kernels' first loads).  A chunk's values
are the eager chunk's exactly (the same kernels on the same shapes; the pair ids computed on the device are the same
integers).  The last, shorter chunk of a layer runs eagerly.  The graphs share one memory pool and a layer's graph is
dropped before the next is captured: the pass holds one chunk's work tensors in the pool (and, reserved by the
allocator, those of the eager chunks and the captures' stream's warm-up).

On the CPU (tests, ``force``) the same fixed-input body runs eagerly for every chunk.  A capture that fails turns
the graphs off for the process (CAPTURE) and the chunk runs eagerly.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

#: capture the scout's scoring chunks on CUDA (set False by a failed capture).  Off by default: their CUDA test
#: (tests/test_ttft.py, graphed masses against the eager chunks') failed on the H200, so until it passes there the
#: scoring runs eagerly
CAPTURE = False

#: a layer's full chunks below which no graph is captured (a capture costs about one eager chunk's launches)
MIN_CHUNKS = 4


_SIDE: dict = {}


def _side_stream(device: torch.device):
    """The captures' stream of a device, one a thread (cuBLAS sets up its workspace once a stream; the blocks' thread
    may capture its rehearsal's chunks while a question captures its own)."""
    key = (device, threading.get_ident())
    if key not in _SIDE:
        _SIDE[key] = torch.cuda.Stream(device)
    return _SIDE[key]


class ChunkGraphs:
    """Replays of one layer's full scoring chunks (``pairs`` pairs each) of a pass.  ``run(layer, a, rows, body)``
    gives chunk a..a+pairs-1's result or None (the caller runs the chunk eagerly: the layer's warm-up chunk, or no
    graph).  ``body(g, i, rows)`` computes a chunk from each pair's group g and span i ([pairs] long) and its rows
    ([pairs, stride] int64) and returns one tensor."""

    def __init__(self, device, pairs: int, n_spans: int, full_chunks: int, force: bool = False):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.on = (force or (self.cuda and CAPTURE)) and full_chunks >= MIN_CHUNKS
        self.pairs, self.S = pairs, n_spans
        self.layer: int | None = None
        self.graph = None
        self.out: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None
        self.body: Callable | None = None
        self.replays = 0  # chunks given by a replay (or, on the CPU, by the fixed-input body)
        self.warm = False
        if self.on:
            self.base = torch.arange(pairs, device=self.device)
            self.at = torch.zeros((), dtype=torch.long, device=self.device)  # the chunk's first pair
            self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
            self.side = _side_stream(self.device) if self.cuda else None

    def fits(self, layers: list[int], a: int, e: int) -> bool:
        return self.on and len(layers) == 1 and e - a == self.pairs

    def run(self, layer: int, a: int, rows: torch.Tensor, body: Callable) -> torch.Tensor | None:
        if layer != self.layer:  # a new layer: its graph is captured at its first full chunk
            self.drop()
            self.layer = layer
            self.rows = torch.empty_like(rows)
        self.at.fill_(a)
        self.rows.copy_(rows)
        if not self.warm:  # the pass's first full chunk: eager on the capture's stream (its set-up: cuBLAS's workspace)
            self.warm = True
            return self._on_side(lambda: self._fixed(body)) if self.cuda else self._fixed(body)
        if not self.cuda:
            self.replays += 1
            return self._fixed(body)
        if self.graph is None and not self._capture(body):
            return None
        self.graph.replay()
        self.replays += 1
        return self.out.clone()

    def _on_side(self, fn: Callable) -> torch.Tensor:
        cur = torch.cuda.current_stream(self.device)
        self.side.wait_stream(cur)
        with torch.cuda.stream(self.side):
            out = fn()
        cur.wait_stream(self.side)
        out.record_stream(cur)
        return out

    def _fixed(self, body: Callable) -> torch.Tensor:
        """The chunk from the fixed inputs: the pair ids from the device scalar, the rows from the fixed buffer."""
        pair = self.base + self.at
        return body(pair // self.S, pair % self.S, self.rows)

    def _capture(self, body: Callable) -> bool:
        global CAPTURE
        cur = torch.cuda.current_stream(self.device)
        self.side.wait_stream(cur)  # the fixed inputs' writes first
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(self.side):
                # thread_local: other threads' CUDA calls meanwhile (page-locking, the zoom tier's copies) do not
                # invalidate it (sekv_core/graphed_step.py)
                g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    self.out = self._fixed(body)
                finally:
                    g.capture_end()
        except Exception:  # noqa: BLE001 - the chunks run eagerly, as without graphs
            CAPTURE = self.on = False
            self.out = None
            cur.wait_stream(self.side)
            return False
        cur.wait_stream(self.side)
        self.graph = g
        return True

    def drop(self) -> None:
        """The layer's graph, its result and its rows' buffer let go (before the next layer's capture)."""
        self.graph = self.out = self.rows = None
        self.layer = None
