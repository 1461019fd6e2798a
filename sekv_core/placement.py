"""Where a model's layers run: accelerate's big-model placement (``device_map``), read off a loaded model.

``--device-map auto|balanced|balanced_low_0|sequential|JSON`` and ``--max-memory 0=120GiB,cpu=200GiB`` are parsed here
(one-line ModelError on a bad value) and handed to ``from_pretrained`` (transformers + accelerate place the layers,
offloading to CPU or disk what does not fit).  A memory asks :func:`layer_devices` where each decoder layer computes
(its *execution device*: the GPU an offloaded layer's weights are streamed to), so that a layer's KV lives beside
its attention; :func:`input_device` is where token ids go in; :func:`spans_devices` says whether the model runs on
more than one device or streams offloaded weights (CUDA graphs and compiled steps are then off).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .errors import ModelError

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
_TARGET = re.compile(r"^(cpu|disk|cuda(:\d+)?|\d+)$")
_SIZE = re.compile(r"^\s*(\d+(\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _target(value, where: str):
    """A device_map target: a GPU index, "cuda:N", "cpu" or "disk"."""
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not _TARGET.match(str(value)):
        raise ModelError(f"--device-map {where}: {value!r} is not a device (a GPU index, cuda:N, cpu or disk)")
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return value


def parse_device_map(text: str | None) -> str | dict | None:
    """--device-map: a strategy name, or a JSON object {module name: device} (module "" places the whole model)."""
    if text is None:
        return None
    text = text.strip()
    if text in STRATEGIES:
        return text
    if not text.startswith("{"):
        raise ModelError(f"--device-map {text!r}: use {', '.join(STRATEGIES)} or a JSON object such as "
                         "'{\"model.layers.0\": 0, \"lm_head\": \"cpu\"}'")
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise ModelError(f"--device-map: not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(raw, dict) or not raw:
        raise ModelError("--device-map: the JSON must be a non-empty object {module name: device}")
    return {str(k): _target(v, repr(k)) for k, v in raw.items()}


def parse_size(text: str, where: str) -> int:
    m = _SIZE.match(text)
    if not m:
        raise ModelError(f"--max-memory {where}: {text!r} is not a size (e.g. 120GiB, 500MB)")
    return int(float(m.group(1)) * _UNITS[m.group(3).upper()])


def parse_max_memory(text: str | None) -> dict | None:
    """--max-memory "0=120GiB,1=130GiB,cpu=200GiB": per device (GPU index, cpu, disk) the most it may hold."""
    if text is None:
        return None
    out: dict = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, size = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ModelError(f"--max-memory: {item!r} is not DEVICE=SIZE (e.g. 0=120GiB,cpu=200GiB)")
        dev = _target(key, "")
        dev = int(dev.split(":")[1]) if isinstance(dev, str) and dev.startswith("cuda:") else 0 if dev == "cuda" else dev
        if dev in out:
            raise ModelError(f"--max-memory: device {key} is given twice")
        out[dev] = parse_size(size, key)
    if not out:
        raise ModelError("--max-memory: give at least one DEVICE=SIZE (e.g. 0=120GiB,cpu=200GiB)")
    return out


def check_devices(device_map, max_memory) -> None:
    """The GPUs a map or a memory limit names exist here."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    named = list((device_map or {}).values()) if isinstance(device_map, dict) else []
    named += list(max_memory or {})
    for d in named:
        idx = d if isinstance(d, int) else int(d.split(":")[1]) if isinstance(d, str) and d.startswith("cuda:") else 0 if d == "cuda" else None
        if idx is not None and idx >= n:
            have = f"cuda:0..cuda:{n - 1}" if n else "no CUDA GPU"
            raise ModelError(f"--device-map / --max-memory name GPU {idx}, but this machine has {have}")


def check_module_names(model, device_map: dict) -> None:
    """Every module a JSON --device-map names is one of the model's ("" is the whole model)."""
    names = {n for n, _ in model.named_modules()}
    unknown = [k for k in device_map if k not in names]
    if unknown:
        some = ", ".join(n for n, _ in model.named_children())
        raise ModelError(f"--device-map names {unknown[0]!r}, which is not a module of this model (its top-level modules: {some})")


