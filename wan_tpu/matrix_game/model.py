"""The causal Matrix-Game-2 DiT (`MatrixGameTransformer`): Wan 2.1 blocks with per-frame modulation,
CLIP-only cross-attention, action modules and static ring caches.

Port of `CausalWanModel._forward_inference` (`wan/modules/causal_model.py`, SkyworkAI/Matrix-Game
commit 3ceb311) on our Wan pieces (`wan_tpu.layers.dit`: `WanAttention`, `WanImageEmbedding`, patchify;
`FeedForward`, norms, RoPE, attention dispatch):

    model = MatrixGameTransformer(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    cache = model.init_cache(clip_tokens, latent_size=(44, 80))   # (B, 257, 1280) CLIP tokens
    flow, cache = model(latents, cond_concat, timestep, keyboard, mouse, cache, frame_offset=0)

Per call: `latents` (B, 16, F, H, W) noisy latents of one chunk, `cond_concat` (B, 20, F, H, W) the
mask + image-latent condition of the same frames, `timestep` (B, F) per frame, `keyboard`/`mouse`
(B, 4F+8, dim) raw action windows (`chunk_action_window`), `frame_offset` the absolute index of
the chunk's first latent frame (may be traced). The chunk's keys go into the caches at their ring
slots and its queries attend over the window: the last `window_frames` latent frames including
the chunk itself (`wan_tpu.matrix_game.cache`). Inside jit use the pure `forward`; a whole
chunk's sampling is `wan_tpu.matrix_game.sampling.denoise_chunk`.

Block order: self-attention → cross-attention (CLIP tokens only) → action module (blocks named by
`action_config.blocks`) → FFN; 6-way modulation per latent frame from a per-frame timestep
([B, F] → [B, F, 6, dim]); head with 2-way modulation. Blocks form runs of equal structure (with or
without an action module), each stacked on a leading layer axis and run with `jax.lax.scan`.
Hooks as in `WanTransformer`: `self_attention`, `cross_attention` (q, k, v) → out, and
`shard_activation(x, name)`; `wan_tpu.matrix_game.loading.shard_matrix_game` sets mesh-aware ones.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan_tpu.configs.matrix_game import MatrixGameTransformerConfig
from wan_tpu.errors import WanInputError
from wan_tpu.layers.dit import WanAttention, WanImageEmbedding, default_attention, identity, patchify, unpatchify
from wan_tpu.layers.embeddings import FeedForward, TimestepEmbedding, linear, timestep_embedding
from wan_tpu.layers.norms import FP32LayerNorm, layer_norm
from wan_tpu.layers.rope import rope_tables
from wan_tpu.loading.stacking import stack_layers
from wan_tpu.matrix_game.action_module import ActionModule
from wan_tpu.matrix_game.cache import BlockCache, KVCache, MatrixGameCache, Window, ring_write, valid_window_frames, windowed

# The authors' RoPE table (`rope_params(1024, …)`) covers 1024 latent frames.
MAX_FRAMES = 1024


def _modulate(x, shift, scale, eps, f):
    """LayerNorm(x)·(1 + scale) + shift per latent frame: x (B, F·S, d), shift/scale (B, F, 1, d)."""
    b, n, d = x.shape
    y = layer_norm(x, eps).reshape(b, f, n // f, d) * (1 + scale) + shift
    return y.reshape(b, n, d).astype(x.dtype)


def _gated(x, y, gate, f):
    b, n, d = x.shape
    out = x.astype(jnp.float32).reshape(b, f, n // f, d) + y.astype(jnp.float32).reshape(b, f, n // f, d) * gate
    return out.reshape(b, n, d).astype(x.dtype)


class _Step:
    """What every block of one forward shares: static sizes, traced positions and inputs, hooks."""

    def __init__(self, grid, frame_offset, valid_frames, rope, keyboard, mouse, self_attn, cross_attn):
        self.grid, self.frame_offset, self.valid_frames, self.rope = grid, frame_offset, valid_frames, rope
        self.keyboard, self.mouse = keyboard, mouse
        self.self_attn, self.cross_attn = self_attn, cross_attn

    @property
    def tokens_per_frame(self) -> int:
        return self.grid[1] * self.grid[2]


class MatrixGameBlock(nnx.Module):
    """`CausalWanAttentionBlock`: names as our Wan block (`attn1`, `attn2`, `norm2` = their affine
    `norm3`, `ffn`, `scale_shift_table` = their `modulation`) plus their `action_model`."""

    def __init__(self, cfg: MatrixGameTransformerConfig, has_action: bool, *, dtype, rngs: nnx.Rngs):
        dim = cfg.dim
        self.eps = cfg.eps
        self.attn1 = WanAttention(dim, cfg.num_heads, cfg.eps, dtype=dtype, rngs=rngs)
        self.attn2 = WanAttention(dim, cfg.num_heads, cfg.eps, dtype=dtype, rngs=rngs)
        self.norm2 = FP32LayerNorm(dim, cfg.eps) if cfg.cross_attn_norm else None
        self.ffn = FeedForward(dim, cfg.ffn_dim, dim, approximate=True, dtype=dtype, rngs=rngs)
        self.scale_shift_table = nnx.Param(jax.random.normal(rngs.params(), (1, 6, dim), jnp.float32) / dim**0.5)
        self.action_model = ActionModule(cfg.action_config, dtype=dtype, rngs=rngs) if has_action else None

    def __call__(self, x, tproj, step: _Step, cache: BlockCache):
        """x (B, F·S, dim), tproj (B, F, 6, dim) → (x, cache with this chunk's entries written)."""
        b, n, _ = x.shape
        f, s = step.grid[0], step.tokens_per_frame
        mod = self.scale_shift_table[...][None] + tproj.astype(jnp.float32)  # (B, F, 6, dim)
        shift, scale, gate, c_shift, c_scale, c_gate = (mod[:, :, None, i] for i in range(6))

        q, k, v = self.attn1.qkv(_modulate(x, shift, scale, self.eps, f), step.rope)
        self_kv = KVCache(*(ring_write(c, t, step.frame_offset, axis=1, frame_len=s)
                            for c, t in ((cache.self_attn.k, k), (cache.self_attn.v, v))))
        out = windowed(lambda n: step.self_attn(q, self_kv.k[:, : n * s], self_kv.v[:, : n * s]), step.valid_frames)
        x = _gated(x, self.attn1.to_out(out.reshape(b, n, -1)), gate, f)

        h = x if self.norm2 is None else self.norm2(x)
        out = step.cross_attn(self.attn2.query(h), *cache.cross_attn)
        x = x + self.attn2.to_out(out.reshape(b, n, -1))

        keyboard_kv, mouse_kv = cache.keyboard, cache.mouse
        if self.action_model is not None:
            x, keyboard_kv, mouse_kv = self.action_model(x, step.grid, step.frame_offset, step.valid_frames,
                                                         step.keyboard, step.mouse, keyboard_kv, mouse_kv)

        x = _gated(x, self.ffn(_modulate(x, c_shift, c_scale, self.eps, f)), c_gate, f)
        return x, BlockCache(self_kv, cache.cross_attn, keyboard_kv, mouse_kv)


class MatrixGameConditionEmbedder(nnx.Module):
    """Time embedding (sinusoid → MLP, float32), its 6-way projection, and the CLIP `img_emb` MLPProj
    (LayerNorm → Linear → exact GELU → Linear → LayerNorm), named as in our Wan DiT."""

    def __init__(self, cfg: MatrixGameTransformerConfig, *, dtype, rngs: nnx.Rngs):
        self.time_embedder = TimestepEmbedding(cfg.freq_dim, cfg.dim, dtype=jnp.float32, rngs=rngs)
        self.time_proj = linear(cfg.dim, 6 * cfg.dim, dtype, rngs)
        self.image_embedder = WanImageEmbedding(cfg.image_dim, cfg.dim, None, dtype=dtype, rngs=rngs)


def block_runs(cfg: MatrixGameTransformerConfig) -> tuple[tuple[int, int, bool], ...]:
    """Maximal runs (start, stop, has_action) of consecutive blocks that share a structure."""
    flags = [i in cfg.action_blocks for i in range(cfg.num_layers)]
    runs, start = [], 0
    for has_action, group in itertools.groupby(flags):
        n = len(list(group))
        runs.append((start, start + n, has_action))
        start += n
    return tuple(runs)


class MatrixGameTransformer(nnx.Module):
    """The causal DiT; see the module docstring. `block_runs` names which blocks each entry of
    `blocks` stacks (and `MatrixGameCache.blocks` follows the same runs)."""

    def __init__(self, config: MatrixGameTransformerConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 attention_impl=None):
        cfg = config
        self.config = cfg
        self.dtype = dtype
        self.block_runs = block_runs(cfg)
        self.patch_embedding = linear(cfg.in_dim * cfg.patch_volume, cfg.dim, dtype, rngs)
        self.condition_embedder = MatrixGameConditionEmbedder(cfg, dtype=dtype, rngs=rngs)

        def make_run(start, stop, has_action):
            return stack_layers(lambda r: MatrixGameBlock(cfg, has_action, dtype=dtype, rngs=r), stop - start, rngs)

        self.blocks = nnx.List([make_run(*run) for run in self.block_runs])
        self.proj_out = linear(cfg.dim, cfg.out_dim * cfg.patch_volume, dtype, rngs)
        self.scale_shift_table = nnx.Param(jax.random.normal(rngs.params(), (1, 2, cfg.dim), jnp.float32) / cfg.dim**0.5)

        self.self_attention = default_attention(attention_impl)
        self.cross_attention = default_attention(attention_impl)
        self.shard_activation = identity

    # -- compiled conveniences -------------------------------------------------------------------
    def __call__(self, latents, cond_concat, timestep, keyboard, mouse, cache, frame_offset, valid_frames=None):
        """`apply`, compiled (timesteps become device values: their sinusoid is then float32)."""
        graphdef, state = nnx.split(self)
        if valid_frames is None:
            valid_frames = valid_window_frames(self.config.window_frames, int(frame_offset) + latents.shape[2])
        return _forward_jit(graphdef, state, latents, cond_concat, timestep, keyboard, mouse, cache, frame_offset,
                            valid_frames)

    def init_cache(self, visual_context, latent_size):
        graphdef, state = nnx.split(self)
        return _init_cache_jit(graphdef, state, visual_context, tuple(latent_size))

    # -- traced computations ---------------------------------------------------------------------
    def embed_time(self, timestep):
        """Per-frame timesteps (B, F) → (temb (B, F, dim), tproj (B, F, 6, dim)).

        A numpy `timestep` is embedded on the host in float64 (exact, as the authors do)."""
        emb = self.condition_embedder
        temb = emb.time_embedder(timestep_embedding(timestep, self.config.freq_dim)).astype(self.dtype)
        tproj = emb.time_proj(jax.nn.silu(temb))
        return temb, tproj.reshape(*tproj.shape[:-1], 6, self.config.dim)

    def apply(self, latents, cond_concat, timestep, keyboard, mouse, cache, frame_offset, valid_frames: int | Window):
        """Flow prediction (B, out_dim, F, H, W) and the updated cache; call it under jit. `valid_frames`: the
        window frames that hold data after this chunk's write, static, or a `Window` (one of several
        sizes, chosen by a traced index: `wan_tpu.matrix_game.cache`)."""
        _check_timestep(latents, timestep)
        return self.apply_embedded(latents, cond_concat, *self.embed_time(timestep), keyboard, mouse, cache,
                                   frame_offset, valid_frames)

    def apply_embedded(self, latents, cond_concat, temb, tproj, keyboard, mouse, cache: MatrixGameCache,
                       frame_offset, valid_frames: int | Window):
        """`apply` with the time embeddings of `embed_time` given (a sampler computes them once per step)."""
        cfg = self.config
        _check_inputs(cfg, latents, cond_concat, keyboard, mouse, cache, valid_frames)
        x = jnp.concatenate([latents, cond_concat], axis=1).astype(self.dtype)
        patches, grid = patchify(x, cfg.patch_size)
        x = self.shard_activation(self.patch_embedding(patches), "tokens")
        rope = rope_tables(cfg.head_dim, grid, frame_offset=frame_offset, max_frames=MAX_FRAMES)
        step = _Step(grid, frame_offset, valid_frames, rope, keyboard, mouse, self.self_attention,
                     self.cross_attention)
        shard = self.shard_activation

        new_caches = []
        for run, run_cache in zip(self.blocks, cache.blocks):
            run_graph, run_state = nnx.split(run)

            def body(x, layer, run_graph=run_graph):
                layer_state, layer_cache = layer
                with jax.named_scope("dit_block"):
                    x, layer_cache = nnx.merge(run_graph, layer_state)(x, tproj, step, layer_cache)
                    return shard(x, "tokens"), layer_cache

            x, run_cache = jax.lax.scan(body, x, (run_state, run_cache))
            new_caches.append(run_cache)

        f = grid[0]
        mod = self.scale_shift_table[...][None] + temb[:, :, None].astype(jnp.float32)  # (B, F, 2, dim)
        x = _modulate(x, mod[:, :, None, 0], mod[:, :, None, 1], cfg.eps, f)
        flow = unpatchify(self.proj_out(x), grid, cfg.patch_size)
        return flow, MatrixGameCache(tuple(new_caches))

    def context_cache(self, visual_context):
        """Cross-attention K/V of every block for CLIP tokens (B, N, image_dim): one `KVCache` per run."""
        if visual_context.ndim != 3 or visual_context.shape[-1] != self.config.image_dim:
            raise WanInputError(f"visual_context has shape {tuple(visual_context.shape)}; "
                                f"expected (batch, tokens, {self.config.image_dim}) CLIP image tokens")
        context = self.condition_embedder.image_embedder(visual_context.astype(self.dtype))
        context = self.shard_activation(context, "context")
        out = []
        for run in self.blocks:
            run_graph, run_state = nnx.split(run)
            k, v = jax.lax.map(lambda s, g=run_graph: nnx.merge(g, s).attn2.key_value(context), run_state)
            out.append(KVCache(k, v))
        return out

    def empty_cache(self, batch: int, latent_size, cross: list[KVCache]) -> MatrixGameCache:
        """Zeroed self-attention, keyboard and mouse ring caches around the given cross-attention K/V."""
        cfg, a = self.config, self.config.action_config
        hp, wp = (n // p for n, p in zip(latent_size, cfg.patch_size[1:]))
        s, w = hp * wp, cfg.window_frames

        def kv(*shape):
            return KVCache(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))

        blocks = []
        for (start, stop, has_action), cross_kv in zip(self.block_runs, cross):
            n = stop - start
            keyboard = mouse = None
            if has_action and a.enable_keyboard:
                keyboard = kv(n, batch, w, a.heads_num, a.keyboard_hidden_dim // a.heads_num)
            if has_action and a.enable_mouse:
                mouse = kv(n, batch, s, w, a.heads_num, a.mouse_hidden_dim // a.heads_num)
            blocks.append(BlockCache(kv(n, batch, w * s, cfg.num_heads, cfg.head_dim), cross_kv, keyboard, mouse))
        return MatrixGameCache(tuple(blocks))


def forward(graphdef, state, latents, cond_concat, timestep, keyboard, mouse, cache, frame_offset, valid_frames):
    """Pure `MatrixGameTransformer.apply`: `graphdef, state = nnx.split(model)`; safe inside jit."""
    return nnx.merge(graphdef, state).apply(latents, cond_concat, timestep, keyboard, mouse, cache, frame_offset,
                                            valid_frames)


def init_cache(graphdef, state, visual_context, latent_size):
    """Pure: the caches of a new stream for CLIP tokens `visual_context` (B, N, image_dim) and a latent
    size (H, W): cross-attention K/V computed, the ring caches zeroed."""
    model = nnx.merge(graphdef, state)
    cross = model.context_cache(visual_context)
    return model.empty_cache(visual_context.shape[0], latent_size, cross)


_forward_jit = jax.jit(forward, static_argnums=(0, 9))
_init_cache_jit = jax.jit(init_cache, static_argnums=(0, 3))


def _check_timestep(latents, timestep):
    b, f = latents.shape[0], latents.shape[2]
    if tuple(np.shape(timestep)) != (b, f):
        raise WanInputError(f"timestep has shape {tuple(np.shape(timestep))}; expected ({b}, {f}): one per latent frame")


def _check_inputs(cfg: MatrixGameTransformerConfig, latents, cond, keyboard, mouse, cache, valid_frames):
    if latents.ndim != 5 or latents.shape[1] != cfg.out_dim:
        raise WanInputError(f"latents have shape {tuple(latents.shape)}; expected (batch, {cfg.out_dim}, frames, height, width)")
    b, _, f, h, w = latents.shape
    cond_c = cfg.in_dim - cfg.out_dim
    if tuple(cond.shape) != (b, cond_c, f, h, w):
        raise WanInputError(f"cond_concat has shape {tuple(cond.shape)}; expected {(b, cond_c, f, h, w)} "
                            "(mask and image latents of the same frames)")
    for name, n, p in zip(("frames", "height", "width"), (f, h, w), cfg.patch_size):
        if n % p:
            raise WanInputError(f"latent {name} {n} is not a multiple of the patch size {p}; pick a size that is")
    for n in valid_frames.sizes if isinstance(valid_frames, Window) else (valid_frames,):
        if not f // cfg.patch_size[0] <= n <= cfg.window_frames:
            raise WanInputError(f"a chunk of {f} latent frames cannot attend over {n} window frames "
                                f"(the window holds {cfg.window_frames}, including the chunk)")
    a = cfg.action_config
    raw = a.vae_time_compression_ratio * (f - 1) + a.window_frames if a is not None else None
    for name, value, enabled, dim in (("keyboard", keyboard, a is not None and a.enable_keyboard, a and a.keyboard_dim_in),
                                      ("mouse", mouse, a is not None and a.enable_mouse, a and a.mouse_dim_in)):
        if not enabled:
            if value is not None:
                raise WanInputError(f"this model takes no {name} input; pass {name}=None")
        elif value is None or tuple(value.shape) != (b, raw, dim):
            got = None if value is None else tuple(value.shape)
            raise WanInputError(f"{name} has shape {got}; expected ({b}, {raw}, {dim}): the raw action window of "
                                "the chunk (chunk_action_window)")
    hp, wp = h // cfg.patch_size[1], w // cfg.patch_size[2]
    expected = (b, cfg.window_frames * hp * wp)
    got = tuple(cache.blocks[0].self_attn.k.shape[1:3]) if cache.blocks else None
    if got != expected:
        raise WanInputError(f"the cache was made for (batch, window tokens) {got}, these latents need {expected}; "
                            "make it with init_cache for this batch and latent size")
