"""Matrix-Game-2's ActionModule: mouse and keyboard conditioning inside a DiT block, with caches.

Port of `wan/modules/action_module.py` (SkyworkAI/Matrix-Game, commit 3ceb311), causal cached path.
Latent frame f sees a window of 12 raw (video-frame) actions: raw frames 4f−12 … 4f−1, the raw
sequence being front-padded with 12 copies of raw frame 0. A chunk's caller passes the raw window
[4f₀−12, 4f₀+4C−4) of its C latent frames f₀ … f₀+C−1 (`chunk_action_window` builds it), 4C+8 frames.

- Mouse (if enabled): every spatial token gets [its hidden state ‖ the 12×2 raw mouse window of its
  frame] → `mouse_mlp` (Linear → GELU(tanh) → Linear → LayerNorm) → `t_qkv` → temporal
  self-attention of that token over the cached window of latent frames → `proj_mouse`, residual.
- Keyboard (if enabled), on the mouse branch's output: the raw window is embedded per raw frame
  (Linear → SiLU → Linear), flattened per latent frame (12·hidden) → `keyboard_attn_kv` [k | v];
  queries `mouse_attn_q` of every token attend over the cached window of latent-frame keys →
  `proj_keyboard`, residual.
q and k of both branches go through a per-head RMSNorm that ignores its weights (the authors'
action-module `WanRMSNorm.forward` never multiplies by them; the checkpoint still holds them), then
the action RoPE (θ 256, split (8, 28, 28) over positions (frame, 0, 0): only the first 8 channels of
each 64-channel head rotate, at the absolute latent frame index).

Their caches keep one keyboard key per batch (`k[:1]`, so batch 1); ours keep one per sample.
The action attentions are tiny (≤ window keys) and run as plain XLA attention on every backend.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan_tpu.configs.matrix_game import ActionConfig
from wan_tpu.errors import WanInputError
from wan_tpu.layers import attention as attention_lib
from wan_tpu.layers.embeddings import FeedForward, TimestepEmbedding
from wan_tpu.layers.norms import FP32LayerNorm, rms_norm
from wan_tpu.layers.rope import apply_rope, rope_tables
from wan_tpu.matrix_game.cache import KVCache, Window, ring_write, windowed

# The authors' action RoPE table covers 7500 latent frames (`get_rotary_pos_embed(7500, …)`).
ACTION_ROPE_FRAMES = 7500
_QK_EPS = 1e-6


def action_rope(cfg: ActionConfig, num_frames: int, frame_offset):
    """(cos, sin) of shape (num_frames, head_dim) for latent frames frame_offset … (+num_frames−1)."""
    head_dim = sum(cfg.rope_dim_list)
    return rope_tables(head_dim, (num_frames, 1, 1), cfg.rope_theta, frame_offset=frame_offset,
                       split=cfg.rope_dim_list, max_frames=ACTION_ROPE_FRAMES)


def _window_index(cfg: ActionConfig, num_frames: int) -> np.ndarray:
    """(num_frames, 12) indices into a chunk's raw window: latent frame i reads [r·i, r·i + 12)."""
    r = cfg.vae_time_compression_ratio
    return r * np.arange(num_frames)[:, None] + np.arange(cfg.window_frames)[None]


def _attend(q, k, v):
    return attention_lib.attention(q, k, v, impl="reference")


def _linear(din, dout, bias, dtype, rngs):
    return nnx.Linear(din, dout, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs)


