"""The runtime memory of a sekv pack (the method's ``KVMemory``).

It opens the pack (sekv/residents.py), keeps the ask's budget and stats (sekv/budget.py) and the question's
ranking (sekv/scout.py), and hands each layer's attention to one step: the reference step on the CPU
(sekv/cpu_step.py), the batched, sync-free step on accelerators (sekv/gpu_step.py).

``device`` is one device, or one per layer (a model placed across devices, sekv_core/placement.py): each layer's
resident KV, coarse entries, zoom buffers and factor blocks' tables are then on its layer's device (sekv/residents.py
``Residents.at``); the ranking and the ledger on the first layer's, where each layer's few statistics are gathered.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ..methods.base import KVMemory, ModelShape, StepStats
from . import factorize as fz
from . import lexical, prior
from .budget import ZoomLedger
from .cpu_step import CpuStep
from .gpu_step import BatchedStep, BlockBuild, take_blocks
from .params import SekvParams
from .residents import Residents
from .scout import Ranking


#: on an accelerator, build the batched step's factor blocks on a second thread from open (False: in the first
#: forward, as the CPU does)
BACKGROUND_BLOCKS = True


class ZoomMemory(KVMemory):
    """Public beyond KVMemory: ``spans()`` (span id -> (start, end) token range), ``step_stats()`` (docs/design.md
    lists the ``extra`` keys), ``res`` (the opened pack), ``ranking`` and ``step``."""

    def __init__(self, store, params: SekvParams, shape: ModelShape, device, blocks: list | None = None):
        """blocks: the batched step's factor blocks, built already (rehearse_layer); None: built from now on."""
        self.params, self.shape = params, shape
        self.res = res = Residents(store, params, shape, device)
        self.device = res.device  # the first layer's
        if res.split:
            self.layer_devices = list(res.layer_devices)
        self.ledger = ZoomLedger(budget=params.ask_budget, zoom=params.zoom, shape=shape, n_doc=res.n_doc, n_base=res.n_base,
                                 router_bytes=res.router_bytes, entry_bytes=res.entry_bytes, n_spans=res.n_spans, device=res.device)
        if params.zoom == "all":
            self.ranking = Ranking("all", res.n_blocks, res.device)
        elif params.zoom == "router" and params.routing == "scout":
            self.ranking = Ranking("scout", res.n_blocks, res.device)
        else:
            self.ranking = None
        #: the scout's KVzip prior per zoom block, z-scored (sekv/prior.py); None: the pack has none
        self.prior = None
        if prior.TENSOR in res.names and self.ranking is not None and self.ranking.kind == "scout":
            self.prior = prior.block_prior(store.get(prior.TENSOR), res.block_start, res.block_len, params.prior_pool).to(res.device)
        #: accelerators take the batched step (any layer on one); the CPU the reference step (settable between asks)
        self.batched = any(d.type == "cuda" for d in res.layer_devices)
        self.step: CpuStep | BatchedStep | None = None
        #: a rehearsal (rehearse_layer, Session.rehearse): the question's branches run where its text takes none (the
        #: look-alikes' demotion with none to demote), so that their kernels are loaded for the questions to come
        self.rehearsing = False
        #: the scout's fused kernel (gpu_step.SCOUT_FUSED) allowed for this question: Triton compiles it at its first
        #: use in a process, seconds a specialization, so a session takes it once its rehearsal has made it
        #: (Session._ask); a single question takes the PyTorch path
        self.fused_scout = True
        #: the batched step's blocks, built on a second thread from now on (sekv/gpu_step.py BlockBuild), or taken up
        #: from the build started for this pack before the model loaded (gpu_step.start_blocks; one device only)
        self._blocks, self._early = None, False
        #: the blocks the build kept in device memory, moved to pinned host memory in pauses (sekv/blocks.py HostPinning)
        self.pinning = None
        #: what _record_kept saw: {"kept": per layer [Hkv, B] bool, "prio": the ranking [B], "hidden": the hidden columns}
        self._kept_first: dict | None = None
        self.record_kept = False
        if self.batched and blocks is not None:
            self._blocks = _Built(blocks)
        elif self.batched and BACKGROUND_BLOCKS:
            self._blocks = take_blocks(store, res.device)
            self._early = self._blocks is not None
            if self._blocks is None:
                self._blocks = BlockBuild(res)

    @property
    def record_kept(self) -> bool:
        """Keep each layer's kept (KV group, zoom block) pairs of an ask's first forward under a ranking, for
        :meth:`token_coverage` (``sekv bench`` sets it; off, the default: nothing is kept, no work is added to an ask)."""
        return self._record

    @record_kept.setter
    def record_kept(self, on: bool) -> None:
        self._record = self._kept_pending = bool(on)  # from the next ranked forward on (and at each new ask: _new_ask)
        self._kept_first = None

    def _step(self) -> CpuStep | BatchedStep:
        kind = BatchedStep if self.batched else CpuStep
        if type(self.step) is not kind:
            if kind is BatchedStep:
                b = self._blocks
                # an early build that failed is built again here from the opened pack (which meets a real error anew)
                blocks = None if b is None else b.result_or_none() if self._early else b.result()
                self._blocks, self._warming = None, b
                self.pinning = b.pinning if blocks is not None else None
                self.step = BatchedStep(self.res, self.ledger, self.ranking, blocks)
            else:
                self.step = CpuStep(self.res, self.ledger, self.ranking)
        return self.step

    # -- KVMemory -------------------------------------------------------------------------------------------

    def _start(self) -> int:
        """The position of the first appended token: the document's length, or the question's slot where the
        resident set is re-positioned (sekv/positions.py)."""
        return self.res.n_doc if self.res.layout is None else self.res.layout.p0

    def n_tokens(self) -> int:
        return self._start() + self.res.kv.len[-1] - self.res.n_base

    def truncate(self, n_tokens: int) -> None:
        self.res.kv.truncate(self.res.n_base + max(0, n_tokens - self._start()))
        self.ledger.stale = True  # this ask's stats stay readable until the next forward starts

    def full_bytes(self) -> int:
        return (self.res.n_doc + self.res.kv.len[-1] - self.res.n_base) * self.shape.kv_bytes_per_token()

    def place_in_window(self, window: int, reserve: int) -> None:
        """Past the window (the document + ``reserve`` appended tokens > ``window`` positions), and from then on:
        re-positioned attention with the question at window - reserve (sekv/positions.py).  Drops appended tokens."""
        if window and (self.res.layout is not None or self.res.n_doc + reserve > window):
            self.question_at(max(0, window - reserve), window)

    def question_at(self, p0: int, window: int = 0) -> None:
        """Re-positioned attention with the question at position p0 (the resident set right before it).  In inference
        mode, as the forwards that made the step's tables are: callers between asks (chat, bench) are outside it."""
        with torch.inference_mode():
            self._question_at(p0, window)

    def _question_at(self, p0: int, window: int) -> None:
        r = self.res
        self.truncate(0)
        r.reposition()
        r.layout.set_question_at(p0)
        cap = self.ledger.layer_cap()
        span_tokens = int(r.span_len.sum())
        allowed = 0 if self.params.zoom == "none" else span_tokens if cap is None else min(span_tokens, cap // (r.shape.n_kv_heads * r.entry_bytes))
        self.ledger.window = (int(window or p0), r.layout.p0, allowed > r.layout.room)
        self.ledger.stale = True
        if self.step is not None:
            self.step.new_ask()

    def restrict(self, ranges: list[tuple[int, int]] | None) -> bool:
        """Only zoom blocks with a token in ``ranges`` are ranked (the scout's block mask, sekv/scout.py); the per-step
        zoom cap is unchanged, the coarse entries and full-resolution tokens of the rest stay."""
        if self.ranking is None:
            return ranges is None
        mask = None
        if ranges is not None:
            a, b = self.res.block_start, self.res.block_start + self.res.block_len
            mask = torch.zeros(self.res.n_blocks, dtype=torch.bool)
            for x, y in ranges:
                mask |= (a < y) & (x < b)
        self.ranking.restrict(None if mask is None else mask.to(self.device))
        return True

    def resident_bytes(self) -> int:
        return self.res.kv.nbytes() + self.res.router_bytes + (self.step.resident_bytes() if self.step is not None else 0)

    def spans(self) -> list[tuple[int, int]]:
        return list(zip(self.res.span_start.tolist(), self.res.span_end.tolist()))

    def step_stats(self) -> StepStats:
        if self.step is not None:
            self.step.fold_stats()
        ranked = self.ranking is not None and self.ranking.kind == "scout" and self.ranking.ready and self.res.n_spans
        order = self.ranking.span_order(self.res.block_span, self.res.n_spans) if ranked else []
        resident = self.ledger.resident if self.ledger.steps else self.resident_bytes()
        kept = self.pinning.device_bytes() if self.pinning is not None else 0  # factor blocks not moved to host memory yet
        hidden = 0 if self.res.hidden.cols is None else int(self.res.hidden.cols.numel())  # look-alikes hidden for the question
        return StepStats(resident_bytes=int(resident), extra={**self.ledger.stats(), "span_order": order, "blocks_on_device_bytes": kept,
                                                              "first_token_parts": self.first_token_parts(),
                                                              "hidden_tokens": hidden})

    def first_token_parts(self) -> dict:
        """Host seconds of this ask's way to its first token, by part (where a launch waited shows): the scout pass's
        forward and scoring, the fixed sets' plan, fill and filling forward's attention (sekv/fixed_set.py HOST_TIMES),
        and the zoom tier's rows (sekv/zoom_tier.py StagedRows: the wait for the row ids, the host gather, the fills'
        waits, bytes sent).  On CUDA the launches run ahead of the device: compare with DecodeStats' event times."""
        out = dict(getattr(self, "_scout_host", {}))
        fixed = getattr(self.step, "fixed", None)
        if fixed is not None:
            out.update(fixed.host_s)
        if self.res.zoom_tier is not None:
            out.update(self.res.zoom_tier.last)
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in out.items()}

    def resident_now(self) -> int:
        return int(self.ledger.resident if self.ledger.steps else self.resident_bytes())  # as step_stats(), no stats

    def _begin_forward(self, n_new: int) -> None:
        if self.ledger.stale:
            self._new_ask()
        self.ledger.begin_forward(self.res.kv.len[-1] + n_new - self.res.n_base)
        self._step().begin_forward(n_new)
        if self.pinning is not None:  # blocks pinned during a pause go in now, between forwards
            self.pinning.settle()

    def _new_ask(self) -> None:
        if self.record_kept:  # the kept sets of this ask's first ranked forward (_attend)
            self._kept_first, self._kept_pending = None, True
        self.ledger.reset()
        if self.res.zoom_tier is not None:
            self.res.zoom_tier.last = {}
        if self.ranking is not None:
            self.ranking.new_ask()
        if self.step is not None:
            self.step.new_ask()

    # -- the scout pass -------------------------------------------------------------------------------------

    def prepare_question(self, forward, question: str | None = None) -> None:
        """Scout pass (routing "scout"): run the question once with the per-layer router, summing each layer's
        z-scored masses of the zoom blocks; the answer's forwards then rank blocks by the sum (minus the document
        profile), plus ``lexical_weight`` x the z-scored lexical score of the question's text (sekv/lexical.py).
        forward() runs the question's tokens through the model over this memory; they are dropped afterwards.
        The question's look-alikes held at full resolution (no ranking reaches them) are hidden from every attention of
        this question and its answer (sekv/residents.py HiddenColumns); the next question sets its own."""
        scouted = self.ranking is not None and self.ranking.kind == "scout" and self.res.n_spans > 0
        self.res.hidden.set(self._hidden_columns(question) if scouted else None)
        if not scouted:
            return
        base = self.n_tokens()
        lex = None
        if self.params.lexical_weight > 0 and question and self.res.lexicon is not None:
            # scored on the host and sent before the forward: a host tensor's copy waits for no device work (a
            # blocking copy after the forward would wait for all of it)
            lex = self.res.lexicon.scores(question).to(self.device, non_blocking=True)
        look = self._lookalikes(question)
        self.ranking.begin_pass()
        self._scouted = []
        try:
            t0 = time.perf_counter()
            forward()
            t1 = time.perf_counter()
            if self._scouted:  # the batched step scores every layer's blocks at once, after the forward
                qs, exact, scaling = zip(*self._scouted)
                self.step.fused_scout = self.fused_scout
                self.ranking.add_masses(self.step.scout_masses(list(qs), list(exact), scaling[0]))
                if self.pinning is not None:
                    self.pinning.touch()
            self._scout_host = {"scout_forward_s": t1 - t0, "scout_score_s": time.perf_counter() - t1}
            self.ranking.finish_pass(self.res.scout_profile, self.params.profile_weight, lex, self.params.lexical_weight)
            prior.add_to(self.ranking.prio, self.prior, self.params.prior_weight)
            lexical.demote(self.ranking.prio, look)
        finally:
            self.ranking.end_pass()
            self._scouted = []
            self.truncate(base)

    def _lookalikes(self, question: str | None):
        """The blocks the scout ranks last for this question (sekv/lexical.py look-alikes), or None; part of the lexical
        evidence (none when lexical_weight is 0: the scout ranks by attention alone)."""
        if self.params.lookalikes != "demote" or self.params.lexical_weight <= 0 or not question or self.res.lexicon is None:
            return None
        look = self.res.lexicon.lookalikes(question, self.res.block_start)
        if look is None and self.rehearsing:  # none: the demotion runs demoting nothing (lexical.demote leaves prio as it is)
            look = torch.zeros(self.res.n_blocks, dtype=torch.bool)
        return look

    def _hidden_columns(self, question: str | None) -> torch.Tensor | None:
        """The full-resolution columns of the question's look-alikes held there (the end window, the sinks), hidden
        from attention for the question (sekv/lexical.py ``Lexicon.resident_columns``), or None; with the blocks'
        rule (``lookalikes="demote"``, lexical evidence on)."""
        if self.params.lookalikes != "demote" or self.params.lexical_weight <= 0 or not question or self.res.lexicon is None:
            return None
        return self.res.lexicon.resident_columns(question, self.res.block_start)

    def _scout_layer(self, layer: int, query: torch.Tensor, scaling: float) -> None:
        hkv, d = self.shape.n_kv_heads, self.shape.head_dim
        q = query[0].float().reshape(hkv, -1, d)  # [Hkv, G*T, d]: a group's heads and tokens
        base = self.step.base if self.res.layout is not None else None
        exact = self.res.exact_keys(layer, base)
        if isinstance(self.step, BatchedStep):  # scored with the other layers' after the forward (no layer needs another's);
            # the part that reads the layer's full-resolution keys is made now, so they are not kept for it
            self._scouted.append((q, BatchedStep.scout_exact(q, exact, scaling), scaling))
        else:
            self.ranking.add_layer(q, exact, scaling, self.step.block_lse(layer, q, scaling))

    # -- attention ------------------------------------------------------------------------------------------

    def attend(self, layer, query, key, value, scaling):
        if query.device.type != "cpu":
            return self._attend(layer, query, key, value, scaling)
        # small tensor ops: one intra-op thread is faster (BLAS threading on [2, 7, 64] products costs 20x)
        with fz.single_thread():
            return self._attend(layer, query, key, value, scaling)

    def _attend(self, layer, query, key, value, scaling):
        if layer == 0 and not self.res.kv.static:  # static steps: static_begin() did it
            self._begin_forward(query.shape[-2])
        out = self.step.attend(layer, query, key, value, scaling)
        if self._kept_pending and self.ranking is not None and self.ranking.ranks():
            self._record_kept(layer)
        if self.pinning is not None:  # in use: no page-locking starts now
            self.pinning.touch()
        if self.ranking is not None and self.ranking.scouting:
            self._scout_layer(layer, query, scaling)
        return out

    def _record_kept(self, layer: int) -> None:
        """record_kept: a copy of the layer's kept pairs in this ask's first ranked forward (the batched step's are
        views that a later fill of the ask would write over)."""
        if self._kept_first is None:  # the ranking and the hidden columns hold for the whole ask: taken once
            self._kept_first = {"kept": [None] * self.shape.n_layers, "prio": self.ranking.prio.clone(), "hidden": self.res.hidden.cols}
        kept = self.step.kept(layer)
        self._kept_first["kept"][layer] = None if kept is None else kept.to(self.device, copy=True)
        if layer == self.shape.n_layers - 1:
            self._kept_pending = False

    def token_coverage(self, positions) -> dict:
        """What the last ask read of each document token position in ``positions``, at its answer's first forward
        (sekv/coverage.py; needs ``record_kept`` set before the ask): per token ``resolution`` ("exact": a
        full-resolution token; "zoomed": its zoom block read at full resolution by every layer and KV group;
        "partly zoomed": by some; "coarse": its span read through the coarse entry only; "unknown": no ranked forward
        was recorded), whether hidden for the question, where a zoomed block's rows came from, its span, block and the
        block's place in the ranking."""
        from .coverage import token_coverage

        return token_coverage(self, positions)

    def token_resolution(self, positions) -> list[str]:
        """Each position's ``resolution`` of :meth:`token_coverage`."""
        return self.token_coverage(positions)["resolution"]

    # -- static single-token steps (sekv_core/graphed_step.py) ----------------------------------------------

    def static_supported(self) -> bool:
        # the batched step has no host sync; a captured step has one device.  Per-layer routing (no fixed set) reads the
        # zoom tier's rows of every step through the host (ZoomTier.rows), which a capture cannot hold: eager steps
        per_layer_tier = self.res.zoom_tier is not None and self.ranking is None
        return self.batched and not self.res.split and not per_layer_tier

    def static_begin(self) -> None:
        self._step()
        if getattr(self, "_warming", None) is not None:  # the blocks' thread ends (its kernels' warm-up) before a step
            self._warming.join()  # that may be captured: another thread's allocations or copies would break a capture
            self._warming = None
        if self.res.zoom_tier is not None:  # so does the zoom tier's staging (done once the fill took every layer)
            self.res.zoom_tier.settle()
        self.res.kv.static_begin()
        if self.ledger.stale:
            self._new_ask()
        self.ledger.begin_forward(self.res.kv.len[-1] + 1 - self.res.n_base)
        if self.pinning is not None:  # before a capture: no page-locking in flight beside it
            self.pinning.settle()
        self.step.static_begin()

    def static_key(self):
        return self.res.kv.static_key() + self.step.static_key() + (self.pinning.key() if self.pinning is not None else ())

    def static_end(self) -> None:
        self.res.kv.advance(1)
        if self.pinning is not None:
            self.pinning.touch()

    def static_mode(self):
        return self.res.kv.static_mode()


