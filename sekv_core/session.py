"""Ask: load a pack and its model once, answer questions from the pack without re-prefilling."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import contextlib
import dataclasses
import threading

from . import methods, models, placement, prompt, reach, rope_scaling
from .errors import PackError, SekvError
from .generate import DecodeStats, TextStream, generate
from .methods.base import KVMemory, ModelShape
from .methods.params import Params
from .pack import Pack, check_manifest, check_model, manifest_shape, read_pack
from .sampling import Sampler, Sampling


#: Session.rehearse's question (its length near a typical question's with the chat template: the question's
#: products pick their kernels by size) and its answer's tokens (the first and two single-token steps: the step the
#: decode graph is captured at and one more; made whatever they are: no stop token ends a rehearsal)
REHEARSAL_QUESTION = "What is this document about, and which of its parts says the most about it?"
REHEARSAL_TOKENS = 3


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    stats: DecodeStats


class Session:
    """A pack + its model + a runtime memory; every ask starts from the pack's state."""

    def __init__(self, pack: Pack, lm: models.LoadedModel, method: str, params: Params, memory: KVMemory, load_s: float):
        self.pack, self.lm, self.method, self.params, self.memory, self.load_s = pack, lm, method, params, memory, load_s
        self.base_tokens = memory.n_tokens()  # the document's tokens
        self.start = self.base_tokens  # the question's position (re-positioned memories: set per ask)
        #: the positions the model addresses: its window, or what the pack's RoPE scaling covers (sekv_core/reach.py)
        self.rope_factor = rope_scaling.of_manifest(pack.manifest, str(pack.path))  # applied again at every ask: lm may be shared
        self.window = reach.effective_window(pack.manifest.get("model"), models.context_window(lm.config))
        self.stop_ids = prompt.stop_token_ids(lm.tokenizer, getattr(lm.model, "generation_config", None))
        self.compile_layers = False  # on CUDA, decode steps' decoder layers torch.compile'd (sekv_core/graphed_step.py)
        #: restrict(): the chosen documents' names and token ranges (None: every document)
        self.documents: list[str] | None = None
        self.doc_ranges: list[tuple[int, int]] | None = None
        self._rehearsal: threading.Thread | None = None
        self.rehearsal_s: float | None = None  # how long the rehearsal ran (None: none ran to its end)
        self.rehearsal_error: Exception | None = None  # what it raised (a real question meets any error anew)

    def rehearse(self, *, force: bool = False) -> bool:
        """On CUDA: ask REHEARSAL_QUESTION once on a second thread, now, and drop its answer, so that the first real
        question finds every kernel of the question's way (the scout pass, the fixed sets' fill, the first forward,
        the decode steps' graph capture) loaded and set up instead of paying each one's first use (lazy CUDA
        function loading, cuBLAS / cuDNN plans).  `sekv chat` starts it when the session opens: it runs while the
        first question is typed.  It runs the same code as any question on the same memory, which every ask
        restores (the pack's state, a new ranking), so it changes no answer; its device memory is one question's
        and is freed before the next question allocates its own.  The next ask, restrict() or rehearsal waits for
        it (an ask counts the wait in its time to first token: ``extra["rehearsal_wait_s"]``).  False where
        nothing was started (not on CUDA, unless ``force``: tests run it on the CPU; or one ran already)."""
        if self._rehearsal is not None or self.rehearsal_s is not None or self.rehearsal_error is not None:
            return False
        device = placement.input_device(self.lm.model)
        if device.type != "cuda" and not force:
            return False

        def run():
            import torch

            t = time.perf_counter()
            rehearsing = hasattr(self.memory, "rehearsing")  # the memory runs the branches a question may take (sekv)
            try:
                if rehearsing:
                    self.memory.rehearsing = True
                with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                    self._ask(REHEARSAL_QUESTION, max_new_tokens=REHEARSAL_TOKENS, rehearsal=0)
                    # the question one token shorter, to its first token: lengths of both parities (a reduction over
                    # the question's rows takes them by fours or by twos, a different kernel)
                    self._ask(REHEARSAL_QUESTION, max_new_tokens=1, rehearsal=1)
                self.rehearsal_s = time.perf_counter() - t
            except Exception as e:  # noqa: BLE001 - a rehearsal only saves time: the real question meets any error itself
                self.rehearsal_error = e
            finally:
                if rehearsing:
                    self.memory.rehearsing = False

        self._rehearsal = threading.Thread(target=run, name="sekv-rehearsal", daemon=True)
        self._rehearsal.start()
        return True

    def settle(self) -> float:
        """Wait for a rehearsal in flight (rehearse); -> the seconds waited."""
        th = self._rehearsal
        if th is None:
            return 0.0
        t = time.perf_counter()
        th.join()  # (interrupted, e.g. Ctrl-C: still in flight, so the next call waits again)
        self._rehearsal = None
        return time.perf_counter() - t

    def restrict(self, names: list[str] | None) -> None:
        """Limit the asks that follow to some of the pack's documents (``--doc``; None or []: all of them again): a
        sekv memory ranks only their zoom blocks, rag retrieves only their chunks, the evidence comes only from them.
        SekvError: a name the pack does not hold (the line lists its documents), a method that attends to every
        document alike."""
        self.settle()
        if not names:
            self.memory.restrict(None)
            self.documents = self.doc_ranges = None
            return
        chosen = pick_documents(self.pack.manifest, names)
        ranges = [(q["token_start"], q["token_end"]) for q in chosen]
        if not self.memory.restrict(ranges):
            raise SekvError(f"--doc: --method {self.method} attends to every document of the pack alike; "
                            "questions can be limited to some documents with sekv or rag packs (docs/long-documents.md)")
        self.documents, self.doc_ranges = [q["name"] for q in chosen], ranges

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
        device_map=None,
        max_memory=None,
    ) -> "Session":
        t0 = time.perf_counter()
        pack = read_pack(Path(pack_path))
        check_manifest(pack)
        start_open(pack, method, lm, device, mapped=device_map is not None or max_memory is not None, overrides=params)
        if lm is None:
            # the pack only names the model: an installed embedded one or an existing local directory, never an install
            place = dict(device=device, device_map=device_map, max_memory=max_memory)
            lm = models.load(model, progress=progress, **place) if model else models.load_named_by_pack(pack.manifest["model"]["id"], **place)
        rope_scaling.apply(lm, pack.manifest, str(pack.path))  # the positions the pack was made with, before anything reads them
        shape = ModelShape.of(lm.config, next(lm.model.parameters()).dtype)
        check_model(pack, lm.model_id, lm.fingerprint, lm.tokenizer_fingerprint, shape)
        vocab = max(int(getattr(lm.config, "vocab_size", 0) or 0), len(lm.tokenizer))
        if pack.token_ids and max(pack.token_ids) >= vocab:
            raise PackError(f"{pack.path}: the pack's token ids exceed the model's vocabulary of {vocab}; re-ingest the document")
        method, params = resolve_method(pack, method, params)
        reach.check(method, pack.n_tokens(), reach.effective_window(pack.manifest.get("model"), models.context_window(lm.config)), lm.model_id)
        check_pack_tensors(pack, shape)
        with loading(pack, "open"):
            memory = open_memory(method, pack, params, shape, lm.model)
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
        waited = self.settle()
        answer = self._ask(question, history=history, max_new_tokens=max_new_tokens, on_text=on_text, on_step=on_step, sampling=sampling)
        if waited:  # the question waited for the rehearsal: its first token did too
            answer.stats.ttft_s += waited
            answer.stats.extra["rehearsal_wait_s"] = round(waited, 6)
        return answer

    def _ask(
        self,
        question: str,
        *,
        history: list[prompt.Turn] | tuple = (),
        max_new_tokens: int = 256,
        on_text: Callable[[str], None] | None = None,
        on_step: Callable[[KVMemory], None] | None = None,
        sampling: Sampling | None = None,
        rehearsal: int | None = None,
    ) -> Answer:
        """rehearsal (Session.rehearse): this many of the question's first tokens dropped (another length), and no stop
        token: its max_new_tokens are all made."""
        question = question.strip()
        if not question:
            raise SekvError("the question is empty")
        suffix = prompt.question_suffix(self.lm.tokenizer, question, history, self.pack.manifest.get("system"))
        q_ids = prompt.encode(self.lm.tokenizer, suffix)
        if rehearsal:
            q_ids = q_ids[rehearsal:]
        models.set_rope_scaling(self.lm, self.rope_factor)
        if hasattr(self.memory, "fused_scout"):  # the scout's Triton kernel once a rehearsal has compiled it (sekv/memory.py)
            self.memory.fused_scout = rehearsal is not None or self.rehearsal_s is not None
        window, reserve = self.window, len(q_ids) + max_new_tokens
        self.start = start_ask(self.memory, self.start, window, reserve)
        used = self.memory.window_tokens()  # the question's position; rag: the most it prefills before the question
        if window and used + reserve > window:
            raise SekvError(
                f"document ({used}) + question ({len(q_ids)}) + --max-new-tokens ({max_new_tokens}) tokens "
                f"exceed the model's context window of {window}; ask a shorter question or lower --max-new-tokens"
            )
        stream = TextStream(self.lm.tokenizer, on_text) if on_text else None
        try:
            ids, stats = generate(
                self.lm.model, self.memory, q_ids, max_new_tokens=max_new_tokens, stop_ids=self.stop_ids if rehearsal is None else set(),
                on_token=stream, on_step=on_step,
                compile_layers=self.compile_layers and placement.input_device(self.lm.model).type == "cuda", question=question,
                sampler=Sampler(sampling) if sampling is not None and not sampling.greedy else None,
            )
        finally:
            self.memory.truncate(self.start)
        stats.extra = self.memory.step_stats().extra
        text = self.lm.tokenizer.decode(ids, skip_special_tokens=True).strip()
        return Answer(text, ids, stats)


