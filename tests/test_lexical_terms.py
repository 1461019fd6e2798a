"""lexical.token_terms (matched all at once) against a plain per-token scan written here, and ingest's reuse of its
own tokenization for the lexical terms against tokenizing the text again."""

from __future__ import annotations

import random
import re
import zlib

import torch

from sekv_core.sekv import lexical


def _reference(text: str, offsets) -> list[int]:
    """Each token's term: the first word (a run of letters / digits that is not a stop word, longer than one
    character) ending after the token starts, if it starts before the token ends; -1 otherwise.  Words and terms
    found here with their own rule (lower-cased, one of -ing -ed -es -s -e stripped leaving 3 letters, crc32)."""
    words = []
    for m in re.finditer(r"[^\W_]+", text):
        w = m.group().lower()
        if len(w) < 2 or w in lexical.STOP_WORDS:
            continue
        for suf in ("ing", "ed", "es", "s", "e"):
            if len(w) > 4 and w.endswith(suf) and len(w) - len(suf) >= 3:
                w = w[: -len(suf)]
                break
        words.append((m.start(), m.end(), zlib.crc32(w.encode()) & 0x7FFFFFFF))
    out = []
    for a, b in offsets:
        term = -1
        for s, e, t in words:
            if e > a:
                term = t if s < b else -1
                break
        out.append(term)
    return out


def test_token_terms_match_a_per_token_scan():
    rng = random.Random(0)
    vocab = ["Pressure", "the", "inlet", "valves", "descaled", "E6", "a", "x", "warranty", "naïve", "Zürich", "9", "under_score",
             "running", "bar", "of", "ÉTÉ", "2024", "it's", "co-op"]
    for trial in range(40):
        text = "".join(rng.choice(vocab) + rng.choice([" ", "  ", ", ", ".\n", "-", ""]) for _ in range(rng.randint(0, 60)))
        n = len(text)
        offsets = []
        pos = 0
        while pos < n:  # tokens tiling the text, with a few empty and overlapping ones as tokenizers make them
            step = rng.randint(1, 7)
            offsets.append((pos, min(n, pos + step)))
            if rng.random() < 0.1:
                offsets.append((pos, pos))
            if rng.random() < 0.1 and pos > 2:
                offsets.append((pos - 2, pos + 1))
            pos += step
        if trial % 10 == 0:
            offsets = []
        got = lexical.token_terms(text, offsets)
        assert got.dtype == torch.int32 and got.shape == (len(offsets),)
        assert got.tolist() == _reference(text, offsets), (text, offsets)
        # the same from an [N, 2] tensor of offsets
        assert lexical.token_terms(text, torch.tensor(offsets, dtype=torch.long).view(-1, 2)).tolist() == got.tolist()


def test_no_words_gives_minus_one():
    assert lexical.token_terms("the a of , .", [(0, 3), (4, 5), (6, 8)]).tolist() == [-1, -1, -1]
    assert lexical.token_terms("", []).tolist() == []


def test_ingest_text_scores_reuse_its_tokenization(lm, tmp_path):
    """ingest hands its own offsets to the lexical terms: the pack's sekv.lex.terms are those of tokenizing the
    document prefix again (the path add.py and the benchmarks take)."""
    from sekv_core import prompt
    from sekv_core.ingest import ingest
    from sekv_core.pack import read_pack

    doc = tmp_path / "d.txt"
    doc.write_text("The inlet valve is descaled every 200 hours. Warranty: E6 means the pressure sensor failed.\n" * 6)
    r = ingest(doc, tmp_path / "d.sekv", lm=lm)
    p = read_pack(r.pack_path)
    try:
        got = p.get("sekv.lex.terms")
    finally:
        p.close()
    from sekv_core.documents import load_document

    text = prompt.document_prefix(lm.tokenizer, load_document(doc).text, None)
    want = lexical.document_terms(lm.tokenizer, text)
    assert torch.equal(got, want.to(torch.int32)) and int((got >= 0).sum()) > 10
