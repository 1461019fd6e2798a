"""The seam between a frozen transformers model and sekv's KV memories.

sekv registers one attention function, ``"sekv"``, through transformers'
``AttentionInterface``, and no mask function: for an attention name without one,
transformers makes no mask and skips its check of the positions for packed
sequences (a host sync per forward on CUDA); the memories mask for themselves.
The model is then run with ``use_cache=False`` and
explicit ``position_ids``: each attention layer projects and rotates the new
tokens' queries and keys as usual and hands them to our function, which asks
the *active memory* (a cache method's runtime object) to attend over
everything it holds plus the new tokens, and to append the new tokens.

Why the attention interface rather than a custom ``Cache``: the attention
function signature is the same across transformers 5.17-5.24, while the cache
API changed (``past_key_values`` -> ``cache``, ``crop``, ``cache_position``).
The model code is never forked.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Protocol

import torch

ATTN_NAME = "sekv"
_active: contextvars.ContextVar = contextvars.ContextVar("sekv_memory", default=None)


class Memory(Protocol):
    """What the attention hook needs from a cache method's runtime memory."""

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
        """query [B,H,q,d], key/value [B,Hkv,q,d] of the new tokens (post-RoPE) -> output [B,H,q,d].

        Appends the new tokens to the memory (they become visible to later calls
        for the same layer) and applies causal masking among them.
        """


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    memory = _active.get()
    if memory is None:
        raise RuntimeError("sekv attention called outside sekv_core.runtime.using(memory)")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    devices = getattr(memory, "layer_devices", None)
    home = devices[module.layer_idx] if devices else query.device
    if home != query.device:  # a memory kept on another device than this layer's (sekv_core/placement.py)
        out = memory.attend(module.layer_idx, query.to(home), key.to(home), value.to(home), scaling).to(query.device)
    else:
        out = memory.attend(module.layer_idx, query, key, value, scaling)
    return out.transpose(1, 2).contiguous(), None


def compilable() -> None:
    """Make the attention hook a graph break for torch.compile (it is the memory's code, run eagerly); called
    once, when a compiled decode step is first asked for (sekv_core/graphed_step.py)."""
    global _attention
    if not getattr(_attention, "_sekv_disabled", False):
        _attention = torch.compiler.disable(_attention)
        _attention._sekv_disabled = True
        _register()


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _attention)


def install(model) -> None:
    """Route a loaded model's attention through sekv memories."""
    _register()
    model.config._attn_implementation = ATTN_NAME
    for sub in model.modules():
        cfg = getattr(sub, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = ATTN_NAME


@contextlib.contextmanager
def using(memory: Memory):
    token = _active.set(memory)
    try:
        yield memory
    finally:
        _active.reset(token)


def forward_hidden(model, input_ids: torch.Tensor, start: int, memory: Memory) -> torch.Tensor:
    """Run the decoder body on new tokens at absolute positions start.. ; return last hidden states.  On a model placed
    across devices (sekv_core/placement.py), a memory that does not say where its layers are (``layer_devices``) is
    on the model's input device, where its layers' new tokens are handed (_attention)."""
    from . import placement

    if getattr(memory, "layer_devices", None) is None and placement.is_mapped(model):
        memory.layer_devices = [placement.input_device(model)] * len(placement.decoder_layers(model))
    pos = torch.arange(start, start + input_ids.shape[-1], device=input_ids.device).unsqueeze(0)
    with using(memory), torch.inference_mode():
        out = model.get_decoder()(input_ids=input_ids, position_ids=pos, use_cache=False)
    return out.last_hidden_state


def forward_logits(model, input_ids: torch.Tensor, start: int, memory: Memory, last_only: bool = True) -> torch.Tensor:
    h = forward_hidden(model, input_ids, start, memory)
    if last_only:
        h = h[:, -1:]
    with torch.inference_mode():
        return model.get_output_embeddings()(h).float()