def start_open(pack: Pack, method: str | None, lm: models.LoadedModel | None, device: str | None, mapped: bool,
               overrides: dict[str, Any] | None = None) -> None:
    """Before the model loads: the pack's method starts on a second thread what its open() will take up
    (CacheMethod.start_open: sekv's factor blocks on CUDA), for the device the model will be on when that is one
    device.  Anything that goes wrong here is left to the open, which meets it itself."""
    if mapped or (method is not None and method != pack.method) or pack.method not in methods.REGISTRY:
        return
    try:
        if lm is not None:
            if placement.is_mapped(lm.model):
                return
            device = placement.input_device(lm.model)
        try:
            params = resolve_method(pack, method, overrides)[1]
        except Exception:  # noqa: BLE001 - the open meets a bad override itself
            params = None
        device = str(device or models.default_device())
        # the attention shape the pack was made for, in the dtype the model will have (what a rehearsal runs in)
        dtype = next(lm.model.parameters()).dtype if lm is not None else models.default_dtype(device)
        shape = dataclasses.replace(manifest_shape(pack), dtype=dtype)
        methods.get(pack.method).start_open(pack, shape, pack.n_tokens(), device, params)
    except Exception:  # noqa: BLE001 - an optimisation only
        return


def open_memory(method, store, params: Params, shape: ModelShape, model) -> KVMemory:
    """A method's runtime memory for a loaded model: on its device, or, for a model placed across devices
    (sekv_core/placement.py), each layer's KV on its layer's device where the method can (``per_layer_devices``),
    else on the model's input device with the other layers' tokens handed there by the attention hook."""
    cache_method = methods.get(method) if isinstance(method, str) else method  # a name, or a CacheMethod
    home = placement.input_device(model)
    if not placement.is_mapped(model):
        return cache_method.open(store, params, shape, home)
    devices = placement.layer_devices(model)
    memory = cache_method.open(store, params, shape, devices if cache_method.per_layer_devices else home)
    memory.layer_devices = devices if cache_method.per_layer_devices else [home] * len(devices)
    return memory


