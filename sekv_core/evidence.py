"""Map zoomed spans back to document text and pages (for --json and --show-evidence).

Only the document's own tokens are evidence: the prompt around it (system prompt, instruction, the
``<document>`` tags) is cut off each span, and a span with nothing else is left out.  Each passage's count is
its share of the answer's zoom reads: the (layer, head, step) expansions that read it, divided by all the
expansions of document passages in that answer (so 25 % on four rows: the zoom was spread evenly over them).
"""

from __future__ import annotations

import bisect


def _page_of(token_pages: list[list[int]], pos: int) -> int:
    starts = [r[1] for r in token_pages]
    i = bisect.bisect_right(starts, pos) - 1
    return token_pages[i][0] if i >= 0 else 0


def part_page(parts: list[dict], pos: int, page: int) -> tuple[str | None, int]:
    """The document of a corpus (manifest document.parts) holding token ``pos``, and ``page`` (the corpus's numbering)
    as that document's own page; (None, page) for a single document."""
    if not parts:
        return None, page
    i = max(bisect.bisect_right([q["token_start"] for q in parts], pos) - 1, 0)
    first = 1 + sum(q["n_pages"] for q in parts[:i])
    return parts[i]["name"], min(max(page - first + 1, 1), max(parts[i]["n_pages"], 1))


def document_tokens(token_pages: list[list[int]], n_tokens: int) -> tuple[int, int]:
    """[start, end) of the document's own tokens in a pack: the runs of the token -> page map on a page (>= 1);
    the whole pack where the map has none."""
    on_page = [r for r in token_pages if r[0] >= 1]
    if not on_page:
        return 0, n_tokens
    return on_page[0][1], on_page[-1][2]


def evidence_rows(session, span_zoom_counts: dict, limit: int = 10, span_order: list[int] | None = None) -> list[dict]:
    """The most zoomed document passages: their text, page (and file, in a corpus), rank, zoom count and share of the answer's zoom reads,
    most zoomed first; equal counts (a scout ranking expands the same spans in every layer) in the order of
    ``span_order`` (the ranking's)."""
    if not span_zoom_counts or not hasattr(session.memory, "spans"):
        return []
    rank = {int(s): i for i, s in enumerate(span_order or [])}
    spans = session.memory.spans()
    ids = session.pack.token_ids
    pages = session.pack.manifest["document"].get("token_pages") or []
    parts = session.pack.manifest["document"].get("parts") or []
    lo, hi = document_tokens(pages, len(ids))
    # --doc: only the chosen documents' tokens; a corpus: its documents' (not the tags between those `sekv add` appended)
    allowed = getattr(session, "doc_ranges", None) or [(q["token_start"], q["token_end"]) for q in parts] or [(lo, hi)]
    clipped = {}
    for sid, count in span_zoom_counts.items():
        start, end = spans[int(sid)]
        for x, y in allowed:
            a, b = max(int(start), lo, x), min(int(end), hi, y)
            if a < b and count > 0:
                clipped[int(sid)] = (a, b, int(count))
                break
    total = sum(c for _, _, c in clipped.values())
    rows = []
    for sid, (a, b, count) in sorted(clipped.items(), key=lambda kv: (-kv[1][2], rank.get(kv[0], len(rank))))[:limit]:
        text = session.lm.tokenizer.decode(ids[a:b], skip_special_tokens=True).strip()
        file, page = part_page(parts, a, _page_of(pages, a))
        rows.append({"rank": len(rows) + 1, "span": sid, "tokens": [a, b], "page": page, "zoom_count": count,
                     "share": round(count / total, 4), "text": " ".join(text.split())} | ({"file": file} if file is not None else {}))
    return rows


def label(row: dict) -> str:
    """A row's heading as the CLI prints it: '#1 page 3 (25% of the zoom)', '#1 notes/a.pdf page 3 (...)' in a corpus
    (the name as the pack holds it: print it escaped)."""
    where = f"{row['file']} page {row['page']}" if row.get("file") is not None else f"page {row['page']}"
    return f"#{row['rank']} {where} ({100 * row['share']:.0f}% of the zoom)"
