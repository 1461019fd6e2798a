"""The registry of cache methods: one name -> one CacheMethod, one file each."""

from __future__ import annotations

from ..errors import SekvError
from .base import CacheMethod, KVMemory, ModelShape, PrefillResult
from .full import FullMethod
from .sekv import SekvMethod
from .chunkkv import ChunkKVMethod
from .depthweave import DepthWeaveMethod
from .h2o import H2OMethod
from .kvzip import KVzipMethod
from .pyramidkv import PyramidKVMethod
from .rag import RagMethod
from .sentencekv import SentenceKVMethod
from .snapkv import SnapKVMethod
from .streamingllm import StreamingLLMMethod

REGISTRY: dict[str, CacheMethod] = {}


def register(method: CacheMethod) -> CacheMethod:
    REGISTRY[method.name] = method
    return method


for _m in (FullMethod(), SekvMethod(), StreamingLLMMethod(), H2OMethod(), SnapKVMethod(), KVzipMethod(), PyramidKVMethod(), ChunkKVMethod(), SentenceKVMethod(), DepthWeaveMethod(), RagMethod()):
    register(_m)

#: `sekv` at its default 10 % budget answers every sample question that `full` answers (8/10 against 7/10) and
#: finds the needles full finds at 4K-16K (docs/design.md); `--method full` keeps the whole KV cache.
DEFAULT_METHOD = "sekv"


def get(name: str) -> CacheMethod:
    try:
        return REGISTRY[name]
    except KeyError:
        raise SekvError(f"unknown cache method '{name}'; available: {', '.join(REGISTRY)}") from None


__all__ = ["REGISTRY", "DEFAULT_METHOD", "CacheMethod", "KVMemory", "ModelShape", "PrefillResult", "get", "register"]
