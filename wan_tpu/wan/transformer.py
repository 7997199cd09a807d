"""The Wan DiT (`WanTransformer`), a Flax NNX port of diffusers' `WanTransformer3DModel`.

    dit = WanTransformer(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))      # random weights
    noise_pred = dit(latents, timestep, prompt_embeds)                      # compiled, cached per shape

Random weights at real sizes build much faster compiled, on the device:
`nnx.jit(lambda: WanTransformer(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(seed)))()`.

Inside a compiled loop (e.g. `jax.lax.fori_loop` of a sampler), use the pure form:

    graphdef, state = nnx.split(dit)
    noise_pred = forward(graphdef, state, latents, timestep, prompt_embeds)

Blocks are one module whose parameters are stacked on a leading layer axis (`blocks.attn1.to_q.kernel`
is (num_layers, dim, dim)) and run with `jax.lax.scan`, so compile time does not grow with depth.
Float32 is kept where diffusers keeps it (`_keep_in_fp32_modules`: rope, time_embedder,
scale_shift_table, norm1/2/3), whatever `dtype` the rest uses.

`abstract_transformer(config)` is a shapes-only build (no weights), e.g. for `wan_tpu.wan.lora.check_lora`.
The attention projections, image embedding, patchify and the default hooks are shared with
Matrix-Game's DiT in `wan_tpu.layers.dit`.

Hooks (plain attributes, replaceable after construction; `wan_tpu.parallel.sharding` sets mesh-aware ones):
  `self_attention(q, k, v)`, `cross_attention(q, k, v)`: (B, S, H, D) attention functions.
  `shard_activation(x, name)`: called on activations so a mesh can constrain them; names:
    "tokens"  — the (B, S, dim) token stream after patch embedding and after every block;
    "context" — the embedded (B, L, dim) text context (and the embedded image context, if any).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from wan_tpu.configs.models import WanTransformerConfig
from wan_tpu.errors import WanInputError
from wan_tpu.layers.dit import WanAttention, WanImageEmbedding, default_attention, identity, patchify, unpatchify
from wan_tpu.layers.embeddings import FeedForward, TextProjection, TimestepEmbedding, linear, timestep_embedding
from wan_tpu.layers.norms import FP32LayerNorm, layer_norm, modulated_layer_norm
from wan_tpu.layers.rope import rope_tables
from wan_tpu.loading.stacking import eval_shape, stack_layers
from wan_tpu.parallel import offload
from wan_tpu.wan import lora as lora_lib


class WanTransformerBlock(nnx.Module):
    """One DiT block. `fused_elementwise` (default True) writes the elementwise work around the
    matmuls as single float32 expressions with one rounding each (`modulated_layer_norm`, RMSNorm
    + RoPE together) so that the compiler emits fewer memory passes; False keeps diffusers' op
    order (norm, cast, modulate; norm, cast, rotate, cast) — the "ours unfused" baseline of
    `benchmarks/bench_dit.py`. Both match diffusers to 1e-5 in float32."""

    def __init__(self, cfg: WanTransformerConfig, *, dtype, rngs: nnx.Rngs):
        dim = cfg.inner_dim
        self.dtype = dtype
        self.eps = cfg.eps
        self.fused_elementwise = True
        self.attn1 = WanAttention(dim, cfg.num_attention_heads, cfg.eps, dtype=dtype, rngs=rngs)
        self.attn2 = WanAttention(dim, cfg.num_attention_heads, cfg.eps, added_kv_proj_dim=cfg.added_kv_proj_dim,
                                  dtype=dtype, rngs=rngs)
        self.norm2 = FP32LayerNorm(dim, cfg.eps) if cfg.cross_attn_norm else None
        self.ffn = FeedForward(dim, cfg.ffn_dim, dim, approximate=True, dtype=dtype, rngs=rngs)
        self.scale_shift_table = nnx.Param(jax.random.normal(rngs.params(), (1, 6, dim), jnp.float32) / dim**0.5)

    def __call__(self, x, context, context_image, temb, rope, self_attn_fn, cross_attn_fn):
        """x (B, S, dim); temb (B, 1 or S, 6, dim) float32-able time projection."""
        mod = self.scale_shift_table[...][None] + temb.astype(jnp.float32)  # (B, 1|S, 6, dim), float32
        shift, scale, gate, c_shift, c_scale, c_gate = (mod[:, :, i] for i in range(6))

        h = self._modulate(x, scale, shift)
        attn = self.attn1.self_attention(h, rope, self_attn_fn, self.fused_elementwise)
        x = (x.astype(jnp.float32) + attn * gate).astype(x.dtype)

        h = x if self.norm2 is None else self.norm2(x)
        x = x + self.attn2.cross_attention(h, context, context_image, cross_attn_fn)

        h = self._modulate(x, c_scale, c_shift)
        return (x.astype(jnp.float32) + self.ffn(h).astype(jnp.float32) * c_gate).astype(x.dtype)

    def _modulate(self, x, scale, shift):
        if self.fused_elementwise:
            return modulated_layer_norm(x, self.eps, scale, shift, x.dtype)
        return (layer_norm(x, self.eps) * (1 + scale) + shift).astype(x.dtype)


class WanConditionEmbedder(nnx.Module):
    def __init__(self, cfg: WanTransformerConfig, *, dtype, rngs: nnx.Rngs):
        dim = cfg.inner_dim
        self.freq_dim = cfg.freq_dim
        self.time_embedder = TimestepEmbedding(cfg.freq_dim, dim, dtype=jnp.float32, rngs=rngs)
        self.time_proj = linear(dim, 6 * dim, dtype, rngs)
        self.text_embedder = TextProjection(cfg.text_dim, dim, dtype=dtype, rngs=rngs)
        self.image_embedder = (
            WanImageEmbedding(cfg.image_dim, dim, cfg.pos_embed_seq_len, dtype=dtype, rngs=rngs)
            if cfg.image_dim is not None
            else None
        )


class WanTransformer(offload.StreamedBlocks, nnx.Module):
    def __init__(self, config: WanTransformerConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, attention_impl=None):
        cfg = config
        self.config = cfg
        self.dtype = dtype
        dim = cfg.inner_dim
        self.patch_embedding = linear(cfg.in_channels * cfg.patch_volume, dim, dtype, rngs)
        self.condition_embedder = WanConditionEmbedder(cfg, dtype=dtype, rngs=rngs)

        self.blocks = stack_layers(lambda r: WanTransformerBlock(cfg, dtype=dtype, rngs=r), cfg.num_layers, rngs)
        self.proj_out = linear(dim, cfg.out_channels * cfg.patch_volume, dtype, rngs)
        self.scale_shift_table = nnx.Param(jax.random.normal(rngs.params(), (1, 2, dim), jnp.float32) / dim**0.5)

        self.self_attention = default_attention(attention_impl)
        self.cross_attention = default_attention(attention_impl)
        self.shard_activation = identity
        # "fp8" once `wan_tpu.wan.quantize.quantize_transformer` has replaced the block linears.
        self.quantization = None
        # The first blocks' device copies while `blocks` lives in host memory (`offload_blocks`).
        self.resident_blocks = nnx.data(None)

    def __call__(self, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image=None):
        """Noise prediction (B, C_out, F, H, W), as diffusers' forward(...).sample; runs compiled."""
        graphdef, state = nnx.split(self)
        return _forward_jit(graphdef, state, hidden_states, timestep, encoder_hidden_states,
                            encoder_hidden_states_image)

    def load_lora(self, path, scale: float = 1.0):
        """Merge the LoRA file at `path` into the weights, in place, on device (`wan_tpu.wan.lora`); calls stack."""
        self._ensure_resident("merging a LoRA")
        return lora_lib.load_lora(self, path, scale)

    def unload_lora(self) -> None:
        """Undo every `load_lora`: the weights as they were before, bit for bit."""
        self._ensure_resident("unloading a LoRA")
        lora_lib.unload_lora(self)

    def _ensure_resident(self, action: str) -> None:
        if self.offloaded:
            raise WanInputError(f"{action} changes the weights on the device, but this DiT's blocks are offloaded to "
                                "host memory; call restore_blocks() first (WanPipeline reloads the DiT instead)")

    def apply(self, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image=None):
        """The forward computation, traced op by op; call it under jit (see `forward`)."""
        inputs = self.embed(hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image)
        return self.head(inputs, self.run_blocks(inputs, inputs.tokens))

    def embed(self, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image=None) -> DiTInputs:
        """Patch embedding, time and text (and image) embeddings, RoPE: what the blocks and the head take."""
        cfg = self.config
        b = hidden_states.shape[0]
        _check_inputs(cfg, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image)
        patches, grid = patchify(hidden_states.astype(self.dtype), cfg.patch_size)
        x = self.shard_activation(self.patch_embedding(patches), "tokens")

        emb = self.condition_embedder
        temb = emb.time_embedder(timestep_embedding(timestep, cfg.freq_dim))  # (B, dim) or (B, S, dim), f32
        # diffusers casts temb to the activation dtype before time_proj and the output modulation.
        tproj = emb.time_proj(jax.nn.silu(temb.astype(self.dtype)))
        tproj = tproj.reshape(b, -1, 6, cfg.inner_dim)  # (B, 1 or S, 6, dim)

        context = self.shard_activation(emb.text_embedder(encoder_hidden_states.astype(self.dtype)), "context")
        context_image = None
        if encoder_hidden_states_image is not None:
            context_image = emb.image_embedder(encoder_hidden_states_image.astype(self.dtype))
            context_image = self.shard_activation(context_image, "context")
        return DiTInputs(x, temb, tproj, context, context_image, rope_tables(cfg.attention_head_dim, grid), grid)

    def run_blocks(self, inputs: DiTInputs, x, start: int = 0, stop: int | None = None):
        """Blocks `start`..`stop` (default: all) on the token stream `x` (B, S, dim); an offloaded stack
        (`offload_blocks`) runs its resident blocks, then streams the others from host memory."""
        block_graph, block_state = nnx.split(self.blocks)
        self_attn, cross_attn, shard = self.self_attention, self.cross_attention, self.shard_activation

        def body(x, layer_state):
            # One scope for the scanned block: profiles group each layer's ops under "dit_block".
            with jax.named_scope("dit_block"):
                block = nnx.merge(block_graph, layer_state)
                x = block(x, inputs.context, inputs.context_image, inputs.tproj, inputs.rope, self_attn, cross_attn)
                return shard(x, "tokens")

        if not offload.is_streamed(block_state):
            return offload.scan_layers(body, x, block_state, None, start, stop)
        resident = None if self.resident_blocks is None else nnx.split(self.resident_blocks)[1]
        return offload.scan_layers(body, x, resident, block_state, start, stop)

    def head(self, inputs: DiTInputs, x):
        """Output norm and modulation, projection, unpatchify: noise prediction (B, C_out, F, H, W)."""
        cfg = self.config
        temb_out = inputs.temb.astype(self.dtype).reshape(x.shape[0], -1, 1, cfg.inner_dim)  # (B, 1 or S, 1, dim)
        mod = self.scale_shift_table[...][None] + temb_out.astype(jnp.float32)
        shift, scale = mod[:, :, 0], mod[:, :, 1]
        x = (layer_norm(x, cfg.eps) * (1 + scale) + shift).astype(x.dtype)
        return unpatchify(self.proj_out(x), inputs.grid, cfg.patch_size)


