"""Prefill once: run the document's tokens through the model in chunks.

Produces the full KV cache (post-RoPE keys, values) and, when a cache method
asks for it, the surprisal s_t = -log p(x_t | x_<t) of every token, read from the
same forward's logits (the LM head is applied in row blocks so the
[N, vocab] logits never exist at once).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable, Sequence

import torch

from . import runtime
from .methods.base import GrowingKV, ModelShape, PrefillResult
from .methods.full import FullMemory

DEFAULT_CHUNK = 1024
#: the chunk on a GPU: a small model's forward is bound by its kernel launches, not its arithmetic (qwen2.5-0.5b on
#: the H200: ~35 ms per 1,024-token forward, docs/gpu.md), so fewer, longer chunks; its memory is a chunk's
#: activations (an 8B model's MLP: ~0.4 GB at 4,096 tokens; attention is the fused kernels', no [q, T] scores and
#: attn_mass is accumulated in blocks of its own) and not the LM head's logits (_HEAD_BLOCK_CUDA rows at a time)
CUDA_CHUNK = 4096
_HEAD_BLOCK = 256
_HEAD_BLOCK_CUDA = 2048  # rows of float32 logits at once on a GPU (1 GB at a 128K vocabulary)


#: measurement knob: the prefill's chunk when the caller gives none, whatever the device (benchmarks/gpu_cli.py runs
#: `sekv ingest` under it to compare chunk sizes with a plain prefill's one forward)
CHUNK_ENV = "SEKV_PREFILL_CHUNK"


#: on a GPU the whole document is one forward when its activations take at most this share of the device memory
#: left after its KV (:func:`whole_fits`): the attention is then the fused kernels' square causal call, the one a plain
#: transformers prefill makes; a chunk after earlier tokens takes the bottom-right causal mask, which torch serves
#: with the flash kernel alone (torch.nn.attention.bias), and an 8B prefill of 128K tokens in 4,096-token chunks took
#: 21.7 s through `sekv ingest` where one forward of sekv's prefill took 12.1 s (docs/gpu.md)
WHOLE_SHARE = 0.5


def default_chunk(device: torch.device, n_tokens: int = 0, fits=None) -> int:
    """The prefill's chunk (tokens a forward) on ``device`` when the caller gives none: $SEKV_PREFILL_CHUNK when set;
    on a GPU the whole document (``n_tokens``) when ``fits(n_tokens)`` says its forward fits (:func:`whole_fits`),
    else CUDA_CHUNK; DEFAULT_CHUNK on the CPU."""
    env = int(os.environ.get(CHUNK_ENV) or 0)
    if env > 0:
        return env
    if device.type != "cuda":
        return DEFAULT_CHUNK
    if n_tokens > CUDA_CHUNK and fits is not None and fits(n_tokens):
        return n_tokens
    return CUDA_CHUNK


def activation_bytes(config, shape: ModelShape, n_tokens: int) -> int:
    """An upper estimate of one forward's transient device memory for n_tokens: a decoder layer's activations (the
    MLP's gate, up and their product, the residual stream, norms, the attention's q / k / v / output in the model's
    dtype) and the pipelined stream's float32 work on one layer's new rows (sekv/zoom_tier.py TierStream)."""
    isz = torch.empty(0, dtype=shape.dtype).element_size()
    hidden = int(getattr(config, "hidden_size", shape.n_heads * shape.head_dim))
    inter = int(getattr(config, "intermediate_size", 4 * hidden) or 4 * hidden)
    per_token = isz * (4 * inter + 8 * hidden + 2 * (shape.n_heads + 2 * shape.n_kv_heads) * shape.head_dim)
    per_token += 4 * 6 * shape.n_kv_heads * shape.head_dim
    return int(n_tokens) * per_token


def whole_fits(model, shape: ModelShape, device: torch.device):
    """fits(n) for :func:`default_chunk`: one forward of n tokens takes at most WHOLE_SHARE of the device's free
    memory (torch's cached blocks counted free), read when called (after the KV's allocation)."""

    def fits(n: int) -> bool:
        if device.type != "cuda":
            return False
        free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return activation_bytes(model.config, shape, n) <= WHOLE_SHARE * free

    return fits


def prefill(
    model,
    token_ids: torch.Tensor,
    *,
    with_surprisal: bool,
    chunk: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    capture: Sequence[str] = (),
    obs_window: int = 64,
    offload_kv: bool | None = None,
    on_rows: Callable[[int, int, int, Callable], None] | None = None,
) -> PrefillResult:
    """capture: prefill statistics to record into PrefillResult.scores (see sekv_core.methods.scores).  offload_kv:
    keep the KV in host memory, chunk by chunk (sekv_core/kv_offload.py); None: when it would not fit the GPU.
    chunk: tokens a forward (None: :func:`default_chunk`: on a GPU the whole document when it fits); the outputs do
    not depend on it beyond rounding.  on_rows(layer, a, b, rows): called inside the forward as soon as a layer has
    appended tokens [a, b), when their KV in that layer is final (causal attention; each layer's calls in token
    order); ``rows()`` -> their (post-RoPE keys, values) [Hkv, b - a, d] (the pipelined ingest's work that needs only
    those rows, sekv_core/chunk_stream.py: it runs while the later layers and chunks compute).  ``progress(done,
    total)`` is called as each layer of a chunk completes (done: the chunk's tokens pro rata of its layers)."""
    from . import kv_offload, placement

    device = placement.input_device(model)
    devices = placement.layer_devices(model)  # each layer's KV where the layer computes
    ids = token_ids.to(device).view(1, -1)
    n = ids.shape[1]
    shape = ModelShape.of(model.config, next(model.parameters()).dtype)
    if offload_kv is None:
        offload_kv = not kv_offload.kv_fits(shape, n, devices)
    if offload_kv:
        kv = kv_offload.HostKV(shape.n_layers, shape.n_kv_heads, shape.head_dim, shape.dtype, devices, max(n, 1))
        chunk = chunk or default_chunk(device)
        if device.type != "cpu":
            chunk = max(chunk, kv_offload.OFFLOAD_CHUNK)
    else:
        kv = GrowingKV(shape.n_layers, shape.n_kv_heads, shape.head_dim, shape.dtype, devices, max(n, 1))
        # one forward: not for a model across devices, nor under the attention-mass statistic (its scores would span
        # every key for every query instead of the keys so far: twice the work of chunks)
        whole = all(d == device for d in devices) and "attn_mass" not in capture
        chunk = chunk or default_chunk(device, n, whole_fits(model, shape, device) if whole else None)
    if capture:
        from .methods.scores import ScoreMemory

        memory = ScoreMemory(kv, shape, n, capture, obs_window)
    else:
        memory = FullMemory(kv, shape)
    memory.layer_devices = devices
    tap = _LayerTap(memory, on_rows, progress, n, offload_kv, device) if on_rows is not None or progress is not None else memory
    head = model.get_output_embeddings()
    surprisal = torch.zeros(n, dtype=torch.float32, device=device)  # to the host once, at the end: no sync per block
    block = _HEAD_BLOCK_CUDA if device.type == "cuda" else _HEAD_BLOCK
    for start in range(0, n, chunk):
        piece = ids[:, start : start + chunk]
        hidden = runtime.forward_hidden(model, piece, start, tap)[0]
        if with_surprisal:
            # logits at position t predict token t+1; -log p = logsumexp(logits) - logit of the target
            targets = ids[0, start + 1 : start + piece.shape[1] + 1]
            with torch.inference_mode():
                for b in range(0, targets.numel(), block):
                    tgt = targets[b : b + block]
                    logits = head(hidden[b : b + tgt.numel()]).float()
                    s = logits.logsumexp(-1) - logits.gather(1, tgt.view(-1, 1)).squeeze(1)
                    surprisal[start + 1 + b : start + 1 + b + tgt.numel()] = s
    surprisal = surprisal.cpu()
    if offload_kv:  # host buffers, read by compress() a layer at a time on the input device
        keys, values = kv.layers(n, device)
    else:
        keys = [memory.kv.k[i][0, :, :n] for i in range(shape.n_layers)]
        values = [memory.kv.v[i][0, :, :n] for i in range(shape.n_layers)]
        if any(d != device for d in devices):  # a model across devices: compress() reads each layer on the input device
            keys, values = kv_offload.LayersOn(keys, [device] * len(keys)), kv_offload.LayersOn(values, [device] * len(values))
    scores = memory.export() if capture else {}
    return PrefillResult(ids[0].cpu(), keys, values, surprisal if with_surprisal else None, shape, scores=scores,
                         model_fingerprint=str(getattr(model, "sekv_fingerprint", "")), model_id=str(getattr(model, "sekv_model_id", "")), model=model)


class _LayerTap:
    """The prefill's memory as the model's attention sees it (runtime.Memory): each layer's new tokens attended and
    appended by ``memory``, then handed to ``on_rows(layer, a, b, rows)`` while the forward goes on to the next layer
    (their KV is final: causal attention), and the progress counted a layer at a time."""

    def __init__(self, memory, on_rows, progress, n: int, offloaded: bool, device: torch.device):
        self.memory, self.on_rows, self.progress, self.n = memory, on_rows, progress, n
        self.offloaded, self.device = offloaded, device
        self.layer_devices = memory.layer_devices
        self.n_layers = len(memory.kv.len)

    def attend(self, layer, query, key, value, scaling):
        a = self.memory.kv.len[layer]
        out = self.memory.attend(layer, query, key, value, scaling)
        b = a + key.shape[-2]
        if self.on_rows is not None:
            self.on_rows(layer, a, b, lambda: _rows(self.memory.kv, layer, a, b, self.offloaded, self.device))
        if self.progress is not None:
            self.progress(a + (b - a) * (layer + 1) // self.n_layers, self.n)
        return out


def _rows(kv, li: int, a: int, b: int, offloaded: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer li's keys and values of tokens [a, b) as the prefill holds them: [Hkv, b - a, d] (views; offloaded:
    copied to ``device``, where compress would read them)."""
    if offloaded:  # kv_offload.HostKV: token-major host buffers
        return kv.hk[li][a:b].to(device).transpose(0, 1), kv.hv[li][a:b].to(device).transpose(0, 1)
    return kv.k[li][0, :, a:b], kv.v[li][0, :, a:b]


def prefill_window(
    model,
    ids: list[int],
    header_len: int,
    window,
    *,
    with_surprisal: bool,
    chunk: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    capture: Sequence[str] = (),
    obs_window: int = 64,
    offload_kv: bool | None = None,
    on_rows: Callable[[int, int, int, Callable], None] | None = None,
) -> PrefillResult:
    """One window of a windowed ingest (sekv_core/windows.py): its header, carried context and own part prefilled at
    native positions; returned is its own part only, at global positions (keys and recorded queries re-rotated by
    the window's offset; PrefillResult.start, .doc_tokens set).  progress(done, total) counts its own part's tokens."""
    from .kv_offload import LayersOn
    from .windows import shift

    local = window.local_ids(ids, header_len)
    drop = len(local) - window.n

    def own(done: int, total: int) -> None:
        progress(max(0, done - drop), window.n)

    delta = window.offset
    inv = None
    if delta:
        from .sekv import rope

        inv = rope.inv_freq_of(ModelShape.of(model.config, next(model.parameters()).dtype))
        if inv is None:
            raise ValueError("the model's rotary embedding is not static (dynamic / partial RoPE): its windows cannot be re-positioned")
    own_rows = None
    if on_rows is not None:

        def own_rows(li: int, a: int, b: int, rows) -> None:  # its own part's tokens, as the keys kept below
            a0 = max(a, drop)
            if b <= a0:
                return

            def kept():
                k, v = rows()
                k, v = k[:, a0 - a :], v[:, a0 - a :]
                return (shift(k, delta, inv) if delta else k), v

            on_rows(li, a0 - drop + window.start, b - drop + window.start, kept)

    r = prefill(model, torch.tensor(local), with_surprisal=with_surprisal, chunk=chunk, progress=own if progress else None,
                capture=capture, obs_window=min(obs_window, window.n), offload_kv=offload_kv, on_rows=own_rows)
    if isinstance(r.keys, LayersOn):  # offloaded: stays on the host, each layer re-positioned when it is read
        keys = r.keys.map(lambda k: shift(k[:, drop:], delta, inv) if delta else k[:, drop:])
        values = r.values.map(lambda v: v[:, drop:])
    else:
        keys = [shift(k[:, drop:], delta, inv) for k in r.keys] if delta else [k[:, drop:] for k in r.keys]
        values = [v[:, drop:] for v in r.values]
    scores = dict(r.scores)
    if delta and scores.get("obs_queries") is not None:  # the queries meet the keys in the same frame
        scores["obs_queries"] = [shift(q, delta, inv) for q in scores["obs_queries"]]
    if scores.get("attn_mass") is not None:
        scores["attn_mass"] = [m[:, drop:] for m in scores["attn_mass"]]
    surprisal = r.surprisal[drop:] if r.surprisal is not None else None
    return PrefillResult(r.token_ids[drop:], keys, values, surprisal, r.shape, scores=scores, model_fingerprint=r.model_fingerprint,
                         model_id=r.model_id, model=r.model, start=window.start, doc_tokens=len(ids))


#: tokens of the warm-up forward (:class:`WarmUp`): the surprisal's LM head block, so its shapes are the prefill's
WARM_TOKENS = _HEAD_BLOCK_CUDA
#: "0": no warm-up before `sekv ingest`'s prefill (comparisons)
WARM_ENV = "SEKV_INGEST_WARM"


class WarmUp:
    """A short forward of the model on a GPU, on a thread of its own, while the caller does the CPU's work (reading
    and tokenizing the document): the first forward of a process loads its kernels and makes the libraries' handles,
    which otherwise the document's prefill waits for.  Its results are dropped; it holds no state of the prefill.
    Nothing is done on a CPU, for a model across devices or with $SEKV_INGEST_WARM=0; a failure (out of memory) is
    ignored: :meth:`join` only waits.  ``on``: the device types it warms (tests: the CPU's)."""

    def __init__(self, model, on: tuple[str, ...] = ("cuda",)):
        from . import placement

        self.thread = None
        if model is None or os.environ.get(WARM_ENV, "1") == "0":
            return
        devices = set(placement.layer_devices(model))
        device = placement.input_device(model)
        if device.type not in on or len(devices) > 1:
            return
        self.thread = threading.Thread(target=self._run, args=(model, device), name="sekv-warm-up", daemon=True)
        self.thread.start()

    @staticmethod
    def _run(model, device) -> None:
        cuda = device.type == "cuda"
        try:
            with torch.cuda.device(device) if cuda else contextlib.nullcontext():
                prefill(model, torch.zeros(WARM_TOKENS, dtype=torch.long), with_surprisal=True, chunk=WARM_TOKENS, offload_kv=False)
                if cuda:
                    torch.cuda.synchronize(device)
        except Exception:  # noqa: BLE001 - a warm-up: the prefill itself reports what is wrong
            pass

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
