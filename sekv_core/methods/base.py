"""The one interface every cache method implements.

A cache method has two halves:

* ``compress(prefill, params)`` runs once at ingest.  It receives the document's
  full KV cache (and the prefill's surprisal) and returns the tensors to store in
  the pack (its parameters, a frozen dataclass, go into the manifest as JSON).
* ``open(store, params, device)`` runs at ask time.  It receives a lazy view of
  the pack's tensors and returns a :class:`KVMemory`, the runtime object the
  attention hook (``sekv_core.runtime``) calls for every layer of every forward.

Budgets are fractions of the full KV cache's bytes, counted on the *peak
GPU-resident KV* of a decoding step, the same accounting for every method.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Mapping, Protocol

import torch
import torch.nn.functional as F

from .params import Params


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
    #: the positions the model addresses (sekv_core.models.context_window: YaRN included), 0 when unknown
    context_window: int = 0

    @classmethod
    def of(cls, config, dtype: torch.dtype) -> "ModelShape":
        hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rope = getattr(config, "rope_theta", None)
        if rope is None:
            rp = getattr(config, "rope_parameters", None) or {}
            rope = rp.get("rope_theta", 10000.0) if isinstance(rp, dict) else 10000.0
        inv_freq, scaling = _static_rope(config, hd, float(rope))
        from ..models import context_window

        return cls(config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, hd, dtype, float(rope), inv_freq, scaling,
                   context_window(config))

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
    #: the model that made the prefill (a method that reruns it at compress time reads it: kvzip), None when unknown
    model: Any = field(default=None, repr=False, compare=False)
    #: windowed ingest (sekv_core/windows.py): the global index of token 0 of this window's kept part, and the
    #: whole document's token count (0: this prefill is the whole document)
    start: int = 0
    doc_tokens: int = 0

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.numel())

    @classmethod
    def without_kv(cls, token_ids: torch.Tensor, shape: "ModelShape", scores: dict[str, Any], lm) -> "PrefillResult":
        """A document's tokens and text statistics with no KV, for a method that prefills nothing at ingest (rag)."""
        return cls(token_ids, [], [], None, shape, scores=dict(scores), model_fingerprint=lm.fingerprint, model_id=lm.model_id, model=lm.model)


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

    #: the device of each layer's KV, when the memory was opened for a model placed across devices (Session.open):
    #: the attention hook (sekv_core/runtime.py) hands a layer's new tokens to its device and the output back;
    #: None: every layer's tensors are where its queries are
    layer_devices: list | None = None

    def window_tokens(self) -> int:
        """Positions the memory occupies before the question, which the model's window must hold with the question
        and the answer: n_tokens(); a memory that lays out less than its document (rag) says how many at most."""
        return self.n_tokens()

    def full_bytes(self) -> int:
        """Bytes the full KV cache of n_tokens() tokens would take in the model dtype."""
        return self.n_tokens() * self.shape.kv_bytes_per_token()

    def step_stats(self) -> StepStats:
        return StepStats(resident_bytes=self.resident_bytes())

    def resident_now(self) -> int:
        """``step_stats().resident_bytes`` alone: generate() reads it after every step, so a memory whose full
        stats cost device->host copies answers it without them."""
        return self.step_stats().resident_bytes

    def prepare_question(self, forward: Callable[[], Any], question: str | None = None) -> None:
        """Called once per answer, before its first forward; forward() runs the question's tokens through the
        model over this memory (a memory may look at them first, then must drop them), forward(ids) other tokens
        [1, n] at the memory's next position (they stay, as any forward's do); question: its text, when the caller
        has it.  Default: nothing."""

    def place_in_window(self, window: int, reserve: int) -> None:
        """Called before an ask that appends up to ``reserve`` tokens to a model of ``window`` positions: a memory that
        can lay its document out inside the window (sekv: re-positioned attention, sekv/positions.py) does so when the
        document and the reserve do not fit; n_tokens() is then the question's position.  Default: nothing (the
        document must fit: sekv_core/reach.py)."""

    def restrict(self, ranges: list[tuple[int, int]] | None) -> bool:
        """Limit what the memory zooms into or retrieves to the token ranges [start, end) (some of a pack's documents:
        ``--doc``; None: everything again), for the asks that follow.  False where the memory cannot (it attends to
        its whole document as it is).  Default: cannot."""
        return ranges is None

    def begin_step(self, n_new: int) -> None:
        """Called before each forward of n_new tokens."""

    def end_step(self) -> None:
        """Called after each forward."""

    # -- single-token steps replayed from one captured CUDA graph (sekv_core/graphed_step.py) ------------------

    def static_supported(self) -> bool:
        """Whether single-token steps can run in static mode (and so be captured as one CUDA graph)."""
        return False

    def static_begin(self) -> None:
        """Host side of a static single-token step, before it runs: bookkeeping, capacity for the new token,
        device scalars (where it is written, what is visible)."""
        raise NotImplementedError

    def static_key(self) -> Hashable:
        """What a step captured now would have fixed (buffers, sizes, host-side decisions): a captured step
        stays valid while this is unchanged.  No side effects."""
        raise NotImplementedError

    def static_end(self) -> None:
        """Host side after a static step ran (the new token is in; host counters move on)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def static_mode(self):
        """While active, attend() handles one new token with device-side positions only (capturable)."""
        raise NotImplementedError
        yield


class GrowingKV:
    """Preallocated per-layer K/V buffers that new tokens are appended to.

    Used for the full cache and for every method's full-resolution tail (the
    question and generated tokens).  Capacity grows by doubling.

    An *annex* of A rows may follow the capacity in the same allocation
    (``set_annex``): a method's own extra entries (sekv: the reconstructed tokens of
    a fixed zoom set, sekv/fixed_set.py), so that one attention call covers
    ``joint(layer)`` = appended tokens, capacity and annex.  ``k[layer]`` /
    ``v[layer]`` are views of the first ``capacity`` rows.  ``generation`` counts
    reallocations (the annex's contents do not survive one).
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype, device, capacity: int = 256):
        # zeros, not empty: static steps attend over the whole capacity with a mask, and a masked entry's
        # value still enters the product (0 x NaN garbage would be NaN)
        self.annex = 0
        self.generation = 0
        self.truncations = 0  # a method's cached view of the tail (sekv's fixed sets) must hide dropped tokens again
        #: each layer's device: ``device`` is one device, or one per layer (a model placed across devices,
        #: sekv_core/placement.py layer_devices); static mode needs them all on one
        self.devices = per_layer(device, n_layers)
        device = self.devices[0] if self.devices else torch.device("cpu")
        self.jk = [torch.zeros(1, n_kv_heads, capacity, head_dim, dtype=dtype, device=dev) for dev in self.devices]
        self.jv = [torch.zeros_like(t) for t in self.jk]
        self.k = list(self.jk)
        self.v = list(self.jv)
        self.len = [0] * n_layers
        #: static mode (single-token steps captured as a CUDA graph): appends write at the device position
        #: ``pos`` and leave the host lengths to ``advance()``
        self.static = False
        self.pos = torch.zeros(1, dtype=torch.long, device=device)

    @classmethod
    def from_tensors(cls, keys: list[torch.Tensor], values: list[torch.Tensor], device, extra: int = 256) -> "GrowingKV":
        hkv, n, d = keys[0].shape
        g = cls(len(keys), hkv, d, keys[0].dtype, device, capacity=n + extra)
        for i, (k, v) in enumerate(zip(keys, values)):
            g.k[i][0, :, :n].copy_(k)
            g.v[i][0, :, :n].copy_(v)
            g.len[i] = n
        return g

    def load_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, extra: int) -> None:
        """Replace a layer's contents by k / v [Hkv, n, d] (layers may differ in length), with `extra` capacity."""
        n = k.shape[1]
        self.jk[layer] = self.k[layer] = k.new_zeros(1, k.shape[0], n + extra, k.shape[2], device=self.devices[layer])
        self.jv[layer] = self.v[layer] = torch.zeros_like(self.k[layer])
        self.k[layer][0, :, :n].copy_(k)
        self.v[layer][0, :, :n].copy_(v)
        self.len[layer] = n

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append q new tokens; returns the layer's keys / values so far.  Static mode (q = 1): writes at the
        device position and returns the whole capacity (entries past the position are to be masked)."""
        if self.static:
            self.k[layer].index_copy_(2, self.pos, key)
            self.v[layer].index_copy_(2, self.pos, value)
            return self.k[layer], self.v[layer]
        n, q = self.len[layer], key.shape[-2]
        self.reserve(layer, n + q)
        self.k[layer][:, :, n : n + q] = key
        self.v[layer][:, :, n : n + q] = value
        self.len[layer] = n + q
        return self.k[layer][:, :, : n + q], self.v[layer][:, :, : n + q]

    def _realloc(self, layer: int, cap: int, annex: int) -> None:
        m = self.len[layer]
        for j, views in ((self.jk, self.k), (self.jv, self.v)):
            old = views[layer]
            new = old.new_zeros(old.shape[0], old.shape[1], cap + annex, old.shape[3])
            new[:, :, :m] = old[:, :, :m]
            j[layer] = new
            views[layer] = new[:, :, :cap]
        self.generation += 1

    def reserve(self, layer: int, n: int) -> None:
        """Capacity for n tokens in a layer (doubling; a new buffer, so captured graphs must be recaptured)."""
        if n > self.k[layer].shape[-2]:
            self._realloc(layer, max(2 * self.k[layer].shape[-2], n), self.annex)

    def set_annex(self, rows: int) -> None:
        """An annex of `rows` entries after every layer's capacity (reallocates when it changes; zeros)."""
        if rows != self.annex:
            self.annex = rows
            for layer in range(len(self.k)):
                self._realloc(layer, self.k[layer].shape[-2], rows)

    def annex_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The annex rows of a layer: views [1, Hkv, A, d]."""
        cap = self.k[layer].shape[-2]
        return self.jk[layer][:, :, cap:], self.jv[layer][:, :, cap:]

    def static_begin(self) -> None:
        """Before a static step: room for one more token in every layer, the device position set."""
        n = self.len[0]
        for layer in range(len(self.k)):
            self.reserve(layer, n + 1)
        self.pos.fill_(n)

    def static_key(self) -> tuple:
        """The buffers' identity: a graph captured over other buffers is stale."""
        return tuple(t.data_ptr() for t in self.k + self.v) + (self.k[0].shape[-2],)

    def static_mask(self) -> torch.Tensor:
        """[1, 1, 1, capacity] bool: the entries a static step's query sees (up to and including its own)."""
        cap = self.k[0].shape[-2]
        return (torch.arange(cap, device=self.pos.device) <= self.pos).view(1, 1, 1, cap)

    @contextlib.contextmanager
    def static_mode(self):
        self.static = True
        try:
            yield
        finally:
            self.static = False

    def advance(self, q: int = 1) -> None:
        self.len = [x + q for x in self.len]

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.len[layer]
        return self.k[layer][:, :, :n], self.v[layer][:, :, :n]

    def truncate(self, n: int) -> None:
        self.len = [min(x, n) for x in self.len]
        self.truncations += 1

    def nbytes(self) -> int:
        """Bytes in use (not capacity, not the annex: its owner counts it)."""
        per = self.k[0].shape[1] * self.k[0].shape[3] * self.k[0].element_size() * 2
        return sum(self.len) * per


