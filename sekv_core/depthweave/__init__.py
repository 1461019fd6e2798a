"""DepthWeave-KV stages (the `depthweave` cache method, sekv_core/methods/depthweave.py).

factorize.py   depth windows, randomised-sketch bases, per-layer residual bases, residual gate
quantize.py    8-bit block / 4-bit group absmax quantisers and their error bounds
router.py      router features, scores, rank levels, budget solve
probe.py       attention-output probes and the threshold controller
codec.py       pack layout (Spec, encode), resident residual pools, byte accounting
attention.py   the PyTorch attention path (chunked reconstruction + partial softmax)
kernel_triton.py  the fused CUDA kernel (imported on CUDA devices only)
memory.py      the runtime KVMemory
"""
