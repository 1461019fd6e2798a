"""`sekv`: SeKV memory + zoom-in decoding (SPEC §1-2), untrained router.

compress (ingest): surprisal -> anchors + spans (sekv/segment.py) -> coarse means
(sekv/summarize.py) -> per-span SVD factors of pre-RoPE keys and of values
(sekv/factorize.py, sekv/rope.py) -> router W, norms, tau (sekv/router.py).

open (ask): full-resolution tokens + coarse entries + router on the compute
device; factors stay in CPU memory (read from the pack, K and V concatenated
per layer) and only the factors of the spans expanded at a step are gathered
(into pinned staging buffers, copied on a side stream on CUDA) and
reconstructed.  The attention
itself is sekv/attention.py.

Pack tensors (all prefixed ``sekv.``; L layers):
  config [8] int64: N, L, Hkv, d, min_span, max_span, window, n_sink
  key_space [1] int64: 1 = keys factorised before RoPE, 0 = after
  rope_inv_freq [d/2] float32 (pre-RoPE packs), rope_scaling [1] float32
  span_start / span_end [S] int64, full_idx [F] int64, anchor_idx [A] int64
  full.k.l / full.v.l   [Hkv, F, d]  model dtype
  coarse.k.l / coarse.v.l [Hkv, S, d] model dtype
  router.w.l [Hw, d_r, d] model dtype (float32 before 2026-12-01), router.norm.l [Hw, S] float32, router.tau [L, H] float32
  fk.l.* / fv.l.*  packed factors (sekv/factorize.py); with factor_bits=4 us/vt at rest as us.q4, us.q4m, vt.q4,
                   vt.q4m, vt.lead (value factors with value_bits=3: us.q3, ... ), row scales us_scale.l8 /
                   us_scale.l8p / vt_scale.l8 / vt_scale.l8p with scale_bits=8, and factor_codec [4-5] int64
                   (+ factor_codec.fv where the values' code differs; sekv/codec.py), decoded to int8 at open
  router.ttau [L, H] float32 (a trained router; its W is read from the router file at open, sekv/router.py)
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch

from ..sekv import codec
from ..sekv import blocks as fb
from ..sekv import factorize as fz
from ..sekv import lexical, rope, router, scout
from ..sekv.decode import BatchedDecoder
from ..sekv.attention import build_mask, coarse_scores, mixed_attention, place, route, select
from ..sekv.segment import Segmentation, auto_lengths, fixed_segment, segment, zoom_blocks
from ..sekv.summarize import span_weights, weighted_means
from ..errors import PackError, SekvError
from .base import CacheMethod, GrowingKV, KVMemory, ModelShape, PrefillResult, StepStats, TensorStore

_ZOOMS = ("router", "all", "none")
ROUTINGS = ("scout", "per_layer")
SEGMENTATIONS = ("surprisal", "fixed")
TAU_MODES = ("per_head", "global")

#: named ablations (SPEC §4; docs/sekv.md "Ablations"): parameter overrides, selectable in
#: `sekv bench --ablations NAME,...` or `--methods sekv:NAME`
ABLATIONS: dict[str, dict[str, Any]] = {
    "no-svd": {"zoom": "none"},  # coarse entries only, nothing is ever expanded
    "fixed-chunks": {"segmentation": "fixed"},  # equal chunks of the surprisal spans' mean length
    "no-anchors": {"anchors": False},  # no sinks, no boundary tokens at full resolution
    "mean-pool": {"weighting": "mean"},  # span means with equal weights
    "global-tau": {"tau_mode": "global"},  # one threshold for every (layer, head)
    "untrained-router": {"router": "untrained"},  # the PCA-initialised router even where a trained one exists
    "per-layer-routing": {"routing": "per_layer"},  # each layer ranks spans by its own gates (no scout pass)
    "no-lexical": {"lexical_weight": 0.0},  # the scout ranks by attention alone (docs/sekv.md §7f)
    "whole-spans": {"zoom_unit": 0},  # the budget keeps whole spans, the paper's unit, not 16-token blocks
    # the at-rest storage before 3-bit values and log8 row scales (the default until 2026-12-01, docs/sekv.md §3)
    "4bit-factors": {"value_bits": 4, "scale_bits": 16},
    "8bit-factors": {"factor_bits": 8},  # factors stored as int8 in the pack (before 4-bit became the default)
}


def apply_tau_mode(rt: router.Router, mode: str) -> router.Router:
    """``per_head``: the router as loaded; ``global``: every (layer, head) threshold replaced by one
    value, the probability whose logit is the mean of the per-head logit thresholds."""
    if mode not in TAU_MODES:
        raise SekvError(f"sekv: tau_mode must be one of {', '.join(TAU_MODES)}, not {mode!r}")
    if mode == "per_head":
        return rt
    tau = torch.full_like(rt.tau, float(torch.sigmoid(rt.logit_tau().double().mean())))
    return dataclasses.replace(rt, tau=tau)


def _config(store: TensorStore) -> dict[str, int]:
    c = store.get("sekv.config").tolist()
    return dict(zip(("n_tokens", "n_layers", "n_kv_heads", "head_dim", "min_span", "max_span", "window", "n_sink"), c))


def store_dtype(params: dict[str, Any], model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the pack's full-resolution tokens, coarse entries and PCA W: the model's when it is 16-bit, else
    float16 (a float32 model on a CPU without bf16 would double them: the 3.2K manual's pack 0.228 -> 0.19 of the raw
    fp16 KV); ``store_dtype="model"`` keeps the model's (exactness tests)."""
    if params.get("store_dtype", "auto") == "model" or model_dtype in (torch.float16, torch.bfloat16):
        return model_dtype
    return torch.float16


def zoom_band(params: dict[str, Any], n_layers: int) -> tuple[int, int, float]:
    """(zoom_from, zoom_to, zoom_outer) clamped: the layers [zoom_from, zoom_to) share the expansion room (zoom_to 0:
    through the last layer), a layer outside gets zoom_outer (0..1) times the share of one inside."""
    z0 = min(max(0, int(params.get("zoom_from", 0))), n_layers - 1)
    z1 = min(max(z0 + 1, int(params.get("zoom_to", 0)) or n_layers), n_layers)
    return z0, z1, min(max(0.0, float(params.get("zoom_outer", 0.0))), 1.0)