def per_layer(device, n_layers: int) -> list[torch.device]:
    """One device for each of n_layers: ``device`` is one device (all layers) or a sequence of one per layer."""
    if isinstance(device, (list, tuple)):
        if len(device) != n_layers:
            raise ValueError(f"{len(device)} devices for {n_layers} layers")
        return [torch.device(d) for d in device]
    return [torch.device(device)] * n_layers


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
    if q > 1 and query.is_cuda:  # a chunk after earlier tokens: the fused kernels' bottom-right causal mask, none materialised
        from torch.nn.attention.bias import causal_lower_right

        return F.scaled_dot_product_attention(query, keys, values, attn_mask=causal_lower_right(q, t), scale=scaling, enable_gqa=gqa)
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
    #: whether ingest prefills the document (rag does not: it keeps text chunks and prefills a few at ask time)
    needs_prefill: bool = True
    #: the method's parameters (sekv_core/methods/params.py): a frozen dataclass, defaults on its fields
    params_type: type[Params] = Params
    #: named variants for `sekv bench --ablations` (name -> an object with ``overrides``), if any
    ablations: Mapping[str, Any] = {}
    #: documents longer than the model's window (sekv_core/ingest.py plan_windows): "window" = refused (the whole
    #: document must fit one prefill); "windowed" = prefilled in windows (sekv_core/windows.py), given to
    #: compress_windows(); "any" = the method needs no prefill of the whole document
    length_policy: str = "window"
    #: whether open() takes one device per layer (a list) and keeps each layer's KV on its layer's device; otherwise
    #: it gets the model's input device and the hook moves the other layers' tokens there (Session.open)
    per_layer_devices: bool = False

    @property
    def default_params(self) -> dict[str, Any]:
        return self.params_type.defaults()

    @property
    def ask_time_params(self) -> tuple[str, ...]:
        """Parameters that may be changed at ask time without re-ingesting."""
        return self.params_type.ask_time_names()

    def resolve_params(self, overrides: Mapping[str, Any] | None) -> Params:
        """The defaults with ``overrides`` (a pack's manifest, CLI options) applied and checked."""
        return self.params_type.from_dict(overrides, self.name)

    def needs(self, params: Params) -> tuple[str, ...]:
        """The prefill statistics compress() reads with these parameters (default: ``needs_scores``)."""
        return self.needs_scores

    def obs_window(self, params: Params) -> int:
        """Document tokens whose queries the prefill records when ``needs_scores`` has "obs_queries"."""
        return int(getattr(params, "window", 64))

    def reserve_host(self, n_tokens: int, shape: ModelShape, params: Params) -> None:
        """Called before the prefill of an n_tokens document on an accelerator: a method whose compress()
        moves large results to the host may prepare that memory meanwhile (sekv does).  Default: nothing."""

    def prefill_stream(self, params: Params, shape: ModelShape, n_tokens: int):
        """Pack tensors this method makes from each layer's prefill rows as they are final, written while the prefill
        runs (the pipelined ingest, sekv_core/ingest.py): None (default: everything comes from compress()), or (a
        stream, the parameters compress() then runs with, so that it leaves out what the stream made).  The stream
        (sekv_core/chunk_stream.py): ``start(writer)`` places its tensors in the pack (pack.PackWriter), then its
        ``layer`` is the prefill's ``on_rows`` hook, then ``finish()`` after the prefill."""
        return None

    @abstractmethod
    def compress(self, prefill: PrefillResult, params: Params) -> dict[str, torch.Tensor]:
        """Tensors to store in the pack (CPU tensors)."""

    def compress_windows(self, windows: Iterable[PrefillResult], params: Params) -> dict[str, torch.Tensor]:
        """Tensors to store for a document prefilled in windows (``length_policy = "windowed"``): ``windows`` yields
        each window's kept part at global positions (PrefillResult.start, .doc_tokens), one at a time, so that
        host memory holds one window's KV plus what the pack keeps.  A one-window document gives one."""
        raise NotImplementedError(f"{self.name} does not ingest in windows")

    @abstractmethod
    def open(self, store: "TensorStore", params: Params, shape: ModelShape, device) -> KVMemory:
        """Build the runtime memory from the pack's tensors."""

    def start_open(self, store: "TensorStore", shape: ModelShape, n_tokens: int, device, params: Params | None = None) -> None:
        """Start, on a second thread, work that open() on ``device`` will take up, before the model is loaded (shape:
        the pack's manifest's; nothing of the store is trusted before :meth:`validate` passed; params: the ask's, where
        known).  Default: none."""

    def describe(self, store: "TensorStore", params: Params) -> dict[str, Any]:
        """Method-specific statistics for `sekv inspect`."""
        return {}

    def tensor_specs(self, params: Params, shape: ModelShape, n_tokens: int) -> list:
        """What a pack's tensors must be (``sekv_core.pack.TensorSpec``: name, dtypes, shape in terms of N, L, H, Hkv,
        d and names bound on the way, value ranges), checked by :meth:`validate` before open() / describe() read them."""
        return []

    def validate(self, store: "TensorStore", params: Params, shape: ModelShape, n_tokens: int) -> None:
        """Raise PackError where the pack's tensors are not what open() / describe() may use.  Default: the specs."""
        from ..pack import check_tensors, model_dims

        check_tensors(store, self.tensor_specs(params, shape, n_tokens), model_dims(shape, n_tokens), shape.n_layers)


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
