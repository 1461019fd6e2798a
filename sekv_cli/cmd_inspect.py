"""`sekv inspect PACK`: what a context pack holds."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from sekv_core.session import inspect_pack

from .common import user_errors
from .display import human_bytes, kv_table, out, safe_line


@user_errors
def inspect(
    pack: Path = typer.Argument(..., help="a context pack"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Show the model, document, tokens, cache method, parameters and sizes of PACK."""
    p, details = inspect_pack(pack)
    m = dict(p.manifest)
    m.pop("token_ids", None)
    m["document"] = {k: v for k, v in m["document"].items() if k != "token_pages"}
    m.pop("tensors", None)
    m["file_bytes"] = p.size_bytes()
    m["method_stats"] = details
    if as_json:
        print(json.dumps(m))
        return
    raw = m["sizes"]["raw_kv_fp16_bytes"]
    doc = m["document"]
    rows = [
        ("pack", f"{pack} (format v{m['format_version']}, {human_bytes(m['file_bytes'])}, created {m['created']})"),
        ("document", f"{doc['name']} ({doc['kind']}, {doc['n_pages']} page(s), sha256 {doc['sha256'][:12]}...)"
         if "parts" not in doc else f"{len(doc['parts'])} documents ({doc['n_pages']} page(s), sha256 {doc['sha256'][:12]}...)"),
        ("tokens", str(m["n_tokens"])),
        ("model", f"{m['model']['id']} ({m['model']['dtype']}, fingerprint {m['model']['fingerprint'][:12]})"),
        ("positions", rope_text(m["model"])),
        ("method", f"{m['method']} {json.dumps(m['method_params'])}"),
        ("size", f"{human_bytes(m['file_bytes'])} = {100 * m['file_bytes'] / max(raw, 1):.1f}% of the raw fp16 KV cache ({human_bytes(raw)})"),
    ]
    for i, part in enumerate(doc.get("parts") or [], 1):  # several documents (ingest a.pdf notes/ -o OUT)
        rows.append((f"document {i}", f"{part['name']} ({part['kind']}, {part['n_pages']} page(s), tokens {part['token_start']}-{part['token_end']})"))
    if isinstance(m.get("system"), str):  # prefilled with the document (ingest --system)
        rows.append(("system prompt", m["system"] if len(m["system"]) <= 200 else m["system"][:197] + "..."))
    rows += [(k.replace("_", " "), v if isinstance(v, str) else json.dumps(v)) for k, v in details.items()]
    out.print(kv_table("", [(safe_line(k), safe_line(v)) for k, v in rows]))


def rope_text(model: dict) -> str:
    """The RoPE scaling a pack was ingested with (checked by inspect_pack), and the window it addresses."""
    rs = model.get("rope_scaling")
    if not rs:
        return f"native RoPE, window {model['context_window']} tokens"
    return f"YaRN x{rs['factor']:g} over the native {rs['original_max_position_embeddings']} tokens, window {model['context_window']} tokens"
