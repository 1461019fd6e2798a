"""`sekv`: SeKV memory + zoom-in decoding (SPEC §1-2).  The stages live in sekv_core/sekv/ (docs/architecture.md)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..sekv import compress, describe, gpu_step, layout, rope, scout, zoom_tier
from ..sekv.host_copies import HostArena
from ..sekv.memory import ZoomMemory
from ..sekv.params import ABLATIONS, SekvParams
from .base import CacheMethod, KVMemory, ModelShape, PrefillResult, TensorStore


class SekvMethod(CacheMethod):
    name = "sekv"
    summary = "SeKV: anchors + coarse span means on device, per-span SVD factors on CPU, zoom-in decoding"
    params_type = SekvParams
    needs_surprisal = True
    length_policy = "windowed"
    # the document end's queries (the scout's question-independent profile), the tokens' word terms (its lexical evidence)
    needs_scores = ("obs_queries", "lex_terms")
    ablations = ABLATIONS
    #: each layer's resident KV, coarse entries and zoom buffers on its layer's device (sekv/residents.py)
    per_layer_devices = True

    def needs(self, params: SekvParams) -> tuple[str, ...]:
        """With the KVzip prior (sekv/prior.py), also the reconstruction prompts kvzip reads; with number tokens kept
        exact (sekv/numbers.py), the tokens' text."""
        return self.needs_scores + (("kvzip_prompts",) if params.prior == "kvzip" else ()) + (
            ("token_text",) if params.number_share > 0 else ())

    def obs_window(self, params: SekvParams) -> int:
        return scout.PROFILE_QUERIES

    def reserve_host(self, n_tokens: int, shape: ModelShape, params: SekvParams, pinned: bool = False) -> None:
        """Host memory for the pack of an n_tokens document, prepared while the prefill runs (sekv/host_copies.py)."""
        self._arena = HostArena(compress.host_bound(n_tokens, shape, params), pinned)
        # and what compress needs that no prefill result decides: RoPE's tables, its kernels' first use (on a GPU)
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        self._prepared = compress.Prepared(n_tokens, shape, params, dev)

    def prefill_stream(self, params: SekvParams, shape: ModelShape, n_tokens: int):
        """The zoom tier (sekv/zoom_tier.py TierStream): its rows made a prefill chunk at a time and written while the
        prefill runs; compress then makes the rest (its parameters without the tier)."""
        if params.zoom_tier == "factors":
            return None
        pre = params.key_space == "pre_rope" and rope.inv_freq_of(shape) is not None
        stream = zoom_tier.TierStream(params.zoom_tier, shape, n_tokens, layout.store_dtype(params, shape.dtype), pre)
        self._stream = stream  # compress hands its layers' final tensors to the same pack writer as it makes them
        return stream, dataclasses.replace(params, zoom_tier="factors")

    def _emit(self):
        stream, self._stream = getattr(self, "_stream", None), None
        live = stream is not None and stream.writer is not None and stream.writer.open  # not one an earlier ingest left
        return stream.writer.submit_tensors if live else None

    def compress(self, prefill: PrefillResult, params: SekvParams):
        arena, self._arena = getattr(self, "_arena", None), None
        prepared, self._prepared = getattr(self, "_prepared", None), None
        # compress_windows runs its many small tensor ops on one thread (intra-op threads cost more than they give
        # on a small CPU); the KVzip prior's model forwards keep the prefill's threads
        return compress.compress(prefill, params, arena.take() if arena is not None else None, self._emit(), prepared)

    def compress_windows(self, windows, params: SekvParams):
        arena, self._arena = getattr(self, "_arena", None), None
        prepared, self._prepared = getattr(self, "_prepared", None), None
        return compress.compress_windows(windows, params, arena.take() if arena is not None else None, self._emit(), prepared)

    def open(self, store: TensorStore, params: SekvParams, shape: ModelShape, device) -> KVMemory:
        return ZoomMemory(store, params, shape, device)

    def start_open(self, store: TensorStore, shape: ModelShape, n_tokens: int, device, params: SekvParams | None = None) -> None:
        """On an accelerator, the batched step's factor blocks, built while the model loads (sekv/gpu_step.py
        start_blocks; with the ask's params, a question's way rehearsed on one layer after them), and the zoom tier's
        check: open() takes them up instead of starting them."""
        gpu_step.start_blocks(store, shape, n_tokens, device, params)
        zoom_tier.start_check(store, shape.n_layers)  # the zoom tier's sha256s, on a thread of its own (sekv/zoom_tier.py)

    def validate(self, store: TensorStore, params: SekvParams, shape: ModelShape, n_tokens: int) -> None:
        layout.validate(store, shape, n_tokens)

    def describe(self, store: TensorStore, params: SekvParams) -> dict[str, Any]:
        return describe.describe(store, params)
