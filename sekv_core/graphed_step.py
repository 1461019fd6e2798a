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


class GraphedStep:
    def __init__(self, model, memory: KVMemory, capture: bool | None = None, compile_layers: bool = False):
        self.model, self.memory = model, memory
        self.compile_layers = compile_layers
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
        """token: [1, 1] long on the model's device -> the last hidden state [1, 1, D]."""
        with torch.inference_mode():  # the memory's device tensors were made in inference mode
            return self._step(token)

    def _step(self, token: torch.Tensor) -> torch.Tensor:
        m = self.memory
        m.static_begin()
        self.tok.copy_(token.view(1, 1))
        self.pos.fill_(m.n_tokens())
        key = m.static_key() if self.capture else None
        if not self.capture:
            out = self._forward()
        elif self.key is not None and key == self.key:
            self.graph.replay()
            out = self.out
        else:
            out = self._eager_then_capture(key)
        m.static_end()
        return out

    def _forward(self) -> torch.Tensor:
        fused = compiled_layers(self.model) if self.compile_layers else contextlib.nullcontext()
        with runtime.using(self.memory), self.memory.static_mode(), torch.inference_mode(), fused:
            return self.model.get_decoder()(input_ids=self.tok, position_ids=self.pos, use_cache=False).last_hidden_state

    def _eager_then_capture(self, key: Hashable) -> torch.Tensor:
        """Run this step eagerly (on a side stream: also the warm-up), then capture it for the steps to come,
        unless the step changed what a capture would fix (e.g. it filled a fixed set that later steps reuse:
        that step is transient, the next one is captured)."""
        cur = torch.cuda.current_stream()
        side = torch.cuda.Stream(cur.device)
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
