"""The UMT5 text encoder (`UMT5Encoder`), a Flax NNX port of transformers' `UMT5EncoderModel`.

    config = UMT5Config.from_folder("Wan2.1-T2V-1.3B-Diffusers/text_encoder")
    model, embed_tokens = load_umt5("Wan2.1-T2V-1.3B-Diffusers/text_encoder", dtype=jnp.bfloat16)  # umt5_loading
    hidden = model(embed_tokens(input_ids), attention_mask)                      # (B, S, d_model), jitted

The math is transformers' (`modeling_umt5.py`), which diffusers' `WanPipeline` runs:
  * every layer has its own relative-position bias table (T5 has one, in layer 0), bucketed
    bidirectionally (`relative_position_buckets`), and attention logits are not scaled by 1/sqrt(d);
  * T5's RMSNorm (`wan_tpu.layers.norms.t5_layer_norm`): statistics in float32, cast to a half
    weight's dtype before the weight multiplies;
  * padded keys are masked out of the softmax (the mask's zeros);
  * the feed-forward is gated GELU (tanh approximation, "gelu_new") for `feed_forward_proj =
    "gated-gelu"`; "relu", "gelu", "gated-relu" work too;
  * every weight, `wo` included, is in `dtype` (float32 or bfloat16) and so is the residual stream.
    transformers keeps `wo` in float32 (`_keep_in_fp32_modules`) only for float16 weights, which we
    do not run (`float16` is refused).

Weights keep the checkpoint's torch layout (linears (out, in), contracted as x·Wᵀ), so loading is a
copy. The blocks' parameters are stacked on a leading layer axis (`blocks.attention.q.weight` is
(num_layers, heads·d_kv, d_model)) and run with `jax.lax.scan`: one layer is compiled, not 24.

The token embedding (`UMT5Embedding`) is looked up on the host, outside the compiled encoder: a prompt
needs at most 512 of UMT5-XXL's 256,384 rows, so its 2.1 GB table (18% of the encoder's bytes) is
neither read whole from the checkpoint (it stays memory-mapped; the lookup reads the rows' pages) nor
placed on a device, which shortens loading and frees that much device memory.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan_tpu.errors import WanInputError
from wan_tpu.layers.attention import reference_attention
from wan_tpu.layers.norms import t5_layer_norm
from wan_tpu.parallel import offload

# transformers' activation names (`ACT2FN`) that UMT5 checkpoints use, as jax functions. "gelu_new" is
# written out as transformers writes it (tanh approximation), op for op.
_ACTIVATIONS = {
    "gelu_new": lambda x: 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3))),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "relu": jax.nn.relu,
}


@dataclasses.dataclass(frozen=True)
class UMT5Config:
    """The fields of transformers' `UMT5Config` (config.json) that the encoder uses."""

    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_layers: int
    num_heads: int
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "gated-gelu"

    def __post_init__(self):
        self.activation  # noqa: B018 - an unsupported activation fails at construction

    @property
    def is_gated(self) -> bool:
        return self.feed_forward_proj.split("-")[0] == "gated"

    @property
    def activation(self) -> str:
        """transformers' `dense_act_fn`: the last part of `feed_forward_proj`, "gelu_new" for "gated-gelu"."""
        name = "gelu_new" if self.feed_forward_proj == "gated-gelu" else self.feed_forward_proj.split("-")[-1]
        if name not in _ACTIVATIONS or len(self.feed_forward_proj.split("-")) > 2:
            raise WanInputError(
                f"UMT5 feed_forward_proj {self.feed_forward_proj!r} is not supported; use one of "
                "'gated-gelu', 'gated-relu', 'relu', 'gelu' (config.json of the text encoder)"
            )
        return name

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.d_kv

    @classmethod
    def from_json(cls, config: dict, where: str = "text encoder config.json") -> UMT5Config:
        names = [f.name for f in dataclasses.fields(cls)]
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        missing = [n for n in required if n not in config]
        if missing:
            raise WanInputError(f"{where}: no {missing[0]!r}; pass the config.json of a UMT5 text encoder")
        return cls(**{n: config[n] for n in names if n in config})

    @classmethod
    def from_folder(cls, folder) -> UMT5Config:
        """The config of a diffusers `text_encoder/` folder (its config.json)."""
        path = os.path.join(os.fspath(folder), "config.json")
        if not os.path.isfile(path):
            raise WanInputError(f"text_encoder folder {os.fspath(folder)!r} has no config.json; pass the "
                                "text_encoder/ folder of a diffusers-format Wan checkpoint")
        try:
            with open(path) as f:
                return cls.from_json(json.load(f), path)
        except json.JSONDecodeError as e:
            raise WanInputError(f"{path}: not valid JSON ({e}); re-download it") from None

    def to_json(self) -> dict:
        """config.json fields as transformers writes them (model_type "umt5")."""
        return {"model_type": "umt5", "architectures": ["UMT5EncoderModel"], **dataclasses.asdict(self)}


