"""The one interface every cache method implements.

A cache method has two halves:

* ``compress(prefill, params)`` runs once at ingest.  It receives the document's
  full KV cache (and the prefill's surprisal) and returns the tensors to store in
  the pack plus the parameters it used.
* ``open(store, params, device)`` runs at ask time.  It receives a lazy view of
  the pack's tensors and returns a :class:`KVMemory`, the runtime object the
  attention hook (``sekv_core.runtime``) calls for every layer of every forward.

Budgets are fractions of the full KV cache's bytes, counted on the *peak
GPU-resident KV* of a decoding step, the same accounting for every method.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import torch
import torch.nn.functional as F


@dataclass
class ModelShape:
    """The attention shape a memory needs to know."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    rope_theta: float = 10000.0
    #: the rotary embedding the model applies to keys, rope scaling included: inverse frequencies
    #: [head_dim/2] and the cos/sin factor; None where it is not static (dynamic / longrope / partial)
    rope_inv_freq: tuple[float, ...] | None = None
    rope_attention_scaling: float = 1.0

    @classmethod
    def of(cls, config, dtype: torch.dtype) -> "ModelShape":
        hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rope = getattr(config, "rope_theta", None)
        if rope is None:
            rp = getattr(config, "rope_parameters", None) or {}
            rope = rp.get("rope_theta", 10000.0) if isinstance(rp, dict) else 10000.0
        inv_freq, scaling = _static_rope(config, hd, float(rope))
        return cls(config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, hd, dtype, float(rope), inv_freq, scaling)

    def kv_bytes_per_token(self, itemsize: int | None = None) -> int:
        itemsize = itemsize or torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * itemsize


def _static_rope(config, head_dim: int, theta: float) -> tuple[tuple[float, ...] | None, float]:
    """(inv_freq, attention_scaling) exactly as the model's rotary module computes them, or (None, 1.0)."""
    try:
        rp = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        rtype = (rp.get("rope_type") or rp.get("type") or "default") if isinstance(rp, dict) else "default"
        if rtype == "default":
            inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
            scaling = 1.0
        elif rtype in ("dynamic", "longrope"):  # inv_freq depends on the sequence length
            return None, 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv, scaling = ROPE_INIT_FUNCTIONS[rtype](config)
        if inv.numel() * 2 != head_dim:  # partial rotary
            return None, 1.0
        return tuple(float(x) for x in inv.float().tolist()), float(scaling)
    except Exception:
        return None, 1.0


@dataclass
class PrefillResult:
    """The document's full KV cache after one prefill, as a cache method sees it."""

    token_ids: torch.Tensor  # [N] int64
    keys: list[torch.Tensor]  # per layer [Hkv, N, d], post-RoPE, model dtype
    values: list[torch.Tensor]  # per layer [Hkv, N, d]
    surprisal: torch.Tensor | None  # [N] float32, s_0 = 0 (first token has no prediction)
    shape: ModelShape
    #: prefill statistics a method asked for through CacheMethod.needs_scores (see methods/scores.py)
    scores: dict[str, Any] = field(default_factory=dict)
    #: fingerprint of the model that made the prefill (sekv_core.models), "" when unknown
    model_fingerprint: str = ""
    #: the model's id (an embedded model's name, or a path), "" when unknown
    model_id: str = ""

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.numel())


@dataclass
class StepStats:
    """What a memory reports about the last forward (for live display and --json)."""

    resident_bytes: int = 0  # peak compute-device KV bytes of the last step
    extra: dict[str, Any] = field(default_factory=dict)


class KVMemory(ABC):
    """Runtime KV memory for one pack: attends over what it holds plus new tokens."""

    shape: ModelShape

    @abstractmethod
    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
        """See ``sekv_core.runtime.Memory.attend``."""

    @abstractmethod
    def n_tokens(self) -> int:
        """Tokens the memory stands for (document + appended), i.e. the next position."""

    @abstractmethod
    def truncate(self, n_tokens: int) -> None:
        """Forget tokens appended after position n_tokens (back to the pack's state)."""

    @abstractmethod
    def resident_bytes(self) -> int:
        """KV bytes held on the compute device right now."""

    def full_bytes(self) -> int:
        """Bytes the full KV cache of n_tokens() tokens would take in the model dtype."""
        return self.n_tokens() * self.shape.kv_bytes_per_token()

    def step_stats(self) -> StepStats:
        return StepStats(resident_bytes=self.resident_bytes())

    def prepare_question(self, forward: Callable[[], Any]) -> None:
        """Called once per answer, before its first forward; forward() runs the question's tokens through the
        model over this memory (a memory may look at them first, then must drop them).  Default: nothing."""

    def begin_step(self, n_new: int) -> None:
        """Called before each forward of n_new tokens."""

    def end_step(self) -> None:
        """Called after each forward."""