def pick_documents(manifest: dict, names: list[str]) -> list[dict]:
    """The pack's documents (document.parts records, in pack order) that ``names`` name: each a document's name as
    `sekv inspect` lists it (the path as given), or its file name; a name may be several, comma-separated.
    SekvError for a name that matches none, listing the pack's documents."""
    from .add import old_parts

    parts = old_parts(manifest)
    wanted = [n.strip() for name in names for n in str(name).split(",") if n.strip()]
    chosen = set()
    for n in wanted:
        hits = [i for i, q in enumerate(parts) if n in (q["name"], Path(q["name"]).name)]
        if not hits:
            listed = ", ".join(q["name"] for q in parts[:20]) + (f" and {len(parts) - 20} more" if len(parts) > 20 else "")
            raise SekvError(f"--doc {n}: no such document in the pack; its documents: {listed}")
        chosen.update(hits)
    if not chosen:
        raise SekvError("--doc: give a document's name (sekv inspect PACK lists them)")
    return [parts[i] for i in sorted(chosen)]


def start_ask(memory: KVMemory, start: int, window: int, reserve: int) -> int:
    """Back to the document's state (appended tokens dropped: ``start`` is where they began) before an ask that
    appends up to ``reserve`` tokens; a memory past the window lays itself out inside it (KVMemory.place_in_window).
    -> the position of the ask's first token."""
    memory.truncate(start)
    if window and reserve < window:
        memory.place_in_window(window, reserve)
    return memory.n_tokens()