def relative_position_buckets(seq_len: int, num_buckets: int, max_distance: int) -> np.ndarray:
    """T5's bidirectional bucket of every relative position `key - query` in [-(seq_len-1), seq_len-1],
    (2·seq_len - 1,) int32, index `key - query + seq_len - 1`.

    Computed on the host in float32 as transformers computes it (`UMT5Attention._relative_position_bucket`),
    so that positions on a bucket boundary fall in the same bucket; the program only gathers from it.
    """
    rel = np.arange(-(seq_len - 1), seq_len, dtype=np.int64)
    half = num_buckets // 2
    buckets = (rel > 0).astype(np.int64) * half
    distance = np.abs(rel)
    max_exact = half // 2
    with np.errstate(divide="ignore"):
        log_ratio = np.log(distance.astype(np.float32) / np.float32(max_exact)) / np.float32(
            math.log(max_distance / max_exact))
    log_ratio = log_ratio * np.float32(half - max_exact)
    large = max_exact + np.where(distance < max_exact, 0, log_ratio).astype(np.int64)
    large = np.minimum(large, half - 1)
    return (buckets + np.where(distance < max_exact, distance, large)).astype(np.int32)


def _linear(x, weight):
    """x · weightᵀ with a torch-layout (out, in) weight, in the weight's dtype."""
    return jnp.einsum("...i,oi->...o", x.astype(weight.dtype), weight)


class Weight(nnx.Module):
    """One torch-layout tensor under the name `weight` (linear (out, in), norm (d,)),
    with an optional leading layer axis, so that parameter paths read like transformers' names."""

    def __init__(self, shape: tuple[int, ...], dtype):
        self.weight = nnx.Param(jnp.zeros(shape, dtype))


class UMT5Attention(nnx.Module):
    def __init__(self, cfg: UMT5Config, dtype, layers: tuple[int, ...]):
        self.q = Weight((*layers, cfg.inner_dim, cfg.d_model), dtype)
        self.k = Weight((*layers, cfg.inner_dim, cfg.d_model), dtype)
        self.v = Weight((*layers, cfg.inner_dim, cfg.d_model), dtype)
        self.o = Weight((*layers, cfg.d_model, cfg.inner_dim), dtype)
        self.relative_attention_bias = Weight((*layers, cfg.relative_attention_num_buckets, cfg.num_heads), dtype)
        self.num_heads = cfg.num_heads

    def __call__(self, x, buckets, key_mask):
        b, s, _ = x.shape
        q, k, v = (_linear(x, p.weight).reshape(b, s, self.num_heads, -1) for p in (self.q, self.k, self.v))
        bias = jnp.transpose(self.relative_attention_bias.weight[buckets], (2, 0, 1))[None]  # (1, H, S, S)
        out = reference_attention(q, k, v, scale=1.0, bias=bias, key_mask=key_mask)
        return _linear(out.reshape(b, s, -1), self.o.weight)


class UMT5FeedForward(nnx.Module):
    def __init__(self, cfg: UMT5Config, dtype, layers: tuple[int, ...]):
        if cfg.is_gated:
            self.wi_0 = Weight((*layers, cfg.d_ff, cfg.d_model), dtype)
            self.wi_1 = Weight((*layers, cfg.d_ff, cfg.d_model), dtype)
        else:
            self.wi = Weight((*layers, cfg.d_ff, cfg.d_model), dtype)
        self.wo = Weight((*layers, cfg.d_model, cfg.d_ff), dtype)
        self.activation = cfg.activation
        self.is_gated = cfg.is_gated

    def __call__(self, x):
        act = _ACTIVATIONS[self.activation]
        if self.is_gated:
            h = act(_linear(x, self.wi_0.weight)) * _linear(x, self.wi_1.weight)
        else:
            h = act(_linear(x, self.wi.weight))
        return _linear(h, self.wo.weight)


