"""Ask: load a pack and its model once, answer questions from the pack without re-prefilling."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from . import methods, models, prompt
from .errors import SekvError
from .generate import DecodeStats, TextStream, generate
from .methods.base import KVMemory, ModelShape
from .pack import Pack, check_model, read_pack
from .sampling import Sampler, Sampling


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    stats: DecodeStats


class Session:
    """A pack + its model + a runtime memory; every ask starts from the pack's state."""

    def __init__(self, pack: Pack, lm: models.LoadedModel, method: str, params: dict[str, Any], memory: KVMemory, load_s: float):
        self.pack, self.lm, self.method, self.params, self.memory, self.load_s = pack, lm, method, params, memory, load_s
        self.base_tokens = memory.n_tokens()
        self.stop_ids = prompt.stop_token_ids(lm.tokenizer, getattr(lm.model, "generation_config", None))
        self.compile_layers = False  # on CUDA, decode steps' decoder layers torch.compile'd (sekv_core/graphed_step.py)

    @classmethod
    def open(
        cls,
        pack_path: str | Path,
        *,
        model: str | None = None,
        lm: models.LoadedModel | None = None,
        method: str | None = None,
        params: dict[str, Any] | None = None,
        device: str | None = None,
        progress: models.Progress | None = None,
    ) -> "Session":
        t0 = time.perf_counter()
        pack = read_pack(Path(pack_path))
        if lm is None:
            lm = models.load(model or pack.manifest["model"]["id"], device=device, progress=progress)
        check_model(pack, lm.model_id, lm.fingerprint, lm.tokenizer_fingerprint)
        method, params = resolve_method(pack, method, params)
        shape = ModelShape.of(lm.config, next(lm.model.parameters()).dtype)
        memory = methods.get(method).open(pack, params, shape, next(lm.model.parameters()).device)
        return cls(pack, lm, method, params, memory, time.perf_counter() - t0)

    def ask(
        self,
        question: str,
        *,
        history: list[prompt.Turn] | tuple = (),
        max_new_tokens: int = 256,
        on_text: Callable[[str], None] | None = None,
        on_step: Callable[[KVMemory], None] | None = None,
        sampling: Sampling | None = None,
    ) -> Answer:
        question = question.strip()
        if not question:
            raise SekvError("the question is empty")
        suffix = prompt.question_suffix(self.lm.tokenizer, question, history)
        q_ids = prompt.encode(self.lm.tokenizer, suffix)
        window = models.context_window(self.lm.config)
        if window and self.base_tokens + len(q_ids) + max_new_tokens > window:
            raise SekvError(
                f"document ({self.base_tokens}) + question ({len(q_ids)}) + --max-new-tokens ({max_new_tokens}) tokens "
                f"exceed the model's context window of {window}; ask a shorter question or lower --max-new-tokens"
            )
        self.memory.truncate(self.base_tokens)
        stream = TextStream(self.lm.tokenizer, on_text) if on_text else None
        try:
            ids, stats = generate(
                self.lm.model, self.memory, q_ids, max_new_tokens=max_new_tokens, stop_ids=self.stop_ids, on_token=stream, on_step=on_step,
                compile_layers=self.compile_layers and next(self.lm.model.parameters()).device.type == "cuda", question=question,
                sampler=Sampler(sampling) if sampling is not None and not sampling.greedy else None,
            )
        finally:
            self.memory.truncate(self.base_tokens)
        stats.extra = self.memory.step_stats().extra
        text = self.lm.tokenizer.decode(ids, skip_special_tokens=True).strip()
        return Answer(text, ids, stats)


def resolve_method(pack: Pack, method: str | None, params: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """The pack's method, or an ask-time override that the pack's tensors support."""
    stored = pack.method
    chosen = method or stored
    if chosen != stored and chosen not in getattr(methods.get(stored), "derivable", ()):  # e.g. a sekv pack read as `full`
        raise SekvError(f"this pack was ingested with --method {stored}; re-ingest with --method {chosen} to use it")
    m = methods.get(chosen)
    merged = dict(pack.params) if chosen == stored else {}
    for k, v in (params or {}).items():
        if v is None:
            continue
        if chosen == stored and k not in m.ask_time_params:
            raise SekvError(f"--{k} cannot be changed at ask time for method '{chosen}'; re-ingest with it")
        merged[k] = v
    return chosen, m.resolve_params(merged)