class _Built:
    """Factor blocks built already, handed to a memory as its BlockBuild would be."""

    pinning = None

    def __init__(self, blocks: list):
        self._b = blocks

    def result(self) -> list:
        return self._b

    result_or_none = result

    def join(self) -> None:
        pass


class _FirstLayers:
    """A pack read as if it held its first ``n`` layers alone (its config says ``n`` layers; every other tensor is the
    pack's, read through it, the zoom tier's rows through its map, unchecked: nothing read here is kept)."""

    def __init__(self, store, n: int):
        self._store, self._n = store, n
        if hasattr(store, "mapped"):
            self.mapped = store.mapped

    def keys(self):
        return self._store.keys()

    def get(self, name: str) -> torch.Tensor:
        t = self._store.get(name)
        if name == "sekv.config":
            from .layout import CONFIG_FIELDS

            t = t.clone()
            t[CONFIG_FIELDS.index("n_layers")] = self._n
        return t


#: rehearse_layer's question lengths, in tokens: near a typical question's with the chat template, one even and one odd
#: (products, reductions and elementwise kernels pick their variant by size: a reduction's outputs by fours or twos,
#: a product's tile by its rows)
REHEARSAL_TOKENS = (32, 47)
#: the pack's layers it runs on: later layers read views at other offsets of tensors stacked over layers (an
#: elementwise kernel's vector width follows its operands' alignment) and the scout stacks several layers' queries
REHEARSAL_LAYERS = 4
#: its question's text: the lexical evidence's kernels run (its scores are the pack's lexicon's, zeros where no word
#: of it is the document's)
REHEARSAL_TEXT = "What does the document say about this, and where?"