class UMT5Block(nnx.Module):
    """Self-attention then feed-forward, each pre-normed with a residual (transformers' `UMT5Block`)."""

    def __init__(self, cfg: UMT5Config, dtype, layers: tuple[int, ...] = ()):
        self.attention_norm = Weight((*layers, cfg.d_model), dtype)
        self.attention = UMT5Attention(cfg, dtype, layers)
        self.ffn_norm = Weight((*layers, cfg.d_model), dtype)
        self.ffn = UMT5FeedForward(cfg, dtype, layers)
        self.eps = cfg.layer_norm_epsilon

    def __call__(self, x, buckets, key_mask):
        x = x + self.attention(t5_layer_norm(x, self.attention_norm.weight, self.eps), buckets, key_mask)
        return x + self.ffn(t5_layer_norm(x, self.ffn_norm.weight, self.eps))


class UMT5Embedding:
    """The tied token embedding (`shared.weight`, (vocab_size, d_model)) on the host: `(input_ids)` → the
    rows, a numpy array in the encoder's dtype (the cast rounds to nearest even, as on a device)."""

    def __init__(self, table: np.ndarray, dtype):
        self.table = table  # read-only; a memory map of the checkpoint where loaded
        self.dtype = np.dtype(dtype)

    def __call__(self, input_ids) -> np.ndarray:
        return np.asarray(self.table[np.asarray(input_ids)]).astype(self.dtype, copy=False)


class UMT5Encoder(offload.StreamedBlocks, nnx.Module):
    """`num_layers` stacked blocks and the final norm over embedded tokens (`UMT5Embedding`):
    transformers' `UMT5EncoderModel(inputs_embeds=...).last_hidden_state`.

    Parameters are zeros until loaded (`wan_tpu.encoders.umt5_loading.load_umt5`) or drawn
    (`wan_tpu.loading.random_init.random_module`); build abstractly with `nnx.eval_shape`.
    """

    def __init__(self, config: UMT5Config, dtype=jnp.float32):
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise WanInputError(f"the UMT5 encoder runs in float32 or bfloat16, not {jnp.dtype(dtype).name}")
        cfg = config
        self.config = cfg
        self.dtype = dtype
        self.blocks = UMT5Block(cfg, dtype, (cfg.num_layers,))
        self.final_layer_norm = Weight((cfg.d_model,), dtype)
        # The first blocks' device copies while `blocks` lives in host memory (`offload_blocks`).
        self.resident_blocks = nnx.data(None)

    def __call__(self, inputs_embeds, attention_mask):
        """(B, S, d_model) embedded tokens and (B, S) mask (1: a token, 0: padding) → (B, S, d_model) in
        `dtype`; runs compiled."""
        graphdef, state = nnx.split(self)
        return encode(graphdef, state, inputs_embeds, attention_mask)

    def apply(self, inputs_embeds, attention_mask):
        """The forward computation, traced op by op; call it under jit."""
        cfg = self.config
        seq = inputs_embeds.shape[1]
        table = relative_position_buckets(seq, cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance)
        relative = jnp.arange(seq)[None, :] - jnp.arange(seq)[:, None] + (seq - 1)
        buckets = jnp.asarray(table)[relative]  # (S, S)
        key_mask = attention_mask > 0
        x = inputs_embeds.astype(self.dtype)
        block_graph, block_state = nnx.split(self.blocks)

        def body(x, layer_state):
            with jax.named_scope("umt5_block"):
                return nnx.merge(block_graph, layer_state)(x, buckets, key_mask)

        if offload.is_streamed(block_state):
            resident = None if self.resident_blocks is None else nnx.split(self.resident_blocks)[1]
            x = offload.scan_layers(body, x, resident, block_state)
        else:
            x = offload.scan_layers(body, x, block_state)
        return t5_layer_norm(x, self.final_layer_norm.weight, cfg.layer_norm_epsilon)


@functools.partial(jax.jit, static_argnums=0)
def encode(graphdef, state, inputs_embeds, attention_mask):
    """The encoder on a split model (`graphdef, state = nnx.split(model)`), compiled once per input shape.
    `encode.lower(graphdef, abstract_state, ...)` compiles it from shapes alone
    (`wan_tpu.encoders.umt5_text.compile_encode`)."""
    return nnx.merge(graphdef, state).apply(inputs_embeds, attention_mask)