def resolve_method(pack: Pack, method: str | None, params: dict[str, Any] | None) -> tuple[str, Params]:
    """The pack's method, or an ask-time override that the pack's tensors support."""
    stored = pack.method
    if stored not in methods.REGISTRY:
        raise PackError(f"{pack.path}: made with cache method {stored!r}, which this sekv does not have ({', '.join(methods.REGISTRY)})")
    chosen = method or stored
    m = methods.get(chosen)  # an unknown --method: one line naming the valid ones
    if chosen != stored and chosen not in getattr(methods.get(stored), "derivable", ()):  # e.g. a sekv pack read as `full`
        raise SekvError(f"this pack was ingested with --method {stored}; --method {chosen} needs a pack made with it (sekv ingest --method {chosen})")
    recorded = stored_params(pack).to_dict()
    merged = dict(recorded) if chosen == stored else {}
    for k, v in (params or {}).items():
        if v is None:
            continue
        if chosen == stored and k not in m.ask_time_params:
            raise SekvError(f"--{k} cannot be changed at ask time for method '{chosen}'; re-ingest with it")
        merged[k] = v
    if chosen == stored and "router" not in (params or {}) and not _recorded_router_ok(pack, merged):
        merged["router"] = "auto"  # a router file the pack names is read only when it is the one it was made with
    try:
        return chosen, m.resolve_params(merged)
    except (TypeError, ValueError) as e:
        raise PackError(f"{pack.path}: the pack's method parameters are invalid ({e}); re-ingest the document") from None


