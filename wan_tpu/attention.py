"""`wan_tpu.attention`: one entry point for every attention kernel, layout (B, S, H, D).

Softmax scale is 1/sqrt(D). `impl=None` picks the fastest correct kernel for the backend; a named
`impl` is honoured even when exporting for another platform (the backend check happens only for
`impl=None`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def reference_attention(q, k, v):
    """Plain XLA attention; logits and softmax in float32 whatever the input dtype."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    p = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


def cudnn_attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")


_IMPLS = {"reference": reference_attention, "cudnn": cudnn_attention}


def attention(q, k, v, impl=None, interpret=False, block_sizes=None):
    if impl is None:
        impl = "cudnn" if jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16) else "reference"
    if impl not in _IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {sorted(_IMPLS)}")
    return _IMPLS[impl](q, k, v)