def _made_up(n: int, heads: int, d: int, dev, dtype, gen: torch.Generator) -> torch.Tensor:
    """[1, heads, n, d] random values in the layout the model's attention hands over ([1, n, heads, d] transposed),
    drawn on the host from ``gen`` and moved: no random op on the device (the device's default generator is shared
    with any CUDA graph captured meanwhile, on any thread, and a draw beside a capture fails)."""
    return torch.randn(1, n, heads, d, generator=gen).to(dev, dtype).transpose(1, 2)


def rehearse_layer(store, params: SekvParams, shape: ModelShape, device, blocks: list, n_q: tuple[int, ...] = REHEARSAL_TOKENS,
                   batched: bool | None = None, layers: int = REHEARSAL_LAYERS) -> float:
    """A question's way through the memory, run on the pack's first ``layers`` layers alone (their resident entries,
    router, profile, zoom tier and factor blocks ``blocks[:layers]``, built already) with made-up queries, keys and
    values of the model's shape, dtype and layout, for each question length of ``n_q``: the scout pass (its
    per-layer-routed forward, its scoring in chunks and graphs as the pack's length makes them, and its lexical
    evidence, the look-alikes' demotion included), the fixed sets' plan and fill, the answer's first forward and the
    ask's statistics; then a single-token step, eager and static (what a captured decode step runs).  On CUDA this
    loads and sets up the kernels of those parts with the pack's own shapes, so that the first real question does not
    (sekv/gpu_step.py BlockBuild runs it after the blocks' build, while the model loads).  No random op runs on the
    device.  Its device memory: those layers' resident entries and fixed sets, and the scout's chunk transients (at
    most three SCOUT_CHUNK_BYTES tensors); all freed when it returns.  ``batched``: the step to take (tests: the
    accelerators' step on the CPU); None: the device's.  -> seconds it took."""
    t0 = time.perf_counter()
    n_layers = max(1, min(layers, shape.n_layers, len(blocks)))
    part = dataclasses.replace(shape, n_layers=n_layers)
    mem = ZoomMemory(_FirstLayers(store, n_layers), params, part, device, blocks=blocks[:n_layers])
    mem.rehearsing = True
    mem.fused_scout = False  # the way a first question takes (the fused kernel only after a session's rehearsal)
    if batched is not None:
        mem.batched = batched
    dev, h, hkv, d = mem.device, shape.n_heads, shape.n_kv_heads, shape.head_dim
    gen = torch.Generator().manual_seed(0)
    made = {n: tuple(_made_up(n, k, d, dev, shape.dtype, gen) for k in (h, hkv, hkv)) for n in (*n_q, 1)}  # before any step

    def forward(n: int) -> None:
        mem.begin_step(n)
        for layer in range(n_layers):
            mem.attend(layer, *made[n], d**-0.5).transpose(1, 2).contiguous()  # as the model's attention hook hands it on
        mem.end_step()

    with torch.inference_mode():
        base = mem.n_tokens()
        for n in n_q:
            mem.truncate(base)  # a new question
            mem.prepare_question(lambda n=n: forward(n), REHEARSAL_TEXT)
            forward(n)  # the answer's first forward, over the ranked fixed sets
            mem.step_stats()  # what an ask reads at its end
        forward(1)  # a single-token step, eager
        if mem.static_supported():  # and static, as a decode step runs (captured on CUDA, by the question)
            mem.static_begin()
            with mem.static_mode():
                for layer in range(n_layers):
                    mem.attend(layer, *made[1], d**-0.5).transpose(1, 2).contiguous()
            mem.static_end()
        mem.truncate(base)
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()
    return time.perf_counter() - t0
