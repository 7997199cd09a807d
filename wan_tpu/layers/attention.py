"""`wan_tpu.attention` (defined here): one entry point for every attention kernel, layout (B, S, H, D).

Softmax scale is 1/sqrt(D), non-causal, any Sq, Skv ≥ 1. Kernels:

- `"reference"`: plain XLA, logits and softmax in float32; runs everywhere.
- `"splash_exp2"`: our TPU Pallas kernel (`wan_tpu/kernels/splash_exp2.py`); `interpret=True` runs it on
  CPU (slowly, for tests).
- `"pallas_gpu"`: our GPU Pallas kernel (`wan_tpu/kernels/flash_gpu.py`): the Hopper kernel for bf16/fp16
  with D % 64 == 0, the Triton fallback otherwise; `interpret=True` runs the latter on CPU.
- `"pallas_gpu_fp8"`: the Hopper kernel on the 8-bit tensor cores (`flash_mgpu.mgpu_attention_fp8`:
  int8 Q·Kᵀ, e4m3 P·V, scaled, each step's P·V summed in float32, FA3's turn hand-over). On an
  H200: 1.48-1.53× jax cuDNN, at 4.0e-2 relative error per call on random inputs where bf16 has
  2.3e-3; the 1.3B forward is 0.84-0.85× as long and moves by 8.4e-3 (14B: 0.82×, 1.3e-2; random
  weights). Opt-in, never picked by `impl=None`: it trades accuracy for speed.
  Self-attention only: cross-attention calls (short key sets) take `impl=None`'s bf16 choice.
  Needs a Hopper GPU and D % 128 == 0.
- `"cudnn"`: `jax.nn.dot_product_attention(implementation="cudnn")`: bf16/fp16 only (float32 is
  refused, not silently cast), head dim a multiple of 8 up to 256 (128 before Hopper); inference
  has no sequence-length constraint.

`block_sizes` (keys block_q, block_kv, block_kv_compute, block_kv_compute_in; missing keys take the
tuned defaults of `wan_tpu/kernels/tuning.py`, unknown keys are an error) tunes the Pallas kernels; the GPU
kernels read only block_q and block_kv.

`kv_len` ((B,) integers ≥ 1, optional): row b attends only to keys [0, kv_len[b]) (UniFoLM's block-causal
action tokens). Only `"reference"` and `"cudnn"` (its padding mask, `key_value_seq_lengths`) take it;
`impl=None` then picks cuDNN for bf16/fp16 on a GPU, so the masked logits are never materialised there,
else the reference.

`impl=None` picks by backend: TPU → splash_exp2; Hopper GPU → the faster of pallas_gpu and cuDNN
for the shape class, as measured (`wan_tpu/kernels/tuning.py`: ours for self-attention and, since FA3's
intra-warpgroup overlap, for a video's cross-attention to a short context; cuDNN where both
sequences are short), other GPUs → cuDNN, float32 on GPU → reference; CPU → reference. The
environment variable `WAN_TPU_ATTENTION` names an impl that `impl=None` uses instead.

A named impl is honoured as given while tracing (inside `jax.jit` or `jax.export` for another
platform, e.g. exporting `splash_exp2` for TPU from a CPU host): the backend is checked only when
the call runs eagerly, on concrete arrays, or when `impl=None` has to choose.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp

from wan_tpu.errors import WanInputError
from wan_tpu.kernels.tuning import GPU_FASTEST, check_block_keys, gpu_shape_class

_HALF = (jnp.bfloat16, jnp.float16)


def reference_attention(q, k, v, kv_len=None, *, scale: float | None = None, bias=None, key_mask=None,
                        causal: bool = False):
    """Plain XLA attention; logits and softmax in float32 whatever the input dtype. Products at
    HIGHEST precision: this is the yardstick, so float32 must not become TF32 on a GPU.

    `kv_len` (optional, (B,) integers ≥ 1): row b attends only to keys [0, kv_len[b]) (UniFoLM's
    block-causal action tokens); the kernels of `attention` take no mask, so masked calls come here.
    `scale` (default 1/sqrt(D)), `bias` (added to the logits, broadcast to (B, H, Sq, Skv)) and
    `key_mask` ((B, Skv) booleans, False: never attended) serve T5-style attention (UMT5: scale 1,
    a relative-position bias, the padding mask); every row must keep at least one key.
    `causal`: query i attends only to keys [0, i] (CLIP's text tower; Sq == Skv).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    highest = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=highest, preferred_element_type=jnp.float32) * scale
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if kv_len is not None:
        key_mask = jnp.arange(k.shape[1])[None, :] < kv_len[:, None]
    if key_mask is not None:
        logits = jnp.where(key_mask[:, None, None, :], logits, -jnp.inf)
    if causal:
        logits = jnp.where(jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool)), logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v, precision=highest, preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


def cudnn_attention(q, k, v, kv_len=None):
    if q.dtype not in _HALF:
        raise WanInputError(f"cudnn attention needs bfloat16 or float16 inputs, got {q.dtype}; cast first or use impl='reference'")
    if kv_len is not None:
        kv_len = jnp.broadcast_to(jnp.asarray(kv_len, jnp.int32), (q.shape[0],))
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=kv_len, implementation="cudnn")


