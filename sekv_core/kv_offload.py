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
        if d.type == "cuda":
            free = torch.cuda.mem_get_info(d)[0] + torch.cuda.memory_reserved(d) - torch.cuda.memory_allocated(d)  # + torch's cache
            if b > FIT_SHARE * free:
                return False
    return True


class HostKV(GrowingKV):
    """GrowingKV with its buffers in host memory, token-major ([capacity, Hkv, d] per layer, so a prefix is one
    contiguous block to copy); capacity fixed: the prefill's tokens.  append() returns the layer's K/V so far on the
    new tokens' device; :meth:`layers` the result."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype, devices, capacity: int):
        self.annex, self.generation, self.truncations, self.static = 0, 0, 0, False
        self.devices = per_layer(devices, n_layers)
        pin = any(d.type == "cuda" for d in self.devices)
        self.hk = [torch.empty(capacity, n_kv_heads, head_dim, dtype=dtype, pin_memory=pin) for _ in range(n_layers)]
        self.hv = [torch.empty(capacity, n_kv_heads, head_dim, dtype=dtype, pin_memory=pin) for _ in range(n_layers)]
        self.len = [0] * n_layers
        self.pos = torch.zeros(1, dtype=torch.long)

    @staticmethod
    def _past(host: torch.Tensor, n: int, like: torch.Tensor) -> torch.Tensor:
        """host[:n] on like's device as [1, Hkv, n, d]."""
        return host[:n].to(like.device, non_blocking=like.device.type != "cpu").transpose(0, 1).unsqueeze(0)

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, q = self.len[layer], key.shape[-2]
        if n + q > self.hk[layer].shape[0]:
            raise ValueError(f"HostKV holds {self.hk[layer].shape[0]} tokens; {n + q} appended")
        keys = torch.cat([self._past(self.hk[layer], n, key), key], 2)
        values = torch.cat([self._past(self.hv[layer], n, value), value], 2)
        on = key.device.type != "cpu"
        # to the host behind this layer's attention, on the same stream as the reads of later chunks
        self.hk[layer][n : n + q].copy_(key[0].transpose(0, 1).contiguous(), non_blocking=on)
        self.hv[layer][n : n + q].copy_(value[0].transpose(0, 1).contiguous(), non_blocking=on)
        self.len[layer] = n + q
        return keys, values

    def reserve(self, layer: int, n: int) -> None:
        if n > self.hk[layer].shape[0]:
            raise ValueError(f"HostKV holds {self.hk[layer].shape[0]} tokens; {n} asked for")

    def truncate(self, n: int) -> None:
        self.len = [min(x, n) for x in self.len]

    def nbytes(self) -> int:
        return 0  # nothing on the compute device between forwards

    def layers(self, n: int, device: torch.device) -> tuple["LayersOn", "LayersOn"]:
        """The first n tokens' keys and values, read a layer at a time on ``device`` as [Hkv, n, d], once the copies to
        the host are done."""
        for d in {d for d in self.devices if d.type == "cuda"}:
            torch.cuda.synchronize(d)
        head_major = lambda x: x.transpose(0, 1)  # noqa: E731 - [n, Hkv, d] -> [Hkv, n, d], on the device
        on = [device] * len(self.hk)
        return LayersOn([h[:n] for h in self.hk], on, head_major), LayersOn([h[:n] for h in self.hv], on, head_major)


class LayersOn(Sequence):
    """Per-layer tensors read on a device: item i is host[i] (in host memory, or on another device) on devices[i]
    (copied when read), after ``fn`` (a view such as a slice, applied there).  ``map(g)`` composes another view
    lazily.  What compress() gets from a prefill offloaded to the host, or from a model across devices (every layer
    on the input device, where compress runs)."""

    def __init__(self, host: list[torch.Tensor], devices: Sequence[torch.device], fn: Callable | None = None):
        self.host, self.devices, self.fn = host, list(devices), fn

    def __len__(self) -> int:
        return len(self.host)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        x = self.host[i].to(self.devices[i], non_blocking=self.host[i].device.type == "cpu" and self.devices[i].type != "cpu")
        return self.fn(x) if self.fn is not None else x

    def host_items(self) -> list[torch.Tensor]:
        """The layers as host tensors (the view applied on the host)."""
        return [self.fn(h) if self.fn is not None else h for h in self.host]

    def map(self, g: Callable) -> "LayersOn":
        f = self.fn
        return LayersOn(self.host, self.devices, g if f is None else (lambda x: g(f(x))))
