"""Method variants for `sekv bench`: a registered method with parameter overrides.

A variant is written ``METHOD[:ITEM[:ITEM...]]`` where an ITEM is ``key=value`` (a
parameter of the method, the value converted to the type of the method's default)
or the name of one of the method's named ablations (``CacheMethod.ablations``: objects with the
parameters they change, ``overrides``; e.g.
``sekv:no-svd``).  Items apply left to right, so ``sekv:fixed-chunks:chunk=64``
overrides the ablation's chunk length.  ``--ablations a,b`` is short for
``--methods sekv:a,sekv:b``.

The canonical label (``Variant.label``) is what a results row carries as its
``method``: the method name alone when there are no items, otherwise the items in
the order given.  It is part of the cell key, so variants are resumed, reported
and plotted as methods of their own.  ``budget`` cannot be set here: it comes from
``--budgets``.  Values cannot contain ``:`` or ``,``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import methods
from ..errors import SekvError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Variant:
    label: str  # the results row's "method"
    method: str  # the registered method
    overrides: dict[str, Any] = field(default_factory=dict)  # parameters beyond the budget
    ablations: tuple[str, ...] = ()  # the named ablations it includes

    def params(self, budget: float | None) -> dict[str, Any]:
        """Overrides for ``CacheMethod.resolve_params``: the variant's, plus the budget."""
        return {**self.overrides, **({"budget": budget} if budget is not None else {})}


def ablation_names(method: str) -> list[str]:
    return list(getattr(methods.get(method), "ablations", {}) or {})


def _convert(method: str, key: str, text: str, default: Any) -> Any:
    if isinstance(default, bool):
        t = text.strip().lower()
        if t in _TRUE:
            return True
        if t in _FALSE:
            return False
        raise SekvError(f"{method}:{key}={text}: expected true or false")
    if isinstance(default, (int, float)):
        try:
            return type(default)(float(text)) if isinstance(default, float) else int(text)
        except ValueError:
            raise SekvError(f"{method}:{key}={text}: expected a number") from None
    return text


def parse(spec: str) -> Variant:
    """``sekv:no-anchors:tau_mode=global`` -> Variant; unknown methods, parameters or ablations are errors."""
    parts = [p.strip() for p in spec.strip().split(":")]
    name, items = parts[0], parts[1:]
    m = methods.get(name)  # unknown name -> SekvError listing the registered ones
    if not items:
        return Variant(name, name)
    named = getattr(m, "ablations", {}) or {}
    overrides: dict[str, Any] = {}
    abl: list[str] = []
    for item in items:
        if not item:
            raise SekvError(f"'{spec}': empty item between ':'")
        if "=" in item:
            key, text = (x.strip() for x in item.split("=", 1))
            if key == "budget":
                raise SekvError(f"'{spec}': the budget comes from --budgets, not from the method spec")
            if key not in m.default_params:
                raise SekvError(f"method '{name}' has no parameter '{key}' (it has: {', '.join(m.default_params)})")
            overrides[key] = _convert(name, key, text, m.default_params[key])
        elif item in named:
            for key in named[item].overrides:
                if key not in m.default_params:
                    raise SekvError(f"ablation '{name}:{item}' needs parameter '{key}', which '{name}' does not have yet")
            overrides.update(named[item].overrides)
            abl.append(item)
        else:
            known = ", ".join(named) if named else "none"
            raise SekvError(f"'{spec}': '{item}' is neither key=value nor an ablation of '{name}' (ablations: {known})")
    return Variant(":".join([name, *items]), name, overrides, tuple(abl))


def expand_ablations(text: str, method: str = "sekv") -> list[str]:
    """``--ablations`` -> variant specs of ``method``; ``all`` = every named ablation the method's parameters support."""
    names = ablation_names(method)
    if text.strip() == "all":
        params = methods.get(method).default_params
        table = getattr(methods.get(method), "ablations", {}) or {}
        chosen = [a for a in names if all(k in params for k in table[a].overrides)]
    else:
        chosen = [p.strip() for p in text.split(",") if p.strip()]
        if not chosen:
            raise SekvError("--ablations is empty")
    specs = [f"{method}:{a}" for a in chosen]
    for s in specs:
        parse(s)  # unknown ablation -> SekvError
    return specs
