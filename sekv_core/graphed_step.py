"""Single-token decode steps as one captured CUDA graph: the model and the KV memory together.

An eager decode step of a transformers model is bound by the host: it launches
~50 kernels per layer, each a few microseconds of GPU work (docs/gpu.md).  A
memory that supports *static mode* (``KVMemory.static_supported``) can run a
single-token step with device-side positions only: the new token's K/V is
written at a device index, the resident part is attended over its whole
preallocated capacity with a length mask, and nothing in the step reads a
value back to the host.  Such a step is captured once and replayed:

* ``memory.static_begin()`` (host, before the step): bookkeeping, capacity for
  the token, device scalars.  ``memory.static_key()`` says what a capture
  fixes; the graph is valid while it stays the same (same buffers, same slot
  count, same per-layer decisions); a new key recaptures.
* the token id and its position go into fixed input tensors, the graph replays;
* ``memory.static_end()`` (host): the lengths move on.

A step with a new key runs eagerly first, on a side stream: its output is the
step's answer, and it warms up the kernels.  If the key is still the same
after it, the step is captured and replayed from the next step on; if the step
itself changed the key (the first step of a scout-routed answer fills the set
that the others reuse) it stays eager and the next step is captured.  So a
graph captured for one answer serves the next answers too, whose first step
runs eagerly.  Off CUDA (tests), the same
static path runs eagerly, so what is captured is the code the CPU tests check.

The model's own small kernels are most of a step's launches (a Llama layer: 7 projections, 2 norms of 8 kernels
each, a rotary embedding of 10; benchmarks/step_ops.py counts them): a static step runs the norms as one
``F.rms_norm`` each and the rotary embedding of q and k together in 4 kernels (:func:`fused_ops`: the same arithmetic,
rounded once where transformers' code rounds twice), so a captured layer makes 17 of the model's calls instead of 37
(tests/test_graphed_step.py bounds them).

``compile_layers=True`` also fuses the model's own small kernels (norms, rotary,
activation, residual adds): inside a static step every decoder layer runs
through one ``torch.compile``d function shared by all layers (the attention
call stays eager: it is the memory's, a graph break).  Single-token shapes only,
so it compiles once per model shape (seconds to a minute), then the captured
graph holds the fused kernels.  Off by default: it pays in long sessions, not
in one ``sekv ask``.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Hashable

import torch
import torch.nn.functional as F

from . import runtime
from .methods.base import KVMemory


def _compiled_layer_call():
    """One compiled function for every decoder layer: the layer is an argument, its parameters graph inputs, so
    all layers of a model (same code and shapes) share one compilation."""
    global _LAYER_CALL
    if _LAYER_CALL is None:
        runtime.compilable()
        _LAYER_CALL = torch.compile(lambda layer, *args, **kw: type(layer).forward(layer, *args, **kw), dynamic=False)
    return _LAYER_CALL


_LAYER_CALL = None


@contextlib.contextmanager
def compiled_layers(model):
    """Within the block, the model's decoder layers run through :func:`_compiled_layer_call`."""
    call = _compiled_layer_call()
    layers = list(model.get_decoder().layers)
    for layer in layers:
        layer.forward = functools.partial(call, layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


#: RMSNorm classes that compute ``weight * (x * rsqrt(mean(x^2) + eps))`` in float32, rounded to x's dtype (Llama's):
#: a static step runs them as one ``F.rms_norm`` call, a fused kernel on CUDA where transformers' code makes eight
#: (the product with the weight rounded once instead of twice: within the model dtype's rounding)
RMS_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm", "Qwen3RMSNorm"})


def _rms_norm(module, x: torch.Tensor) -> torch.Tensor:
    w = module.weight
    if x.dtype != w.dtype:  # transformers' promotes to the wider dtype: left to its code
        return type(module).forward(module, x)
    return F.rms_norm(x, w.shape, w, module.variance_epsilon)


#: transformers' modeling modules whose ``apply_rotary_pos_emb`` is Llama's, ``x * cos + rotate_half(x) * sin`` with
#: rotate_half(x) = cat(-x2, x1): a static step runs it as ``addcmul(x * cos, roll(x, d / 2), sin')`` with sin' = sin,
#: its first half negated (made once a step), q's and k's heads concatenated: four kernels for both where it makes ten
#: (the last sum rounded once)
ROTARY_MODULES = frozenset(f"transformers.models.{m}.modeling_{m}" for m in ("llama", "qwen2", "mistral", "qwen3"))


def _rotary(plain, signed: dict):
    """A Llama ``apply_rotary_pos_emb`` (plain) in fewer kernels, its signed sin made once per sin tensor (signed:
    for one forward); a call in another form than transformers' (q, k, cos, sin[, unsqueeze_dim]) goes to plain."""

    def apply(q, k, cos, sin, *rest, unsqueeze_dim=1, **kw):
        if rest or kw:
            return plain(q, k, cos, sin, *rest, unsqueeze_dim=unsqueeze_dim, **kw)
        held = signed.get(id(sin))
        if held is None:  # the same cos / sin for every layer of a forward (the reference keeps the id unique)
            h = sin.shape[-1] // 2
            held = signed[id(sin)] = (sin, torch.cat([-sin[..., :h], sin[..., h:]], -1).unsqueeze(unsqueeze_dim))
        cos, s = cos.unsqueeze(unsqueeze_dim), held[1]
        h = q.shape[-1] // 2
        if unsqueeze_dim == 1 and q.dim() == 4 and q.shape[0] == k.shape[0] and q.shape[2:] == k.shape[2:] and q.dtype == k.dtype:
            # q's and k's heads side by side: one rotation of both (four kernels, not six), each element the same arithmetic
            qk = torch.cat([q, k], 1)
            out = torch.addcmul(qk * cos, qk.roll(h, -1), s)
            return out[:, : q.shape[1]], out[:, q.shape[1] :]
        return torch.addcmul(q * cos, q.roll(h, -1), s), torch.addcmul(k * cos, k.roll(h, -1), s)

    return apply


@contextlib.contextmanager
def fused_ops(model):
    """Within the block, the model's RMSNorm modules of :data:`RMS_NORMS` run as :func:`_rms_norm` and the rotary
    embedding of :data:`ROTARY_MODULES` as :func:`_rotary`'s: the same arithmetic in fewer kernels (a decode step on
    CUDA is bound by their number as much as by the bytes it reads)."""
    import sys

    norms = [m for m in model.modules() if type(m).__name__ in RMS_NORMS and hasattr(m, "variance_epsilon")]
    mods = {type(m).__module__ for m in model.modules()} & ROTARY_MODULES
    saved = [(sys.modules[n], sys.modules[n].apply_rotary_pos_emb) for n in mods if hasattr(sys.modules[n], "apply_rotary_pos_emb")]
    signed: dict = {}
    for m in norms:
        m.forward = functools.partial(_rms_norm, m)
    for mod, plain in saved:
        mod.apply_rotary_pos_emb = _rotary(plain, signed)
    try:
        yield
    finally:
        for m in norms:
            del m.forward
        for mod, f in saved:
            mod.apply_rotary_pos_emb = f


class GraphedStep:
    """``greedy``: the step ends with the model's head and the argmax of the last position's logits, inside the graph:
    a call returns the next token [1] (long, on the device) instead of the hidden state, and leaves it as the next
    step's input (a call with that tensor copies nothing), and the position moves on inside the graph: the host's work
    a token is the memory's bookkeeping, the replay and the token's read."""

    def __init__(self, model, memory: KVMemory, capture: bool | None = None, compile_layers: bool = False, greedy: bool = False):
        self.model, self.memory = model, memory
        self.compile_layers = compile_layers
        self.greedy = greedy
        self._pos_next: int | None = None  # greedy: the position the device holds after the last step (None: unknown)
        self._last_out: torch.Tensor | None = None  # greedy: the token the last step returned (the input it left)
        self._side: dict = {}  # the eager run's side stream, by device
        from .placement import input_device

        dev = input_device(model)
        self.capture = dev.type == "cuda" if capture is None else capture
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.graph = None
        self.key: Hashable | None = None
        self.out: torch.Tensor | None = None
        self.captures = 0  # how often the step was (re)captured
        self.capture_s = 0.0  # host seconds those captures took (a capture ends with a sync)

    @staticmethod
    def supported(model, memory: KVMemory) -> bool:
        """The memory has a static step, and the model runs on one device with its weights resident (a model placed
        across devices or streaming offloaded weights, sekv_core/placement.py, runs its steps eagerly)."""
        from .placement import spans_devices

        return memory.static_supported() and not spans_devices(model)

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        """token: [1, 1] long on the model's device -> the last hidden state [1, 1, D] (greedy: the next token [1])."""
        with torch.inference_mode():  # the memory's device tensors were made in inference mode
            return self._step(token)

    def _step(self, token: torch.Tensor) -> torch.Tensor:
        m = self.memory
        m.static_begin()
        last = self._last_out  # greedy: the token the last step returned, held (so no other tensor takes its memory)
        if last is None or token.data_ptr() != last.data_ptr():  # else that step left it as the input already
            self.tok.copy_(token.view(1, 1))
        n = m.n_tokens()
        if not (self.greedy and self._pos_next == n):  # greedy: the step before moved it on (inside the graph)
            self.pos.fill_(n)
        self._pos_next = self._last_out = None  # known again once this step has run
        key = m.static_key() if self.capture else None
        if not self.capture:
            out = self._forward()
        elif self.key is not None and key == self.key:
            self.graph.replay()
            out = self.out
        else:
            out = self._eager_then_capture(key)
        if self.greedy:
            self._pos_next, self._last_out = n + 1, out
        m.static_end()
        return out

    def _forward(self) -> torch.Tensor:
        fused = compiled_layers(self.model) if self.compile_layers else fused_ops(self.model)
        with runtime.using(self.memory), self.memory.static_mode(), torch.inference_mode(), fused:
            hidden = self.model.get_decoder()(input_ids=self.tok, position_ids=self.pos, use_cache=False).last_hidden_state
            if not self.greedy:
                return hidden
            best = self.model.get_output_embeddings()(hidden[:, -1]).argmax(-1)  # generate's greedy token, in the step
            self.tok.copy_(best.view(1, 1))  # the next step's input
            self.pos.add_(1)  # and its position
            return best

    def _eager_then_capture(self, key: Hashable) -> torch.Tensor:
        """Run this step eagerly (on a side stream: also the warm-up), then capture it for the steps to come,
        unless the step changed what a capture would fix (e.g. it filled a fixed set that later steps reuse:
        that step is transient, the next one is captured)."""
        cur = torch.cuda.current_stream()
        side = self._side.get(cur.device)
        if side is None:  # one side stream a step, reused: each new stream that runs a product gets a cuBLAS workspace
            side = self._side[cur.device] = torch.cuda.Stream(cur.device)  # of its own, kept in device memory (32 MiB on Hopper)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            out = self._forward().clone()
        cur.wait_stream(side)
        if self.memory.static_key() != key:
            return out
        self.graph = self.out = self.key = None  # free the old graph's pool before capturing anew
        t = time.perf_counter()
        g = torch.cuda.CUDAGraph()
        # thread_local: only this thread's calls are checked during the capture.  Other threads page-lock host memory
        # and copy on their own streams meanwhile (the zoom tier, the factor blocks' pinning, a previous memory's
        # threads in a process that opens several); in the default global mode one such call invalidates the capture
        # and leaves the context failing every later call ("invalid argument")
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            self.out = self._forward()
        self.graph, self.key = g, key
        self.captures += 1
        self.capture_s += time.perf_counter() - t
        return out
