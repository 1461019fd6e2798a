"""The registry of cache methods: one name -> one CacheMethod, one file each."""

from __future__ import annotations

from ..errors import SekvError
from .base import CacheMethod, KVMemory, ModelShape, PrefillResult
from .full import FullMethod

REGISTRY: dict[str, CacheMethod] = {}


def register(method: CacheMethod) -> CacheMethod:
    REGISTRY[method.name] = method
    return method


for _m in (FullMethod(),):
    register(_m)

DEFAULT_METHOD = "full"


def get(name: str) -> CacheMethod:
    try:
        return REGISTRY[name]
    except KeyError:
        raise SekvError(f"unknown cache method '{name}'; available: {', '.join(REGISTRY)}") from None


__all__ = ["REGISTRY", "DEFAULT_METHOD", "CacheMethod", "KVMemory", "ModelShape", "PrefillResult", "get", "register"]
