"""The tensors of a sekv pack: what compress writes and open reads (all prefixed ``sekv.``; L layers).

  config [8] int64: N, L, Hkv, d, min_span, max_span, window, n_sink
  key_space [1] int64: 1 = keys factorised before RoPE, 0 = after
  rope_inv_freq [d/2] float32, rope_scaling [1] float32 (pre-RoPE packs)
  span_start / span_end [S] int64, full_idx [F] int64, anchor_idx [A] int64
  full.k.l / full.v.l     [Hkv, F, d]  store dtype (sekv/params.py store_dtype)
  coarse.k.l / coarse.v.l [Hkv, S, d]  store dtype
  router.w.l [Hw, d_r, d] store dtype, router.norm.l [Hw, S] float32, router.tau [L, H] float32: the untrained router
  router.ttau [L, H] float32, router.sha256 [32] uint8: the trained router the pack was made with (its W is read
                   from the router file at open, sekv/router.py)
  scout.profile [S] float32, scout.profile_blocks [B] float32, scout.profile_unit [1] int64: the document end's
                   span / zoom-block profile (sekv/scout.py)
  lex.terms [N] int32: the tokens' word terms (sekv/lexical.py)
  fk.l.* / fv.l.*  key / value factors (sekv/factorize.py); with factor_bits 4 coded at rest (sekv/codec.py,
                   factor_codec [4-5] int64, + factor_codec.fv where the values' code differs), decoded to int8 at open
"""

from __future__ import annotations

import torch

from . import codec
from . import factorize as fz
from .params import SekvParams

CONFIG_FIELDS = ("n_tokens", "n_layers", "n_kv_heads", "head_dim", "min_span", "max_span", "window", "n_sink")


def read_config(store) -> dict[str, int]:
    return dict(zip(CONFIG_FIELDS, store.get("sekv.config").tolist()))


def store_dtype(params: SekvParams, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the pack's full-resolution tokens, coarse entries and PCA W: the model's when it is 16-bit, else
    float16 (a float32 model on a CPU without bf16 would double them: the 3.2K manual's pack 0.228 -> 0.19 of the raw
    fp16 KV); ``store_dtype="model"`` keeps the model's (exactness tests)."""
    if params.store_dtype == "model" or model_dtype in (torch.float16, torch.bfloat16):
        return model_dtype
    return torch.float16


def read_factors(store, names: set[str], prefix: str, device=None) -> fz.Factors:
    """One layer's key or value factors; coded (factor_bits 4) factors are decoded to int8 here, on ``device``."""
    coded = codec.read_factors(store, names, prefix, device=device)
    if coded is not None:
        return coded
    scaled = f"{prefix}.us_scale" in names
    return fz.Factors(
        store.get(f"{prefix}.us"),
        store.get(f"{prefix}.vt"),
        store.get(f"{prefix}.rank"),
        store.get(f"{prefix}.us_scale") if scaled else None,
        store.get(f"{prefix}.vt_scale") if scaled else None,
    )


def router_sha256(store, names: set[str]) -> str:
    """The sha256 of the trained router the pack was made with, "" for an untrained one."""
    if "sekv.router.sha256" not in names:
        return ""
    return bytes(store.get("sekv.router.sha256").tolist()).hex()


def sha256_tensor(hex_digest: str) -> torch.Tensor:
    return torch.tensor(list(bytes.fromhex(hex_digest)), dtype=torch.uint8)