class ActionModule(nnx.Module):
    """Parameter names follow the authors' (`keyboard_embed.0` → `keyboard_embed.linear_1`,
    `mouse_mlp.0/.2` → `mouse_mlp.proj_in/proj_out`, `mouse_mlp.3` → `mouse_mlp_norm`)."""

    def __init__(self, cfg: ActionConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        dim, bias = cfg.img_hidden_size, cfg.qkv_bias
        mouse, keyboard = cfg.enable_mouse, cfg.enable_keyboard
        c, kb = cfg.mouse_hidden_dim, cfg.keyboard_hidden_dim
        # Each attribute is set once: a submodule, or None where its branch is disabled.
        self.mouse_mlp = FeedForward(cfg.mouse_dim_in * cfg.window_frames + dim, c, c, approximate=True, dtype=dtype,
                                     rngs=rngs) if mouse else None
        self.mouse_mlp_norm = FP32LayerNorm(c, 1e-5) if mouse else None
        self.t_qkv = _linear(c, 3 * c, bias, dtype, rngs) if mouse else None
        self.proj_mouse = _linear(c, dim, bias, dtype, rngs) if mouse else None
        self.keyboard_embed = TimestepEmbedding(cfg.keyboard_dim_in, cfg.hidden_size, dtype=dtype,
                                                rngs=rngs) if keyboard else None
        self.mouse_attn_q = _linear(dim, kb, bias, dtype, rngs) if keyboard else None
        self.keyboard_attn_kv = _linear(cfg.hidden_size * cfg.window_frames, 2 * kb, bias, dtype,
                                        rngs) if keyboard else None
        self.proj_keyboard = _linear(kb, dim, bias, dtype, rngs) if keyboard else None

    def _heads(self, x):
        return x.reshape(*x.shape[:-1], self.cfg.heads_num, -1)

    def __call__(self, x, grid, frame_offset, valid_frames: int | Window, keyboard, mouse, keyboard_cache, mouse_cache):
        """x (B, F·S, dim) → (x, keyboard_cache, mouse_cache).

        `grid` (F, h, w) static; `frame_offset` the absolute index of the first latent frame (may be
        traced); `valid_frames` how many window frames hold data after this chunk's write (static, or a
        `Window`: then every size is attended and the chunk's kept, a few keys each);
        `keyboard` (B, 4F+8, keyboard_dim), `mouse` (B, 4F+8, mouse_dim) raw windows.
        """
        b, _, dim = x.shape
        f = grid[0]
        s = grid[1] * grid[2]
        idx = _window_index(self.cfg, f)
        cos, sin = action_rope(self.cfg, f, frame_offset)
        if self.mouse_mlp is not None:
            window = mouse[:, idx].reshape(b, f, 1, -1).astype(x.dtype)  # (B, F, 1, 12·2), time-major
            h = jnp.concatenate([x.reshape(b, f, s, dim), jnp.broadcast_to(window, (b, f, s, window.shape[-1]))], -1)
            qkv = self.t_qkv(self.mouse_mlp_norm(self.mouse_mlp(h)))  # (B, F, S, 3c)
            q, k, v = (self._heads(t).transpose(0, 2, 1, 3, 4) for t in jnp.split(qkv, 3, axis=-1))
            heads, hd = q.shape[-2:]  # (B, S, F, H, D): one temporal sequence per spatial token
            q, k = (apply_rope(rms_norm(t, _QK_EPS).reshape(b * s, f, heads, hd), cos, sin) for t in (q, k))
            mouse_cache = KVCache(*(ring_write(c, t.reshape(b, s, f, heads, hd), frame_offset, axis=2, frame_len=1)
                                    for c, t in ((mouse_cache.k, k), (mouse_cache.v, v))))

            def attend_mouse(n):
                return _attend(q, *(c[:, :, :n].reshape(b * s, n, heads, hd) for c in mouse_cache))

            out = windowed(attend_mouse, valid_frames, select=True)
            out = out.reshape(b, s, f, heads * hd).transpose(0, 2, 1, 3).reshape(b, f * s, -1)
            x = x + self.proj_mouse(out)
        if self.keyboard_embed is not None:
            emb = self.keyboard_embed(keyboard.astype(x.dtype))  # (B, 4F+8, hidden)
            kv = self.keyboard_attn_kv(emb[:, idx].reshape(b, f, -1))  # (B, F, 2·kb)
            k, v = (self._heads(t) for t in jnp.split(kv, 2, axis=-1))
            k = apply_rope(rms_norm(k, _QK_EPS), cos, sin)
            # Every token of a latent frame shares that frame's position.
            q = apply_rope(rms_norm(self._heads(self.mouse_attn_q(x)), _QK_EPS), jnp.repeat(cos, s, 0),
                           jnp.repeat(sin, s, 0))
            keyboard_cache = KVCache(*(ring_write(c, t, frame_offset, axis=1, frame_len=1)
                                       for c, t in ((keyboard_cache.k, k), (keyboard_cache.v, v))))
            out = windowed(lambda n: _attend(q, keyboard_cache.k[:, :n], keyboard_cache.v[:, :n]), valid_frames,
                           select=True)
            x = x + self.proj_keyboard(out.reshape(b, f * s, -1))
        return x, keyboard_cache, mouse_cache


def chunk_action_window(actions: np.ndarray, chunk_index: int, frames_per_chunk: int,
                        compression: int = 4, window: int = 12) -> np.ndarray:
    """The raw action frames a chunk reads: (…, T, dim) per video frame → (…, 4C + 8, dim).

    Chunk k covers latent frames kC … kC+C−1; their windows span raw frames [4kC − 12, 4kC + 4C − 4),
    where raw frames before 0 are copies of frame 0 (the authors' front padding). `actions` must
    hold at least 4(k+1)C − 4 frames: through the second-to-last video frame of chunk k (the
    chunk's last video frame is first read by the next chunk).
    """
    actions = np.asarray(actions)
    start = compression * frames_per_chunk * chunk_index - window
    stop = start + compression * (frames_per_chunk - 1) + window
    if actions.shape[-2] < stop:
        raise WanInputError(
            f"chunk {chunk_index} reads action frames 0…{stop - 1} but only {actions.shape[-2]} were given; "
            "pass one action per video frame through the chunk's end"
        )
    idx = np.clip(np.arange(start, stop), 0, None)
    return np.take(actions, idx, axis=-2)
