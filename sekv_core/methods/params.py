"""Typed method parameters: one frozen dataclass per cache method.

A method's parameters are a subclass of :class:`Params` whose fields carry their
defaults; ``__post_init__`` checks them.  Fields that may change at ask time,
without re-ingesting, are declared with :func:`ask_time`.  A pack stores them in
its manifest as JSON (:meth:`Params.to_dict`) and they are read back with
:meth:`Params.from_dict`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from ..errors import SekvError

#: the resident-KV budget every compressing method defaults to: a fraction of the full KV cache's bytes
DEFAULT_BUDGET = 0.10


def ask_time(default: Any) -> Any:
    """A field that may be changed at ask time (``sekv ask --KEY``) without re-ingesting."""
    return field(default=default, metadata={"ask_time": True})


@dataclass(frozen=True)
class Params:
    """No parameters (the base of every method's parameter class)."""

    method = ""  # the method's name, for error messages (a class attribute, not a field)
    #: ingest-time parameters added after packs were made without them: the value such a pack was made with (a
    #: pack's manifest records every parameter, so one without the name predates it; session.pack_params)
    absent_in_pack: ClassVar[Mapping[str, Any]] = {}

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return cls().to_dict()

    @classmethod
    def ask_time_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("ask_time"))

    @classmethod
    def from_dict(cls, values: "Mapping[str, Any] | Params | None", method: str = "") -> "Params":
        """Defaults overridden by ``values`` (None values ignored), each converted to its field's type; ``values``
        may be parameters already resolved."""
        if isinstance(values, Params):
            values = values.to_dict()
        defaults = cls.defaults()
        method = method or cls.method
        kw = {}
        for k, v in (values or {}).items():
            if v is None:
                continue
            if k not in defaults:
                raise SekvError(f"method '{method}' has no parameter '{k}' (it has: {', '.join(defaults) or 'none'})")
            try:
                kw[k] = type(defaults[k])(v)
            except (TypeError, ValueError):
                raise SekvError(f"{method}: {k}={v!r} is not a {type(defaults[k]).__name__}") from None
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "Params":
        return dataclasses.replace(self, **changes)

    def _one_of(self, name: str, allowed: tuple) -> None:
        if getattr(self, name) not in allowed:
            raise SekvError(f"{self.method}: {name} must be one of {', '.join(map(str, allowed))}, not {getattr(self, name)!r}")


@dataclass(frozen=True)
class BudgetParams(Params):
    """A budget: the fraction of the full KV cache's bytes a method may keep resident."""

    budget: float = DEFAULT_BUDGET