def _splash_exp2(q, k, v, block_sizes, interpret):
    from wan_tpu.kernels.splash_exp2 import splash_exp2_attention

    return splash_exp2_attention(q, k, v, block_sizes=block_sizes, interpret=interpret)


def _pallas_gpu(q, k, v, block_sizes, interpret):
    from wan_tpu.kernels.flash_gpu import flash_attention

    return flash_attention(q, k, v, block_sizes=block_sizes, interpret=interpret)


def _pallas_gpu_fp8(q, k, v, block_sizes, interpret):
    from wan_tpu.kernels.flash_gpu import flash_attention_fp8

    shape_class = gpu_shape_class(q.shape[1], k.shape[1])
    if shape_class != "self":  # a short context: the measured bf16 choice
        return _IMPLS[GPU_FASTEST[shape_class]][0](q, k, v, block_sizes, interpret)
    return flash_attention_fp8(q, k, v, block_sizes=block_sizes)


# name → (function of (q, k, v, block_sizes, interpret), backends it runs on without interpret).
_IMPLS = {
    "reference": (lambda q, k, v, bs, interpret: reference_attention(q, k, v), ("cpu", "gpu", "tpu")),
    "splash_exp2": (_splash_exp2, ("tpu",)),
    "pallas_gpu": (_pallas_gpu, ("gpu",)),
    "pallas_gpu_fp8": (_pallas_gpu_fp8, ("gpu",)),
    "cudnn": (lambda q, k, v, bs, interpret: cudnn_attention(q, k, v), ("gpu",)),
}
# The impls that hold a (Sq, Skv) logits array in memory (`wan_tpu.runtime.memory` budgets it); every other
# one is a flash kernel, so a new kernel is budgeted right without being listed anywhere else.
MATERIALISES_LOGITS = ("reference",)
# Pallas interpret mode runs these on any backend.
_INTERPRETABLE = ("splash_exp2", "pallas_gpu")
# The impls that take `kv_len`, each called as fn(q, k, v, kv_len).
_MASKED = {"reference": reference_attention, "cudnn": cudnn_attention}


def runnable_impls(backend: str, interpret: bool = False) -> list[str]:
    return [name for name, (_, backends) in _IMPLS.items() if backend in backends or (interpret and name in _INTERPRETABLE)]


def _default_impl(q, k, backend: str) -> str:
    override = os.environ.get("WAN_TPU_ATTENTION")
    if override:
        return override
    if backend == "tpu":
        return "splash_exp2"
    if backend == "gpu" and q.dtype in _HALF and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256:
        from wan_tpu.kernels.flash_gpu import is_hopper

        # The Hopper kernel needs D % 64 == 0; elsewhere ours is the Triton fallback, slower than cuDNN.
        ours = is_hopper() and q.shape[-1] % 64 == 0
        return GPU_FASTEST[gpu_shape_class(q.shape[1], k.shape[1])] if ours else "cudnn"
    return "reference"


def _backend_of(x) -> str | None:
    """Platform the concrete array `x` lives on; None while tracing."""
    if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
        return None
    return next(iter(x.devices())).platform


def attention(q, k, v, impl=None, interpret=False, block_sizes=None, kv_len=None):
    """Attention over (B, S, H, D) inputs; returns (B, Sq, H, D) in q's dtype."""
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or (q.shape[0], q.shape[2:]) != (k.shape[0], k.shape[2:]):
        raise WanInputError(f"q {q.shape}, k {k.shape}, v {v.shape} must be (B, S, H, D) with equal B, H, D")
    if q.shape[1] < 1 or k.shape[1] < 1:
        raise WanInputError(f"sequence lengths must be ≥ 1, got Sq={q.shape[1]}, Skv={k.shape[1]}")
    check_block_keys(block_sizes)
    backend = _backend_of(q)
    if kv_len is not None:
        return _masked(q, k, v, impl, backend, kv_len)
    if impl is None:
        backend = backend or jax.default_backend()
        impl = _default_impl(q, k, backend)
    if impl not in _IMPLS or (backend is not None and impl not in runnable_impls(backend, interpret)):
        where = backend or jax.default_backend()
        raise WanInputError(
            f"attention impl {impl!r} {'is unknown' if impl not in _IMPLS else 'cannot run here'}; on {where} "
            f"(interpret={interpret}) choose one of {runnable_impls(where, interpret)}; "
            f"interpret=True adds {list(_INTERPRETABLE)}"
        )
    fn, _ = _IMPLS[impl]
    return fn(q, k, v, block_sizes, interpret)


def _masked(q, k, v, impl, backend, kv_len):
    """`attention` with `kv_len`: cuDNN's padding mask for half precision on a GPU, else the reference."""
    if impl is None:
        where = backend or jax.default_backend()
        chosen = os.environ.get("WAN_TPU_ATTENTION")
        cudnn_fits = where == "gpu" and q.dtype in _HALF and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
        impl = chosen if chosen in _MASKED else "cudnn" if cudnn_fits else "reference"
    if impl not in _MASKED:
        raise WanInputError(f"attention impl {impl!r} takes no kv_len (a key mask); use one of {sorted(_MASKED)} or impl=None")
    if backend is not None and impl not in runnable_impls(backend):
        raise WanInputError(f"attention impl {impl!r} cannot run on {backend}; choose one of "
                            f"{[n for n in runnable_impls(backend) if n in _MASKED]} for a kv_len")
    return _MASKED[impl](q, k, v, kv_len)