class DiTInputs(NamedTuple):
    """What `WanTransformer.embed` computes once per forward for the blocks and the head."""

    tokens: jax.Array  # (B, S, dim) patch embeddings
    temb: jax.Array  # (B, dim) or (B, S, dim) time embedding, float32
    tproj: jax.Array  # (B, 1 or S, 6, dim) block modulation
    context: jax.Array  # (B, L, dim) embedded text
    context_image: jax.Array | None  # (B, 257, dim) embedded CLIP image tokens
    rope: tuple
    grid: tuple[int, int, int]  # tokens along (frames, height, width)


def forward(graphdef, state, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image=None):
    """Pure functional forward: `graphdef, state = nnx.split(dit)`; safe inside jit / fori_loop."""
    return nnx.merge(graphdef, state).apply(hidden_states, timestep, encoder_hidden_states,
                                            encoder_hidden_states_image)


_forward_jit = jax.jit(forward, static_argnums=0)


@functools.cache
def abstract_transformer(config: WanTransformerConfig) -> WanTransformer:
    """A shapes-only `WanTransformer` of `config` (float32, no device memory; cached per config): what
    checks against a model's parameters (`wan_tpu.wan.lora.check_lora`) need before the weights load."""
    return eval_shape(lambda: WanTransformer(config, rngs=nnx.Rngs(0)))


