"""Shared fixtures: a tiny trained tokenizer and tiny random-weight Qwen2 / Llama models.

Everything here is built offline in seconds, so the unit tests need no model
packages.  Tests marked `integration` use the real embedded smollm2-135m.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_MD = ROOT / "sample_docs" / "lighthouse_keepers_log.md"
SAMPLE_PDF = ROOT / "sample_docs" / "halden_hx40_manual.pdf"

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="session", autouse=True)
def _offline_env(tmp_path_factory):
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # Fingerprint caches etc. go to a private SEKV_HOME unless the embedded models are wanted.
    os.environ.setdefault("SEKV_HOME", str(Path.home() / ".cache" / "sekv"))


def _tiny_tokenizer(path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = [p.read_text() for p in sorted((ROOT / "sample_docs").glob("*.md"))]
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(path)
    return fast


def make_tiny_model(path: Path, arch: str = "qwen2", max_positions: int = 8192, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    tok = _tiny_tokenizer(path)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=len(tok), max_position_embeddings=max_positions, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    cfg = Qwen2Config(**common) if arch == "qwen2" else LlamaConfig(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Random init is near-uniform; sharpen it so greedy decoding is not a coin toss between near-ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen"), "qwen2")


@pytest.fixture(scope="module")
def lm(tiny_qwen):
    """The tiny Qwen2 model loaded in float32 on the CPU, once per test module."""
    from sekv_core import models

    return models.load(str(tiny_qwen), device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_short(tmp_path_factory) -> Path:
    """A tiny model with a 256-token context window (for the too-long-document error)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_short"), "qwen2", max_positions=256)


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded SmolLM2-135M (installed into SEKV_HOME on first use)."""
    from sekv_core import models

    return models.load("smollm2-135m", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def haystack(tmp_path_factory) -> Path:
    """A small haystack folder (the sample documents), independent of shared/."""
    d = tmp_path_factory.mktemp("haystack")
    for p in sorted((ROOT / "sample_docs").glob("*.md")):
        (d / f"{p.stem}.txt").write_text(p.read_text())
    return d