class GrowingKV:
    """Preallocated per-layer K/V buffers that new tokens are appended to.

    Used for the full cache and for every method's full-resolution tail (the
    question and generated tokens).  Capacity grows by doubling.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype, device, capacity: int = 256):
        self.k = [torch.empty(1, n_kv_heads, capacity, head_dim, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.empty_like(t) for t in self.k]
        self.len = [0] * n_layers

    @classmethod
    def from_tensors(cls, keys: list[torch.Tensor], values: list[torch.Tensor], device, extra: int = 256) -> "GrowingKV":
        hkv, n, d = keys[0].shape
        g = cls(len(keys), hkv, d, keys[0].dtype, device, capacity=n + extra)
        for i, (k, v) in enumerate(zip(keys, values)):
            g.k[i][0, :, :n].copy_(k)
            g.v[i][0, :, :n].copy_(v)
            g.len[i] = n
        return g

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, q = self.len[layer], key.shape[-2]
        if n + q > self.k[layer].shape[-2]:
            cap = max(2 * self.k[layer].shape[-2], n + q)
            for buf in (self.k, self.v):
                new = buf[layer].new_empty(*buf[layer].shape[:2], cap, buf[layer].shape[-1])
                new[:, :, :n] = buf[layer][:, :, :n]
                buf[layer] = new
        self.k[layer][:, :, n : n + q] = key
        self.v[layer][:, :, n : n + q] = value
        self.len[layer] = n + q
        return self.k[layer][:, :, : n + q], self.v[layer][:, :, : n + q]

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.len[layer]
        return self.k[layer][:, :, :n], self.v[layer][:, :, :n]

    def truncate(self, n: int) -> None:
        self.len = [min(x, n) for x in self.len]

    def nbytes(self) -> int:
        """Bytes in use (not capacity)."""
        per = self.k[0].shape[1] * self.k[0].shape[3] * self.k[0].element_size() * 2
        return sum(self.len) * per


def causal_attention(query, keys, values, scaling: float, n_new: int) -> torch.Tensor:
    """Attention of n_new queries over keys whose last n_new entries are the queries' own tokens.

    query [B,H,q,d]; keys/values [B,Hkv,T,d] with T >= q.  Earlier keys are all
    visible; the new block is causal.
    """
    q, t = query.shape[-2], keys.shape[-2]
    mask = None
    gqa = keys.shape[1] != query.shape[1]
    if q > 1 and q == t:  # a whole sequence at once: the fused causal kernels (flash), no mask tensor
        return F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scaling, enable_gqa=gqa)
    if q > 1:
        mask = torch.ones(q, t, dtype=torch.bool, device=query.device).tril(diagonal=t - q)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=gqa)


class CacheMethod(ABC):
    """A registered cache method: how a document's KV cache is stored and attended."""

    name: str = ""
    summary: str = ""
    needs_surprisal: bool = False
    #: prefill statistics compress() reads from PrefillResult.scores: any of "obs_queries",
    #: "attn_mass", "token_text" (captured by sekv_core.methods.scores during the one prefill)
    needs_scores: tuple[str, ...] = ()
    default_params: Mapping[str, Any] = {}
    #: parameters that may be changed at ask time without re-ingesting
    ask_time_params: tuple[str, ...] = ()

    def resolve_params(self, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
        params = dict(self.default_params)
        for k, v in (overrides or {}).items():
            if v is None:
                continue
            if k not in params:
                from ..errors import SekvError

                raise SekvError(f"method '{self.name}' has no parameter '{k}' (it has: {', '.join(params) or 'none'})")
            params[k] = type(params[k])(v) if params[k] is not None else v
        return params

    def obs_window(self, params: dict[str, Any]) -> int:
        """Document tokens whose queries the prefill records when ``needs_scores`` has "obs_queries"."""
        return int(params.get("window", 64))

    def reserve_host(self, n_tokens: int, shape: ModelShape, params: dict[str, Any]) -> None:
        """Called before the prefill of an n_tokens document on an accelerator: a method whose compress()
        moves large results to the host may prepare that memory meanwhile (sekv does).  Default: nothing."""

    @abstractmethod
    def compress(self, prefill: PrefillResult, params: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Tensors to store in the pack (CPU tensors)."""

    @abstractmethod
    def open(self, store: "TensorStore", params: dict[str, Any], shape: ModelShape, device) -> KVMemory:
        """Build the runtime memory from the pack's tensors."""

    def describe(self, store: "TensorStore", params: dict[str, Any]) -> dict[str, Any]:
        """Method-specific statistics for `sekv inspect`."""
        return {}


class TensorStore(Protocol):
    """A lazy mapping name -> CPU tensor (a pack's safetensors, memory-mapped)."""

    def keys(self) -> list[str]: ...

    def get(self, name: str) -> torch.Tensor: ...


class DictStore:
    """A TensorStore over a plain dict: what compress() returned, used without writing a pack file."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self._t = tensors

    def keys(self) -> list[str]:
        return list(self._t)

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._t[name]
        except KeyError:
            from ..errors import SekvError

            raise SekvError(f"the method's compress() produced no tensor '{name}'") from None
