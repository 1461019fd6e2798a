"""How far a cache method reads: the window a pack's positions must fit in, and the one error past it.

A method whose memory attends at the document's own positions (``full``, the eviction baselines, kvzip,
sentencekv, depthweave) can address as many positions as the model: its native window, or the window its RoPE
scaling covers when the pack records one (``manifest["model"]["rope_scaling"]``: YaRN x F over W native positions
reaches W x F).  ``sekv`` reads any length: it lays what it holds out inside the window at ask time
(re-positioned attention, sekv_core/sekv/positions.py).  Every place that opens a memory checks here.
"""

from __future__ import annotations

from typing import Any, Mapping

from . import methods
from .errors import SekvError


def effective_window(model_manifest: Mapping[str, Any] | None, native: int) -> int:
    """The positions a pack's model addresses: W x F where the pack records YaRN scaling over W native positions,
    else ``native`` (the loaded model's window; 0: unknown)."""
    rs = (model_manifest or {}).get("rope_scaling")
    if isinstance(rs, Mapping) and rs.get("rope_type") == "yarn":
        try:
            w, f = int(rs["original_max_position_embeddings"]), float(rs["factor"])
        except (KeyError, TypeError, ValueError):
            return native
        if w > 0 and f >= 1:
            return int(w * f)
    return native


def check(method: str, n_tokens: int, window: int, model_id: str) -> None:
    """One line naming ``sekv`` where ``method`` cannot address a document of n_tokens in ``window`` positions."""
    if not window or n_tokens <= window or methods.get(method.split(":", 1)[0]).length_policy != "window":
        return  # "windowed" (sekv): re-positioned at ask time; "any": the method prefills what it reads at ask time
    raise SekvError(f"the document is {n_tokens} tokens, past {model_id}'s window of {window}, which --method {method} cannot read "
                    "beyond; ingest it with --method sekv")
