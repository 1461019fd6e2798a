"""`sekv train`: fit the zoom-in router of a frozen model (SPEC §3).

Per training context (a stretch of the training text in the ingest chat
template): one prefill (keys, values, surprisal), the segmentation ingest would
make at the default budget, and every span's singular triplets
(train/memory.py ``compress_context``).  Query samples are *recall* questions
("quote the passage that follows ...", answered with the passage verbatim),
mined where the teacher looks far back: ``candidates`` windows are drawn and the
``per_context`` with the largest teacher attention mass beyond the local window
are kept.  Each kept sample is one optimisation step: the teacher forward (full
KV, no gradient) gives the target distributions and span masses, the student
forward (differentiable SeKV attention) the predictions; losses in
train/losses.py; AdamW, linear warm-up over the first 10 % of steps then cosine
decay; context lengths follow the curriculum in order (equal shares of steps).

The base model is frozen (``requires_grad_(False)``); only W, tau and G train.
Checkpoints: the router file itself (OUT) plus OUT.state.safetensors (optimizer
moments, step) -- safetensors only, so resuming never unpickles anything; a log
of every step's metrics in OUT.log.jsonl.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from .. import prompt, runtime
from ..errors import SekvError
from ..methods import get as get_method
from ..methods.base import ModelShape
from ..prefill import prefill
from ..sekv import router as rt
from ..sekv import router_file
from ..sekv import compress as sekv_compress
from ..sekv.rank_gate import RankGate, n_params
from . import corpus, losses
from .memory import CompressedContext, RouterParams, StudentMemory, TeacherMemory, compress_context

ANSWER_TOKENS = 24
LEAD_TOKENS = 12


@dataclass
class TrainConfig:
    steps: int = 200
    contexts: tuple[int, ...] = (2048, 4096)
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: float = 0.10
    per_context: int = 4
    candidates: int = 8
    temperature: float = 0.1
    tau_init: float = 0.05
    d_r: int = rt.D_R
    rank: int = 32
    seed: int = 0
    save_every: int = 25
    warm_contexts: int = 8  # stage 1 (0: skip): contexts whose teacher queries and span masses are cached
    warm_per_context: int = 12
    warm_steps: int = 600
    warm_lr: float = 3e-3
    loss_weights: dict[str, float] = field(default_factory=lambda: dict(losses.WEIGHTS))

    def to_json(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


@dataclass
class Sample:
    ids: list[int]  # query tokens (question + answer)
    kl_pos: list[int]  # positions (within ids) whose next-token distribution is distilled


def recall_sample(tokenizer, ctx_ids: list[int], doc_start: int, window: int, rng: random.Random) -> Sample | None:
    """A passage from before the local window, asked back by its lead-in."""
    lo, hi = doc_start + LEAD_TOKENS, len(ctx_ids) - window - ANSWER_TOKENS
    if hi <= lo:
        return None
    p = rng.randrange(lo, hi)
    lead = tokenizer.decode(ctx_ids[p - LEAD_TOKENS : p]).strip()
    answer = tokenizer.decode(ctx_ids[p : p + ANSWER_TOKENS])
    if not lead or not answer.strip():
        return None
    q = f'Continue the quote "{lead}"'
    q_ids = prompt.encode(tokenizer, prompt.question_suffix(tokenizer, q))
    a_ids = prompt.encode(tokenizer, answer)[:ANSWER_TOKENS]
    ids = q_ids + a_ids
    return Sample(ids, list(range(len(q_ids) - 1, len(ids) - 1)))


def init_router(shape: ModelShape, ctx: CompressedContext, cfg: TrainConfig) -> RouterParams:
    """W from the untrained PCA initialisation (per KV head, copied to its query heads), tau = tau_init, fresh G."""
    g = shape.n_heads // shape.n_kv_heads
    w = torch.stack([rt.pca_init(ctx.keys[i].float(), cfg.d_r, ctx.layers[i].kbar).repeat_interleave(g, 0) for i in range(shape.n_layers)])
    tau = torch.full((shape.n_layers, shape.n_heads), cfg.tau_init)
    return RouterParams(w, tau, RankGate(cfg.rank, shape.head_dim)).to(w.device)


def _decoder_forward(model, ids: list[int], start: int, memory, grad: bool) -> torch.Tensor:
    dev = next(model.parameters()).device
    x = torch.tensor([ids], device=dev)
    pos = torch.arange(start, start + len(ids), device=dev).unsqueeze(0)
    with runtime.using(memory), torch.set_grad_enabled(grad):
        return model.get_decoder()(input_ids=x, position_ids=pos, use_cache=False).last_hidden_state[0]


def _logits(model, hidden: torch.Tensor, positions: list[int]) -> torch.Tensor:
    return model.get_output_embeddings()(hidden[positions]).float()


class Trainer:
    def __init__(self, lm, cfg: TrainConfig, out: Path, docs: list[tuple[str, str]], data_info: dict[str, Any], log: Callable[[str], None] = print):
        self.lm, self.cfg, self.out, self.docs, self.data_info, self.log = lm, cfg, Path(out), docs, data_info, log
        self.model = lm.model
        self.model.requires_grad_(False)
        self.shape = ModelShape.of(lm.config, next(self.model.parameters()).dtype)
        self.method = get_method("sekv")
        self.params = self.method.resolve_params({})
        self.router: RouterParams | None = None
        self.opt: torch.optim.Optimizer | None = None
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.warm: dict[str, float] = {}

    # -- schedule -----------------------------------------------------------------------------------------
    def stage_of(self, step: int) -> int:
        n = len(self.cfg.contexts)
        return min(n - 1, step * n // max(self.cfg.steps, 1))

    def lr_at(self, step: int) -> float:
        w = max(1, int(self.cfg.warmup * self.cfg.steps))
        if step < w:
            return self.cfg.lr * (step + 1) / w
        t = (step - w) / max(1, self.cfg.steps - w)
        return self.cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    # -- data ---------------------------------------------------------------------------------------------
    def contexts_for(self, stage: int) -> list[corpus.Context]:
        steps_in = sum(1 for s in range(self.cfg.steps) if self.stage_of(s) == stage)
        count = math.ceil(steps_in / self.cfg.per_context)
        return corpus.contexts(self.lm.tokenizer, self.docs, self.cfg.contexts[stage], count, self.cfg.seed + 1000 * stage)

    def prepare(self, c: corpus.Context) -> CompressedContext:
        pre = prefill(self.model, torch.tensor(c.doc_ids), with_surprisal=True)
        pre.keys = [k.clone() for k in pre.keys]  # out of inference mode: the student saves them for backward
        pre.values = [v.clone() for v in pre.values]
        if self.params.number_share > 0:  # the number tokens ingest keeps exact (sekv/numbers.py)
            pre.scores["token_text"] = self.lm.tokenizer.batch_decode([[t] for t in c.doc_ids])
        seg = sekv_compress.segmentation(pre, self.params)
        ctx = compress_context(pre, seg, weighting=self.params.weighting, rank=self.cfg.rank, pre_rope=self.params.key_space == "pre_rope")
        ctx.window = sekv_compress.lengths(pre.n_tokens, self.params)[2]
        return ctx

    def teacher(self, ctx: CompressedContext, s: Sample) -> tuple[torch.Tensor, dict[int, torch.Tensor], float]:
        mem = TeacherMemory(ctx, far_window=max(ctx.window, 64))
        with torch.no_grad():
            h = _decoder_forward(self.model, s.ids, ctx.n_tokens, mem, grad=False)
            logits = _logits(self.model, h, s.kl_pos)
        return logits, mem.mass, sum(mem.far.values()) / max(len(mem.far), 1)

    # -- optimisation -------------------------------------------------------------------------------------
    def state_path(self) -> Path:
        return self.out.with_name(self.out.name + ".state.safetensors")

    def resume(self) -> bool:
        """Continue from OUT + OUT.state.safetensors when both exist."""
        if not (self.out.is_file() and self.state_path().is_file()):
            return False
        rf = router_file.load(self.out)
        if rf.fingerprint != self.lm.fingerprint:
            raise SekvError(f"{self.out} was trained for another model; choose another --out")
        dev = next(self.model.parameters()).device
        self.router = RouterParams(rf.w, rf.tau, rf.gate.train().requires_grad_(True)).to(dev)
        self._make_opt()
        st = load_file(str(self.state_path()))
        self.step = int(st.pop("step").item())
        for i, p in enumerate(self.router.parameters()):
            s = self.opt.state[p]
            s["step"] = torch.tensor(float(self.step))
            s["exp_avg"], s["exp_avg_sq"] = st[f"m.{i}"].to(p.device), st[f"v.{i}"].to(p.device)
        self.history = list(rf.meta.get("history", []))
        self.warm = dict(rf.meta.get("warm_start", {}))
        self.log(f"resumed from {self.out} at step {self.step}")
        return True

    def warm_start(self) -> dict[str, float]:
        """Stage 1: fit W on cached teacher queries and span masses (zoom BCE + listwise span-mass KL).

        Each sample needs one cheap teacher forward and no student forward, so hundreds of optimisation
        steps cost less than one end-to-end step; the end-to-end stage then starts from a router that
        already ranks spans.  Reports the teacher span mass in the top-2 gated spans on held-out samples.
        """
        cfg, L = self.cfg, self.shape.n_layers
        cs = corpus.contexts(self.lm.tokenizer, self.docs, cfg.contexts[0], cfg.warm_contexts, cfg.seed + 555)
        doc_start = len(prompt.encode(self.lm.tokenizer, prompt.document_prefix(self.lm.tokenizer, "")))
        data = []
        for ci, c in enumerate(cs):
            ctx = self.prepare(c)
            if self.router is None:
                self.start(ctx)
                self.report_size()
            rng = random.Random(cfg.seed * 31 + ci)
            kb, log_n = [lay.kbar for lay in ctx.layers], ctx.span_len.float().log().to(ctx.layers[0].kbar.device)
            for _ in range(cfg.warm_per_context):
                smp = recall_sample(self.lm.tokenizer, c.doc_ids, doc_start, ctx.window, rng)
                if smp is None:
                    continue
                mem = TeacherMemory(ctx, far_window=max(ctx.window, 64), keep_queries=True)
                with torch.no_grad():
                    _decoder_forward(self.model, smp.ids, ctx.n_tokens, mem, grad=False)
                data.append((kb, log_n, [mem.queries[i] for i in range(L)], [mem.mass[i] for i in range(L)]))
            self.log(f"warm start: context {ci + 1}/{len(cs)}, {len(data)} samples")
            del ctx
        if len(data) < 2:
            raise SekvError("warm start: not enough training samples")
        n_held = max(1, len(data) // 5)
        held, train = data[:n_held], data[n_held:]
        r = self.router

        def evaluate() -> tuple[float, float]:
            got = best = 0.0
            with torch.no_grad():
                for kb, log_n, qs, ms in held:
                    for i in range(L):
                        g, b = losses.top_mass(r.gate_logits(i, qs[i].float(), kb[i], log_n), ms[i])
                        got, best = got + g, best + b
            k = len(held) * L
            return got / k, best / k

        before, oracle = evaluate()
        opt = torch.optim.AdamW([r.w], lr=cfg.warm_lr, weight_decay=cfg.weight_decay)
        rng = random.Random(cfg.seed + 99)
        for it in range(cfg.warm_steps):
            kb, log_n, qs, ms = train[rng.randrange(len(train))]
            opt.zero_grad(set_to_none=True)
            loss = 0.0
            for i in range(L):
                lg = r.gate_logits(i, qs[i].float(), kb[i], log_n)
                loss = loss + losses.zoom(lg, losses.rho_targets(ms[i])) + losses.listwise(lg, ms[i])
            (loss / L).backward()
            torch.nn.utils.clip_grad_norm_([r.w], 1.0)
            opt.step()
        after, _ = evaluate()
        out = {"samples": len(data), "held_out": n_held, "steps": cfg.warm_steps,
               "top2_mass_before": round(before, 4), "top2_mass_after": round(after, 4), "top2_mass_oracle": round(oracle, 4)}
        self.log(f"warm start: teacher span mass in the top-2 gated spans (held out): {before:.3f} -> {after:.3f} (best possible {oracle:.3f})")
        self.warm = out
        return out

    def start(self, first: CompressedContext) -> None:
        self.router = init_router(self.shape, first, self.cfg)
        self._make_opt()

    def report_size(self) -> None:
        n_train = n_params(self.router)
        n_model = n_params(self.model)
        self.log(f"trainable parameters: {n_train:,} ({100 * n_train / n_model:.3f}% of the model's {n_model:,}); base model frozen")

    def _make_opt(self) -> None:
        self.opt = torch.optim.AdamW(self.router.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)

    def loss(self, ctx: CompressedContext, s: Sample, t_logits, t_mass) -> tuple[torch.Tensor, dict[str, float]]:
        stu = StudentMemory(ctx, self.router, self.cfg.temperature, self.params.budget)
        h = _decoder_forward(self.model, s.ids, ctx.n_tokens, stu, grad=True)
        s_logits = _logits(self.model, h, s.kl_pos)
        rec = stu.rec
        l_kl = losses.distill(t_logits, s_logits)
        targets = [losses.rho_targets(t_mass[i]) for i in range(len(rec.logits))]
        l_zoom = torch.stack([losses.zoom(lg, y) for lg, y in zip(rec.logits, targets)]).mean()
        layers = ctx.layers
        l_rec = torch.stack(
            [losses.reconstruction(lay.sig_k[..., : gk.shape[-1]], gk, relative=True) + losses.reconstruction(lay.sig_v[..., : gv.shape[-1]], gv, relative=True)
             for lay, (gk, gv) in zip(layers, rec.g)]
        ).mean()
        gates = [x for pair in rec.g for x in pair]
        l_budget = losses.budget(rec.z, gates)
        w = self.cfg.loss_weights
        total = w["distill"] * l_kl + w["zoom"] * l_zoom + w["reconstruction"] * l_rec + w["budget"] * l_budget
        with torch.no_grad():
            hard = [(z > 0.5).float() for z in rec.z]
            zr = float(torch.stack([x.mean() for x in hard]).mean())
            hit = sum(float((x * y).sum()) for x, y in zip(hard, targets)) / max(1.0, sum(float(y.sum()) for y in targets))
            rank = float(torch.stack([(x > 0.5).float().mean() for x in gates]).mean())
        d = lambda t: float(t.detach())  # noqa: E731
        return total, {"loss": d(total), "distill": d(l_kl), "zoom": d(l_zoom), "reconstruction": d(l_rec),
                       "budget": d(l_budget), "zoom_rate": zr, "target_recall": hit, "rank_kept": rank}

    def optimise(self, ctx, s, t_logits, t_mass) -> dict[str, float]:
        for grp in self.opt.param_groups:
            grp["lr"] = self.lr_at(self.step)
        self.opt.zero_grad(set_to_none=True)
        total, m = self.loss(ctx, s, t_logits, t_mass)
        total.backward()
        torch.nn.utils.clip_grad_norm_(self.router.parameters(), 1.0)
        self.opt.step()
        return m

    # -- checkpoints --------------------------------------------------------------------------------------
    def save(self) -> None:
        r = self.router
        tail = self.history[-20:]
        metrics = {k: round(sum(h[k] for h in tail) / len(tail), 5) for k in tail[0]} if tail else {}
        meta = {
            "model": {
                "id": self.lm.model_id,
                "fingerprint": self.lm.fingerprint,
                "shape": {"layers": self.shape.n_layers, "heads": self.shape.n_heads, "kv_heads": self.shape.n_kv_heads, "head_dim": self.shape.head_dim},
            },
            "hyper_parameters": self.cfg.to_json(),
            "segmentation": {k: getattr(self.params, k) for k in ("budget", "alpha", "n_sink", "weighting", "key_space")},
            "data": self.data_info,
            "steps_done": self.step,
            "metrics_last_20_steps": metrics,
            "history": self.history,
            "trainable_parameters": n_params(r),
            "warm_start": self.warm,
        }
        rf = router_file.RouterFile(r.w.detach(), torch.sigmoid(r.tau_logit.detach()), r.gate, meta)
        router_file.save(self.out, rf)
        st = {"step": torch.tensor(self.step)}
        for i, p in enumerate(r.parameters()):
            s = self.opt.state.get(p, {})
            st[f"m.{i}"] = s.get("exp_avg", torch.zeros_like(p)).detach().cpu().contiguous()
            st[f"v.{i}"] = s.get("exp_avg_sq", torch.zeros_like(p)).detach().cpu().contiguous()
        state = self.out.with_name(self.out.name + ".state.safetensors")
        tmp = state.with_name(state.name + ".tmp")
        save_file(st, str(tmp))
        tmp.replace(state)

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self, progress: Callable[[int, int, dict], None] | None = None, resume: bool = True) -> dict[str, Any]:
        cfg = self.cfg
        log_path = self.out.with_name(self.out.name + ".log.jsonl")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        if resume and self.resume():
            self.report_size()
            if log_path.exists():  # drop the steps after the checkpoint: they are about to be redone
                keep = [ln for ln in log_path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] < self.step]
                log_path.write_text("".join(ln + "\n" for ln in keep))
            self.history = self.history[: self.step]
        else:
            if log_path.exists():
                log_path.unlink()
            if cfg.warm_contexts > 0:
                self.warm_start()
                self.save()
        planned = 0  # steps planned before the current context
        for stage in range(len(cfg.contexts)):
            stage_steps = [s for s in range(cfg.steps) if self.stage_of(s) == stage]
            cs = self.contexts_for(stage)
            if stage_steps and not cs:
                raise SekvError(f"not enough training text for {cfg.contexts[stage]}-token contexts")
            for ci, c in enumerate(cs):
                n_here = min(cfg.per_context, stage_steps[-1] + 1 - planned) if stage_steps else 0
                if n_here <= 0:
                    break
                if planned + n_here <= self.step:  # done before a resume
                    planned += n_here
                    continue
                t0 = time.perf_counter()
                ctx = self.prepare(c)
                if self.router is None:
                    self.start(ctx)
                    self.report_size()
                rng = random.Random(cfg.seed * 7919 + stage * 104729 + ci)
                doc_start = len(prompt.encode(self.lm.tokenizer, prompt.document_prefix(self.lm.tokenizer, "")))
                cands = [s for s in (recall_sample(self.lm.tokenizer, c.doc_ids, doc_start, ctx.window, rng) for _ in range(cfg.candidates)) if s]
                scored = sorted(((self.teacher(ctx, s), s) for s in cands), key=lambda x: -x[0][2])[:n_here]
                prep_s = time.perf_counter() - t0
                for k, ((t_logits, t_mass, far), s) in enumerate(scored):
                    if planned + k < self.step:  # partially done context after a resume
                        continue
                    t1 = time.perf_counter()
                    m = self.optimise(ctx, s, t_logits, t_mass)
                    m.update(step=self.step, context=cfg.contexts[stage], teacher_far_mass=far, lr=self.lr_at(self.step),
                             step_s=time.perf_counter() - t1, prepare_s=prep_s)
                    self.step += 1
                    self.history.append({k2: round(float(v), 5) for k2, v in m.items()})
                    with open(log_path, "a") as f:
                        f.write(json.dumps(m) + "\n")
                    if progress:
                        progress(self.step, cfg.steps, m)
                    if self.step % cfg.save_every == 0:
                        self.save()
                planned += n_here
                if len(scored) < n_here:  # fewer usable samples than planned: skip their steps, keep the schedule aligned
                    self.step = max(self.step, min(planned, cfg.steps))
        if self.router is None:
            raise SekvError("no training step ran (no usable training context)")
        self.save()
        return {"steps": self.step, "out": str(self.out)}


def load_text(data: str | None) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """--data: None/"debian" -> the Debian manuals; a directory -> its text files."""
    if data in (None, "", "debian"):
        root, sources = corpus.fetch_debian()
        docs = corpus.read_documents(root)
        info = {"source": "debian", "packages": sources, "license": "GPL-2/GPL-2+ and compatible notices (see each package's copyright file)"}
    else:
        root = Path(data).expanduser()
        if not root.is_dir():
            raise SekvError(f"--data: {data} is not a directory")
        docs = corpus.read_documents(root)
        info = {"source": str(root.resolve()), "files": len(docs)}
    if not docs:
        raise SekvError(f"--data: no text files of at least {corpus.MIN_DOC_CHARS} characters found")
    info["documents"] = len(docs)
    info["characters"] = sum(len(t) for _, t in docs)
    return docs, info