class SekvMemory(KVMemory):
    """Runtime SeKV memory of one pack.

    Public beyond KVMemory: ``spans()`` (span id -> (start, end) token range),
    ``step_stats()`` (see docs/sekv.md for the ``extra`` keys).
    """

    def __init__(self, store: TensorStore, params: dict[str, Any], shape: ModelShape, device):
        device = torch.device(device)
        self.shape, self.device, self.params = shape, device, params
        cfg = _config(store)
        self.n_doc = cfg["n_tokens"]
        L, hkv, d, H = shape.n_layers, shape.n_kv_heads, shape.head_dim, shape.n_heads
        if (cfg["n_layers"], cfg["n_kv_heads"], cfg["head_dim"]) != (L, hkv, d):
            raise PackError("the sekv pack's attention shape does not match the model; re-ingest the document")
        self.span_start = store.get("sekv.span_start").long()
        self.span_end = store.get("sekv.span_end").long()
        self.span_len = self.span_end - self.span_start
        S = self.n_spans = int(self.span_start.numel())
        self.n_full = int(store.get("sekv.full_idx").numel())
        self.pre_rope = bool(store.get("sekv.key_space")[0])
        if self.pre_rope:
            self.inv_freq = store.get("sekv.rope_inv_freq").float().to(device)
            self.rope_scaling = float(store.get("sekv.rope_scaling")[0])

        # compute-device residents: [full-res | coarse] (+ appended tokens) per layer, router
        keys = [torch.cat([store.get(f"sekv.full.k.{i}"), store.get(f"sekv.coarse.k.{i}")], 1).to(shape.dtype) for i in range(L)]
        vals = [torch.cat([store.get(f"sekv.full.v.{i}"), store.get(f"sekv.coarse.v.{i}")], 1).to(shape.dtype) for i in range(L)]
        self.n_base = self.n_full + S
        self.kv = GrowingKV.from_tensors(keys, vals, device, extra=256)
        rt = router.load(store, params, shape)
        rt = apply_tau_mode(rt, params.get("tau_mode", "per_head"))
        self.router_source = rt.source
        self.w = rt.w.to(device, shape.dtype)  # [L, Hw, d_r, d]
        if rt.source == "pack":
            norms = torch.stack([store.get(f"sekv.router.norm.{i}").float() for i in range(L)])
        else:  # a swapped-in router: norms of its own W
            norms = torch.stack([router.span_norms(rt.w[i], store.get(f"sekv.coarse.k.{i}")) for i in range(L)])
        self.inv_norm = (1.0 / (norms.clamp_min(1e-6) * math.sqrt(rt.d_r))).to(device)  # [L, Hw, S]
        self.logit_tau = rt.logit_tau().to(device)  # [L, H]
        self.log_n = self.span_len.float().log().to(device)
        # zoom blocks (sekv/segment.py zoom_blocks): the unit the scout's ranking and the budget cap keep (the per-layer
        # router gates whole spans); zoom_unit 0 = whole spans (SPEC).  A block is rebuilt from its span's factors (its
        # rows of U*sigma, the span's Vt); a span's coarse entry then stands for its tokens not expanded
        self.zoom_unit = max(0, int(params.get("zoom_unit", 0))) if params.get("routing", "scout") == "scout" else 0
        bs, b0, b1 = zoom_blocks(self.span_start, self.span_end, self.zoom_unit)
        self.block_span, self.block_start, self.block_len = bs.long(), b0.long(), (b1 - b0).long()
        self.block_off = self.block_start - self.span_start[self.block_span]
        self.n_blocks = int(self.block_span.numel())
        self.whole_spans = self.n_blocks == S and bool((self.block_len == self.span_len).all())
        self.block_span_dev = self.block_span.to(device)
        self.block_len_dev = self.block_len.to(device)
        self.block_off_dev = self.block_off.to(device)
        self.block_start_dev = self.block_start.to(device)

        # CPU side: packed factors (pack tensors, never moved whole); K and V stacked so one gather and one
        # batched product serve both (V blocks are "heads" Hkv..2Hkv-1)
        self.factors: list[tuple[fz.Factors, fz.Layout]] = []
        names = set(store.keys())
        for i in range(L):
            f = fz.stack_kv(*(self._factors(store, names, f"sekv.{kind}.{i}", device) for kind in ("fk", "fv")))
            self.factors.append((f, fz.Layout.of(f, self.span_len, d)))
        self.cuda = device.type == "cuda"
        # accelerators take the batched, sync-free step (sekv/decode.py); the CPU keeps the reference step.  The
        # batched step sizes one slot buffer for every layer, so a zoom limited to some layers (zoom_from /
        # zoom_to) takes the reference step there too
        z0, z1, outer = zoom_band(params, shape.n_layers)
        self.batched = self.cuda and ((z0, z1) == (0, shape.n_layers) or outer >= 1.0)
        self._dec = None
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self.staging = [{"_pin": True}, {"_pin": True}]  # double-buffered pinned staging, by layer parity
            self.staging_done = [None, None]
        self.span_len_dev = self.span_len.to(device)
        self.span_start_dev = self.span_start.to(device)

        isz = torch.empty(0, dtype=shape.dtype).element_size()
        self.entry_bytes = 2 * d * isz  # K+V of one token of one KV head
        self.cost = (self.span_len * self.entry_bytes).to(device)  # bytes to reconstruct span i for one KV group
        self.block_cost = (self.block_len * self.entry_bytes).to(device)  # ... zoom block b
        # per-document router state counts as resident KV; a trained W is a model parameter (the same for every
        # document, like the model's own projections), so only the untrained, per-document PCA W is counted
        per_doc = (self.inv_norm, self.logit_tau, self.log_n) + ((self.w,) if rt.source == "pack" else ())
        self.router_bytes = sum(t.numel() * t.element_size() for t in per_doc)
        budget = float(params.get("budget", 0.10))
        self.budget = None if budget <= 0 or budget >= 1 else budget
        self.head_masks = bool(params.get("head_masks", True))
        self.zoom = params.get("zoom", "router")
        #: CPU reference step only: (layer, head candidates [H, S], group priority [Hkv, S]) -> the same, replaced
        self.route_hook = None
        if self.zoom not in _ZOOMS:
            raise SekvError(f"sekv: zoom must be one of {', '.join(_ZOOMS)}, not {self.zoom!r}")
        self.routing = params.get("routing", "scout")
        if self.routing not in ROUTINGS:
            raise SekvError(f"sekv: routing must be one of {', '.join(ROUTINGS)}, not {self.routing!r}")
        # scout routing (sekv/scout.py): the question's span ranking, one value per span, shared by every layer;
        # a fixed device buffer (the batched step's CUDA graphs read it), filled by prepare_question()
        self.shared_prio = torch.zeros(self.n_blocks, device=device) if self.routing == "scout" and self.zoom == "router" else None
        self._scouting = False
        self._scout_sum = None
        self.prio_version = 0  # bumped with every new ranking: the batched step's fixed sets are keyed on it
        self.truncations = 0
        # the ranking holds for the ask that follows prepare_question(); a forward of an ask without one (a
        # caller that bypasses generate()) routes per layer on the CPU step
        self._scout_pending = self._scout_ready = False
        # the document end's span profile (sekv/scout.py), subtracted from the question's; absent in older packs
        self.scout_profile = self._profile(store, names)
        # the document's word terms (sekv/lexical.py), indexed by zoom block; absent in older packs
        self.lexicon = lexical.Lexicon(store.get("sekv.lex.terms"), self.block_start, self.block_len) if "sekv.lex.terms" in names and self.n_blocks else None
        self._reset_ask()
        self._last_resident = self.resident_bytes()

    def span_level(self, x: torch.Tensor) -> torch.Tensor:
        """[R, B] bool over zoom blocks -> [R, S] bool over spans: a span is set when any of its blocks is."""
        if self.whole_spans:
            return x
        bs = self.block_span_dev if x.device == self.block_span_dev.device else self.block_span.to(x.device)
        return torch.zeros(x.shape[0], self.n_spans, device=x.device).index_add_(1, bs, x.float()) > 0

    def coarse_mask(self, expanded: torch.Tensor) -> torch.Tensor:
        """The coarse entries' additive scores [H, S] for a head x block expansion [H, B]: + log of the tokens of the
        span not expanded, -inf where all of them are (SPEC §2.5 with whole spans: + log n_i or hidden)."""
        if self.whole_spans:
            return torch.where(expanded, float("-inf"), self.log_n.float().view(1, -1))
        return coarse_scores(expanded, self.block_span_dev, self.block_len_dev, self.span_len_dev)

    def _profile(self, store: TensorStore, names: set[str]) -> torch.Tensor | None:
        """The document profile per zoom block: the pack's block profile when it was made for this zoom_unit, else
        the span profile given to each of a span's blocks; None in packs from before profiles."""
        if "sekv.scout.profile" not in names:
            return None
        if "sekv.scout.profile_blocks" in names and int(store.get("sekv.scout.profile_unit")[0]) == self.zoom_unit:
            prof = store.get("sekv.scout.profile_blocks").float()
            if prof.numel() == self.n_blocks:
                return prof.to(self.device)
        return store.get("sekv.scout.profile").float()[self.block_span].to(self.device)

    @staticmethod
    def _factors(store: TensorStore, names: set[str], prefix: str, device=None) -> fz.Factors:
        # factor_bits=4 packs: decoded to int8 here (on an accelerator when the memory opens on one)
        coded = codec.read_factors(store, names, prefix, device=device)
        if coded is not None:
            return coded
        sc = f"{prefix}.us_scale" in names
        return fz.Factors(
            store.get(f"{prefix}.us"),
            store.get(f"{prefix}.vt"),
            store.get(f"{prefix}.rank"),
            store.get(f"{prefix}.us_scale") if sc else None,
            store.get(f"{prefix}.vt_scale") if sc else None,
        )

    # -- KVMemory -------------------------------------------------------------------------------------------

    def n_tokens(self) -> int:
        return self.n_doc + self.kv.len[-1] - self.n_base

    def truncate(self, n_tokens: int) -> None:
        self.kv.truncate(self.n_base + max(0, n_tokens - self.n_doc))
        self.truncations += 1  # a fixed set's mask must hide the dropped tokens again (sekv/decode.py)
        self._stats_stale = True  # this ask's stats stay readable until the next forward starts

    def resident_bytes(self) -> int:
        return self.kv.nbytes() + self.router_bytes + (self._dec.resident_bytes() if self._dec is not None else 0)

    def spans(self) -> list[tuple[int, int]]:
        return list(zip(self.span_start.tolist(), self.span_end.tolist()))

    def step_stats(self) -> StepStats:
        if self._dec is not None:
            self._dec.fold_stats()
        rates = [(r / self._steps if self._steps else 0.0) for r in self._rate_sum.tolist()]
        counts = {int(i): int(c) for i, c in zip(torch.nonzero(self._span_counts).flatten().tolist(), self._span_counts[self._span_counts > 0].tolist())}
        return StepStats(
            resident_bytes=int(self._last_resident),
            extra={
                "zoom_spans_step": int(self._step_spans.sum()),
                "zoom_spans_total": int(self._ask_spans.sum()),
                "h2d_bytes_step": int(self._h2d_step),
                "h2d_bytes_total": int(self._h2d_total),
                "zoom_rate_per_layer": rates,
                "span_zoom_counts": counts,
                "budget_bytes": int(self._budget_bytes),
                "appended_bytes": int(self._appended_bytes),
                "span_order": self._span_order(),
            },
        )

    def _span_order(self, limit: int = 32) -> list[int]:
        """Under a scout ranking: the spans in the order of their best-ranked zoom block (the first `limit`), which
        orders the evidence where every layer expanded the same spans; else []."""
        if self.shared_prio is None or not self._scout_ready or self.n_spans == 0:
            return []
        cached = getattr(self, "_span_order_of", None)
        if cached is None or cached[0] != self.prio_version:  # once per ranking: step_stats() runs every step
            best = torch.full((self.n_spans,), float("-inf")).scatter_reduce(0, self.block_span, self.shared_prio.float().cpu(), "amax")
            self._span_order_of = cached = (self.prio_version, torch.argsort(best, descending=True, stable=True)[:limit].tolist())
        return list(cached[1])

    # -- stats ----------------------------------------------------------------------------------------------

    def _reset_ask(self) -> None:
        S, L = self.n_spans, self.shape.n_layers
        self._ask_spans = torch.zeros(S, dtype=torch.bool)
        self._step_spans = torch.zeros(S, dtype=torch.bool)
        self._span_counts = torch.zeros(S, dtype=torch.long)
        self._rate_sum = torch.zeros(L, dtype=torch.float64)
        self._steps = 0
        self._h2d_step = self._h2d_total = 0
        self._budget_bytes = 0
        self._appended_bytes = 0
        self._zoom_from, self._zoom_to = 0, self.shape.n_layers
        self._cap_outer = 0
        self._stats_stale = False
        self._reused = 0
        self._scout_ready, self._scout_pending = getattr(self, "_scout_pending", False), False
        self._held: list[tuple | None] = [None] * L  # per layer: (keep, rows K, rows V, slot spans) of its last step
        if getattr(self, "_dec", None) is not None:
            self._dec.reset_stats()

    def prepare_question(self, forward, question: str | None = None) -> None:
        """Scout pass (routing="scout"): run the question once with the per-layer router, summing each layer's
        z-scored masses of the zoom blocks; the answer's forwards then rank blocks by the sum (minus the document
        profile), plus ``lexical_weight`` x the z-scored lexical score of the question's text (sekv/lexical.py)
        where the pack has the document's terms.  forward() runs the question's tokens through the model over
        this memory; they are dropped again afterwards."""
        if self.shared_prio is None or self.n_spans == 0:
            return
        base = self.n_tokens()
        self._scouting, self._scout_sum = True, torch.zeros(self.n_blocks, dtype=torch.float32, device=self.device)
        try:
            forward()
            w = float(self.params.get("profile_weight", 0.75))
            prof = self.scout_profile
            clip = float(self.params.get("profile_clip", 0.0))
            if prof is not None and clip > 0:  # only the spans that stand out in the profile (mean 0: a sum of z-scores)
                prof = (prof - clip * prof.std()).clamp_min(0)
            rank = self._scout_sum if prof is None else self._scout_sum - w * prof
            lw = float(self.params.get("lexical_weight", 0.0))
            if lw > 0 and question and self.lexicon is not None:
                lex = self.lexicon.scores(question).to(self.device)
                if float(lex.max()) > 0:  # no question word in the document: attention alone
                    rank = scout.zscore(rank) + lw * scout.zscore(lex)
            self.shared_prio.copy_(rank)
            self.prio_version += 1
            self._scout_pending = True
        finally:
            self._scouting, self._scout_sum = False, None
            self.truncate(base)

    def scout_ranks(self) -> bool:
        """Whether this forward keeps spans in the scout's order (scout routing, after a scout pass for this ask)."""
        return self.shared_prio is not None and self._scout_ready and not self._scouting

    def _scout_layer(self, layer: int, query: torch.Tensor, scaling: float) -> None:
        """Add this layer's z-scored masses of the zoom blocks (spans when zoom_unit is 0; sekv/scout.py) for the
        question's queries [1, H, T, d]."""
        d, hkv = self.shape.head_dim, self.shape.n_kv_heads
        q = query[0].float().reshape(hkv, -1, d)  # [Hkv, G*T, d]: a group's heads and tokens
        k_full = torch.cat([self.kv.k[layer][0, :, : self.n_full], self.kv.k[layer][0, :, self.n_base : self.kv.len[layer]]], 1)
        other = torch.logsumexp(torch.bmm(q, k_full.float().transpose(1, 2)) * scaling, dim=-1)  # [Hkv, G*T]
        if self._dec is not None:  # the batched step's blocks: gathered on the device, no host work per chunk
            lse, grp, sid = self._scout_blocks(layer, q, scaling)
            mass = scout.layer_mass(lse, grp, sid, other, self.n_blocks)
            self._scout_sum += scout.zscore(mass)
            return
        # blocks in chunks of about the layer's zoom budget in reconstructed keys (at least one block)
        per_block = hkv * int(self.block_len.max()) * d * 4
        chunk = max(1, int((self._cap or per_block) // per_block))
        lse, grp, sid = [], [], []
        for a in range(0, self.n_blocks, chunk):
            b = torch.arange(a, min(a + chunk, self.n_blocks)).repeat(hkv)
            g = torch.arange(hkv).repeat_interleave(b.numel() // hkv)
            rows = self._block_rows(layer, g, b)
            gd, bd = g.to(self.device), b.to(self.device)
            lse.append(scout.span_logsumexp(q, rows, self.block_len_dev[bd], gd, scaling))
            grp.append(gd)
            sid.append(bd)
        mass = scout.layer_mass(torch.cat(lse), torch.cat(grp), torch.cat(sid), other, self.n_blocks)
        self._scout_sum += scout.zscore(mass)

    def _scout_blocks(self, layer: int, q: torch.Tensor, scaling: float):
        """The scout pass's logsumexps of the zoom blocks from the batched step's factor blocks (one per (group,
        span)), in chunks of as many (group, span) pairs as a step may fetch (the step's own transient workspace,
        in float32): -> (lse [E, M], group [E], block [E])."""
        dec, S = self._dec, self.n_spans
        b = dec.blocks[layer]
        n_pairs = self.shape.n_kv_heads * S
        chunk = max(dec.P, 64)
        first, counts, per_span, row_block = self._span_blocks()
        lse, grp, sid = [], [], []
        for a in range(0, n_pairs, chunk):
            pair = torch.arange(a, min(a + chunk, n_pairs), device=self.device)
            rows, _ = fb.fetch(b, pair, torch.ones_like(pair, dtype=torch.bool))
            us, vt = fb.unpack(b, rows, torch.float32)
            g, i = pair // S, pair % S
            keys = self._rope_rows(torch.matmul(us[:, 0], vt[:, 0]), self.span_start_dev[i])  # [P, n_max, d]; rows past n_i are masked
            if self.whole_spans:
                lse.append(scout.span_logsumexp(q, keys, self.span_len_dev[i], g, scaling))
                grp.append(g)
                sid.append(i)
                continue
            # one segmented logsumexp: each row's exp (against its pair's max) summed into its block of the span
            logits = torch.bmm(q[g], keys.transpose(1, 2)) * scaling  # [P, M, n_max]
            rb = row_block[i]  # [P, n_max]: the block-within-span of each row, -1 past the span
            mx = logits.masked_fill((rb < 0).unsqueeze(1), float("-inf")).amax(-1, keepdim=True)  # [P, M, 1]
            e = torch.exp(logits - mx).masked_fill((rb < 0).unsqueeze(1), 0.0)
            sums = torch.zeros(*e.shape[:2], per_span, device=self.device).scatter_add_(2, rb.clamp_min(0).unsqueeze(1).expand_as(e), e)
            part = (sums.log() + mx).transpose(1, 2).reshape(-1, e.shape[1])  # [P * per_span, M]
            k = torch.arange(per_span, device=self.device).view(1, -1)
            blk = (first[i].view(-1, 1) + k).flatten()
            has = (k < counts[i].view(-1, 1)).flatten()
            lse.append(part[has])
            grp.append(g.view(-1, 1).expand(-1, per_span).flatten()[has])
            sid.append(blk[has])
        return torch.cat(lse), torch.cat(grp), torch.cat(sid)

    def _span_blocks(self) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """(first zoom block of each span [S], its number of blocks [S], the most blocks a span has, the block-within-
        span of each row of each span [S, n_max] (-1 past its end)), on the device; computed once."""
        if getattr(self, "_span_block_tables", None) is None:
            counts = torch.bincount(self.block_span, minlength=self.n_spans)
            first = torch.cumsum(counts, 0) - counts
            n_max = int(self.span_len.max())
            row_block = torch.full((self.n_spans, n_max), -1, dtype=torch.long)
            for k in range(int(counts.max())):  # the k-th block of each span that has one
                b = (first + k)[counts > k]
                rows = self.block_off[b].view(-1, 1) + torch.arange(n_max).view(1, -1)
                inside = rows < (self.block_off[b] + self.block_len[b]).view(-1, 1)
                sp = self.block_span[b].view(-1, 1).expand_as(rows)
                row_block[sp[inside], rows[inside]] = k
            self._span_block_tables = (first.to(self.device), counts.to(self.device), int(counts.max()), row_block.to(self.device))
        return self._span_block_tables

    def _fetch_blocks(self, layer: int, g: torch.Tensor, b: torch.Tensor, out: dict | None = None) -> fz.Fetch:
        """The factor rows of (factor head g, zoom block b) pairs (host indices; g >= Hkv: value heads)."""
        f, lay = self.factors[layer]
        return fz.gather(f, lay, self.span_len, g, self.block_span[b], self.shape.head_dim, out=out, row0=self.block_off[b], rows=self.block_len[b])

    def _block_rows(self, layer: int, g: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Keys of (group g, zoom block b) pairs rebuilt from the factors, post-RoPE: [E, n_max, d] float32."""
        dev = self._fetch_blocks(layer, g, b).to(self.device)
        return self._rope_rows(fz.expand(dev, self.shape.head_dim, torch.float32), self.block_start_dev[b.to(self.device)])

    def _rope_rows(self, rows: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE packs: rotate reconstructed key rows [E, n_max, d] of blocks starting at token positions start [E]
        to their positions (in place)."""
        if self.pre_rope and rows.numel():
            d = rows.shape[-1]
            pos = start.view(-1, 1) + torch.arange(rows.shape[1], device=self.device).view(1, -1)
            cos, sin = rope.cos_sin(pos.flatten(), self.inv_freq, self.rope_scaling, dtype=self.shape.dtype)
            rows[:] = rope.apply(rows.reshape(-1, d), cos, sin).view(rows.shape)
        return rows

    def _begin_forward(self, n_new: int) -> None:
        if self._stats_stale:
            self._reset_ask()
        self._steps += 1
        self._step_spans = torch.zeros(self.n_spans, dtype=torch.bool)
        self._h2d_step = 0
        self._expanded_bytes = 0
        # the budget is b x the full KV of the DOCUMENT's tokens, against the document's persistent part (full-res
        # tokens, coarse entries, router state) plus the reconstructed spans; the question's and generated tokens
        # (the appended tail) are resident on top, like the baselines that never compress the question, and are
        # reported separately (step_stats: appended_bytes)
        L = self.shape.n_layers
        per_tok = self.shape.n_kv_heads * self.entry_bytes * L
        appended = (self.kv.len[-1] + n_new - self.n_base) * per_tok
        doc_persistent = self.n_base * per_tok + self.router_bytes
        persistent = doc_persistent + appended
        self._persistent, self._appended_bytes = persistent, appended
        if self.budget is None or self.zoom == "all":
            full = (self.n_tokens() + n_new) * self.shape.kv_bytes_per_token()
            self._budget_bytes = full if self.budget is None else int(self.budget * self.n_doc * self.shape.kv_bytes_per_token())
            self._cap = None
        else:
            self._budget_bytes = int(self.budget * self.n_doc * self.shape.kv_bytes_per_token())
            # the expansion room, split over the layers: those in [zoom_from, zoom_to) get weight 1, the others
            # zoom_outer (0: they keep coarse entries only; 1, with the default band of every layer: equal shares)
            z0, z1, outer = zoom_band(self.params, L)
            room = max(0, self._budget_bytes - doc_persistent)
            unit = room / ((z1 - z0) + outer * (L - (z1 - z0)))
            self._cap = int(unit)  # per layer of the band
            self._cap_outer = int(unit * outer)  # per layer outside it
            self._zoom_from, self._zoom_to = z0, z1
        self._last_resident = persistent

    # -- attention ------------------------------------------------------------------------------------------

    def attend(self, layer, query, key, value, scaling):
        if self.device.type != "cpu":
            return self._attend(layer, query, key, value, scaling)
        # small tensor ops: one intra-op thread is faster (BLAS threading on [2, 7, 64] products costs 20x)
        with fz.single_thread():
            return self._attend(layer, query, key, value, scaling)

    def static_supported(self) -> bool:
        return self.batched  # the batched step has no host sync (sekv/decode.py)

    def static_begin(self) -> None:
        if self._dec is None:
            self._dec = BatchedDecoder(self)
        self.kv.static_begin()
        self._begin_forward(1)
        self._dec.static_begin()

    def static_key(self):
        return self.kv.static_key() + self._dec.static_key()

    def static_end(self) -> None:
        self.kv.advance(1)

    def static_mode(self):
        return self.kv.static_mode()

    def _attend(self, layer, query, key, value, scaling):
        if layer == 0 and not self.kv.static:  # static steps: static_begin() did it
            self._begin_forward(query.shape[-2])
        if self.batched:
            if self._dec is None:
                self._dec = BatchedDecoder(self)
            out = self._dec.attend(layer, query, key, value, scaling)
            if self._scouting:
                self._scout_layer(layer, query, scaling)
            return out
        keys, values = self.kv.append(layer, key, value)
        H, q = query.shape[1], query.shape[2]
        hkv, B = self.shape.n_kv_heads, self.n_blocks
        n_tail = self.kv.len[layer] - self.n_base
        # keep [Hkv, B] / expanded [H, B] are over zoom blocks (= spans when zoom_unit is 0)
        if B == 0:
            expanded = torch.zeros(H, 0, dtype=torch.bool, device=query.device)
            keep = torch.zeros(hkv, 0, dtype=torch.bool, device=query.device)
        elif self.zoom == "none":
            expanded = torch.zeros(H, B, dtype=torch.bool, device=query.device)
            keep = torch.zeros(hkv, B, dtype=torch.bool, device=query.device)
        elif self.zoom == "all":
            expanded = torch.ones(H, B, dtype=torch.bool, device=query.device)
            keep = torch.ones(hkv, B, dtype=torch.bool, device=query.device)
        elif self._cap == 0 or not (self._zoom_from <= layer < self._zoom_to or self._cap_outer > 0):  # the persistent part fills the budget / no zoom here
            expanded = torch.zeros(H, B, dtype=torch.bool, device=query.device)
            keep = torch.zeros(hkv, B, dtype=torch.bool, device=query.device)
        else:
            cap = self._cap if self._zoom_from <= layer < self._zoom_to else self._cap_outer
            if self.scout_ranks():  # the question's ranking of zoom blocks, every layer; no gates to compute
                cand = torch.ones(H, B, dtype=torch.bool, device=query.device)
                prio = self.shared_prio.view(1, -1).expand(hkv, -1)
                if self.route_hook is not None:  # diagnostics (benchmarks/route_diagnosis.py): replace the routing
                    cand, prio = self.route_hook(layer, cand, prio)
                keep = select(prio, self.block_cost, cap)
            else:  # the router gates whole spans (SPEC §2.2-2.4); a kept span is all of its blocks
                kbar = self.kv.k[layer][0, :, self.n_full : self.n_base]
                logits = router.gate_logits(query[0], self.w[layer], kbar, self.inv_norm[layer], self.log_n)
                cand, prio = route(logits, self.logit_tau[layer], hkv)
                if self.route_hook is not None:
                    cand, prio = self.route_hook(layer, cand, prio)
                keep = select(prio, self.cost, cap)
                if not self.whole_spans:
                    cand, keep = cand[:, self.block_span_dev], keep[:, self.block_span_dev]
            expanded = keep.unsqueeze(1).expand(hkv, H // hkv, B).reshape(H, B)
            if self.head_masks:  # SPEC §2.6: each head sees the tokens only of spans it wanted itself
                expanded = expanded & cand

        slot_span = None
        if keep.any():
            cached = self._held[layer]
            if cached is not None and torch.equal(cached[0], keep):  # same spans as this layer's last step: still resident
                rk, rv, slot_span = cached[1:]
                self._reused += 1
            else:
                self._held[layer] = None  # release the old set before building the new one
                rk, rv, slot_span = self._reconstruct(layer, keep)
                self._held[layer] = (keep, rk, rv, slot_span)
            keys = torch.cat([keys, rk.unsqueeze(0)], 2)
            values = torch.cat([values, rv.unsqueeze(0)], 2)
        else:
            self._held[layer] = None
        mask = build_mask(
            n_heads=H, n_q=q, n_full=self.n_full, log_n=self.log_n, expanded=expanded, n_tail=n_tail, slot_span=slot_span, dtype=query.dtype,
            coarse=self.coarse_mask(expanded),
        )
        out = mixed_attention(query, keys, values, mask, scaling)
        self._account(layer, keep, expanded)
        if self._scouting:
            self._scout_layer(layer, query, scaling)
        return out

    def _reconstruct(self, layer: int, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fetch + reconstruct the kept (group, block) pairs -> rows K/V [Hkv, U, d], slot block ids [Hkv, U]."""
        d, hkv = self.shape.head_dim, self.shape.n_kv_heads
        g, i = torch.nonzero(keep.cpu(), as_tuple=True)  # sorted by group, then block
        g2, i2 = torch.cat([g, g + hkv]), torch.cat([i, i])  # K blocks, then V blocks
        if self.cuda:
            slot = layer % 2
            if self.staging_done[slot] is not None:
                self.staging_done[slot].synchronize()  # the staging buffers of this parity are free again
            host = self._fetch_blocks(layer, g2, i2, out=self.staging[slot])
            with torch.cuda.stream(self.copy_stream):
                dev = host.to(self.device, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.copy_stream)
            self.staging_done[slot] = ev
            main = torch.cuda.current_stream(self.device)
            main.wait_event(ev)
            for t in (dev.us, dev.vt, dev.us_scale, dev.vt_scale, dev.n, dev.r):
                if t is not None:
                    t.record_stream(main)
        else:
            dev = self._fetch_blocks(layer, g2, i2)
        self._h2d_step += dev.nbytes()
        rows = fz.expand(dev, d, torch.float32)  # [2E, n_max, d]
        e = g.numel()
        idev = i.to(self.device)
        self._rope_rows(rows[:e], self.block_start_dev[idev])
        out, blk, _ = place(rows.to(self.shape.dtype), g2.to(self.device), self.block_len_dev[i2.to(self.device)], 2 * hkv)
        slot_span = torch.where(blk[:hkv] >= 0, idev[blk[:hkv].clamp_min(0)], torch.full_like(blk[:hkv], -1))
        return out[:hkv], out[hkv:], slot_span

    def _account(self, layer: int, keep: torch.Tensor, expanded: torch.Tensor) -> None:
        if keep.numel() == 0:
            return
        kb = keep.cpu()
        self._expanded_bytes += int((kb.long() * self.block_len.view(1, -1)).sum()) * self.entry_bytes
        self._last_resident = self._persistent + self._expanded_bytes
        kb, eb = self.span_level(kb), self.span_level(expanded.cpu())  # a span counts as zoomed when any of its blocks is
        spans = kb.any(0)
        self._step_spans |= spans
        self._ask_spans |= spans
        self._span_counts += eb.long().sum(0)
        self._rate_sum[layer] += float(eb.float().mean())
        if layer == self.shape.n_layers - 1:
            self._h2d_total += self._h2d_step


class _HostCopies:
    """Pack tensors computed on an accelerator -> host memory, each layer's while the next one computes.

    Without an arena a worker thread copies into ordinary memory (page faults bound it: 1.5 GB/s on the H200
    machine, against 2.8 GB/s to page-lock and 55 GB/s to copy into locked memory, benchmarks/gpu_micro.py).
    With an ``arena`` (``SekvMethod.reserve_host``) a finished layer's tensors go into views of it, on a side
    stream that waits only for that layer's work: DMA copies issued from this thread when it is page-locked;
    when it is ordinary memory already faulted in, the worker thread copies (a pageable copy blocks its caller).
    On the CPU it does nothing.
    """

    def __init__(self, device: torch.device, arena: torch.Tensor | None = None):
        self.on = device.type == "cuda"
        self.done: set[str] = set()
        self.jobs = []
        self.arena, self.off = arena, 0
        if self.on:
            from concurrent.futures import ThreadPoolExecutor

            self.stream = torch.cuda.Stream(device)
            self.pool = ThreadPoolExecutor(1)

    def _slot(self, t: torch.Tensor) -> torch.Tensor | None:
        if self.arena is None:
            return None
        nb = t.numel() * t.element_size()
        o = (self.off + 63) // 64 * 64
        if o + nb > self.arena.numel():
            return None
        self.off = o + nb
        return self.arena[o : o + nb].view(t.dtype).view(t.shape)

    def submit(self, out: dict[str, torch.Tensor]) -> None:
        if not self.on:
            return
        todo = {k: t for k, t in out.items() if k not in self.done and t.device.type != "cpu"}
        self.done.update(todo)
        ev = torch.cuda.Event()
        ev.record()
        rest = {}
        pinned = self.arena is not None and self.arena.is_pinned()
        slots = {}
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ev)
            got = {}
            for k, t in todo.items():
                t = t.contiguous()
                dst = self._slot(t)
                if dst is None:
                    rest[k] = t
                elif pinned:
                    dst.copy_(t, non_blocking=True)
                    t.record_stream(self.stream)
                    got[k] = dst
                else:
                    slots[k] = (dst, t)
        self.jobs.append(got)
        if rest or slots:

            def work():
                with torch.cuda.stream(self.stream):
                    host = {k: dst.copy_(t) for k, (dst, t) in slots.items()}
                    return host | {k: t.to("cpu") for k, t in rest.items()}

            self.jobs.append(self.pool.submit(work))

    def finish(self, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not self.on:
            return out
        self.submit(out)
        host = dict(out)
        for j in self.jobs:
            host.update(j if isinstance(j, dict) else j.result())
        self.stream.synchronize()
        self.pool.shutdown()
        return host


def _to_host(out: dict[str, torch.Tensor], copies: "_HostCopies | None" = None) -> dict[str, torch.Tensor]:
    """Pack tensors -> host memory (what ``copies`` has not moved yet, then everything it moved)."""
    if copies is None:
        copies = _HostCopies(next((t.device for t in out.values() if t.device.type != "cpu"), torch.device("cpu")))
    return copies.finish(out)


class SekvMethod(CacheMethod):
    name = "sekv"
    summary = "SeKV: anchors + coarse span means on device, per-span SVD factors on CPU, zoom-in decoding"
    needs_surprisal = True
    # the document end's queries (the scout's question-independent profile) and the tokens' word terms (its lexical
    # evidence, sekv/lexical.py)
    needs_scores = ("obs_queries", "lex_terms")
    ablations = ABLATIONS
    default_params = {
        "budget": 0.10,  # resident KV budget, fraction of the full KV (also sizes window / spans at ingest)
        "alpha": 1.0,  # boundary: s_t > mu + alpha * sigma
        "min_span": 0,  # 0: auto from the budget (sekv/segment.py auto_lengths)
        "max_span": 0,  # 0: auto (2 * min_span)
        "n_sink": 4,
        "anchors": True,  # False (ablation): no full-resolution anchors at all, neither sinks nor boundary tokens
        "segmentation": "surprisal",  # or "fixed" (ablation): equal chunks instead of surprisal spans
        "chunk": 0.0,  # fixed chunk length; 0: the surprisal segmentation's mean span length
        "tau_mode": "per_head",  # or "global" (ablation): one threshold for every (layer, head)
        "window": -1,  # -1: auto, min(512, 0.25 * budget * N)
        "weighting": "surprisal",  # or "mean" (ablation)
        "rank_max": 32,
        "energy_k": 0.99,  # untrained rank rule: smallest rank keeping this share of sigma^2 (docs/sekv.md)
        "energy_v": 0.99,
        "factors_8bit": True,
        # 4: the int8 factors are stored 4-bit coded in the pack (sekv/codec.py) and decoded to int8 at open; 8: as int8.
        # Float factors (factors_8bit=False) are stored as they are whatever this says.
        "factor_bits": 4,
        # with factor_bits=4: bits of the value factors' code (3: nf3 levels, 4: nf4 like the keys) and of the row
        # scales at rest (8: log8 codes, 16: float16 as factorize wrote them); docs/sekv.md §3 measured both
        "value_bits": 3,
        "scale_bits": 8,
        "factor_dtype": "float16",  # float factors when not 8-bit ("float32" for exactness tests)
        "store_dtype": "auto",  # full-resolution / coarse tensors at rest: the model dtype if 16-bit, else float16; "model"
        "key_space": "pre_rope",  # or "post_rope"
        "svd": "gram",  # or "svd" (torch.linalg.svd)
        "d_r": router.D_R,
        "tau": 0.0,  # 0: the router's (calibrated) thresholds
        "zoom": "router",  # "all" (every span, the exactness check) | "none" (coarse only)
        "head_masks": True,  # False: every query head of a group sees the spans the group reconstructed
        # "auto": the trained router shipped for this model (sekv_core/routers/), else "untrained"; or a router file.
        # compress() replaces "auto" by what it used, so the pack's manifest records it.
        "router": "auto",
        # "scout": a scout pass of the question ranks spans once for every layer (sekv/scout.py, docs/sekv.md §7c);
        # "per_layer": each layer keeps spans in the order of its own gates (SPEC §2.4)
        "routing": "scout",
        "profile_weight": 0.75,  # scout: rank = question's span sum - profile_weight x the document end's (sekv/scout.py)
        "profile_clip": 0.0,  # scout: > 0 subtracts only the profile's part above this many std (its outliers)
        # the layers [zoom_from, zoom_to) share the expansion room (zoom_to 0: through the last layer); a layer outside
        # that band gets zoom_outer times the share of one inside (0: coarse entries only).  Defaults: every layer, equally
        "zoom_from": 0,
        "zoom_to": 0,
        "zoom_outer": 0.0,
        # the unit the budget keeps: spans cut into blocks of at most this many tokens, each rebuilt alone from its
        # span's factors (0: whole spans, the paper's unit); docs/sekv.md §7f
        "zoom_unit": 16,
        # scout: rank = z(attention sum - profile) + lexical_weight x z(the question's lexical score), where the pack
        # has the document's word terms and the question's text is known (sekv/lexical.py; 0: attention alone)
        "lexical_weight": 2.0,
        "router_sha256": "",  # set by compress(): the trained router file the pack was built with
    }
    ask_time_params = (
        "budget", "router", "routing", "profile_weight", "profile_clip", "zoom_from", "zoom_to", "zoom_outer", "zoom_unit", "lexical_weight",
    )

    def obs_window(self, params: dict[str, Any]) -> int:
        return scout.PROFILE_QUERIES

    def resolve_params(self, overrides):
        params = super().resolve_params(overrides)
        if params["routing"] not in ROUTINGS:
            raise SekvError(f"sekv: --routing must be one of {', '.join(ROUTINGS)}, not {params['routing']!r}")
        if params["factor_bits"] not in (8, 4):
            raise SekvError(f"sekv: factor_bits must be 8 or 4, not {params['factor_bits']!r}")
        if params["value_bits"] not in (3, 4):
            raise SekvError(f"sekv: value_bits must be 3 or 4, not {params['value_bits']!r}")
        if params["scale_bits"] not in (8, 16):
            raise SekvError(f"sekv: scale_bits must be 8 or 16, not {params['scale_bits']!r}")
        return params

    @staticmethod
    def lengths(n_tokens: int, params: dict[str, Any]) -> tuple[int, int, int]:
        """(min_span, max_span, window): the explicit parameters, or the budget-driven defaults."""
        b = float(params["budget"]) if 0 < float(params["budget"]) < 1 else 0.10
        mn, mx, w = auto_lengths(n_tokens, b)
        mn = int(params["min_span"]) or mn
        mx = int(params["max_span"]) or 2 * mn
        w = int(params["window"]) if int(params["window"]) >= 0 else w
        return mn, mx, w

    def segmentation(self, prefill: PrefillResult, params: dict[str, Any]) -> Segmentation:
        n = prefill.n_tokens
        mn, mx, w = self.lengths(n, params)
        s = prefill.surprisal if prefill.surprisal is not None else torch.zeros(n)
        mode, anchors = params.get("segmentation", "surprisal"), bool(params.get("anchors", True))
        if mode not in SEGMENTATIONS:
            raise SekvError(f"sekv: segmentation must be one of {', '.join(SEGMENTATIONS)}, not {mode!r}")
        seg = segment(s, alpha=float(params["alpha"]), min_span=mn, max_span=mx, n_sink=int(params["n_sink"]), window=w, anchors=anchors)
        if mode == "surprisal":
            return seg
        chunk = float(params.get("chunk", 0)) or (float(seg.span_len.float().mean()) if seg.n_spans else 0.0)
        return fixed_segment(n, chunk=chunk, n_sink=int(params["n_sink"]), window=w, anchors=anchors)

    def reserve_host(self, n_tokens: int, shape: ModelShape, params: dict[str, Any], pinned: bool = False) -> None:
        """Prepare host memory for the pack of an n_tokens document in a background thread while the prefill
        runs; compress() then copies into it.  ``pinned``: page-lock it.  Measured on the H200 (docs/gpu.md):
        compress halves, but page-locking holds the CUDA driver and the prefill grows by as much.  Otherwise
        ordinary memory is allocated and every page touched (no CUDA call), so the copies do not page-fault."""
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(1)
        nbytes = self._host_bound(n_tokens, shape, params)
        if pinned:
            self._arena = (pool.submit(lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)), pool)
        else:
            self._arena = (pool.submit(lambda: torch.zeros(nbytes, dtype=torch.uint8)), pool)

    def _take_arena(self) -> torch.Tensor | None:
        a = getattr(self, "_arena", None)
        self._arena = None
        if a is None:
            return None
        fut, pool = a
        pool.shutdown(wait=False)
        return fut.result()

    def _host_bound(self, n: int, shape: ModelShape, params: dict[str, Any]) -> int:
        """An upper bound of the pack's tensor bytes for n tokens (spans at least min_span long)."""
        mn, _, w = self.lengths(n, params)
        L, hkv, d = shape.n_layers, shape.n_kv_heads, shape.head_dim
        isz = torch.empty(0, dtype=shape.dtype).element_size()
        s = n // max(mn, 1) + 2
        f = min(n, w + int(params["n_sink"]) + 2 * s + mn)
        r = int(params["rank_max"])
        es = 1 if params["factors_8bit"] else torch.empty(0, dtype=getattr(torch, params["factor_dtype"])).element_size()
        per_kind = hkv * n * r * es + hkv * s * r * d * es + 2 * hkv * n + 2 * hkv * s * r + 2 * hkv * s
        per_layer = 2 * per_kind + 2 * hkv * (f + s) * d * isz + hkv * int(params["d_r"]) * d * 4 + hkv * s * 4
        return L * (per_layer + 64 * 16)

    def compress(self, prefill: PrefillResult, params):
        # many small tensor ops: intra-op threads cost more than they give on a small CPU (docs/sekv.md)
        with fz.single_thread():
            return self._compress(prefill, params)

    def _compress(self, prefill: PrefillResult, params):
        shape = prefill.shape
        L, hkv, d, H = shape.n_layers, shape.n_kv_heads, shape.head_dim, shape.n_heads
        if params["key_space"] not in ("pre_rope", "post_rope"):
            raise SekvError(f"sekv: key_space must be pre_rope or post_rope, not {params['key_space']!r}")
        seg = self.segmentation(prefill, params)
        pos, sid = seg.span_tokens()
        S = seg.n_spans
        span_len = seg.span_len
        weights = span_weights(prefill.surprisal, pos, sid, S, params["weighting"])
        inv = rope.inv_freq_of(shape)
        pre = params["key_space"] == "pre_rope" and inv is not None
        int8 = bool(params["factors_8bit"])
        coded = int8 and int(params.get("factor_bits", 8)) == 4  # params from before the parameter: int8
        fdt = getattr(torch, params["factor_dtype"])
        mn, mx, w = self.lengths(prefill.n_tokens, params)
        out: dict[str, torch.Tensor] = {
            "sekv.config": torch.tensor([prefill.n_tokens, L, hkv, d, mn, mx, w, int(params["n_sink"]) if params.get("anchors", True) else 0], dtype=torch.long),
            "sekv.key_space": torch.tensor([int(pre)], dtype=torch.long),
            "sekv.span_start": seg.span_start.clone(),
            "sekv.span_end": seg.span_end.clone(),
            "sekv.full_idx": seg.full_idx.clone(),
            "sekv.anchor_idx": seg.anchor_idx.clone(),
        }
        if coded:  # params from before value_bits / scale_bits: 4-bit values, float16 scales
            kcfg = dict(codec.DEFAULT, scales="log8" if int(params.get("scale_bits", 16)) == 8 else "fp16")
            vcfg = dict(codec.VALUES_3BIT, scales=kcfg["scales"]) if int(params.get("value_bits", 4)) == 3 else kcfg
            out[codec.CONFIG] = codec.config_tensor(**kcfg)
            if vcfg != kcfg:
                out[codec.config_name("fv")] = codec.config_tensor(**vcfg)
        if pre:
            out["sekv.rope_inv_freq"] = inv
            out["sekv.rope_scaling"] = torch.tensor([shape.rope_attention_scaling], dtype=torch.float32)
            cos, sin = rope.cos_sin(pos, inv, shape.rope_attention_scaling, dtype=prefill.keys[0].dtype)
        taus = torch.full((L, H), router.TAU_DEFAULT if not params["tau"] else float(params["tau"]), dtype=torch.float32)
        out["sekv.router.tau"] = taus
        out["sekv.scout.profile"] = scout.document_profile(prefill, seg.span_start, seg.span_end)
        if prefill.scores and prefill.scores.get("lex_terms") is not None:  # the scout's lexical evidence (4 bytes a token)
            out["sekv.lex.terms"] = prefill.scores["lex_terms"].to(torch.int32).cpu()
        unit = max(0, int(params.get("zoom_unit", 0)))
        if unit > 0 and S:  # the profile of the zoom blocks the pack is made for (another unit at ask time: the span's)
            _, b0, b1 = zoom_blocks(seg.span_start, seg.span_end, unit)
            out["sekv.scout.profile_blocks"] = scout.document_profile(prefill, b0, b1)
            out["sekv.scout.profile_unit"] = torch.tensor([unit], dtype=torch.long)
        trained = self._trained_router(prefill, params, shape)
        if trained is not None:
            out["sekv.router.ttau"] = trained.tau.float()
        # compress on the prefill's device (summaries, RoPE undo, SVD, packing); only the results move to the host
        dev = prefill.keys[0].device
        pos, sid, weights, full_idx = pos.to(dev), sid.to(dev), weights.to(dev), seg.full_idx.to(dev)
        if pre:
            cos, sin = cos.to(dev), sin.to(dev)
        copies = _HostCopies(dev, self._take_arena() if dev.type == "cuda" else None)
        sdt = store_dtype(params, prefill.keys[0].dtype)
        for li in range(L):
            copies.submit(out)  # the previous layer's results travel while this layer computes
            k, v = prefill.keys[li], prefill.values[li]
            out[f"sekv.full.k.{li}"] = k[:, full_idx].to(sdt).contiguous()
            out[f"sekv.full.v.{li}"] = v[:, full_idx].to(sdt).contiguous()
            kbar = weighted_means(k, pos, sid, weights, S)
            out[f"sekv.coarse.k.{li}"] = kbar.to(sdt)
            out[f"sekv.coarse.v.{li}"] = weighted_means(v, pos, sid, weights, S).to(sdt)
            w = router.pca_init(k, int(params["d_r"]), kbar)
            # stored in the 16-bit store dtype, which the memory casts to the model's at open
            out[f"sekv.router.w.{li}"] = w.to(sdt)
            out[f"sekv.router.norm.{li}"] = router.span_norms(w, kbar.to(sdt))
            kx = k[:, pos].float()
            if pre:
                kx = rope.undo(kx, cos, sin)
            opts = dict(rank_max=int(params["rank_max"]), int8=int8, dtype=fdt, method=params["svd"])
            keep_k = keep_v = None
            if trained is not None:  # the trained rank gate G chooses each block's components (sekv/rank_gate.py)
                # its W is not copied into the pack: router.load reads it from the file (recorded with its sha256)
                depth = li / max(L - 1, 1)
                vbar = out[f"sekv.coarse.v.{li}"].float()
                keep_k = trained.gate.keep(kbar.float(), span_len, False, depth)
                keep_v = trained.gate.keep(vbar, span_len, True, depth)
            fk = fz.factorize(kx, span_len, energy=float(params["energy_k"]), keep=keep_k, **opts)
            fv = fz.factorize(v[:, pos].float(), span_len, energy=float(params["energy_v"]), keep=keep_v, **opts)
            for f, kind in ((fk, "fk"), (fv, "fv")):
                if coded:  # at rest 4-bit (values: value_bits); SekvMemory._factors decodes to int8
                    enc = codec.encode_factors(f, span_len, d, **(kcfg if kind == "fk" else vcfg))
                    out.update({f"sekv.{kind}.{li}.{k}": t for k, t in enc.items()})
                else:
                    out.update(f.tensors(f"sekv.{kind}.{li}"))
        return _to_host(out, copies)

    @staticmethod
    def _trained_router(prefill: PrefillResult, params: dict[str, Any], shape: ModelShape):
        """Resolve ``router`` for this model (in place, so the manifest records it); the file or None."""
        from ..sekv import router_file

        spec = router_file.resolve(params.get("router", "auto"), prefill.model_fingerprint, shape, prefill.model_id)
        params["router"] = spec
        if spec == "untrained":
            params["router_sha256"] = ""
            return None
        rf = router_file.load(spec)
        params["router_sha256"] = router_file.file_sha256(Path(spec))
        return rf

    def open(self, store: TensorStore, params, shape: ModelShape, device) -> KVMemory:
        return SekvMemory(store, params, shape, device)

    def validate(self, store: TensorStore, params, shape: ModelShape, n_tokens: int) -> None:
        """Every tensor SekvMemory / describe() read: dtypes, shapes against N / S / F and the model, spans inside the
        document and disjoint, indices in range, ranks <= min(span length, d), and the factors' and codes' lengths."""
        from ..pack import FLOATS, TensorSpec as T, check_tensors, model_dims

        def bad(what: str):
            return PackError(f"{what}; the pack is damaged or was not written by sekv, re-ingest the document")

        L, N = shape.n_layers, n_tokens
        choices = {"zoom": _ZOOMS, "tau_mode": TAU_MODES, "routing": ROUTINGS, "segmentation": SEGMENTATIONS, "weighting": ("surprisal", "mean"),
                   "key_space": ("pre_rope", "post_rope"), "factor_bits": (4, 8), "value_bits": (3, 4), "scale_bits": (8, 16)}
        for k, allowed in choices.items():
            if k in params and params[k] not in allowed:
                raise bad(f"parameter {k} is {params[k]!r}, not one of {', '.join(map(str, allowed))}")
        dims = check_tensors(store, [T("sekv.config", ("int64",), (8,)), T("sekv.key_space", ("int64",), (1,), values=(0, 1))], model_dims(shape, N))
        c = [int(x) for x in store.get("sekv.config").tolist()]
        if c[:4] != [N, L, shape.n_kv_heads, shape.head_dim] or not (1 <= c[4] <= c[5] < 2**31 and 0 <= c[6] < 2**31 and 0 <= c[7] < 2**31):
            raise bad("tensor 'sekv.config' does not match the document and model")
        pre = int(store.get("sekv.key_space")[0]) == 1
        f32 = ("float32",)
        dims = check_tensors(store, [
            T("sekv.rope_inv_freq", f32, (shape.head_dim // 2,), optional=not pre, finite=True),
            T("sekv.rope_scaling", f32, (1,), optional=not pre, finite=True),
            T("sekv.span_start", ("int64",), ("S",), values=(0, N - 1), increasing=True),
            T("sekv.span_end", ("int64",), ("S",), values=(1, N), increasing=True),
            T("sekv.full_idx", ("int64",), ("F",), values=(0, N - 1)),
            T("sekv.anchor_idx", ("int64",), ("A",), values=(0, N - 1)),
            *(T(f"sekv.{p}.{kv}.{{l}}", FLOATS, ("Hkv", n, "d"), finite=True) for p, n in (("full", "F"), ("coarse", "S")) for kv in "kv"),
            T("sekv.router.w.{l}", FLOATS, ("Hw", "dr", "d"), finite=True),
            T("sekv.router.norm.{l}", f32, ("Hw", "S"), finite=True),
            T("sekv.router.tau", f32, ("L", "H"), finite=True),
            T("sekv.router.ttau", f32, ("L", "H"), optional=True, finite=True),
            T("sekv.router.tw.{l}", FLOATS, ("H", "*", "d"), optional=True, finite=True),
            T("sekv.lex.terms", ("int32",), ("N",), optional=True, values=(-1, 2**31 - 1)),
            T("sekv.scout.profile", f32, ("S",), optional=True, finite=True),
            T("sekv.scout.profile_blocks", f32, ("B",), optional=True, finite=True),
            T("sekv.scout.profile_unit", ("int64",), (1,), optional=True, values=(0, N)),
            *(T(f"sekv.{k}.{{l}}.rank", ("int16",), ("Hkv", "S"), values=(0, shape.head_dim)) for k in ("fk", "fv")),
        ], dims, L)
        if dims["Hw"] not in (shape.n_heads, shape.n_kv_heads) or not 1 <= dims["dr"] <= 4096:
            raise bad("the router's shape does not match the model")
        start, end = store.get("sekv.span_start"), store.get("sekv.span_end")
        n = end - start
        if bool((n <= 0).any()) or bool((start[1:] < end[:-1]).any()) or dims["F"] + int(n.sum()) != N:
            raise bad("the spans are empty, overlap, or do not cover the document with the full-resolution tokens")
        if "sekv.router.tw.0" in set(store.keys()) and "sekv.router.ttau" not in set(store.keys()):
            raise bad("tensor 'sekv.router.ttau' is missing")
        names = set(store.keys())
        hkv, d, T_ = shape.n_kv_heads, shape.head_dim, int(n.sum())
        for i in range(L):
            for kind in ("fk", "fv"):
                p = f"sekv.{kind}.{i}"
                r = store.get(f"{p}.rank").long()
                if bool((r > n.view(1, -1)).any()):
                    raise bad(f"tensor '{p}.rank' holds ranks above their span's length")
                rs, n_us, n_vt = int(r.sum()), int((r * n.view(1, -1)).sum()), int(r.sum()) * d
                cfg = None
                if codec.CONFIG in names or codec.config_name("fv") in names:
                    for cn in {codec.CONFIG, codec.config_name(kind)} & names:
                        ct = store.get(cn)
                        v = [int(x) for x in ct.tolist()] if ct.dtype == torch.int64 and ct.dim() == 1 and ct.numel() in (4, 5) else None
                        if v is None or not (2 <= v[0] <= 4096 and v[0] % 2 == 0 and 0 <= v[1] < len(codec.LEVELS) and 0 <= v[2] < len(codec.ORDERS)
                                             and 0 <= v[3] <= d and (len(v) == 4 or 0 <= v[4] < len(codec.SCALES))):
                            raise bad(f"tensor '{cn}' is not a factor codec")
                    cfg = codec.kind_config(store, names, kind)
                if cfg is not None and f"{p}.{codec.code_names(cfg['levels'])[0]}" in names:
                    b, g, lead = codec.bits_of(cfg["levels"]), cfg["group"], cfg["lead"]
                    n_lead = int(torch.minimum(r, torch.tensor(lead)).sum()) * d
                    m = n_vt - n_lead
                    cu, mu, cv, mv = codec.code_names(cfg["levels"])
                    want = {cu: (n_us * b + 7) // 8, mu: codec.n_groups(n_us, g), cv: (m * b + 7) // 8, mv: codec.n_groups(m, g)}
                    specs = [T(f"{p}.{k}", ("uint8",), (v,)) for k, v in want.items()] + [T(f"{p}.vt.lead", ("int8",), (n_lead,))]
                    if cfg["scales"] == "log8":
                        specs += [T(f"{p}.us_scale.l8", ("uint8",), (hkv * T_,)), T(f"{p}.vt_scale.l8", ("uint8",), (rs,)),
                                  *(T(f"{p}.{k}_scale.l8p", f32, (2,), finite=True) for k in ("us", "vt"))]
                    else:
                        specs += [T(f"{p}.us_scale", ("float16",), (hkv * T_,), finite=True), T(f"{p}.vt_scale", ("float16",), (rs,), finite=True)]
                elif f"{p}.us_scale" in names:
                    specs = [T(f"{p}.us", ("int8",), (n_us,)), T(f"{p}.vt", ("int8",), (n_vt,)),
                             T(f"{p}.us_scale", ("float16",), (hkv * T_,), finite=True), T(f"{p}.vt_scale", ("float16",), (rs,), finite=True)]
                else:
                    specs = [T(f"{p}.us", FLOATS, (n_us,), finite=True), T(f"{p}.vt", FLOATS, (n_vt,), finite=True)]
                check_tensors(store, specs, {})

    def describe(self, store: TensorStore, params) -> dict[str, Any]:
        cfg = _config(store)
        n, L, hkv, d = cfg["n_tokens"], cfg["n_layers"], cfg["n_kv_heads"], cfg["head_dim"]
        start, end = store.get("sekv.span_start"), store.get("sekv.span_end")
        lens = (end - start).float()
        n_full = int(store.get("sekv.full_idx").numel())
        hist = {}
        for kind, label in (("fk", "keys"), ("fv", "values")):
            r = torch.cat([store.get(f"sekv.{kind}.{i}.rank").flatten().long() for i in range(L)]) if lens.numel() else torch.zeros(0)
            hist[label] = {
                "0-4": int((r <= 4).sum()),
                "5-8": int(((r >= 5) & (r <= 8)).sum()),
                "9-16": int(((r >= 9) & (r <= 16)).sum()),
                "17-32": int(((r >= 17) & (r <= 32)).sum()),
                **({">32": int((r > 32).sum())} if bool((r > 32).any()) else {}),
            }
        nbytes = {k: store.get(k).numel() * store.get(k).element_size() for k in store.keys() if k.startswith("sekv.")}
        tensor_bytes = sum(nbytes.values())
        factor_bytes = sum(b for k, b in nbytes.items() if k.startswith(("sekv.fk.", "sekv.fv.")))
        raw = n * 2 * L * hkv * d * 2
        if codec.CONFIG in nbytes:
            names = set(nbytes)
            c, cv = (codec.kind_config(store, names, k) for k in ("fk", "fv"))
            vals = f"values {codec.bits_of(cv['levels'])}-bit {cv['levels']} in groups of {cv['group']}, keys " if cv != c else ""
            factors = (f"4-bit at rest ({c['levels']}, {vals}groups of {c['group']}, us {c['order']}-major, {c['lead']} leading vt row(s) int8, "
                       f"row scales {c['scales']}), int8 in memory")
        else:
            factors = "int8" if "sekv.fk.0.us_scale" in nbytes else "float"
        unit = max(0, int(params.get("zoom_unit", 0)))
        names = set(store.keys())
        lex = store.get("sekv.lex.terms") if "sekv.lex.terms" in names else None
        return {
            "spans": int(lens.numel()),
            "mean_span_tokens": round(float(lens.mean()), 1) if lens.numel() else 0.0,
            "zoom_unit": unit,
            "zoom_blocks": int(zoom_blocks(start, end, unit)[0].numel()),
            # tokens with a word term for the scout's lexical evidence (0: a pack from before it, attention alone)
            "lexical_terms": int((lex >= 0).sum()) if lex is not None else 0,
            "full_resolution_tokens": n_full,
            "full_resolution_share": round(n_full / max(n, 1), 4),
            "anchors": int(store.get("sekv.anchor_idx").numel()),
            "window": cfg["window"],
            "key_space": "pre_rope" if int(store.get("sekv.key_space")[0]) else "post_rope",
            "router": ("trained: " + Path(str(params.get("router", ""))).name) if "sekv.router.ttau" in set(store.keys()) else "untrained",
            "effective_rank_histogram": hist,
            "factors": factors,
            "factor_bytes": int(factor_bytes),
            "factor_share": round(factor_bytes / max(tensor_bytes, 1), 4),
            "pack_tensor_bytes": int(tensor_bytes),
            "raw_kv_fp16_bytes": int(raw),
            "pack_vs_raw": round(tensor_bytes / max(raw, 1), 4),
        }


