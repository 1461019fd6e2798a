"""The Python API (``import sekv``): read a document into a context pack once, then ask the pack questions.

    import sekv

    sekv.ingest("report.pdf")                       # writes report.sekv beside it
    pack = sekv.open("report.sekv")                 # loads the model and the pack once
    r = pack.ask("What is the maximum pressure?")   # a Result
    print(r.answer, r.timings.ttft_s, r.memory.resident_fraction)
    results = pack.ask_many(["q1", "q2"])
    for piece in pack.stream("q3"):                 # the answer as it is decoded
        print(piece, end="", flush=True)

Greedy decoding is the default; ``temperature``/``top_p``/``seed`` sample (sekv_core/sampling.py).
Bad input raises ``SekvError`` (its message is the one line the CLI prints).  docs/api.md is the reference.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from .evidence import evidence_rows

from . import methods, models, prompt
from .errors import SekvError
from .ingest import IngestResult
from .methods.base import ModelShape
from .sampling import Sampling
from .session import Answer, Session, resolve_method

__all__ = [
    "ingest", "open", "Pack", "Result", "Timings", "Tokens", "MemoryUse", "Evidence", "IngestResult", "Sampling", "SekvError",
]


@dataclass(frozen=True)
class Timings:
    load_s: float  # opening the pack (and loading the model, when open() loaded it)
    ttft_s: float  # the question's tokens through the model + the first answer token
    decode_s: float  # the rest of the answer
    tokens_per_s: float  # answer tokens after the first / decode_s


@dataclass(frozen=True)
class Tokens:
    document: int  # tokens in the pack
    question: int  # the question's prompt tokens
    generated: int  # answer tokens (stop token excluded)
    ids: tuple[int, ...]  # the answer's token ids
    stop_reason: str  # "stop token" or "max_new_tokens"


@dataclass(frozen=True)
class MemoryUse:
    resident_kv_bytes_peak: int  # peak KV bytes on the compute device during any decode step
    full_kv_bytes: int  # what the full KV cache of the same tokens takes
    resident_fraction: float  # the two above, divided
    gpu_peak_bytes: int | None  # torch.cuda.max_memory_allocated on CUDA, else None
    rss_bytes: int  # process resident set size after the answer


@dataclass(frozen=True)
class Evidence:
    span: int
    tokens: tuple[int, int]  # [start, end) in the pack
    page: int  # page of the passage's first token
    zoom_count: int  # how many (layer, head, step) expansions read it
    text: str
    share: float = 0.0  # its share of the answer's zoom reads of document passages
    rank: int = 0  # 1 = the most read (ties: the question's ranking)
    file: str | None = None  # in a pack of several documents: the one the passage is in (page is that document's)


@dataclass(frozen=True)
class Result:
    question: str
    answer: str
    tokens: Tokens
    timings: Timings
    memory: MemoryUse
    evidence: list[Evidence] = field(default_factory=list)  # passages the answer zoomed into, most read first (sekv)
    zoom: dict | None = None  # method-specific zoom statistics (sekv); None for methods that report none
    pack: str = ""
    model: str = ""
    method: str = ""
    budget: float | None = None
    sampling: Sampling = Sampling()  # with the seed actually used

    def to_dict(self) -> dict:
        """The JSON object `sekv ask --json` prints for this answer."""
        tok = asdict(self.tokens)
        del tok["ids"]
        d = {
            "answer": self.answer, "question": self.question, "pack": self.pack, "model": self.model, "method": self.method,
            "budget": self.budget, "timings": asdict(self.timings), "tokens": tok, "memory": asdict(self.memory),
        }
        if not self.sampling.greedy:
            d["sampling"] = asdict(self.sampling)
        if self.zoom is not None:
            d["zoom"] = self.zoom
            d["evidence"] = [{k: v for k, v in asdict(e).items() if k != "file" or v is not None} | {"tokens": list(e.tokens)} for e in self.evidence]
        return d


def result_of(session: Session, answer: Answer, question: str, sampling: Sampling = Sampling()) -> Result:
    """A Session's Answer as a Result (the CLI's --json goes through here too)."""
    s = answer.stats
    extra = dict(s.extra or {})
    counts, order = extra.pop("span_zoom_counts", None), extra.pop("span_order", None)
    rows = evidence_rows(session, counts or {}, span_order=order) if s.extra else []  # the CLI's --show-evidence rows
    return Result(
        question=question,
        answer=answer.text,
        tokens=Tokens(session.base_tokens, s.question_tokens, s.generated_tokens, tuple(answer.token_ids), s.stop_reason),
        timings=Timings(round(session.load_s, 4), s.ttft_s, s.decode_s, s.tokens_per_s),
        memory=MemoryUse(s.resident_kv_bytes_peak, s.full_kv_bytes, s.resident_kv_bytes_peak / max(s.full_kv_bytes, 1), s.gpu_peak_bytes, s.rss_bytes),
        evidence=[Evidence(r["span"], tuple(r["tokens"]), r["page"], r["zoom_count"], r["text"], r["share"], r["rank"], r.get("file")) for r in rows],
        zoom=extra if s.extra else None,
        pack=str(session.pack.path),
        model=session.lm.model_id,
        method=session.method,
        budget=getattr(session.params, "budget", None),
        sampling=sampling,
    )


def retune(session: Session, overrides: dict[str, Any]) -> Session:
    """The same pack and loaded model with other ask-time parameters (e.g. a budget): only the memory is rebuilt
    (after the session's rehearsal, if one is in flight: it uses the model)."""
    session.settle()
    method, params = resolve_method(session.pack, session.method, overrides)
    lm = session.lm
    from .session import open_memory

    memory = open_memory(method, session.pack, params, ModelShape.of(lm.config, next(lm.model.parameters()).dtype), lm.model)
    new = Session(session.pack, lm, method, params, memory, session.load_s)
    new.compile_layers = session.compile_layers
    new.restrict(session.documents)
    return new


def _load(model: str | models.LoadedModel | None, default: str, device: str | None, **placed) -> models.LoadedModel:
    if isinstance(model, models.LoadedModel):
        return model
    return models.load(model or default, device=device, **placed)


def ingest(
    path: str | Path | list[str | Path],
    out: str | Path | None = None,
    *,
    method: str | None = None,
    budget: float | None = None,
    model: str | models.LoadedModel | None = None,
    device: str | None = None,
    params: dict[str, Any] | None = None,
    system: str | None = None,
    rope_scaling: str = "auto",
    device_map: str | dict | None = None,
    max_memory: str | dict | None = None,
    offload_kv: bool | None = None,
) -> IngestResult:
    """Read the document at ``path`` (.pdf, .txt, .md) once and write its context pack to ``out`` (default: beside
    it, suffix .sekv).  ``model``: an embedded model name, a local Hugging Face directory or a loaded model;
    ``params``: further method parameters (as the CLI's options); ``system``: the system prompt to prefill with the
    document (None: the default); ``rope_scaling``: "auto", "none" or "yarn:F" (sekv_core/rope_scaling.py).
    A list of paths (files, folders) makes one pack of several documents (documents.load_corpus; needs ``out``).
    ``device_map`` / ``max_memory``: place the model across devices (as ``--device-map`` / ``--max-memory``,
    sekv_core/placement.py); ``offload_kv``: keep the prefill's KV in host memory, chunk by chunk (None: when it
    would not fit the GPU; sekv_core/kv_offload.py)."""
    from .documents import load_corpus
    from .ingest import ingest as run_ingest

    method = method or methods.DEFAULT_METHOD
    overrides = dict(params or {}) | ({"budget": budget} if budget is not None else {})
    resolved = methods.get(method).resolve_params(overrides)
    from .rope_scaling import parse

    parse(rope_scaling)
    doc = load_corpus(list(path) if isinstance(path, (list, tuple)) else [path])  # a bad document fails before the model loads
    lm = _load(model, models.DEFAULT_MODEL, device, device_map=device_map, max_memory=max_memory)
    return run_ingest(doc, out, lm=lm, method=method, params=resolved, system=system, rope_scaling=rope_scaling, offload_kv=offload_kv)


def add(pack: str | Path, paths: str | Path | list[str | Path], *, model: str | models.LoadedModel | None = None, device: str | None = None,
        glob: str | None = None):
    """Add documents (files, folders, "-") to the pack file at ``pack`` without reading its documents again (as
    `sekv add`); -> sekv_core.add.AddResult.  ``model``: default the one the pack names."""
    from .add import add as run_add
    from .documents import DEFAULT_GLOB, load_corpus
    from .pack import check_manifest, read_pack

    doc = load_corpus(list(paths) if isinstance(paths, (list, tuple)) else [paths], glob or DEFAULT_GLOB, headings=True)
    if isinstance(model, models.LoadedModel):
        lm = model
    elif model:
        lm = models.load(model, device=device)
    else:
        p = read_pack(Path(pack))
        try:
            check_manifest(p)
            lm = models.load_named_by_pack(p.manifest["model"]["id"], device=device)
        finally:
            p.close()
    return run_add(pack, doc, lm=lm)


def open(  # noqa: A001 - `sekv.open(path)` reads like the builtin on purpose
    path: str | Path,
    *,
    model: str | models.LoadedModel | None = None,
    method: str | None = None,
    budget: float | None = None,
    device: str | None = None,
    params: dict[str, Any] | None = None,
    device_map: str | dict | None = None,
    max_memory: str | dict | None = None,
    docs: Sequence[str] | None = None,
) -> "Pack":
    """Open a context pack: its model (the one it was made with unless ``model`` is given) is loaded once.
    ``method``/``budget``/``params``: ask-time overrides the pack's method allows (as `sekv ask`'s options);
    ``docs``: the documents questions are limited to (as `--doc`)."""
    overrides = dict(params or {}) | ({"budget": budget} if budget is not None else {})
    lm = model if isinstance(model, models.LoadedModel) else None
    session = Session.open(path, model=None if lm else model, lm=lm, method=method, params=overrides, device=device,
                           device_map=device_map, max_memory=max_memory)
    session.restrict(list(docs) if docs else None)
    return Pack(session, overrides)


class Pack:
    """An open context pack: ask it questions, one at a time (every answer starts from the pack's state)."""

    def __init__(self, session: Session, overrides: dict[str, Any] | None = None):
        self.session = session  # the engine underneath (sekv_core.session.Session)
        self._overrides = dict(overrides or {})
        self._busy = threading.Lock()

    path = property(lambda self: self.session.pack.path)
    method = property(lambda self: self.session.method)
    budget = property(lambda self: getattr(self.session.params, "budget", None))
    model = property(lambda self: self.session.lm.model_id)
    n_tokens = property(lambda self: self.session.base_tokens)
    document = property(lambda self: self.session.pack.manifest["document"]["name"])

    def __repr__(self) -> str:
        return f"<sekv.Pack {str(self.path)!r} {self.document!r}: {self.n_tokens} tokens, {self.method}, model {self.model}>"

    def ask(
        self,
        question: str,
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        history: Sequence[tuple[str, str]] = (),
    ) -> Result:
        """Answer one question from the pack.  history: earlier (question, answer) pairs to put in the prompt."""
        return self._ask(question, max_new_tokens, Sampling(temperature, top_p, seed), history, None)

    def ask_many(self, questions: Iterable[str], **kwargs) -> list[Result]:
        """Answer each question on its own from the pack (as separate ask() calls, with the model loaded once);
        with a seed, each answer is the one ask() gives for that question alone."""
        questions = list(questions)
        for q in questions:
            if not isinstance(q, str) or not q.strip():
                raise SekvError(f"every question must be a non-empty string, got {q!r}")
        return [self.ask(q, **kwargs) for q in questions]

    def stream(self, question: str, **kwargs) -> "Stream":
        """The answer's text as it is decoded: ``for piece in pack.stream(q)``; the stream's ``result`` is the
        full Result once the loop has finished.  Leaving the loop early stops decoding."""
        return Stream(self, question, kwargs)

    @property
    def documents(self) -> list[str]:
        """The pack's documents' names (as `sekv inspect` lists them)."""
        from .add import old_parts

        return [q["name"] for q in old_parts(self.session.pack.manifest)]

    def with_docs(self, docs: Sequence[str] | None) -> "Pack":
        """The same pack and loaded model with questions limited to some documents (as `--doc`; None: all)."""
        new = Pack(retune(self.session, self._overrides), self._overrides)
        new.session.restrict(list(docs) if docs else None)
        return new

    def add(self, *paths: str | Path, glob: str | None = None) -> "Pack":
        """Add documents (files, folders, "-") to the pack file (as `sekv add`) and return it reopened with them."""
        from .add import add as run_add
        from .documents import DEFAULT_GLOB, load_corpus

        if not paths:
            raise SekvError("add() needs at least one document")
        doc = load_corpus(list(paths), glob or DEFAULT_GLOB, headings=True)
        run_add(self.path, doc, lm=self.session.lm)
        session = Session.open(self.path, lm=self.session.lm, method=self.session.method, params=self._overrides)
        session.compile_layers = self.session.compile_layers
        self.session.pack.close()
        return Pack(session, self._overrides)

    def with_budget(self, budget: float) -> "Pack":
        """The same pack and loaded model at another resident-KV budget (methods whose budget is ask-time)."""
        overrides = self._overrides | {"budget": budget}
        return Pack(retune(self.session, overrides), overrides)

    def _ask(self, question, max_new_tokens, sampling: Sampling, history, on_text) -> Result:
        sampling = sampling.resolved()
        turns = [t if isinstance(t, prompt.Turn) else prompt.Turn(*t) for t in history]
        if not self._busy.acquire(blocking=False):
            raise SekvError("this pack is answering another question; finish (or leave) that stream first")
        try:
            answer = self.session.ask(question, history=turns, max_new_tokens=max_new_tokens, on_text=on_text, sampling=sampling)
        finally:
            self._busy.release()
        return result_of(self.session, answer, question.strip(), sampling)


class _Stop(Exception):
    """Raised inside the decode loop when the reader left the stream."""


class Stream:
    """Iterator over an answer's text pieces; decoding runs in a worker thread, one piece ahead at most."""

    def __init__(self, pack: Pack, question: str, kwargs: dict):
        self._pack, self._question, self._kwargs = pack, question, kwargs
        self._result: Result | None = None
        self._started = False

    @property
    def result(self) -> Result:
        if self._result is None:
            raise SekvError("the stream has not finished: iterate it to the end first")
        return self._result

    def __iter__(self) -> Iterator[str]:
        if self._started:
            raise SekvError("a stream can be iterated once")
        self._started = True
        kw = dict(self._kwargs)
        max_new = kw.pop("max_new_tokens", 256)
        history = kw.pop("history", ())
        sampling = Sampling(kw.pop("temperature", 0.0), kw.pop("top_p", 1.0), kw.pop("seed", None))
        if kw:
            raise TypeError(f"stream() got unexpected arguments: {', '.join(kw)}")
        return self._run(max_new, sampling, history)

    def _run(self, max_new, sampling, history) -> Iterator[str]:
        pieces: queue.Queue = queue.Queue(maxsize=1)
        stop = threading.Event()
        done = object()

        def on_text(piece: str) -> None:
            while True:
                if stop.is_set():
                    raise _Stop
                try:
                    pieces.put(piece, timeout=0.05)
                    return
                except queue.Full:
                    continue

        def work() -> None:
            try:
                self._result = self._pack._ask(self._question, max_new, sampling, history, on_text)
                item = done
            except _Stop:
                return
            except BaseException as e:  # handed to the reader, raised there
                item = e
            while not stop.is_set():
                try:
                    pieces.put(item, timeout=0.05)
                    return
                except queue.Full:
                    continue

        worker = threading.Thread(target=work, name="sekv-stream", daemon=True)
        worker.start()
        try:
            while True:
                item = pieces.get()
                if item is done:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            worker.join()
