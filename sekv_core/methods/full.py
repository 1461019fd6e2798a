"""`full`: the complete KV cache, stored as is and attended exactly.

The reference every other method is measured against: answers from a `full`
pack are token-for-token those of a plain prefill of document + question.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..chunk_stream import ChunkStream
from .base import CacheMethod, GrowingKV, KVMemory, ModelShape, PrefillResult, TensorStore, causal_attention


class FullMemory(KVMemory):
    def __init__(self, kv: GrowingKV, shape: ModelShape):
        self.kv = kv
        self.shape = shape

    @classmethod
    def empty(cls, shape: ModelShape, device, capacity: int = 1024) -> "FullMemory":
        return cls(GrowingKV(shape.n_layers, shape.n_kv_heads, shape.head_dim, shape.dtype, device, capacity), shape)

    def attend(self, layer, query, key, value, scaling):
        keys, values = self.kv.append(layer, key, value)
        if self.kv.static:  # the whole capacity, masked past the new token
            mask = self.kv.static_mask()
            return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=keys.shape[1] != query.shape[1])
        return causal_attention(query, keys, values, scaling, query.shape[-2])

    def static_supported(self) -> bool:
        return True

    def static_begin(self) -> None:
        self.kv.static_begin()

    def static_key(self):
        return self.kv.static_key()

    def static_end(self) -> None:
        self.kv.advance(1)

    def static_mode(self):
        return self.kv.static_mode()

    def n_tokens(self) -> int:
        return self.kv.len[-1]

    def truncate(self, n_tokens: int) -> None:
        self.kv.truncate(n_tokens)

    def resident_bytes(self) -> int:
        return self.kv.nbytes()


class FullMethod(CacheMethod):
    name = "full"
    summary = "the complete KV cache; exact, largest"
    per_layer_devices = True

    def prefill_stream(self, params, shape: ModelShape, n_tokens: int):
        """The KV itself, a prefill chunk at a time (FullStream): compress then has nothing left to give."""
        self._stream = FullStream(shape, n_tokens)
        return self._stream, params

    def compress(self, prefill: PrefillResult, params):
        stream, self._stream = getattr(self, "_stream", None), None
        if stream is not None and stream.writer is not None and stream.writer.open:  # written while the prefill ran
            return {}
        out = {}
        keys, values = prefill.keys, prefill.values
        if hasattr(keys, "host_items"):  # a prefill offloaded to the host (sekv_core/kv_offload.py): stored from there
            keys, values = keys.host_items(), values.host_items()
        for i, (k, v) in enumerate(zip(keys, values)):
            out[f"full.k.{i}"] = k.contiguous()
            out[f"full.v.{i}"] = v.contiguous()
        return out

    def tensor_specs(self, params, shape: ModelShape, n_tokens: int) -> list:
        from ..pack import FLOATS, TensorSpec

        return [TensorSpec(f"full.{kv}.{{l}}", FLOATS, ("Hkv", "N", "d"), finite=True) for kv in "kv"]

    def open(self, store: TensorStore, params, shape: ModelShape, device) -> KVMemory:
        keys = [store.get(f"full.k.{i}").to(shape.dtype) for i in range(shape.n_layers)]
        values = [store.get(f"full.v.{i}").to(shape.dtype) for i in range(shape.n_layers)]
        return FullMemory(GrowingKV.from_tensors(keys, values, device), shape)


class FullStream(ChunkStream):
    """full's pack tensors (``full.k.l`` / ``full.v.l`` [Hkv, N, d], the prefill's post-RoPE keys and values) written
    while the prefill runs, a chunk's rows as it completes (sekv_core/chunk_stream.py): the same bytes compress()
    would give."""

    def tensors(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        s = self.shape
        return {f"full.{kv}.{li}": (s.dtype, (s.n_kv_heads, self.n, s.head_dim)) for li in range(s.n_layers) for kv in "kv"}

    def layer_rows(self, li: int, k: torch.Tensor, v: torch.Tensor, a: int, b: int) -> list[tuple[str, torch.Tensor]]:
        return [(f"full.k.{li}", k), (f"full.v.{li}", v)]