def _check_inputs(cfg, x, timestep, context, context_image):
    if x.ndim != 5 or x.shape[1] != cfg.in_channels:
        raise WanInputError(
            f"hidden_states has shape {tuple(x.shape)}; "
            f"expected (batch, {cfg.in_channels}, frames, height, width) latents"
        )
    b, _, f, h, w = x.shape
    for name, n, p in zip(("frames", "height", "width"), (f, h, w), cfg.patch_size):
        if n % p:
            raise WanInputError(f"latent {name} {n} is not a multiple of the patch size {p}; pick a size that is")
        if n // p > cfg.rope_max_seq_len:
            raise WanInputError(
                f"latent {name} {n} gives {n // p} positions, more than rope_max_seq_len={cfg.rope_max_seq_len}"
            )
    seq = (f // cfg.patch_size[0]) * (h // cfg.patch_size[1]) * (w // cfg.patch_size[2])
    if timestep.shape not in ((b,), (b, seq)):
        raise WanInputError(f"timestep has shape {tuple(timestep.shape)}; expected ({b},) or ({b}, {seq}) per token")
    if context.ndim != 3 or context.shape[0] != b or context.shape[2] != cfg.text_dim:
        raise WanInputError(
            f"encoder_hidden_states has shape {tuple(context.shape)}; expected ({b}, text_len, {cfg.text_dim})"
        )
    if (context_image is None) != (cfg.image_dim is None):
        need = "needs" if cfg.image_dim is not None else "takes no"
        raise WanInputError(f"this transformer {need} encoder_hidden_states_image (CLIP image tokens)")
    if context_image is not None and (context_image.ndim != 3 or context_image.shape[-1] != cfg.image_dim):
        raise WanInputError(
            f"encoder_hidden_states_image has shape {tuple(context_image.shape)}; "
            f"expected (batch, tokens, {cfg.image_dim})"
        )


def set_attention(dit, impl: str | None, mesh):
    """Point the DiT's attention hooks at kernel `impl` (None: the backend's fastest), mesh-aware if a mesh is given."""
    if mesh is not None:
        from wan_tpu.parallel.sharding import shard_transformer

        return shard_transformer(dit, mesh, **({} if impl is None else {"impl": impl}))
    if impl is not None:
        from wan_tpu.layers import attention as attention_lib

        dit.self_attention = functools.partial(attention_lib.attention, impl=impl)
        dit.cross_attention = functools.partial(attention_lib.attention, impl=impl)
    return dit
