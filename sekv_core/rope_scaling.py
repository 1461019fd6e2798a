"""RoPE scaling at ingest: which positions a pack's document is read with, decided in one place.

A document that fits the model's native window keeps native RoPE (static YaRN costs quality on short texts:
docs/long-documents.md, "RoPE scaling (YaRN)").  Past the window, a method that must hold the whole document in
one window (``full`` and the eviction baselines: length policy "window") gets the smallest integer YaRN factor
that covers it, up to MAX_FACTOR; past that, only windowed ingest (``sekv``) reads the document.  ``sekv``
(windowed) and ``rag`` (any length: it prefills a budget's worth of chunks at ask time) stay native unless
``yarn:F`` is asked for.

The factor is recorded in the pack (``manifest["model"]["rope_scaling"]``: null, or transformers' YaRN
parameters) and applied to the model again before the pack is opened (session.py), so the keys a method
re-rotates at ask time (sekv's pre-RoPE keys) use the frequencies they were made with.
"""

from __future__ import annotations

import math
from typing import Any

from .errors import DocumentError, PackError, SekvError

#: the largest YaRN factor `auto` chooses (the issue's measurement: x4 finds 9/9 needles up to 92K tokens)
MAX_FACTOR = 4
#: the largest factor `yarn:F` accepts
MAX_REQUESTED = 8.0
CHOICES = "auto, none or yarn:F (1 < F <= 8)"


def parse(requested: str | None) -> str | float | None:
    """--rope-scaling: "auto", None ("none") or a YaRN factor (float); SekvError on anything else."""
    text = "auto" if requested is None else str(requested).strip().lower()
    if text in ("auto", "none"):
        return None if text == "none" else "auto"
    if text.startswith("yarn:"):
        try:
            f = float(text[5:])
        except ValueError:
            f = float("nan")
        if math.isfinite(f) and 1.0 < f <= MAX_REQUESTED:
            return f
    raise SekvError(f"--rope-scaling {requested!r} is not one of {CHOICES}")


def policy_of(method) -> str:
    """A cache method's length policy: "window" (the whole document in one window), "windowed" or "any"."""
    return getattr(method, "length_policy", None) or ("windowed" if getattr(method, "name", "") == "sekv" else "window")


def plan(method, n_tokens: int, native_window: int, requested: str | None = "auto", *, reserve: int = 0, what: str = "the document") -> float | None:
    """The YaRN factor to ingest an n_tokens document with (None: native RoPE), for a cache method and a native
    window; ``reserve`` tokens stay free for the question and the answer.  DocumentError (one line) where a
    "window" method cannot read the document at the scaling asked for."""
    choice = parse(requested) if not isinstance(requested, float) else requested
    policy = policy_of(method)
    need = n_tokens + reserve
    name = getattr(method, "name", str(method))
    if not native_window:  # a model that does not say: nothing to scale against
        return None
    if choice == "auto":
        if policy != "window" or need <= native_window:
            return None
        factor = math.ceil(need / native_window)
        if factor > MAX_FACTOR:
            raise DocumentError(
                f"{what} is {n_tokens} tokens (+{reserve} reserved for the question and answer), more than {MAX_FACTOR}x the model's "
                f"window of {native_window} that YaRN scaling carries for --method {name}; ingest it with --method sekv (windowed)"
            )
        return float(factor)
    window = native_window * (choice or 1.0)
    if policy == "window" and need > window:
        how = "native RoPE" if choice is None else f"YaRN x{choice:g}"
        raise DocumentError(
            f"{what} is {n_tokens} tokens (+{reserve} reserved for the question and answer), longer than the {int(window)} tokens "
            f"{how} addresses; use --rope-scaling auto (YaRN up to x{MAX_FACTOR}) or --method sekv"
        )
    return choice


def manifest_entry(lm) -> dict[str, Any] | None:
    """What a pack records of the model's current RoPE scaling: None (native) or its YaRN parameters."""
    from . import models

    rp = getattr(lm.config, "rope_parameters", None)
    if models.rope_factor(lm.config) is None:
        return None
    return {"rope_type": "yarn", "factor": float(rp["factor"]), "original_max_position_embeddings": int(rp["original_max_position_embeddings"])}


def of_manifest(manifest: dict, where: str = "the pack") -> float | None:
    """The YaRN factor a pack was ingested with (None: native, also for packs from before the field); PackError on a
    value this sekv did not write."""
    model = manifest.get("model") if isinstance(manifest, dict) else None
    entry = model.get("rope_scaling") if isinstance(model, dict) else None
    if entry is None:
        return None
    ok = isinstance(entry, dict) and entry.get("rope_type") == "yarn" and set(entry) == {"rope_type", "factor", "original_max_position_embeddings"}
    f = entry.get("factor") if ok else None
    w = entry.get("original_max_position_embeddings") if ok else None
    if not (type(f) in (int, float) and math.isfinite(f) and 1.0 < f <= MAX_REQUESTED and type(w) is int and 0 < w < 2**31):
        raise PackError(f"{where}: the manifest's rope_scaling is not one this sekv writes; re-ingest the document")
    return float(f)


def apply(lm, manifest: dict, where: str = "the pack") -> float | None:
    """Put the model in the RoPE scaling a pack was made with (before its memory is opened); the factor."""
    from . import models

    factor = of_manifest(manifest, where)
    if factor is not None:
        native_window = models.native_rope(lm.model)[1]
        recorded = manifest["model"]["rope_scaling"]["original_max_position_embeddings"]
        if recorded != native_window:
            raise PackError(f"{where}: the pack was scaled over a window of {recorded} tokens, the model's is {native_window}; re-ingest the document")
    models.set_rope_scaling(lm, factor)
    return factor


def prepare(lm, method, n_tokens: int, requested, *, reserve: int, what: str) -> float | None:
    """Ingest's one call: plan the scaling for this document and put the model in it (native where None)."""
    from . import models

    models.set_rope_scaling(lm, None)  # plan against the native window, whatever an earlier pack left
    factor = plan(method, n_tokens, models.context_window(lm.config), requested, reserve=reserve, what=what)
    models.set_rope_scaling(lm, factor)
    return factor
