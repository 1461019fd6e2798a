"""DepthWeave-KV runtime memory: routed resident codes, question-time routing, online probes.

Resident on the compute device: window bases, per-layer residual bases, every token's
quantised coefficients, the routed residual pools (codec.py), the routing offsets, the
exact first tokens and everything appended (question, answer) at full precision.
CPU tier: the pack's top-level residuals of every token (memory-mapped), from which
pools are cut when the routing changes and the probes' higher-fidelity reference is made.

Routing, per ask: the pack's features give the initial routing at the budget.  During the
question's forward, at the first layer of each depth window, the question's attention
over the document (at the current fidelity) is added to the window's accumulated
attention mass and the window is re-routed within its current residual bytes.  Every
``probe_every`` decode steps the probes (probe.py) measure attention-output errors,
move the window offsets, add their attention mass, and the routing is re-solved
against the budget.  ``truncate`` back to the document restores the pack's state.

On a model placed across devices (``device``: one per layer) each layer's codes, pools and exact / appended tokens
live on its layer's device; the window tables a layer reads (bases, group counts and offsets, the rotation) are on
every device that has a layer, the first layer's as ``ng`` / ``boff`` / ``rot``, the others' in ``_other``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import SekvError
from ..methods.base import GrowingKV, KVMemory, ModelShape, StepStats, TensorStore, per_layer
from . import attention as at
from . import codec, router
from .probe import ProbeController, relative_error

kernel_triton = None  # imported on first use on a CUDA device: CPU installs never import triton


def fused_available(device: torch.device) -> bool:
    global kernel_triton
    if device.type != "cuda":
        return False
    if kernel_triton is None:
        try:
            from . import kernel_triton as kt
        except Exception:  # no triton, or one that does not work here: the PyTorch path
            return False
        kernel_triton = kt
    return bool(kernel_triton.AVAILABLE)


class DepthWeaveMemory(KVMemory):
    def __init__(self, store: TensorStore, params: dict[str, Any], shape: ModelShape, device):
        self.spec = spec = codec.Spec.load(store)
        if (spec.n_layers, spec.n_kv_heads, spec.head_dim) != (shape.n_layers, shape.n_kv_heads, shape.head_dim):
            raise SekvError("this depthweave pack was made for a model of a different shape; re-ingest the document")
        self.devices = per_layer(device, shape.n_layers)
        self.shape, self.params = shape, params
        self.device = self.devices[0] if isinstance(device, (list, tuple)) else torch.device(device)
        dev, L, M, hkv, nc = self.device, spec.n_layers, spec.n_windows, spec.n_kv_heads, spec.n_compressed
        split = len(set(self.devices)) > 1
        self.itemsize = torch.empty(0, dtype=shape.dtype).element_size()
        chunk = int(params.get("chunk", 0))  # 0: ~1/8 of the document, at least 256 tokens
        self.chunk = chunk if chunk > 0 else max(256, -(-spec.n_compressed // 8 // 256) * 256)
        self.gol = torch.tensor(spec.groups_of_level, dtype=torch.uint8)

        bases = {(z, m): store.get(f"depthweave.basis.{z}.{m}").float().to(dev) for z in "kv" for m in range(M)}
        if split:  # each window's bases on every device one of its layers is on
            bases.update({(z, spec.window_of(i), d): bases[(z, spec.window_of(i))].to(d) for i, d in enumerate(self.devices) if d != dev for z in "kv"})
        self.codes: list[dict[str, at.ZCodes]] = []
        self.tier: list[dict[str, tuple[torch.Tensor, torch.Tensor | None]]] = []  # CPU top-level residuals
        for i in range(L):
            m, zc, tier, di = spec.window_of(i), {}, {}, self.devices[i] if split else dev
            for z in "kv":
                get = lambda name: store.get(f"depthweave.{name}.{z}.{i}")  # noqa: E731
                coef = get("coef").to(di)
                cs = get("coef_scale").to(di) if spec.coef_bits else None
                tier[z] = (get("res"), get("res_scale") if spec.res_bits and spec.channels(z) else None)
                basis = bases[(z, m)] if di == dev else bases[(z, m, di)]
                zc[z] = at.ZCodes(basis, get("resbasis").float().to(di), coef, cs, torch.empty(0), None, spec.group(z), spec.rank(z))
            self.codes.append(zc)
            self.tier.append(tier)
        exact = [[store.get(f"depthweave.exact.{z}.{i}").to(shape.dtype) for i in range(L)] for z in "kv"]
        self.kv = GrowingKV.from_tensors(exact[0], exact[1], self.devices if split else dev, extra=256)
        self.rot = None
        #: the window tables of the devices other than the first layer's: device -> {"ng", "boff": per window, "rot"}
        self._other = {d: {"ng": [None] * M, "boff": [None] * M, "rot": None} for d in dict.fromkeys(self.devices) if split and d != dev}
        if spec.pre_rope:
            r = store.get("depthweave.rope").float()
            self.rot = at.Rotary(r[:-1].to(dev), float(r[-1]), shape.dtype, spec.n_exact)
            for d, t in self._other.items():
                t["rot"] = at.Rotary(r[:-1].to(d), float(r[-1]), shape.dtype, spec.n_exact)

        # router state
        self.feat = {k: store.get(f"depthweave.feat.{k}").float() for k in ("mass", "spike", "energy")}
        self.feat["delim"] = store.get("depthweave.feat.delim").float()
        self.u = router.RouterWeights.parse(params.get("router", ""))
        self.spacing = float(params.get("spacing", 1.0))
        self.online_weight = float(params.get("online_weight", 0.5))
        self.cost = codec.level_cost(spec)
        self.fixed = codec.fixed_bytes(spec, self.itemsize)
        self.transient_reserve = codec.transient_bytes(spec, self.chunk)
        budget = float(params.get("budget", 0.25))
        if budget <= 0:
            raise SekvError(f"--budget must be > 0 (a fraction of the full KV cache), got {budget:g}")
        self.budget_bytes = int(budget * spec.n_tokens * shape.kv_bytes_per_token())
        floor = sum(self.fixed.values()) + self.transient_reserve
        if budget >= 1.0:
            self.allowance = float("inf")
        else:
            self.allowance = float(self.budget_bytes - floor)
            if self.allowance < 0:
                raise SekvError(f"--budget {budget:g} is below depthweave's floor of {floor / (self.budget_bytes / budget):.3f} of the full KV "
                                f"for this pack (bases + coefficients at rank_k={spec.rank_k}, rank_v={spec.rank_v}); raise --budget or re-ingest with lower ranks")
        self.controller = ProbeController(M, float(params.get("probe_tolerance", 0.05)), float(params.get("probe_step", 0.5)),
                                          int(params.get("probe_quiet", 3)))
        self.probe_every = int(params.get("probe_every", 16))
        self.question_routing = bool(int(params.get("question_routing", 1)))
        fused = str(params.get("fused", "auto"))
        # the kernel covers quantised packs whose keys and values both have (or both lack) residual channels
        kernel_layout = bool(spec.coef_bits and spec.res_bits) and (spec.channels("k") > 0) == (spec.channels("v") > 0)
        self.use_fused = fused != "off" and kernel_layout and all(fused_available(d) for d in set(self.devices))
        if fused == "on" and not self.use_fused:
            raise SekvError("fused=on needs a CUDA device with triton installed and a quantised pack")
        self.ng = [torch.zeros(hkv, nc, dtype=torch.uint8, device=dev) for _ in range(M)]
        self.boff = [torch.zeros(hkv, -(-nc // codec.OFF_BLOCK), dtype=torch.int32, device=dev) for _ in range(M)]
        self.level: list[torch.Tensor | None] = [None] * M
        self._shares: list[float] | None = None
        self._probing, self._probe_layers, self._probe_head, self._multi, self._reset_pending = False, set(), 0, False, False
        self._reset_online()
        self.base_level, self.base_tau = self._solve()
        self.tau = self.base_tau
        self._set_levels(self.base_level)
        self._dirty = False
        self._transient = self._peak = 0
        self._pending: list[tuple[int, int, float]] = []

    # -- routing ---------------------------------------------------------------------------------------------
    def _reset_online(self) -> None:
        M, hkv, nc = self.spec.n_windows, self.spec.n_kv_heads, self.spec.n_compressed
        self.online_sum = torch.zeros(M, hkv, nc)
        self.online_rows = torch.zeros(M, hkv)
        self.controller.reset(hkv)
        self.step = 0
        self.question_pending = True
        self.probe_errors: list[float] = []

    def score(self) -> torch.Tensor:
        rows = self.online_rows.unsqueeze(-1)
        online = torch.where(rows > 0, self.online_sum / rows.clamp_min(1), self.feat["mass"])
        return router.score(self.feat, self.u, online, self.online_weight if bool((rows > 0).any()) else 0.0, self.controller.last_error)

    def _solve(self) -> tuple[list[torch.Tensor], float]:
        s, delta = self.score(), self.controller.delta
        tau = router.solve_offset(s, delta, self.spacing, self.cost, self.allowance) if self.allowance != float("inf") else -1e9
        lv = router.levels(s, tau + delta, self.spacing, len(self.spec.levels))
        return list(lv), tau

    def _set_levels(self, levels: list[torch.Tensor], only: list[int] | None = None) -> None:
        """Make the resident pools match ``levels`` (windows whose levels changed, or ``only``)."""
        spec = self.spec
        for m, (s, e) in enumerate(spec.windows):
            if only is not None and m not in only:
                continue
            if only is None and self.level[m] is not None and torch.equal(levels[m], self.level[m]):
                continue
            lv = levels[m]
            self.level[m] = lv.clone()
            self._shares = None
            ng, boff, _ = codec.group_offsets(lv, self.gol)
            self.ng[m], self.boff[m] = ng.to(self.device), boff.to(self.device)
            for d, t in self._other.items():
                t["ng"][m], t["boff"][m] = ng.to(d), boff.to(d)
            for i in range(s, e):
                for z in "kv":
                    res, scale = self.tier[i][z]
                    g, mg = spec.group(z), spec.max_groups
                    if mg == 0 or g == 0:
                        continue
                    dense = res.view(*res.shape[:2], mg, -1)
                    zc = self.codes[i][z]
                    di = self.devices[i] if self._other else self.device
                    zc.pool = codec.cut_pool(dense, lv, self.gol, mg).to(di)
                    zc.pool_scale = None if scale is None else codec.cut_pool(scale, lv, self.gol, mg).to(di)

    def _route_all(self) -> None:
        levels, self.tau = self._solve()
        self._set_levels(levels)
        self._dirty = True

    def _route_window(self, m: int) -> None:
        """Re-route one window on updated scores, keeping its residual bytes."""
        s = self.score()[m : m + 1]
        cost = self.cost[m : m + 1]
        used = float(cost[0][self.level[m].long()].sum())
        tau = router.solve_offset(s, torch.zeros(1), self.spacing, cost, used) if self.allowance != float("inf") else -1e9
        self.controller.delta[m] = tau - self.tau
        self._set_levels([None if j != m else router.levels(s, torch.tensor([tau]), self.spacing, len(self.spec.levels))[0]
                          for j in range(self.spec.n_windows)], only=[m])
        self._dirty = True

    # -- attention -------------------------------------------------------------------------------------------
    def _tables(self, layer: int, m: int):
        """(group counts, group offsets, rotation) of window m on the layer's device."""
        t = self._other.get(self.devices[layer]) if self._other else None
        return (self.ng[m], self.boff[m], self.rot) if t is None else (t["ng"][m], t["boff"][m], t["rot"])

    def _attend(self, layer: int, qf: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, n_new: int, heads=None, dense=None,
                keep_scores: bool = False):
        """qf [Hkv', G*q, d] float32, pre-scaled -> (o [Hkv', G*q, d], lse, doc score chunks)."""
        m = self.spec.window_of(layer)
        t = kt.shape[1]
        mask = None
        if n_new > 1:  # the new block is causal among itself; a single new token sees everything
            rows = torch.arange(qf.shape[1], device=qf.device) % n_new
            mask = (torch.arange(t, device=qf.device)[None, :] <= (t - n_new + rows)[:, None]).unsqueeze(0)
        ktt, vtt = (kt, vt) if heads is None else (kt[heads], vt[heads])
        tail = at.partial(qf, ktt.float(), vtt.float(), mask)[:3]
        ng, boff, rot = self._tables(layer, m)
        if self.use_fused and n_new == 1 and heads is None and dense is None and not keep_scores and self.spec.n_compressed:
            zk, zv = self.codes[layer]["k"], self.codes[layer]["v"]
            doc = [kernel_triton.doc_attention(qf, zk, zv, ng, boff, self.spec.max_groups, rot)]
            scores, transient = [], 0
        else:
            doc, scores, transient = at.doc_partials(qf, self.codes[layer]["k"], self.codes[layer]["v"], ng,
                                                     self.spec.max_groups, rot, self.chunk, keep_scores, heads, dense)
        self._transient = max(self._transient, transient)
        o, lse = at.merge(doc + [tail])
        return o, lse, scores

    def _doc_probs(self, scores: list[torch.Tensor], lse: torch.Tensor) -> torch.Tensor:
        """Attention probabilities over the compressed document, relative to uniform, summed over rows: [Hkv', Nc]."""
        s = torch.cat(scores, -1)
        total = self.n_tokens()
        return (torch.exp(s - lse.unsqueeze(-1)) * total).sum(1)

    def attend(self, layer, query, key, value, scaling):
        spec = self.spec
        kt, vt = self.kv.append(layer, key, value)
        kt, vt = kt[0], vt[0]
        _, H, q, d = query.shape
        hkv = spec.n_kv_heads
        G = H // hkv
        qf = (query[0].float() * scaling).reshape(hkv, G * q, d)
        m = spec.window_of(layer)
        first = layer == spec.windows[m][0]
        if self.question_pending and q > 1 and first and self.question_routing and spec.n_compressed and spec.max_groups:
            _, lse, scores = self._attend(layer, qf, kt, vt, q, keep_scores=True)
            self.online_sum[m] += self._doc_probs(scores, lse).cpu()
            self.online_rows[m] += G * q
            self._route_window(m)
        o, lse, _ = self._attend(layer, qf, kt, vt, q)
        if self._probing and layer in self._probe_layers and spec.n_compressed and spec.max_groups:
            h = self._probe_head
            hs = torch.tensor([h], device=qf.device)
            o_ref, lse_ref, scores = self._attend(layer, qf[h : h + 1], kt, vt, q, heads=hs, dense=self.tier[layer], keep_scores=True)
            err = relative_error(o[h], o_ref[0])
            self.online_sum[m, h] += self._doc_probs(scores, lse_ref)[0].cpu()
            self.online_rows[m, h] += G * q
            self._pending.append((m, h, err))
        return o.reshape(1, H, q, d).to(query.dtype)

    # -- KVMemory --------------------------------------------------------------------------------------------
    def begin_step(self, n_new: int) -> None:
        if self._reset_pending:  # deferred from truncate() so that the last ask's stats stay readable
            self._reset_online()
            if self._dirty:
                self.tau = self.base_tau
                self._set_levels(self.base_level)
                self._dirty = False
            self._reset_pending = False
        self._transient = 0
        self._probing = False
        self._multi = n_new > 1
        if n_new == 1:
            self.step += 1
            if self.probe_every > 0 and self.step % self.probe_every == 0:
                self._probing = True
                k = self.controller.n_probes // max(1, self.spec.n_windows)
                self._probe_layers = {s + k % (e - s) for s, e in self.spec.windows}
                self._probe_head = k % self.spec.n_kv_heads

    def end_step(self) -> None:
        if self._multi:
            self.question_pending = False
        if self._pending:
            for m, h, err in self._pending:
                self.controller.record(m, h, err)
                self.probe_errors.append(err)
            self._pending = []
            self._route_all()
        self._peak = self.resident_bytes() + self._transient

    def n_tokens(self) -> int:
        return self.spec.n_tokens + self.kv.len[-1] - self.spec.n_exact

    def truncate(self, n_tokens: int) -> None:
        self.kv.truncate(self.spec.n_exact + max(0, n_tokens - self.spec.n_tokens))
        if n_tokens <= self.spec.n_tokens:
            self._reset_pending = True

    def pool_bytes(self) -> int:
        return sum(at.qz.nbytes(z.pool, z.pool_scale) for zc in self.codes for z in zc.values())

    def resident_bytes(self) -> int:
        fixed = sum(v for k, v in self.fixed.items() if k != "exact_tokens")  # exact tokens live in self.kv
        return int(fixed + self.pool_bytes() + self.kv.nbytes())

    def level_shares(self) -> list[float]:
        """Share of (window, KV head, token) entries at each residual level (cached per routing)."""
        if self._shares is None:
            counts = torch.stack([torch.bincount(lv.flatten().long(), minlength=len(self.spec.levels)) for lv in self.level]).sum(0)
            total = max(1, int(counts.sum()))
            self._shares = [round(int(c) / total, 4) for c in counts]
        return self._shares

    def step_stats(self) -> StepStats:
        errs = self.probe_errors
        return StepStats(
            resident_bytes=int(self._peak or self.resident_bytes()),
            extra={
                "budget_bytes": self.budget_bytes,
                "residual_pool_bytes": self.pool_bytes(),
                "transient_bytes": int(self._transient),
                "level_shares": dict(zip(map(str, self.spec.levels), self.level_shares())),
                "window_offsets": [round(float(x), 3) for x in self.controller.delta],  # question re-routing + probes
                "probe_moves": [round(float(x), 3) for x in self.controller.moves],  # the probes' share of the offsets
                "probes": len(errs),
                "probe_error_mean": round(sum(errs) / len(errs), 4) if errs else None,
                "fused_kernel": self.use_fused,
            },
        )
