"""RoPE scaling (static YaRN) as an ingest option: the in-place switch, the one planning rule, the pack's record.

References: transformers' own rotary module and model built from a YaRN config from scratch; transformers'
apply_rotary_pos_emb for sekv's re-rotation of pre-RoPE keys; plain transformers greedy decoding.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.qwen2 import modeling_qwen2 as mq
from typer.testing import CliRunner

from sekv_core import methods, models, prompt, rope_scaling
from sekv_core.errors import DocumentError, ModelError, PackError, SekvError
from sekv_core.ingest import ingest
from sekv_core.pack import read_pack, write_pack
from sekv_core.sekv import rope
from sekv_core.session import Session, inspect_pack

from conftest import SAMPLE_MD, make_tiny_model


def yarn(factor, window, theta=10000.0):
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": window, "rope_theta": theta}


@pytest.mark.parametrize("factor", [2.0, 4.0])
def test_set_rope_scaling_equals_a_model_built_with_that_config(tiny_qwen, factor):
    plain = lambda **kw: AutoModelForCausalLM.from_pretrained(tiny_qwen, dtype=torch.float32, attn_implementation="sdpa", **kw).eval()
    m = plain()
    window = models.context_window(m.config)
    assert window == 8192 and models.rope_factor(m.config) is None
    native_inv = m.model.rotary_emb.inv_freq.clone()
    models.set_rope_scaling(m, factor)
    cfg = AutoConfig.from_pretrained(tiny_qwen)
    cfg.rope_parameters = yarn(factor, 8192)
    ref = mq.Qwen2RotaryEmbedding(cfg)  # transformers' own init from the config
    assert torch.equal(m.model.rotary_emb.inv_freq, ref.inv_freq) and torch.equal(m.model.rotary_emb.original_inv_freq, ref.inv_freq)
    assert m.model.rotary_emb.attention_scaling == ref.attention_scaling > 1.0
    assert models.context_window(m.config) == models.context_window(cfg) == int(8192 * factor)
    ids = torch.randint(3, 500, (1, 300))
    with torch.no_grad():
        got = m(ids).logits
        want = plain(rope_parameters=yarn(factor, 8192)).eval()(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    models.set_rope_scaling(m, factor)  # idempotent
    models.set_rope_scaling(m, None)  # and back
    assert torch.equal(m.model.rotary_emb.inv_freq, native_inv) and m.model.rotary_emb.attention_scaling == 1.0
    assert models.context_window(m.config) == 8192 and m.config.rope_parameters["rope_type"] == "default"


def test_a_model_with_scaled_native_rope_is_not_rescaled(tiny_qwen):
    m = AutoModelForCausalLM.from_pretrained(tiny_qwen, dtype=torch.float32, rope_parameters=yarn(2.0, 4096))
    with pytest.raises(ModelError):
        models.set_rope_scaling(m, 4.0)
    models.set_rope_scaling(m, None)  # native: left as it is
    assert models.rope_factor(m.config) == 2.0


class _M:
    def __init__(self, name, policy=None):
        self.name = name
        if policy:
            self.length_policy = policy


@pytest.mark.parametrize("method,n,requested,want", [
    ("full", 1000, "auto", None),  # fits: native
    ("full", 1600, "auto", 2.0),  # 1600 + 512 reserve over a 2048 window: x2
    ("snapkv", 5000, "auto", 3.0),
    ("full", 7680, "auto", 4.0),  # 8192 = 4 x 2048 exactly
    ("sekv", 5000, "auto", None),  # windowed: native
    ("rag", 50000, "auto", None),  # any length, native
    ("full", 1000, "yarn:2", 2.0),  # asked for, even when it fits
    ("sekv", 5000, "yarn:4", 4.0),
    ("full", 1000, "none", None),
])
def test_plan(method, n, requested, want):
    m = methods.get(method) if method in methods.REGISTRY else _M(method)
    assert rope_scaling.plan(m, n, 2048, requested, reserve=512) == want


@pytest.mark.parametrize("method,n,requested,needle", [
    ("full", 7700, "auto", "--method sekv"),  # past 4x
    ("h2o", 1600, "none", "--rope-scaling auto"),
    ("full", 5000, "yarn:2", "YaRN x2"),
])
def test_plan_refuses_in_one_line(method, n, requested, needle):
    with pytest.raises(DocumentError) as e:
        rope_scaling.plan(methods.get(method), n, 2048, requested, reserve=512, what="doc.pdf")
    assert needle in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("doc.pdf")


@pytest.mark.parametrize("bad", ["yarn", "yarn:1", "yarn:0.5", "yarn:nan", "yarn:100", "linear:2", ""])
def test_parse_rejects(bad):
    with pytest.raises(SekvError, match="--rope-scaling"):
        rope_scaling.parse(bad)


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    p = tmp_path_factory.mktemp("doc") / "log.md"
    p.write_text(SAMPLE_MD.read_text()[:2200])
    return p


def test_sekv_rerotates_a_yarn_pack_as_the_model_rotates(lm, doc, tmp_path):
    pack = tmp_path / "y.sekv"
    ingest(doc, pack, lm=lm, method="sekv", rope_scaling="yarn:2")
    assert read_pack(pack).manifest["model"]["rope_scaling"] == {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8192}
    models.set_rope_scaling(lm, None)
    s = Session.open(pack, lm=lm)
    assert models.rope_factor(lm.config) == 2.0  # applied before the memory was opened
    res = s.memory.res
    assert res.pre_rope
    rot = lm.model.model.rotary_emb
    assert torch.equal(res.inv_freq, rot.inv_freq.float()) and res.rope_scaling == pytest.approx(rot.attention_scaling)
    pos = torch.arange(0, 16000, 37)
    k = torch.randn(1, 2, pos.numel(), 16)
    cos, sin = rot(k, pos.view(1, -1))
    _, want = mq.apply_rotary_pos_emb(k, k, cos, sin)
    torch.testing.assert_close(res.rotate(k[0], pos.view(1, -1).expand(2, -1)), want[0], atol=1e-5, rtol=1e-5)
    # and the native frequencies differ: the test would see a pack rotated natively
    assert not torch.allclose(rope.inv_freq_of(type(s.memory.shape).of(AutoConfig.from_pretrained(lm.path), torch.float32)), res.inv_freq)


def _plain_greedy(model_dir, ids, n, stop, **cfg):
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa", **cfg).eval()
    out = m.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=sorted(stop), pad_token_id=0)
    return [t for t in out[0, len(ids):].tolist() if t not in stop]


def test_pack_scaling_survives_write_and_read_and_is_applied_at_ask(lm, tiny_qwen, doc, tmp_path):
    pack = tmp_path / "f.sekv"
    ingest(doc, pack, lm=lm, method="full", rope_scaling="yarn:4")
    p = read_pack(pack)
    assert p.manifest["model"]["context_window"] == 4 * 8192
    q = "How many steps does the tower have?"
    s = Session.open(pack, lm=lm)
    models.set_rope_scaling(lm, None)  # another pack (or ingest) switched the shared model back meanwhile
    ans = s.ask(q, max_new_tokens=10)
    assert models.rope_factor(lm.config) == 4.0
    ids = p.token_ids + prompt.encode(lm.tokenizer, prompt.question_suffix(lm.tokenizer, q))
    want = _plain_greedy(tiny_qwen, ids, 10, s.stop_ids, rope_parameters=yarn(4.0, 8192))
    assert len(ans.token_ids) > 3 and ans.token_ids == want
    assert want != _plain_greedy(tiny_qwen, ids, 10, s.stop_ids)  # native RoPE answers otherwise: the test can fail
    # a native pack switches the model back
    ingest(doc, tmp_path / "n.sekv", lm=lm, method="full")
    assert read_pack(tmp_path / "n.sekv").manifest["model"]["rope_scaling"] is None
    Session.open(tmp_path / "n.sekv", lm=lm)
    assert models.rope_factor(lm.config) is None


@pytest.mark.parametrize("bad", [{"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 8192}, "yarn", 4,
                                 {"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 8192},
                                 {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096}])
def test_a_bad_rope_record_is_a_pack_error(lm, doc, tmp_path, bad):
    pack = tmp_path / "f.sekv"
    ingest(doc, pack, lm=lm, method="full")
    p = read_pack(pack)
    manifest = copy.deepcopy(p.manifest)
    tensors = {k: p.get(k).clone() for k in p.keys()}
    p.close()
    for k in ("magic", "format_version", "tensors", "created", "method", "method_params"):
        manifest.pop(k, None)
    manifest["model"]["rope_scaling"] = bad
    write_pack(pack, manifest | {"method": "full", "method_params": {}}, tensors)
    with pytest.raises(PackError, match="rope_scaling|window"):
        Session.open(pack, lm=lm)


def test_auto_scales_full_past_the_window_and_refuses_past_4x(tmp_path):
    lm = models.load(str(make_tiny_model(tmp_path / "m", "qwen2", max_positions=512)), device="cpu", dtype=torch.float32)
    doc = tmp_path / "d.md"
    doc.write_text(SAMPLE_MD.read_text()[:1500])  # ~600 tokens + 512 reserved: x3 of 512
    r = ingest(doc, tmp_path / "f.sekv", lm=lm, method="full")
    rec = read_pack(r.pack_path).manifest["model"]["rope_scaling"]
    assert rec["factor"] == float(-(-(r.n_tokens + 512) // 512)) and models.context_window(lm.config) == 512 * rec["factor"]
    assert Session.open(r.pack_path, lm=lm).ask("How many steps?", max_new_tokens=4).stats.generated_tokens > 0
    assert ingest(doc, tmp_path / "s.sekv", lm=lm, method="rag").n_tokens == r.n_tokens
    assert read_pack(tmp_path / "s.sekv").manifest["model"]["rope_scaling"] is None  # rag: native, whatever was before
    doc.write_text(SAMPLE_MD.read_text())
    with pytest.raises(DocumentError, match="--method sekv"):
        ingest(doc, tmp_path / "g.sekv", lm=lm, method="full")
    assert not (tmp_path / "g.sekv").exists()


def test_cli_option_and_inspect(tiny_qwen, doc, tmp_path):
    from sekv_cli.app import app

    runner = CliRunner()
    pack = tmp_path / "c.sekv"
    r = runner.invoke(app, ["ingest", str(doc), "-o", str(pack), "--model", str(tiny_qwen), "--method", "full", "--rope-scaling", "yarn:2", "-q"])
    assert r.exit_code == 0, r.stderr
    r = runner.invoke(app, ["inspect", str(pack)])
    assert r.exit_code == 0 and "YaRN x2 over the native 8192 tokens" in r.stdout
    r = runner.invoke(app, ["inspect", str(pack), "--json"])
    assert json.loads(r.stdout)["model"]["rope_scaling"]["factor"] == 2.0
    r = runner.invoke(app, ["ingest", str(doc), "-o", str(tmp_path / "d.sekv"), "--model", str(tiny_qwen), "--rope-scaling", "yarn:x"])
    assert r.exit_code != 0 and r.stderr.strip().startswith("sekv: error: --rope-scaling") and len(r.stderr.strip().splitlines()) == 1