def pack_params(pack: Pack) -> dict[str, Any]:
    """The pack's method parameters, checked against the method's: known names, each of its default's JSON type
    (an int where a float is expected is fine), finite numbers of a sane size, and a budget in (0, 1]."""
    m = methods.get(pack.method)
    out = {}
    for k, v in pack.params.items():
        if k not in m.default_params:
            raise PackError(f"{pack.path}: unknown {pack.method} parameter {k!r} in the pack; it was not written by this sekv, re-ingest the document")
        d = m.default_params[k]
        ok = (type(v) is bool) if type(d) is bool else (type(v) is int) if type(d) is int else (
            type(v) in (int, float)) if type(d) is float else isinstance(v, str) if isinstance(d, str) else v is None or type(v) in (int, float, str, bool)
        if ok and type(v) in (int, float) and not (abs(v) <= 2**31):
            ok = False
        if not ok or (isinstance(v, str) and len(v) > 4096):
            raise PackError(f"{pack.path}: the pack's {pack.method} parameter {k!r} has a bad value; re-ingest the document")
        out[k] = v
    for k, v in m.params_type.absent_in_pack.items():  # a pack made before the parameter existed
        out.setdefault(k, v)
    b = out.get("budget")
    if b is not None and not 0 < b <= 1:
        raise PackError(f"{pack.path}: the pack's budget {b!r} is not in (0, 1]; re-ingest the document")
    return out


def _recorded_router_ok(pack: Pack, params: dict[str, Any]) -> bool:
    """A router named by path in a pack is used only if that file's sha256 is the one the pack records."""
    spec = params.get("router")
    if not isinstance(spec, str) or spec in ("auto", "untrained", ""):
        return True
    p = Path(spec).expanduser()
    try:
        if not p.is_file():
            return True  # the shipped routers are searched by sha256 (sekv/router.py trained_file)
        from .sekv import layout, router_file

        return router_file.file_sha256(p) == layout.router_sha256(pack, set(pack.keys()))
    except OSError:
        return False


def stored_params(pack: Pack):
    """The pack's method parameters, typed (sekv_core/methods/params.py); PackError where they are not valid."""
    try:
        return methods.get(pack.method).resolve_params(pack_params(pack))
    except (SekvError, TypeError, ValueError) as e:
        if isinstance(e, PackError):
            raise
        raise PackError(f"{pack.path}: the pack's method parameters are invalid ({e}); re-ingest the document") from None


def check_pack_tensors(pack: Pack, shape: ModelShape) -> None:
    """The stored method's tensor checks (CacheMethod.validate), before any of its tensors is used."""
    with loading(pack, "check"):
        try:
            methods.get(pack.method).validate(pack, stored_params(pack), shape, pack.n_tokens())
        except PackError as e:
            msg = str(e)
            raise PackError(msg if msg.startswith(str(pack.path)) else f"{pack.path}: {msg}") from None


@contextlib.contextmanager
def loading(pack: Pack, stage: str):
    """Anything but a SekvError while a pack is checked or opened is a pack the checks did not anticipate: one
    PackError (the traceback stays with it for -v / SEKV_DEBUG).  Running out of memory is not the pack's fault
    (a KV cache bigger than the GPU holds): it goes on as it is."""
    try:
        yield
    except (SekvError, MemoryError):
        raise
    except Exception as e:
        if type(e).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError, without importing torch here
            raise
        raise PackError(f"{pack.path}: the pack's contents are inconsistent ({stage}: {type(e).__name__}); re-ingest the document") from e


def inspect_pack(path: str | Path) -> tuple[Pack, dict[str, Any]]:
    """A pack, checked as ask checks it (without its model: the shape its manifest records), and its method's
    statistics for `sekv inspect`."""
    pack = read_pack(Path(path))
    check_manifest(pack)
    if pack.method not in methods.REGISTRY:
        raise PackError(f"{pack.path}: made with cache method {pack.method!r}, which this sekv does not have ({', '.join(methods.REGISTRY)})")
    params = stored_params(pack)
    rope_scaling.of_manifest(pack.manifest, str(pack.path))
    check_pack_tensors(pack, manifest_shape(pack))
    with loading(pack, "inspect"):
        return pack, methods.get(pack.method).describe(pack, params)
