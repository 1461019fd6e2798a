"""An opened sekv pack: what both decode steps read.

On the compute device: the full-resolution tokens and the coarse span entries (with the appended tokens after them,
one growing buffer per layer), the router, the span and zoom-block tables.  On the host: the packed factors (never
moved whole; a step fetches the rows of the blocks it expands).

A model placed across devices (sekv_core/placement.py) opens the pack with one device per layer: each layer's buffer
and router gates live on its layer's device, and the tables a step reads are on every layer device once
(:meth:`Residents.at`: a view of the pack with its tables on that device, made once per device).  The ranking, the
ledger and the scout's profile stay on the first layer's device (``device``).
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch

from ..errors import PackError
from ..methods.base import GrowingKV, ModelShape, per_layer
from . import factorize as fz
from . import layout, lexical, positions, rope, router
from .attention import coarse_scores, route
from .params import SekvParams
from .segment import zoom_blocks
from .zoom_tier import ZoomTier


def apply_tau_mode(rt: router.Router, mode: str) -> router.Router:
    """``per_head``: the router as loaded; ``global``: every (layer, head) threshold replaced by one value, the
    probability whose logit is the mean of the per-head logit thresholds."""
    if mode == "per_head":
        return rt
    tau = torch.full_like(rt.tau, float(torch.sigmoid(rt.logit_tau().double().mean())))
    return dataclasses.replace(rt, tau=tau)


#: "cuda": a pack opened on CUDA reads and decodes its factors when the batched step first needs them, one on the
#: CPU at open; "always": lazily on the CPU too (tests of that path)
LAZY_FACTORS = "cuda"


#: the most device bytes a pack's table of every document position's rotation may take (Residents.rotate_doc: cos and
#: sin, float32 [n_doc, head_dim] each; the 0.5B at 30K tokens: 16 MB); a longer document computes them per call
ROPE_TABLE_BYTES = 64 << 20


#: the tables a step reads on its layer's device: a view of the pack on another device (:meth:`Residents.at`) has
#: its own copy of each
DEVICE_TABLES = ("inv_freq", "cost", "block_cost", "block_span_dev", "block_len_dev", "block_off_dev", "block_start_dev",
                 "span_len_dev", "span_start_dev", "log_n", "head_group", "scout_profile")


class HiddenColumns:
    """The full-resolution columns hidden from attention for the question being asked: the look-alikes no ranking
    reaches (sekv/lexical.py ``Lexicon.resident_columns``: another archive's passphrase sentence in the end window;
    docs/long-documents.md, "Four needles").  Nothing hidden is the common case: every mask is then made as without it.

    ``row(device)``: [n_full] float32, 0 or -inf, to add to the full-resolution columns; one buffer a device, refilled in
    place at each :meth:`set` (a captured step reads it); None when nothing is hidden.  ``key``: None when nothing is
    hidden, else a number that changes at each :meth:`set` (the masks made for a hidden set are cached by it)."""

    def __init__(self, n_full: int, device):
        self.n_full, self.device = n_full, torch.device(device)
        self.cols: torch.Tensor | None = None  # host [K] indices into the full-resolution tokens
        self.version = 0
        self._rows: dict = {}

    @property
    def key(self) -> int | None:
        return None if self.cols is None else self.version

    def set(self, cols: torch.Tensor | None) -> None:
        """Hide ``cols`` (indices into the full-resolution tokens) from now on; None or empty: nothing."""
        if cols is not None and not cols.numel():
            cols = None
        if cols is None and self.cols is None:
            return
        self.cols = None if cols is None else cols.long().cpu()
        self.version += 1
        with torch.inference_mode():  # the buffers are a forward's (inference tensors)
            if self.cols is not None and self.device not in self._rows:  # made before any step can be captured
                self._rows[self.device] = torch.empty(self.n_full, dtype=torch.float32, device=self.device)
            for row in self._rows.values():
                row.zero_()
                if self.cols is not None:
                    row.index_fill_(0, self.cols.to(row.device), float("-inf"))

    def row(self, device) -> torch.Tensor | None:
        if self.cols is None:
            return None
        device = torch.device(device)
        row = self._rows.get(device)
        if row is None:  # another layer device's (a model placed across devices)
            row = self._rows[device] = torch.zeros(self.n_full, dtype=torch.float32, device=device)
            row.index_fill_(0, self.cols.to(device), float("-inf"))
        return row


class Residents:
    """The tensors and tables of one opened pack (read-only after open, except the growing K/V buffers).

    ``device``: one device, or one per layer (a model placed across devices); ``layer_devices`` the latter,
    ``device`` the first layer's."""

    def __init__(self, store, params: SekvParams, shape: ModelShape, device):
        self.layer_devices = per_layer(device, shape.n_layers)
        device = self.layer_devices[0] if isinstance(device, (list, tuple)) else torch.device(device)
        #: whether the layers are on more than one device; the views of the pack on the other ones (:meth:`at`)
        self.split = len(set(self.layer_devices)) > 1
        self._home: Residents | None = None
        self._views: dict = {}
        self.shape, self.device, self.cuda = shape, device, device.type == "cuda"
        cfg = layout.read_config(store)
        if (cfg["n_layers"], cfg["n_kv_heads"], cfg["head_dim"]) != (shape.n_layers, shape.n_kv_heads, shape.head_dim):
            raise PackError("the sekv pack's attention shape does not match the model; re-ingest the document")
        self.n_doc = cfg["n_tokens"]
        self.names = set(store.keys())
        self._spans(store, params.block_unit)
        self.pre_rope = bool(store.get("sekv.key_space")[0])
        if self.pre_rope:
            self.inv_freq = store.get("sekv.rope_inv_freq").float().to(device)
            self.rope_scaling = float(store.get("sekv.rope_scaling")[0])
        L = shape.n_layers
        # [full-res | coarse] per layer, the appended tokens after them
        keys = [torch.cat([store.get(f"sekv.full.k.{i}"), store.get(f"sekv.coarse.k.{i}")], 1).to(shape.dtype) for i in range(L)]
        vals = [torch.cat([store.get(f"sekv.full.v.{i}"), store.get(f"sekv.coarse.v.{i}")], 1).to(shape.dtype) for i in range(L)]
        self.n_base = self.n_full + self.n_spans
        #: the full-resolution columns hidden for the question being asked (shared by the views on other devices)
        self.hidden = HiddenColumns(self.n_full, device)
        self.kv = GrowingKV.from_tensors(keys, vals, self.layer_devices if self.split else device, extra=256)
        self._router(store, params)
        # K and V factors stacked per layer, so one gather and one batched product serve both (V: heads Hkv..2Hkv-1);
        # on an accelerator read when the batched step first needs them, not at open (layout.PackFactors)
        self.factors = layout.PackFactors(store, self.names, L, self.span_len, shape.head_dim, device)
        # the span tokens' own K / V where the pack keeps them: what a zoomed block holds (sekv/zoom_tier.py)
        self.zoom_tier = ZoomTier.of(store, self.names, shape, device) if params.read_zoom_tier else None
        self.head_group = torch.arange(shape.n_heads, device=device) // (shape.n_heads // shape.n_kv_heads)  # query head -> its KV group
        if not (LAZY_FACTORS == "always" or (self.cuda and LAZY_FACTORS == "cuda")):
            self.factors.load_all()
        isz = torch.empty(0, dtype=shape.dtype).element_size()
        self.entry_bytes = 2 * shape.head_dim * isz  # K+V of one token of one KV head
        self.cost = (self.span_len * self.entry_bytes).to(device)  # bytes to rebuild span i for one KV group
        self.block_cost = (self.block_len * self.entry_bytes).to(device)  # ... zoom block b
        self.head_masks = params.head_masks
        self.reposition_kind = params.reposition  # the layout past the window (sekv/positions.py)
        self.coarse_mass = params.coarse_mass
        self.lexicon = lexical.Lexicon(store.get("sekv.lex.terms"), self.block_start, self.block_len, self.full_pos) if "sekv.lex.terms" in self.names and self.n_blocks else None
        self.scout_profile = self._profile(store, params.block_unit)
        #: re-positioned attention (sekv/positions.py): set by reposition(), the first time an ask needs it
        self.layout = None

    # -- the pack on each layer's device --------------------------------------------------------------------

    def at(self, device) -> "Residents":
        """The pack as a step on ``device`` reads it: this object on its own device; elsewhere a view, made once, that
        shares the buffers, the factors and the layout's state and has its own copy of the DEVICE_TABLES there."""
        home = self._home or self
        device = torch.device(device)
        if device == home.device:
            return home
        view = home._views.get(device)
        if view is None:
            view = copy.copy(home)
            view.device, view.cuda, view._home, view._layout_on = device, device.type == "cuda", home, None
            for name in DEVICE_TABLES:
                if hasattr(home, name):
                    setattr(view, name, getattr(home, name).to(device))
            home._views[device] = view
        return view

    def at_layer(self, layer: int) -> "Residents":
        """The pack on a layer's device (:meth:`at`); itself where every layer shares one."""
        return self.at(self.layer_devices[layer]) if self.split else self

    @property
    def layout(self) -> positions.Layout | None:
        """Re-positioned attention's layout (None: not re-positioned); a view's is a copy on its device, with the
        question's position as the pack's."""
        home = self._home
        if home is None:
            return self._layout
        lay = home._layout
        if lay is None:
            return None
        if self._layout_on is None or self._layout_on[0] is not lay:
            self._layout_on = (lay, lay.to(self.device))
        mine = self._layout_on[1]
        mine.p0, mine.room, mine.coarse_shift = lay.p0, lay.room, lay.coarse_shift
        return mine

    @layout.setter
    def layout(self, value) -> None:
        self._layout = value

    def reposition(self) -> None:
        """From now on every forward lays the resident keys out at positions of its own (sekv/positions.py): the
        full-resolution tokens and coarse entries in the resident buffers are de-rotated in place, once, to be rotated
        to their slots at each forward."""
        if self.layout is not None:
            return
        if not self.pre_rope:
            from ..errors import SekvError

            raise SekvError("this pack's keys are stored after RoPE (key_space post_rope), so it cannot be read past the model's "
                            "window; re-ingest it with the default key space")
        self.layout = positions.Layout(self.full_pos, self.span_start, self.span_len, self.block_start, self.block_len,
                                       self.block_span, self.shape.n_kv_heads, self.device, n_doc=self.n_doc,
                                       spread=self.reposition_kind == "spread", coarse_mass=self.coarse_mass)
        cos, sin = rope.cos_sin(self.layout.base_doc_pos, self.inv_freq, self.rope_scaling, dtype=self.shape.dtype)
        on = {self.device: (cos, sin)}
        for layer in range(self.shape.n_layers):
            k = self.kv.k[layer][0, :, : self.n_base]
            if k.device not in on:
                on[k.device] = (cos.to(k.device), sin.to(k.device))
            k.copy_(rope.undo(k.float(), *on[k.device]).to(k.dtype))

    def _spans(self, store, unit: int) -> None:
        """Spans and zoom blocks (sekv/segment.py zoom_blocks; unit 0: whole spans), on the host and the device."""
        dev = self.device
        self.span_start = store.get("sekv.span_start").long()
        self.span_end = store.get("sekv.span_end").long()
        self.span_len = self.span_end - self.span_start
        self.n_spans = int(self.span_start.numel())
        self.full_pos = store.get("sekv.full_idx").long()
        self.n_full = int(self.full_pos.numel())
        bs, b0, b1 = zoom_blocks(self.span_start, self.span_end, unit)
        self.block_span, self.block_start, self.block_len = bs.long(), b0.long(), (b1 - b0).long()
        self.block_off = self.block_start - self.span_start[self.block_span]
        self.n_blocks = int(self.block_span.numel())
        self.whole_spans = self.n_blocks == self.n_spans and bool((self.block_len == self.span_len).all())
        self.block_span_dev, self.block_len_dev = self.block_span.to(dev), self.block_len.to(dev)
        self.block_off_dev, self.block_start_dev = self.block_off.to(dev), self.block_start.to(dev)
        self.span_len_dev, self.span_start_dev = self.span_len.to(dev), self.span_start.to(dev)

    def _router(self, store, params: SekvParams) -> None:
        shape, dev, L = self.shape, self.device, self.shape.n_layers
        rt = apply_tau_mode(router.load(store, params, shape), params.tau_mode)
        self.router_source = rt.source
        self.w = rt.w.to(dev, shape.dtype)  # [L, Hw, d_r, d]
        if rt.source == "pack":
            norms = torch.stack([store.get(f"sekv.router.norm.{i}").float() for i in range(L)])
        else:  # a router from a file: the norms of its own W
            norms = torch.stack([router.span_norms(rt.w[i], store.get(f"sekv.coarse.k.{i}")) for i in range(L)])
        self.inv_norm = (1.0 / (norms.clamp_min(1e-6) * math.sqrt(rt.d_r))).to(dev)  # [L, Hw, S]
        self.logit_tau = rt.logit_tau().to(dev)  # [L, H]
        self.log_n = self.span_len.float().log().to(dev)
        # per-document router state counts as resident KV; a trained W is a model parameter (the same for every
        # document, like the model's own projections), so only the untrained, per-document PCA W is counted
        per_doc = (self.inv_norm, self.logit_tau, self.log_n) + ((self.w,) if rt.source == "pack" else ())
        self.router_bytes = sum(t.numel() * t.element_size() for t in per_doc)
        #: each layer's (W, 1 / norms, logit thresholds) on its device: views of the stacked ones on one device; on
        #: several, the stacked ones stay on the host
        if self.split:
            self.gates = [tuple(t[i].to(self.layer_devices[i]) for t in (self.w, self.inv_norm, self.logit_tau)) for i in range(L)]
            self.w, self.inv_norm, self.logit_tau = self.w.cpu(), self.inv_norm.cpu(), self.logit_tau.cpu()
        else:
            self.gates = [(self.w[i], self.inv_norm[i], self.logit_tau[i]) for i in range(L)]

    def _profile(self, store, unit: int) -> torch.Tensor:
        """The document profile per zoom block: the pack's block profile when it was made for this unit, else the
        span profile given to each of a span's blocks."""
        if "sekv.scout.profile_blocks" in self.names and int(store.get("sekv.scout.profile_unit")[0]) == unit:
            prof = store.get("sekv.scout.profile_blocks").float()
            if prof.numel() == self.n_blocks:
                return prof.to(self.device)
        return store.get("sekv.scout.profile").float()[self.block_span].to(self.device)

    # -- shared by both steps -------------------------------------------------------------------------------

    def span_level(self, x: torch.Tensor) -> torch.Tensor:
        """[R, B] bool over zoom blocks -> [R, S] bool over spans: a span is set when any of its blocks is."""
        if self.whole_spans:
            return x
        bs = self.block_span_dev if x.device == self.block_span_dev.device else self.block_span.to(x.device)
        return torch.zeros(x.shape[0], self.n_spans, device=x.device).index_add_(1, bs, x.float()) > 0

    def coarse_mask(self, expanded: torch.Tensor) -> torch.Tensor:
        """The coarse entries' additive scores [H, S] for a head x block expansion [H, B]: + log of the tokens of the
        span not expanded, -inf where all of them are (SPEC §2.5 with whole spans: + log n_i or hidden)."""
        shift = 0.0 if self.layout is None else self.layout.coarse_shift  # re-positioned: sekv/positions.py
        if self.whole_spans:
            return torch.where(expanded, float("-inf"), self.log_n.float().view(1, -1) + shift)
        return coarse_scores(expanded, self.block_span_dev, self.block_len_dev, self.span_len_dev) + shift

    def rotate(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE packs: rebuilt key rows [..., d] rotated to their token positions [...] (float32); else as is."""
        if not self.pre_rope or rows.numel() == 0:
            return rows
        return rope.rotate(rows, positions, self.inv_freq, self.rope_scaling, self.shape.dtype)

    def rotate_doc(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """:meth:`rotate` for positions inside the document (< n_doc): the same values, each position's rotation read
        from a table of every document position made once a device (where it takes at most ROPE_TABLE_BYTES), two
        lookups instead of computing them at every call (a layer of a routed forward).  A position past the document
        (a row the caller discards) reads the last one's."""
        if not self.pre_rope or rows.numel() == 0:
            return rows
        tables = self.__dict__.setdefault("_rope_tables", {})  # shared with the views on other devices: keyed by device
        if self.device not in tables:
            d = self.shape.head_dim
            small = 2 * 4 * self.n_doc * d <= ROPE_TABLE_BYTES
            tables[self.device] = rope.swapped(*self._cos_sin(torch.arange(self.n_doc, device=self.device))) if small else None
        t = tables[self.device]
        if t is None:
            return self.rotate(rows, positions)
        cos, signed_sin, perm = t
        p = positions.flatten().clamp_max(self.n_doc - 1)
        d = rows.shape[-1]
        return rope.apply_swapped(rows.reshape(-1, d).float(), cos.index_select(0, p), signed_sin.index_select(0, p), perm).view(rows.shape)

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope.cos_sin(positions, self.inv_freq, self.rope_scaling, dtype=self.shape.dtype)

    def base_keys(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Re-positioned: a layer's full-resolution tokens and coarse entries rotated to their slots [Hkv, F + S]
        -> [Hkv, F + S, d] in the model dtype."""
        return self.rotate(self.kv.k[layer][0, :, : self.n_base], slots).to(self.shape.dtype)

    def gate_priorities(self, layer: int, query: torch.Tensor, base: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-layer router (SPEC §2.2-2.4): (head candidates [H, S], group priority [Hkv, S]) for this forward.
        base: the layer's rotated base keys where they are re-positioned."""
        kbar = (self.kv.k[layer][0] if base is None else base)[:, self.n_full : self.n_base]
        w, inv_norm, logit_tau = self.gates[layer]
        logits = router.gate_logits(query[0], w, kbar, inv_norm, self.log_n)
        return route(logits, logit_tau, self.shape.n_kv_heads)

    def exact_keys(self, layer: int, base: torch.Tensor | None = None) -> torch.Tensor:
        """A layer's keys at full resolution: the document's full-resolution tokens and the appended ones [Hkv, F+A, d]
        (base: the layer's rotated base keys where they are re-positioned)."""
        k = self.kv.k[layer][0]
        return torch.cat([(k if base is None else base)[:, : self.n_full], k[:, self.n_base : self.kv.len[layer]]], 1)
