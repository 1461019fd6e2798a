"""A prefill whose KV cache lives in host memory: each chunk's keys and values go to the host as they are made.

A document's full KV may not fit beside the weights (a 70B model at 128K: 40 GiB of KV, 8 GiB free on an H200),
while the pack it becomes lives on the host anyway.  :class:`HostKV` keeps every layer's K/V in (pinned, on CUDA)
host buffers; a chunk's attention at layer l brings that layer's earlier K/V to the layer's device for the chunk
(one layer at a time, so the GPU holds one layer's KV at most) and copies the chunk's own K/V to the host, both
asynchronously on the compute stream (ordered with each other, no host sync).  :class:`LayersOn` hands the
result to a cache method's compress() one layer at a time on the device, so compress runs where the prefill ran.

``prefill(offload_kv=None)`` decides with :func:`kv_fits` (sekv_core/prefill.py).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .methods.base import GrowingKV, ModelShape, per_layer

#: a prefill's chunk when its KV is offloaded on an accelerator: every chunk re-reads the earlier KV from the host,
#: so fewer, longer chunks move less (at 128K: 8K chunks move 1/8 of what 1K chunks do)
OFFLOAD_CHUNK = 8192
#: the share of a device's free memory the KV of its layers may take before the prefill offloads it
FIT_SHARE = 0.6


def kv_fits(shape: ModelShape, n_tokens: int, devices: Sequence[torch.device]) -> bool:
    """Whether the full KV of n_tokens fits on the layers' devices beside the prefill's activations (CPU: always)."""
    per_layer_bytes = n_tokens * shape.kv_bytes_per_token() // max(shape.n_layers, 1)
    need: dict[torch.device, int] = {}
    for d in devices:
        need[d] = need.get(d, 0) + per_layer_bytes
    for d, b in need.items():
        if d.type == "cuda" and b > FIT_SHARE * torch.cuda.mem_get_info(d)[0]:
            return False
    return True


class HostKV(GrowingKV):
    """GrowingKV with its buffers in host memory (capacity fixed: the prefill's tokens); append() returns the layer's
    K/V so far on the new tokens' device."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype, devices, capacity: int):
        self.annex, self.generation, self.truncations, self.static = 0, 0, 0, False
        self.devices = per_layer(devices, n_layers)
        pin = any(d.type == "cuda" for d in self.devices)
        self.jk = [torch.empty(1, n_kv_heads, capacity, head_dim, dtype=dtype, pin_memory=pin) for _ in range(n_layers)]
        self.jv = [torch.empty(t.shape, dtype=dtype, pin_memory=pin) for t in self.jk]
        self.k, self.v = list(self.jk), list(self.jv)
        self.len = [0] * n_layers
        self.pos = torch.zeros(1, dtype=torch.long)

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, q = self.len[layer], key.shape[-2]
        if n + q > self.k[layer].shape[-2]:
            raise ValueError(f"HostKV holds {self.k[layer].shape[-2]} tokens; {n + q} appended")
        on = key.device.type != "cpu"
        keys = torch.cat([self.k[layer][:, :, :n].to(key.device, non_blocking=on), key], 2)
        values = torch.cat([self.v[layer][:, :, :n].to(value.device, non_blocking=on), value], 2)
        self.k[layer][:, :, n : n + q].copy_(key, non_blocking=on)  # to the host behind this layer's attention
        self.v[layer][:, :, n : n + q].copy_(value, non_blocking=on)
        self.len[layer] = n + q
        return keys, values

    def reserve(self, layer: int, n: int) -> None:
        if n > self.k[layer].shape[-2]:
            raise ValueError(f"HostKV holds {self.k[layer].shape[-2]} tokens; {n} asked for")

    def finish(self) -> None:
        """Wait for the copies to the host (before the host reads them)."""
        for d in {d for d in self.devices if d.type == "cuda"}:
            torch.cuda.synchronize(d)


class LayersOn(Sequence):
    """Per-layer host tensors read as device tensors: item i is host[i] on devices[i] (copied when read), after
    ``fn`` (a view such as a slice, applied on the device).  ``map(g)`` composes another view lazily."""

    def __init__(self, host: list[torch.Tensor], devices: Sequence[torch.device], fn: Callable | None = None):
        self.host, self.devices, self.fn = host, list(devices), fn

    def __len__(self) -> int:
        return len(self.host)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        x = self.host[i].to(self.devices[i], non_blocking=self.devices[i].type != "cpu")
        return self.fn(x) if self.fn is not None else x

    def map(self, g: Callable) -> "LayersOn":
        f = self.fn
        return LayersOn(self.host, self.devices, g if f is None else (lambda x: g(f(x))))
