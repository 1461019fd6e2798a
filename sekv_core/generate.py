"""Decoding from a KV memory: question tokens, then greedy tokens, with timing and memory stats."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import psutil
import torch

from . import runtime
from .graphed_step import GraphedStep
from .methods.base import KVMemory


@dataclass
class DecodeStats:
    question_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0  # question prefill + first token
    # its parts: the memory's preparation (sekv's scout pass) and the question's forward to the first token's logits;
    # on CUDA timed by events on the stream (no extra sync), so each ends when the device finished its work
    scout_s: float = 0.0
    first_forward_s: float = 0.0
    capture_s: float = 0.0  # CUDA-graph captures of decode steps in this answer (after the first token)
    decode_s: float = 0.0  # after the first token
    tokens_per_s: float = 0.0  # generated tokens after the first / decode_s
    resident_kv_bytes_peak: int = 0  # peak KV bytes on the compute device during any step
    full_kv_bytes: int = 0  # what the full KV of the same tokens would take
    gpu_peak_bytes: int | None = None  # torch.cuda.max_memory_allocated, when on CUDA
    rss_bytes: int = 0  # process resident set size at the end
    stop_reason: str = ""
    extra: dict = field(default_factory=dict)  # method-specific (zoom statistics, ...)

    def as_dict(self) -> dict:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(
    model,
    memory: KVMemory,
    question_ids: list[int],
    *,
    max_new_tokens: int,
    stop_ids: set[int],
    on_token: Callable[[int], None] | None = None,
    on_step: Callable[[KVMemory], None] | None = None,
    graphs: bool | None = None,
    compile_layers: bool = False,
    question: str | None = None,
    sampler: Callable[[torch.Tensor], int] | None = None,
) -> tuple[list[int], DecodeStats]:
    """Greedy answer to question_ids from a memory.  graphs: run single-token steps through GraphedStep (one
    captured CUDA graph per step; on the CPU the same static path, eagerly) when the memory supports it;
    None = on CUDA.  compile_layers: those steps' decoder layers run torch.compile'd (GraphedStep).  question: the
    question's text, for memories that rank what to read by it (sekv's lexical evidence).  sampler: logits -> next
    token (sekv_core/sampling.py); None = greedy."""
    from .placement import input_device

    device = input_device(model)
    if graphs is None:
        graphs = device.type == "cuda"
    graphed = None
    greedy = sampler is None
    if graphs and GraphedStep.supported(model, memory):  # one per (memory, model), kept: its graph serves later asks
        graphed = getattr(memory, "_graphed_step", None)
        if graphed is None or graphed.model is not model or graphed.compile_layers != compile_layers or graphed.greedy != greedy:
            # greedy: the head and the argmax inside the captured step, which returns the token
            graphed = memory._graphed_step = GraphedStep(model, memory, compile_layers=compile_layers, greedy=greedy)
    stats = DecodeStats(question_tokens=len(question_ids))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    head = model.get_output_embeddings()
    out: list[int] = []
    ids = torch.tensor([question_ids], device=device)
    marks = _Marks(device)
    captures_s = graphed.capture_s if graphed is not None else 0.0
    t0 = time.perf_counter()
    t_first = None
    peak = 0
    marks.mark()
    # forward(): the question's tokens through the model over the memory; forward(other_ids): those instead (rag prefills its chunks)
    memory.prepare_question(lambda other=None: runtime.forward_hidden(model, ids if other is None else other, memory.n_tokens(), memory), question)
    marks.mark()
    # a captured step is launched as soon as its token is known: the host's work for the token before (its text,
    # printed) runs while the device computes, not between steps
    defer = graphed is not None and graphed.capture
    pending = None
    while True:
        stepped = None
        if graphed is not None and ids.shape[1] == 1:
            if graphed.greedy:
                stepped = graphed(ids)  # the greedy token [1], made in the step
            else:
                hidden = graphed(ids)
        else:
            memory.begin_step(ids.shape[1])
            hidden = runtime.forward_hidden(model, ids, memory.n_tokens(), memory)
            memory.end_step()
        if pending is not None:
            on_token(pending)
            pending = None
        with torch.inference_mode():
            logits = head(hidden[:, -1]) if stepped is None else None
            if t_first is None:
                marks.mark()
            if sampler is None:
                best = logits.argmax(-1) if stepped is None else stepped
                nxt = int(best.item())
            else:
                best, nxt = None, sampler(logits[0])
        peak = max(peak, memory.resident_now())
        if on_step:
            on_step(memory)
        if t_first is None:
            _sync(device)
            t_first = time.perf_counter()
        if nxt in stop_ids:
            stats.stop_reason = "stop token"
            break
        out.append(nxt)
        if len(out) >= max_new_tokens:
            if on_token:
                on_token(nxt)
            stats.stop_reason = "max_new_tokens"
            break
        if on_token:
            if defer:
                pending = nxt
            else:
                on_token(nxt)
        # greedy: the next step's input is the argmax on the device (no host-to-device copy)
        ids = best.view(1, 1).to(device) if best is not None else torch.tensor([[nxt]], device=device)
    _sync(device)
    t_end = time.perf_counter()
    stats.generated_tokens = len(out)
    stats.ttft_s = t_first - t0
    stats.scout_s, stats.first_forward_s = marks.spans()
    stats.capture_s = (graphed.capture_s if graphed is not None else 0.0) - captures_s
    stats.decode_s = t_end - t_first
    stats.tokens_per_s = (len(out) - 1) / stats.decode_s if len(out) > 1 and stats.decode_s > 0 else 0.0
    stats.resident_kv_bytes_peak = peak
    stats.full_kv_bytes = memory.full_bytes()
    if device.type == "cuda":
        stats.gpu_peak_bytes = int(torch.cuda.max_memory_allocated(device))
    stats.rss_bytes = psutil.Process().memory_info().rss
    return out, stats


class _Marks:
    """Points on the way to the first token: CUDA events on the input device's stream (read once the first token has
    synchronised: no sync of their own), else the host's clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.current_stream(device) if self.cuda else None  # the input device's (the question's)
        self.points: list = []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record(self.stream)
            self.points.append(e)
        else:
            self.points.append(time.perf_counter())

    def spans(self) -> list[float]:
        """Seconds between consecutive marks (the last mark has been reached on the device)."""
        p = self.points
        if self.cuda:
            return [a.elapsed_time(b) / 1000 for a, b in zip(p, p[1:])]
        return [b - a for a, b in zip(p, p[1:])]


class TextStream:
    """Incremental detokenisation: emits only complete new text (no half UTF-8 characters)."""

    def __init__(self, tokenizer, emit: Callable[[str], None]):
        self.tok, self.emit, self.ids, self.sent = tokenizer, emit, [], 0

    def __call__(self, token_id: int) -> None:
        self.ids.append(token_id)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        if len(text) > self.sent:
            self.emit(text[self.sent :])
            self.sent = len(text)
