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

from .errors import SekvError

SYSTEM = (
    "You are a careful assistant. Answer the user's question using only the document they give you. "
    "Answer briefly and precisely; if the document does not contain the answer, say so."
)
#: the longest system prompt accepted (--system at ingest; a pack's manifest)
MAX_SYSTEM_CHARS = 65536
_DOC = "\x00SEKV_DOC\x00"
_Q = "\x00SEKV_Q\x00"


INSTRUCTION = "Read the document below, then answer the question after it."
_OPEN = "\n\n<document>\n"
_CLOSE = "\n</document>\n\n"


def _user_first(document: str) -> str:
    """The first user message's content up to the question: the instruction once, the document in one closed tag."""
    return INSTRUCTION + _OPEN + document + _CLOSE


@dataclass(frozen=True)
class Turn:
    question: str
    answer: str


def _render(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _messages(document: str, questions: list[str], answers: list[str], system: str | None = None) -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM if system is None else system}]
    for i, q in enumerate(questions):
        content = (_user_first(document) + "Question: " + q) if i == 0 else q
        msgs.append({"role": "user", "content": content})
        if i < len(answers):
            msgs.append({"role": "assistant", "content": answers[i]})
    return msgs


def document_header(tokenizer, system: str | None = None) -> str:
    """The text before the document's first character: the chat template's head (system prompt, user header), the
    instruction and the opening ``<document>`` tag (what a prefill window of a long document starts with)."""
    return template_head(tokenizer, system) + INSTRUCTION + _OPEN


def document_footer() -> str:
    """The text after the document's last character: the closing tag and the blank line the ask-time part follows."""
    return _CLOSE


#: what opens documents appended to a pack (sekv add): they follow the pack's closing tag in a tag of their own
CONTINUATION_OPEN = "<document>\n"


def document_continuation(document: str) -> str:
    """Text prefilled for documents appended to a pack (``sekv add``): after the pack's text (which ends with the
    footer's blank line) they open a ``<document>`` tag of their own and close it as the first one was closed, so
    the question's part follows them as it followed the pack."""
    return CONTINUATION_OPEN + document + document_footer()


def document_prefix(tokenizer, document: str, system: str | None = None) -> str:
    """Text prefilled at ingest: header, document, footer (everything up to and including the blank line after
    the document).  ``system``: the system prompt (None: SYSTEM)."""
    return document_header(tokenizer, system) + document + document_footer()


def template_head(tokenizer, system: str | None = None) -> str:
    """The chat template's text before the first user message's content (system prompt and user header)."""
    if tokenizer.chat_template is None:
        return ""
    text = _render(tokenizer, _messages(_DOC, [_Q], [], system))
    marker = _user_first(_DOC)
    if text.count(marker) != 1:
        raise SekvError("the chat template does not render the document exactly once (a system prompt with NUL characters?)")
    return text.split(marker)[0]


def question_suffix(tokenizer, question: str, history: list[Turn] | tuple = (), system: str | None = None) -> str:
    """Text appended at ask time: the question (after any earlier turns) and the assistant header.  ``system``:
    the system prompt the pack was made with (None: SYSTEM)."""
    if tokenizer.chat_template is None:
        past = "".join(f"Question: {t.question}\nAnswer: {t.answer}\n\n" for t in history)
        return past + f"Question: {question}\nAnswer:"
    qs = [t.question for t in history] + [question]
    text = _render(tokenizer, _messages(_DOC, qs, [t.answer for t in history], system))
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
