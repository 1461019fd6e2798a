"""The sekv method's parameters and its named ablations.

Every default is justified in docs/design.md (the measurement and the command
that reproduces it).  Ask-time fields (:func:`ask_time`) may change with
``sekv ask --KEY`` on an existing pack; the others fix what the pack holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..methods.params import DEFAULT_BUDGET, Params, ask_time
from .router import D_R
from .zoom_tier import TIERS

PRIORS = ("none", "kvzip")  # sekv/prior.py
POOLS = ("mean", "max")

ZOOMS = ("router", "all", "none")
ROUTINGS = ("scout", "per_layer")
SEGMENTATIONS = ("surprisal", "fixed")
TAU_MODES = ("per_head", "global")
KEY_SPACES = ("pre_rope", "post_rope")
WEIGHTINGS = ("surprisal", "mean")
REPOSITIONS = ("spread", "packed")
COARSE_MASSES = ("window", "document", "none")
LOOKALIKES = ("keep", "demote")


@dataclass(frozen=True)
class SekvParams(Params):
    method = "sekv"
    # packs made before number tokens were kept exact, before the zoom tier
    absent_in_pack = {"number_share": 0.0, "zoom_tier": "factors"}

    # resident KV budget, a fraction of the document's full KV (also sizes the window and the spans at ingest)
    budget: float = ask_time(DEFAULT_BUDGET)
    # segmentation (sekv/segment.py): a boundary where surprisal > mu + alpha * sigma
    alpha: float = 1.0
    min_span: int = 0  # 0: from the budget (segment.auto_lengths)
    max_span: int = 0  # 0: 2 * min_span
    n_sink: int = 4
    anchors: bool = True  # False: no full-resolution sinks or boundary tokens
    segmentation: str = "surprisal"  # or "fixed": equal chunks
    chunk: float = 0.0  # the fixed chunk length; 0: the surprisal spans' mean length
    window: int = -1  # full-resolution tokens at the document's end; -1: min(512, 0.25 * budget * N)
    weighting: str = "surprisal"  # the coarse entry's weights over its span's tokens, or "mean"
    # number tokens (text with a digit) kept at full resolution, at most this share of the budget's tokens b x N
    # (sekv/numbers.py; longest numbers first); 0: none
    number_share: float = 0.0
    # what a zoomed block holds (sekv/zoom_tier.py): "int8" / "exact" the span tokens' own K / V stored in the pack
    # (int8 with a scale a row / the store dtype), read in place of the factors' rebuild; "factors": the rebuild
    zoom_tier: str = "int8"
    read_zoom_tier: bool = ask_time(True)  # False: a pack's zoom tier is not read (the factors' rebuild, as without one)
    # factors (sekv/factorize.py, sekv/codec.py)
    rank_max: int = 32
    energy_k: float = 0.99  # untrained rank rule: the smallest rank keeping this share of sigma^2
    energy_v: float = 0.99
    factors_8bit: bool = True
    factor_bits: int = 4  # 4: int8 factors stored 4-bit coded in the pack, decoded to int8 at open; 8: int8
    value_bits: int = 3  # with factor_bits 4: the value factors' code (3: nf3, 4: nf4 like the keys)
    scale_bits: int = 8  # with factor_bits 4: row scales at rest (8: log8 codes, 16: float16)
    factor_dtype: str = "float16"  # float factors when not 8-bit ("float32" for exactness tests)
    store_dtype: str = "auto"  # full-resolution / coarse tensors at rest: the model dtype if 16-bit, else float16; "model"
    key_space: str = "pre_rope"  # keys factorised before RoPE, or "post_rope"
    svd: str = "gram"  # or "svd" (torch.linalg.svd)
    # router (sekv/router.py)
    d_r: int = D_R
    tau: float = 0.0  # > 0: one gate threshold for every head instead of the router's
    tau_mode: str = "per_head"  # or "global": one threshold, the mean of the per-head logits
    # "auto": the trained router shipped for this model (sekv_core/routers/), else "untrained"; or a router file
    router: str = ask_time("auto")
    # decoding
    zoom: str = "router"  # "all": every span expanded (the exactness check); "none": coarse entries only
    head_masks: bool = True  # each query head sees only the spans it wanted itself (SPEC §2.6)
    # "scout": one ranking of zoom blocks per question, shared by every layer (sekv/scout.py);
    # "per_layer": each layer keeps spans in the order of its own gates (SPEC §2.4)
    routing: str = ask_time("scout")
    profile_weight: float = ask_time(0.75)  # scout: rank = question's sum - profile_weight x the document end's
    # the unit the budget keeps: spans cut into blocks of at most this many tokens (0: whole spans)
    zoom_unit: int = ask_time(16)
    # scout: rank = z(attention - profile) + lexical_weight x z(lexical score of the question's words); 0: attention alone
    lexical_weight: float = ask_time(2.0)
    # scout: "demote" ranks the question's look-alike passages (most of its best match's words but not the rarest,
    # away from it: sekv/lexical.py) after every other block; "keep" ranks them as the rest (docs/long-documents.md,
    # "Four needles: look-alike passages")
    lookalikes: str = ask_time("demote")
    # past the window (sekv/positions.py): "spread" keeps the document's gaps between resident units, scaled to fit the
    # window; "packed" puts the resident units at consecutive positions
    reposition: str = ask_time("packed")
    # past the window (sekv/positions.py), what the coarse entries together stand for (each one's + log of its span's
    # hidden tokens): "document": every hidden token, as within the window; "window": their counts scaled by p0 /
    # document tokens; "none": hidden, the model reads the full-resolution tokens and the zoomed blocks
    # (docs/long-documents.md, "Why needles were missed past the window")
    coarse_mass: str = ask_time("document")
    # "kvzip": KVzip's reconstruction scores computed at ingest (one more pass over the document) and stored as a
    # per-token prior; the scout adds prior_weight x z(each block's pooled prior) to its ranking (sekv/prior.py)
    prior: str = "none"
    prior_weight: float = ask_time(1.0)
    prior_pool: str = ask_time("mean")  # a block's prior: the mean or the max of its tokens'

    def __post_init__(self):
        self._one_of("routing", ROUTINGS)
        self._one_of("zoom", ZOOMS)
        self._one_of("segmentation", SEGMENTATIONS)
        self._one_of("tau_mode", TAU_MODES)
        self._one_of("key_space", KEY_SPACES)
        self._one_of("weighting", WEIGHTINGS)
        self._one_of("reposition", REPOSITIONS)
        self._one_of("coarse_mass", COARSE_MASSES)
        self._one_of("factor_bits", (8, 4))
        self._one_of("value_bits", (3, 4))
        self._one_of("scale_bits", (8, 16))
        self._one_of("prior", PRIORS)
        self._one_of("prior_pool", POOLS)
        self._one_of("zoom_tier", TIERS)
        self._one_of("lookalikes", LOOKALIKES)
        if self.router not in ("auto", "untrained"):  # a router file: recorded absolute, found from any directory
            object.__setattr__(self, "router", str(Path(self.router).expanduser().resolve()))

    @property
    def ask_budget(self) -> float | None:
        """The budget as a cap on resident bytes; None: no cap (0 or >= 1)."""
        return None if self.budget <= 0 or self.budget >= 1 else self.budget

    @property
    def layout_budget(self) -> float:
        """The budget that sizes spans and the window at ingest (the default where it is no cap)."""
        return self.budget if 0 < self.budget < 1 else DEFAULT_BUDGET

    @property
    def coded(self) -> bool:
        """Factors stored 4-bit coded in the pack."""
        return self.factors_8bit and self.factor_bits == 4

    @property
    def block_unit(self) -> int:
        """The zoom block length the memory uses (per-layer routing gates whole spans: 0)."""
        return max(0, self.zoom_unit) if self.routing == "scout" else 0


@dataclass(frozen=True)
class Ablation:
    """A named variant of the method (SPEC §4): the parameters it changes.  ``sekv bench --ablations NAME``
    or ``--methods sekv:NAME``."""

    name: str
    what: str
    overrides: Mapping[str, Any] = field(default_factory=dict)

    def apply(self, params: SekvParams) -> SekvParams:
        return params.replace(**self.overrides)


ABLATIONS: dict[str, Ablation] = {a.name: a for a in (
    Ablation("no-svd", "coarse entries only, nothing is ever expanded", {"zoom": "none"}),
    Ablation("fixed-chunks", "equal chunks of the surprisal spans' mean length", {"segmentation": "fixed"}),
    Ablation("no-anchors", "no sinks, no boundary tokens at full resolution", {"anchors": False}),
    Ablation("mean-pool", "span means with equal weights", {"weighting": "mean"}),
    Ablation("global-tau", "one gate threshold for every (layer, head)", {"tau_mode": "global"}),
    Ablation("untrained-router", "the PCA-initialised router even where a trained one exists", {"router": "untrained"}),
    Ablation("per-layer-routing", "each layer ranks spans by its own gates (no scout pass)", {"routing": "per_layer"}),
    Ablation("no-lexical", "the scout ranks by attention alone", {"lexical_weight": 0.0}),
    Ablation("keep-lookalikes", "the question's look-alike passages ranked as the rest, not last", {"lookalikes": "keep"}),
    Ablation("whole-spans", "the budget keeps whole spans, the paper's unit, not 16-token blocks", {"zoom_unit": 0}),
    Ablation("4bit-factors", "value factors 4-bit and float16 row scales at rest", {"value_bits": 4, "scale_bits": 16}),
    Ablation("8bit-factors", "factors stored as int8 in the pack", {"factor_bits": 8}),
)}
