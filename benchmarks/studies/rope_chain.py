"""How exact a re-positioned key is in the model's dtype: the keys of real text through the path a windowed pack's
key takes to its slot, against RoPE at the slot computed in float64 from the same pre-RoPE key.

The path (sekv_core/windows.py, sekv/residents.py): the model rotates the key at its position in its window (cos / sin
in float32, cast to its dtype, products in it), ``windows.shift`` moves it to its document position, the pack keeps
it in the model's dtype, ``Residents.reposition`` de-rotates it there and ``Residents.base_keys`` rotates it to its
slot.  The same key rotated by the model at the slot ("native") is the yardstick: the rounding every key has anyway.
Per layer and (window position, document position, slot): the worst relative error of a key, and the worst error of
an attention logit q.k / sqrt(d) of the text's last query (rotated exactly, just after the slots).

    python -m benchmarks.studies.rope_chain --dtype bfloat16
"""

from __future__ import annotations

import argparse
import glob

import torch

from sekv_core import models, windows
from sekv_core.sekv import rope

CASES = [(100, 100, 26_000), (100, 8_100, 26_000), (100, 30_100, 26_000), (16_000, 16_000, 27_000), (17_000, 49_000, 30_000),
         (800, 32_800, 29_000), (30_000, 61_000, 28_000)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", default="0,6,12,23")
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--haystack", default="/work/shared/data/haystack/pg_essays")
    a = ap.parse_args()
    dt = getattr(torch, a.dtype)
    lm = models.load(a.model, device="cpu", dtype=dt)
    m = lm.model
    m.set_attn_implementation("sdpa")  # plain transformers: only the projections are read
    text = open(sorted(glob.glob(f"{a.haystack}/*"))[0]).read()[:20_000]
    ids = lm.tokenizer(text, return_tensors="pt").input_ids[:, : a.tokens]
    layers = [int(x) for x in a.layers.split(",")]
    pre, qs = {}, {}
    for i in layers:
        att = m.model.layers[i].self_attn
        att.k_proj.register_forward_hook(lambda mod, inp, out, i=i: pre.__setitem__(i, out))
        att.q_proj.register_forward_hook(lambda mod, inp, out, i=i: qs.__setitem__(i, out))
    with torch.inference_mode():
        m.get_decoder()(input_ids=ids)
    inv = m.model.rotary_emb.inv_freq.float().cpu()
    d = m.config.hidden_size // m.config.num_attention_heads
    n = ids.shape[1]

    def exact(x, pos):
        ang = pos.double().view(-1, 1) * inv.double().view(1, -1)
        emb = torch.cat([ang, ang], -1)
        return x.double() * emb.cos() + rope.rotate_half(x.double()) * emb.sin()

    def native(x, pos):
        c, s = rope.cos_sin(pos, inv)
        return x * c.to(dt) + rope.rotate_half(x) * s.to(dt)

    print(f"{a.model} {a.dtype}: worst relative key error and worst logit error, re-positioned (chain) / the model at the slot (native)")
    for li in layers:
        k = pre[li][0].view(n, -1, d).transpose(0, 1)  # [Hkv, n, d]
        q = qs[li][0].view(n, -1, d)[-1]  # the last token's queries [H, d]
        hkv = k.shape[0]
        for local, doc, slot in CASES:
            lp, dp, sp = torch.arange(n) + local, torch.arange(n) + doc, torch.arange(n) + slot
            stored = windows.shift(native(k, lp), doc - local, inv).to(dt)
            c, s = rope.cos_sin(dp, inv, 1.0, dtype=dt)
            base = rope.undo(stored.float(), c, s).to(dt)
            chain = rope.rotate(base, sp.expand(hkv, -1), inv, 1.0, dt).to(dt)
            ref, nat = exact(k, sp), native(k, sp)
            qr = exact(q, torch.tensor([slot + n])).view(hkv, -1, d)

            def key_err(x):
                return float(((x.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max())

            def logit_err(x):
                return float(((qr @ (x.double() - ref).transpose(1, 2)) * d**-0.5).abs().max())

            top = float(((qr @ ref.transpose(1, 2)) * d**-0.5).abs().max())
            print(f"layer {li:2d} window position {local:6d} document {doc:6d} slot {slot:6d}: key {key_err(chain):.4f} / {key_err(nat):.4f}"
                  f"   logit {logit_err(chain):.3f} / {logit_err(nat):.3f} (largest logit {top:.1f})")


if __name__ == "__main__":
    main()
