"""``--set MODULE.NAME=VALUE``: a module setting changed for one benchmark run (an A/B without editing the code)."""

from __future__ import annotations

import argparse
import ast
import importlib


def add_set_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="set a module constant first (a Python literal), e.g. sekv_core.sekv.linalg.SUBSPACE_ITERS=3")


def apply_sets(items: list[str]) -> dict[str, object]:
    """Set each MODULE.NAME to the Python literal VALUE; -> {MODULE.NAME: value} (what a result records)."""
    done = {}
    for item in items:
        target, value = item.split("=", 1)
        mod, name = target.rsplit(".", 1)
        m = importlib.import_module(mod)
        if not hasattr(m, name):
            raise SystemExit(f"--set {item}: {mod} has no {name}")
        setattr(m, name, ast.literal_eval(value))
        done[target] = getattr(m, name)
    return done
