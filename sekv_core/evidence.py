"""Map zoomed spans back to document text and pages (for --json and --show-evidence)."""

from __future__ import annotations

import bisect


def _page_of(token_pages: list[list[int]], pos: int) -> int:
    starts = [r[1] for r in token_pages]
    i = bisect.bisect_right(starts, pos) - 1
    return token_pages[i][0] if i >= 0 else 0


def evidence_rows(session, span_zoom_counts: dict, limit: int = 10, span_order: list[int] | None = None) -> list[dict]:
    """The most zoomed spans: their text, page and zoom count, most zoomed first; equal counts (a scout ranking
    expands the same spans in every layer) in the order of ``span_order`` (the ranking's)."""
    if not span_zoom_counts or not hasattr(session.memory, "spans"):
        return []
    rank = {int(s): i for i, s in enumerate(span_order or [])}
    spans = session.memory.spans()
    ids = session.pack.token_ids
    pages = session.pack.manifest["document"].get("token_pages") or []
    rows = []
    for sid, count in sorted(span_zoom_counts.items(), key=lambda kv: (-kv[1], rank.get(int(kv[0]), len(rank))))[:limit]:
        start, end = spans[int(sid)]
        text = session.lm.tokenizer.decode(ids[start:end], skip_special_tokens=True).strip()
        rows.append({"span": int(sid), "tokens": [int(start), int(end)], "page": _page_of(pages, int(start)), "zoom_count": int(count), "text": " ".join(text.split())})
    return rows
