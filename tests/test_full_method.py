"""The `full` method against an independent reference: plain transformers with SDPA and its own cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from sekv_core import models, prompt
from sekv_core.ingest import ingest
from sekv_core.session import Session

from conftest import SAMPLE_MD

QUESTION = "How many steps does the tower have?"


def reference_greedy(model_dir, ids: list[int], max_new: int, stop: set[int]) -> list[int]:
    """Plain transformers: one prefill of document + question, then greedy decoding with generate()."""
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    out = ref.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=sorted(stop), pad_token_id=0)
    gen = out[0, len(ids):].tolist()
    while gen and gen[-1] in stop:
        gen.pop()
    return gen


@pytest.mark.parametrize("arch", ["tiny_qwen", "tiny_llama"])
def test_pack_answer_equals_direct_prefill(arch, request, tmp_path):
    model_dir = request.getfixturevalue(arch)
    lm = models.load(str(model_dir), device="cpu", dtype=torch.float32)
    pack = tmp_path / "doc.sekv"
    ingest(SAMPLE_MD, pack, lm=lm, method="full", chunk=100)  # several chunks: chunked prefill must be exact too
    session = Session.open(pack, lm=lm)
    answer = session.ask(QUESTION, max_new_tokens=24)
    ids = session.pack.token_ids + prompt.encode(lm.tokenizer, prompt.question_suffix(lm.tokenizer, QUESTION))
    expected = reference_greedy(model_dir, ids, 24, session.stop_ids)
    assert len(expected) > 3
    assert answer.token_ids == expected
    # asking again from the same session starts from the pack state again
    assert session.ask(QUESTION, max_new_tokens=24).token_ids == expected


def test_chunked_prefill_logits_match_one_forward(tiny_qwen):
    from sekv_core import runtime
    from sekv_core.methods.full import FullMemory
    from sekv_core.prefill import prefill

    lm = models.load(str(tiny_qwen), device="cpu", dtype=torch.float32)
    ids = torch.tensor(prompt.encode(lm.tokenizer, SAMPLE_MD.read_text()[:3000]))
    res = prefill(lm.model, ids[:-5], with_surprisal=True, chunk=64)
    memory = FullMemory.empty(res.shape, "cpu")
    for i, (k, v) in enumerate(zip(res.keys, res.values)):
        memory.kv.append(i, k[None], v[None])
    logits = runtime.forward_logits(lm.model, ids[-5:].view(1, -1), len(ids) - 5, memory, last_only=False)[0]
    ref = AutoModelForCausalLM.from_pretrained(tiny_qwen, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        ref_logits = ref(ids.view(1, -1)).logits[0].float()
    torch.testing.assert_close(logits, ref_logits[-5:], atol=2e-4, rtol=2e-4)
    # surprisal equals -log softmax of the reference logits at the next token
    ref_s = -torch.log_softmax(ref_logits[:-6], -1).gather(1, ids[1:-5].view(-1, 1)).squeeze(1)
    torch.testing.assert_close(res.surprisal[1:], ref_s, atol=2e-4, rtol=2e-4)
    assert res.surprisal[0] == 0


def test_prefix_plus_suffix_tokens_equal_whole_prompt(tiny_qwen):
    lm = models.load(str(tiny_qwen), device="cpu", dtype=torch.float32)
    doc = SAMPLE_MD.read_text()
    whole = prompt.document_prefix(lm.tokenizer, doc) + prompt.question_suffix(lm.tokenizer, QUESTION)
    split = prompt.encode(lm.tokenizer, prompt.document_prefix(lm.tokenizer, doc)) + prompt.encode(
        lm.tokenizer, prompt.question_suffix(lm.tokenizer, QUESTION))
    assert split == prompt.encode(lm.tokenizer, whole)


def test_history_is_rendered_in_order(tiny_qwen):
    lm = models.load(str(tiny_qwen), device="cpu", dtype=torch.float32)
    s = prompt.question_suffix(lm.tokenizer, "second?", [prompt.Turn("first?", "one")])
    assert s.index("first?") < s.index("one") < s.index("second?")
    assert s.endswith("<|im_start|>assistant\n")


@pytest.mark.integration
def test_smollm2_pack_answer_equals_direct_prefill(smollm2, tmp_path):
    pack = tmp_path / "log.sekv"
    ingest(SAMPLE_MD, pack, lm=smollm2, method="full")
    session = Session.open(pack, lm=smollm2)
    q = "How many steps does the Skarvholm tower have from the door to the lantern room?"
    answer = session.ask(q, max_new_tokens=32)
    ids = session.pack.token_ids + prompt.encode(smollm2.tokenizer, prompt.question_suffix(smollm2.tokenizer, q))
    assert answer.token_ids == reference_greedy(smollm2.path, ids, 32, session.stop_ids)
    assert answer.text
