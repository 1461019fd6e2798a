"""Chat-template split: [system + document] is prefilled once; [question + assistant turn] at ask time.

The model's own chat template is rendered with marker strings in place of the
document and the question, then cut at the markers.  The pack stores the token
ids of the first part; `ask` tokenizes the second part and appends it.  The
cut lies on a blank line after the document, a boundary byte-level BPE
tokenizers do not merge across, so prefix + question tokens equal the tokens of
the whole prompt in practice (and the reference tests use exactly these ids).
"""

from __future__ import annotations

from dataclasses import dataclass

SYSTEM = (
    "You are a careful assistant. Answer the user's question using only the document they give you. "
    "Answer briefly and precisely; if the document does not contain the answer, say so."
)
_DOC = "\x00SEKV_DOC\x00"
_Q = "\x00SEKV_Q\x00"


def _user_first(document: str) -> str:
    return f"Read the document below, then answer the question after it.\n\n<document>\n{document}\n</document>\n\n"


@dataclass(frozen=True)
class Turn:
    question: str
    answer: str


def _render(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _messages(document: str, questions: list[str], answers: list[str]) -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM}]
    for i, q in enumerate(questions):
        content = (_user_first(document) + "Question: " + q) if i == 0 else q
        msgs.append({"role": "user", "content": content})
        if i < len(answers):
            msgs.append({"role": "assistant", "content": answers[i]})
    return msgs


def document_prefix(tokenizer, document: str) -> str:
    """Text prefilled at ingest: everything up to and including the blank line after the document."""
    if tokenizer.chat_template is None:
        return _user_first(document)
    text = _render(tokenizer, _messages(_DOC, [_Q], []))
    head = text.split(_DOC)[0]
    return head + _user_first(document)


def template_head(tokenizer) -> str:
    """The chat template's text before the first user message's content (system prompt and user header): the
    start of document_prefix()."""
    if tokenizer.chat_template is None:
        return ""
    return _render(tokenizer, _messages(_DOC, [_Q], [])).split(_user_first(_DOC))[0]


def question_suffix(tokenizer, question: str, history: list[Turn] | tuple = ()) -> str:
    """Text appended at ask time: the question (after any earlier turns) and the assistant header."""
    if tokenizer.chat_template is None:
        past = "".join(f"Question: {t.question}\nAnswer: {t.answer}\n\n" for t in history)
        return past + f"Question: {question}\nAnswer:"
    qs = [t.question for t in history] + [question]
    text = _render(tokenizer, _messages(_DOC, qs, [t.answer for t in history]))
    marker = _user_first(_DOC)
    return text[text.index(marker) + len(marker) :]


def document_token_range(tokenizer, prefix: str) -> tuple[int, int]:
    """[start, end) of the document's tokens in a document_prefix() text as ingest tokenizes it: the tokens that
    start inside the document's characters (the header before it, the closing tag after it)."""
    tail = len(_user_first("")) - len(_user_first("").split("\n</document>")[0])
    start_char, end_char = len(document_prefix(tokenizer, "")) - tail, len(prefix) - tail
    offsets = tokenizer(prefix, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    start = sum(1 for a, _ in offsets if a < start_char)
    end = sum(1 for a, _ in offsets if a < end_char)
    return start, max(start, end)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop_token_ids(tokenizer, generation_config=None) -> set[int]:
    ids: set[int] = set()
    for tid in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")):
        if isinstance(tid, int) and tid >= 0 and tid != tokenizer.unk_token_id:
            ids.add(tid)
    eos = getattr(generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(eos)
    return ids
