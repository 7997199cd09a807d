"""torchax glue: the import shim for torch 2.13 and the SDPA → `wan_tpu.attention` swap.

Every use of torchax in wan_tpu goes through `import_torchax()` / `default_env()` from here.

Why a shim: torchax 0.0.13 names aten named-tensor overloads (`aten.prod.dim_Dimname`,
`aten.norm.names_out`, ...) in its autocast table (read at `import torchax`) and its decomposition
list (read when the first `torchax.default_env()` is built). torch 2.13 removed those overloads, so
the look-ups raise `AttributeError`. torchax never executes them (no named tensors reach it), so
during those two moments only, a failed look-up of such a name returns an inert placeholder that
no real operator ever equals. Where the overloads exist (torch ≤ 2.12) the original look-up succeeds
and the shim changes nothing.

Why the SDPA swap: torch modules run through torchax (diffusers' Wan, transformers' UMT5 and CLIP)
call `F.scaled_dot_product_attention`; torchax lowers it to a plain matmul/softmax. Plain calls
(no mask, no dropout, not causal, default scale) go to `wan_tpu.attention` instead, so they use the
same kernels as our Flax DiT; every other call keeps torch's exact semantics.
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch

import wan_tpu.layers.attention as attention_module
from wan_tpu.errors import WanInputError

_NAMED_TENSOR_MARKERS = ("dimname", "Dimname", "names")
_shim_lock = threading.Lock()
_placeholders: dict[tuple[str, str], _MissingOverload] = {}
_env = None


class _MissingOverload:
    """Stands in for an overload this torch does not have; hashable by identity, never called."""

    def __init__(self, qualified_name: str):
        self.qualified_name = qualified_name

    def __repr__(self):
        return f"<missing overload {self.qualified_name}>"


@contextlib.contextmanager
def _tolerate_missing_named_tensor_overloads():
    """Inside: a failed look-up of a named-tensor overload returns a placeholder instead of raising."""
    packet_cls = torch._ops.OpOverloadPacket
    original = packet_cls.__getattr__

    def lookup(self, key):
        try:
            return original(self, key)
        except AttributeError:
            if not any(marker in key for marker in _NAMED_TENSOR_MARKERS):
                raise
            name = (self._qualified_op_name, key)
            if name not in _placeholders:
                _placeholders[name] = _MissingOverload(f"{self._qualified_op_name}.{key}")
            return _placeholders[name]

    with _shim_lock:
        packet_cls.__getattr__ = lookup
        try:
            yield
        finally:
            packet_cls.__getattr__ = original


def import_torchax():
    """`import torchax`, tolerating the named-tensor overloads torch 2.13 removed."""
    with _tolerate_missing_named_tensor_overloads():
        import torchax
    return torchax


def default_env():
    """`torchax.default_env()`, built under the shim, with the SDPA swap registered once."""
    global _env
    if _env is None:
        torchax = import_torchax()
        with _tolerate_missing_named_tensor_overloads():
            env = torchax.default_env()
        _register_sdpa(env)
        _env = env
    return _env


def torch_dtype(dtype) -> torch.dtype:
    """The torch dtype for a jax dtype (the model dtypes we load: float32, bfloat16)."""
    dtypes = {jnp.dtype(jnp.float32): torch.float32, jnp.dtype(jnp.bfloat16): torch.bfloat16}
    if jnp.dtype(dtype) not in dtypes:
        raise WanInputError(f"dtype {jnp.dtype(dtype).name} is not supported here; use jnp.float32 or jnp.bfloat16")
    return dtypes[jnp.dtype(dtype)]


def module_state(module: torch.nn.Module, mesh=None, family: str | None = None) -> dict[str, jax.Array]:
    """The module's parameters and buffers as jax arrays, under every torch name they have.

    Without a mesh they land on the default device; with one, each is placed as sharding rule
    table `family` (`"umt5"`, `"clip"`) says. A tied weight (UMT5's `shared` and
    `encoder.embed_tokens`) is placed once and listed under each name. The torch copies are released
    afterwards (the module moves to the meta device, which unties it, hence every name): from here
    on the module is only a program, run with `functional_call`.
    """
    if mesh is None:
        place = lambda name, array: jnp.asarray(array)  # noqa: E731
    elif family is None:
        raise ValueError("module_state: placing on a mesh needs the sharding rule table `family`")
    else:
        from wan_tpu.parallel.sharding import place_param

        place = lambda name, array: place_param(mesh, family, name, array)  # noqa: E731
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    placed = {}
    for name, tensor in named:
        if id(tensor) not in placed:
            placed[id(tensor)] = place(name, _to_numpy(tensor))
    state = {name: placed[id(tensor)] for name, tensor in named}
    module.to("meta")
    return state


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16; reinterpret the bits
        return tensor.view(torch.int16).numpy().view(jnp.bfloat16)
    return tensor.numpy()


def functional_call(module: torch.nn.Module, state, args=(), kwargs=None, output=lambda out: out):
    """Runs `module` with `state` on jax inputs through torchax; jax in, jax out, traceable by jax.jit.

    `output` picks jax-convertible tensors out of the torch result (e.g. `lambda o: o.last_hidden_state`).
    """
    env = default_env()
    state, args, kwargs = env.j2t_iso((state, tuple(args), dict(kwargs or {})))
    with env, warnings.catch_warnings():
        # torch code asks for int64 indices; without x64 JAX makes them int32, as we want: no warning.
        warnings.filterwarnings("ignore", "Explicitly requested dtype int64", UserWarning)
        result = output(torch.func.functional_call(module, state, args, kwargs, tie_weights=False))
    return env.t2j_iso(result)


# ---------------------------------------------------------------------------------------------
# SDPA swap

_sdpa_options = threading.local()


@contextlib.contextmanager
def attention_impl(impl=None, interpret=False, block_sizes=None):
    """Inside: plain SDPA calls go to `wan_tpu.attention` with these options (read while tracing)."""
    previous = getattr(_sdpa_options, "value", None)
    _sdpa_options.value = {"impl": impl, "interpret": interpret, "block_sizes": block_sizes}
    try:
        yield
    finally:
        _sdpa_options.value = previous


def _register_sdpa(env):
    from torchax import interop

    def sdpa(*args, **kwargs):
        return interop.call_jax(scaled_dot_product_attention, *args, **kwargs)

    # torchax lowers both the Python function and the aten op; a call to either takes the swap.
    for op in (torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention):
        env.override_op_definition(op, sdpa)


def _is_plain(query, key, value, attn_mask, dropout_p, is_causal, scale):
    if attn_mask is not None or dropout_p != 0.0 or is_causal:
        return False
    if query.ndim != 4 or key.shape != value.shape or query.shape[:2] != key.shape[:2]:
        return False
    if query.shape[-1] != key.shape[-1]:
        return False
    return scale is None or math.isclose(scale, 1.0 / math.sqrt(query.shape[-1]), rel_tol=1e-6)


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """`F.scaled_dot_product_attention` on jax arrays, (..., H, L, E) layout, torch semantics."""
    if _is_plain(query, key, value, attn_mask, dropout_p, is_causal, scale):
        out = attention_module.attention(
            query.transpose(0, 2, 1, 3),
            key.transpose(0, 2, 1, 3),
            value.transpose(0, 2, 1, 3),
            **(getattr(_sdpa_options, "value", None) or {}),
        )
        return out.transpose(0, 2, 1, 3)
    return _sdpa_math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _sdpa_math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """torch's math SDPA: bool masks select, float masks add, causal is top-left aligned."""
    if dropout_p != 0.0:
        raise NotImplementedError("scaled_dot_product_attention with dropout_p > 0 (wan_tpu is inference only)")
    if is_causal and attn_mask is not None:
        raise ValueError("scaled_dot_product_attention: is_causal=True does not take an explicit attn_mask")
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if enable_gqa and query.shape[-3] != key.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key = jnp.repeat(key, groups, axis=-3)
        value = jnp.repeat(value, groups, axis=-3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    logits = jnp.einsum("...qd,...kd->...qk", query, key, preferred_element_type=jnp.float32) * scale
    if is_causal:
        attn_mask = jnp.tril(jnp.ones((q_len, kv_len), dtype=bool))
    if attn_mask is not None:
        if attn_mask.dtype == jnp.bool_:
            logits = jnp.where(attn_mask, logits, -jnp.inf)
        else:
            logits = logits + attn_mask.astype(jnp.float32)
    weights = jax.nn.softmax(logits, axis=-1)
    # torch returns zeros, not NaN, for a query row whose keys are all masked out.
    weights = jnp.where(jnp.isneginf(logits).all(axis=-1, keepdims=True), 0.0, weights)
    out = jnp.einsum("...qk,...kd->...qd", weights.astype(value.dtype), value, preferred_element_type=jnp.float32)
    return out.astype(query.dtype)