def load_kwargs(device_map, max_memory, offload_dir: Path) -> dict:
    """from_pretrained's placement arguments for a parsed --device-map / --max-memory (a strategy by default when only
    --max-memory is given)."""
    check_devices(device_map, max_memory)
    kw = {"device_map": device_map or "auto", "offload_folder": str(offload_dir)}
    if max_memory:
        kw["max_memory"] = max_memory
    return kw


def weights_bytes(path: Path, itemsize: int) -> int:
    """Bytes a local model's weights take at ``itemsize`` bytes a value (from its safetensors headers; 0 unknown)."""
    total = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n))
        except (OSError, ValueError):
            return 0
        for name, info in header.items():
            if name != "__metadata__" and isinstance(info, dict):
                count = 1
                for s in info.get("shape", []):
                    count *= int(s)
                total += count * itemsize
    return total


def needs_map(path, device: str, itemsize: int) -> bool:
    """The default placement: one device; a CUDA model whose weights would not fit its GPU (with 10 % to spare) is
    placed by accelerate ("auto") instead."""
    import torch

    if not device.startswith("cuda") or not isinstance(path, Path):
        return False
    need = weights_bytes(path, itemsize)
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return need > 0.9 * free


# -- reading a loaded model's placement --------------------------------------------------------------------------

def _device(dev):
    """A torch.device with its index (accelerate says 0 or "cuda" where tensors say cuda:0)."""
    import torch

    dev = torch.device(f"cuda:{dev}" if isinstance(dev, int) else dev)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _exec_device(module):
    for sub in module.modules():  # the module's own hook first
        dev = getattr(getattr(sub, "_hf_hook", None), "execution_device", None)
        if dev is not None:
            return _device(dev)
    for p in module.parameters():
        if p.device.type != "meta":
            return _device(p.device)
    return None


def decoder_layers(model) -> list:
    dec = model.get_decoder() if hasattr(model, "get_decoder") else model
    return list(getattr(dec, "layers", []))


def input_device(model):
    """Where the model's token ids go in: its input embedding's execution device."""
    import torch

    dev = _exec_device(model.get_input_embeddings())
    return dev if dev is not None else torch.device("cpu")


def layer_devices(model) -> list:
    """The execution device of each decoder layer (an offloaded layer computes on the device its weights are
    brought to)."""
    home = input_device(model)
    return [_exec_device(layer) or home for layer in decoder_layers(model)]


def is_mapped(model) -> bool:
    """Whether accelerate placed the model (hooks move inputs between devices, offloaded weights are streamed);
    remembered on the model (it is asked at every forward)."""
    known = getattr(model, "_sekv_mapped", None)
    if known is None:
        known = bool(getattr(model, "hf_device_map", None)) and any(hasattr(m, "_hf_hook") for m in model.modules())
        model._sekv_mapped = known
    return known


def spans_devices(model) -> bool:
    """More than one execution device, or weights streamed from CPU / disk: what a captured or compiled step
    cannot follow."""
    if not is_mapped(model):
        return False
    offloaded = {"cpu", "disk"} & {str(v) for v in model.hf_device_map.values()}
    accelerated = input_device(model).type != "cpu"  # on a machine without GPUs, "cpu" is where a module runs, not an offload
    return len({str(d) for d in layer_devices(model)} | {str(input_device(model))}) > 1 or (bool(offloaded) and accelerated)


def describe(model) -> str:
    """One line: how many decoder layers run where, and what is offloaded (for banners and docs)."""
    from collections import Counter

    counts = Counter(str(d) for d in layer_devices(model))
    where = Counter(str(v) for v in (getattr(model, "hf_device_map", None) or {}).values())
    accelerated = input_device(model).type != "cpu"
    off = [f"{where[k]} module(s) offloaded to {k}" for k in ("cpu", "disk") if where.get(k) and (accelerated or k == "disk")]
    return ", ".join([f"{n} layer(s) on {d}" for d, n in counts.items()] + off)
