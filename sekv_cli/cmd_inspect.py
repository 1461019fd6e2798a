"""`sekv inspect PACK`: what a context pack holds."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from sekv_core import methods
from sekv_core.pack import read_pack

from .common import user_errors
from .display import human_bytes, kv_table, out


@user_errors
def inspect(
    pack: Path = typer.Argument(..., help="a context pack"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Show the model, document, tokens, cache method, parameters and sizes of PACK."""
    p = read_pack(pack)
    m = dict(p.manifest)
    m.pop("token_ids", None)
    m["document"] = {k: v for k, v in m["document"].items() if k != "token_pages"}
    m.pop("tensors", None)
    m["file_bytes"] = p.size_bytes()
    details = methods.get(p.method).describe(p, methods.get(p.method).resolve_params(p.params)) if p.method in methods.REGISTRY else {}
    m["method_stats"] = details
    if as_json:
        print(json.dumps(m))
        return
    raw = m["sizes"]["raw_kv_fp16_bytes"]
    rows = [
        ("pack", f"{pack} (format v{m['format_version']}, {human_bytes(m['file_bytes'])}, created {m['created']})"),
        ("document", f"{m['document']['name']} ({m['document']['kind']}, {m['document']['n_pages']} page(s), sha256 {m['document']['sha256'][:12]}...)"),
        ("tokens", str(m["n_tokens"])),
        ("model", f"{m['model']['id']} ({m['model']['dtype']}, fingerprint {m['model']['fingerprint'][:12]})"),
        ("method", f"{m['method']} {json.dumps(m['method_params'])}"),
        ("size", f"{human_bytes(m['file_bytes'])} = {100 * m['file_bytes'] / max(raw, 1):.1f}% of the raw fp16 KV cache ({human_bytes(raw)})"),
    ]
    rows += [(k.replace("_", " "), v if isinstance(v, str) else json.dumps(v)) for k, v in details.items()]
    out.print(kv_table("", rows))
