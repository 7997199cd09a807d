"""CLIP's vision and text transformers in Flax NNX, equal to transformers' `CLIPVisionModel` / `CLIPTextModel`.

    config = CLIPVisionConfig.from_json(json.load(open("image_encoder/config.json")))
    model = load_clip_vision("image_encoder", num_layers=config.num_hidden_layers - 1)   # wan_tpu.encoders.clip_loading
    hidden = model(pixel_values)   # (B, 1 + patches, hidden): the output of the kept blocks, no final norm

What the towers compute (transformers' `modeling_clip.py`):
  * vision: a bias-free patch convolution (stride = patch), the class token in front, learned position
    embeddings, `pre_layrnorm`, then the blocks. `last_hidden_state` is the last block's output (the
    `post_layernorm` only feeds the pooled output, which nobody here uses, so it is not a parameter);
  * text: token + position embeddings, the blocks under a causal mask, `final_layer_norm`;
  * a block is pre-LN: x + out_proj(attention(layer_norm1(x))), then x + fc2(act(fc1(layer_norm2(x)))),
    with `hidden_act` exact GELU ("gelu") or CLIP's x·σ(1.702x) ("quick_gelu", transformers' default).

A model keeps the first `num_hidden_layers` blocks of its config; the loader builds it with fewer to get
an earlier hidden state: `hidden_states[-2]` (Wan 2.1 I2V, Matrix-Game-2's `use_31_block`) is the output
of a model without its last block. Weights keep the checkpoint's torch layout (linears (out, in),
contracted as x·Wᵀ; the patch convolution (out, in, p, p)), so loading is a copy; block parameters are
stacked on a leading layer axis (`encoder.layers.self_attn.q_proj.weight` is (layers, out, in)) and run
with `jax.lax.scan`: one block is compiled, not 32. Parameter paths are transformers' names without the
`vision_model.` / `text_model.` prefix and the layer index. LayerNorms compute in float32 and round to
the weight dtype, as torch's do; the vision attention runs through `wan_tpu.attention` (kernel
`attention_impl`, None: the backend's fastest), the text tower's causal attention through its masked
reference path.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from wan_tpu.errors import WanInputError
from wan_tpu.layers import attention as attention_lib
from wan_tpu.layers.norms import layer_norm

ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
}


def _from_json(cls, config: dict, where: str):
    """The dataclass `cls` from a transformers config.json dict; fields it leaves out take transformers'
    defaults (`save_pretrained` writes only the fields that differ from them)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    cfg = cls(**{k: v for k, v in config.items() if k in fields})
    if cfg.hidden_act not in ACTIVATIONS:
        raise WanInputError(f"{where}: CLIP hidden_act {cfg.hidden_act!r} is not supported; use one of {sorted(ACTIVATIONS)}")
    if cfg.hidden_size % cfg.num_attention_heads:
        raise WanInputError(f"{where}: hidden_size {cfg.hidden_size} is not divisible by num_attention_heads "
                            f"{cfg.num_attention_heads}")
    return cfg


@dataclasses.dataclass(frozen=True)
class CLIPVisionConfig:
    """The fields of transformers' `CLIPVisionConfig` the tower uses, with its defaults."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5

    @classmethod
    def from_json(cls, config: dict, where: str = "CLIP vision config.json") -> CLIPVisionConfig:
        return _from_json(cls, config, where)

    def to_json(self) -> dict:
        """config.json as transformers writes it."""
        return {"model_type": "clip_vision_model", "architectures": ["CLIPVisionModel"], **dataclasses.asdict(self)}

    @property
    def num_positions(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + 1


@dataclasses.dataclass(frozen=True)
class CLIPTextConfig:
    """The fields of transformers' `CLIPTextConfig` the tower (and its tokenizer framing) uses, with its defaults."""

    vocab_size: int = 49408
    hidden_size: int = 512
    intermediate_size: int = 2048
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    pad_token_id: int = 1
    bos_token_id: int = 49406
    eos_token_id: int = 49407

    @classmethod
    def from_json(cls, config: dict, where: str = "CLIP text config.json") -> CLIPTextConfig:
        return _from_json(cls, config, where)

    def to_json(self) -> dict:
        """config.json as transformers writes it."""
        return {"model_type": "clip_text_model", "architectures": ["CLIPTextModel"], **dataclasses.asdict(self)}


def _linear(x, weight, bias):
    """x · weightᵀ + bias with a torch-layout (out, in) weight, in the weight's dtype."""
    return jnp.einsum("...i,oi->...o", x.astype(weight.dtype), weight) + bias


class Linear(nnx.Module):
    """A torch-layout linear (`weight` (out, in), `bias` (out,)), with an optional leading layer axis."""

    def __init__(self, d_in: int, d_out: int, dtype, layers: tuple[int, ...] = ()):
        self.weight = nnx.Param(jnp.zeros((*layers, d_out, d_in), dtype))
        self.bias = nnx.Param(jnp.zeros((*layers, d_out), dtype))

    def __call__(self, x):
        return _linear(x, self.weight[...], self.bias[...])


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype, layers: tuple[int, ...] = ()):
        self.weight = nnx.Param(jnp.zeros((*layers, dim), dtype))
        self.bias = nnx.Param(jnp.zeros((*layers, dim), dtype))
        self.eps = eps

    def __call__(self, x):
        return layer_norm(x, self.eps, self.weight[...], self.bias[...]).astype(self.weight.dtype)


class Weight(nnx.Module):
    """One tensor under the name `weight` (an `nn.Embedding` table, the patch `nn.Conv2d` kernel)."""

    def __init__(self, shape: tuple[int, ...], dtype):
        self.weight = nnx.Param(jnp.zeros(shape, dtype))


class CLIPAttention(nnx.Module):
    def __init__(self, cfg, dtype, layers, causal: bool, attention_impl):
        d = cfg.hidden_size
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (Linear(d, d, dtype, layers) for _ in range(4))
        self.num_heads, self.causal, self.attention_impl = cfg.num_attention_heads, causal, attention_impl

    def __call__(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).reshape(b, s, self.num_heads, -1) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.causal:  # the kernels of `attention` take no mask
            out = attention_lib.reference_attention(q, k, v, causal=True)
        else:
            out = attention_lib.attention(q, k, v, impl=self.attention_impl)
        return self.out_proj(out.reshape(b, s, -1))


class CLIPMLP(nnx.Module):
    def __init__(self, cfg, dtype, layers):
        self.fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, dtype, layers)
        self.fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, dtype, layers)
        self.activation = cfg.hidden_act

    def __call__(self, x):
        return self.fc2(ACTIVATIONS[self.activation](self.fc1(x)))


class CLIPEncoderLayer(nnx.Module):
    """One pre-LN block (or `layers` of them stacked, for the scan)."""

    def __init__(self, cfg, dtype, layers=(), causal=False, attention_impl=None):
        self.self_attn = CLIPAttention(cfg, dtype, layers, causal, attention_impl)
        self.layer_norm1 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype, layers)
        self.mlp = CLIPMLP(cfg, dtype, layers)
        self.layer_norm2 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype, layers)

    def __call__(self, x):
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nnx.Module):
    def __init__(self, cfg, dtype, causal: bool, attention_impl):
        self.layers = CLIPEncoderLayer(cfg, dtype, (cfg.num_hidden_layers,), causal, attention_impl)

    def __call__(self, x):
        graph, state = nnx.split(self.layers)

        def body(x, layer_state):
            with jax.named_scope("clip_block"):
                return nnx.merge(graph, layer_state)(x), None

        return jax.lax.scan(body, x, state)[0]


def _check_dtype(dtype):
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise WanInputError(f"the CLIP towers run in float32 or bfloat16, not {jnp.dtype(dtype).name}")


class CLIPVisionEmbeddings(nnx.Module):
    def __init__(self, cfg: CLIPVisionConfig, dtype):
        p = cfg.patch_size
        self.class_embedding = nnx.Param(jnp.zeros((cfg.hidden_size,), dtype))
        self.patch_embedding = Weight((cfg.hidden_size, cfg.num_channels, p, p), dtype)
        self.position_embedding = Weight((cfg.num_positions, cfg.hidden_size), dtype)
        self.patch_size = p

    def __call__(self, pixel_values):
        weight = self.patch_embedding.weight[...]
        b, c, h, w = pixel_values.shape
        p = self.patch_size
        # A stride-p convolution with a p×p kernel is a matmul over each patch's (c, p, p) values.
        patches = pixel_values.astype(weight.dtype).reshape(b, c, h // p, p, w // p, p)
        x = jnp.einsum("bcipjq,dcpq->bijd", patches, weight).reshape(b, (h // p) * (w // p), -1)
        cls = jnp.broadcast_to(self.class_embedding[...], (b, 1, x.shape[-1]))
        return jnp.concatenate([cls, x], axis=1) + self.position_embedding.weight[...]


class CLIPVisionTransformer(nnx.Module):
    """transformers' `CLIPVisionModel` up to `last_hidden_state`; parameters are zeros until loaded
    (`wan_tpu.encoders.clip_loading.load_clip_vision`) or drawn (`random_clip`); build abstractly with `nnx.eval_shape`."""

    def __init__(self, config: CLIPVisionConfig, dtype=jnp.float32, attention_impl: str | None = None):
        _check_dtype(dtype)
        self.config = config
        self.embeddings = CLIPVisionEmbeddings(config, dtype)
        self.pre_layrnorm = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype)
        self.encoder = CLIPEncoder(config, dtype, causal=False, attention_impl=attention_impl)

    def __call__(self, pixel_values):
        """(B, C, S, S) pixel values, S the config's image size → (B, 1 + (S/patch)², hidden); runs compiled."""
        s = self.config.image_size
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != (self.config.num_channels, s, s):
            raise WanInputError(f"CLIP vision takes (B, {self.config.num_channels}, {s}, {s}) pixel values, got shape "
                                f"{tuple(pixel_values.shape)}; resize the images to {s}×{s} first")
        return _run(*nnx.split(self), pixel_values)

    def lower(self, batch: int = 1):
        """The program `__call__` runs for `batch` float32 images, lowered (`.compile()` it; `.out_info` is
        its output's shape), also on an abstract tower (`nnx.eval_shape`), before any weight exists."""
        s = self.config.image_size
        return _run.lower(*nnx.split(self), jax.ShapeDtypeStruct((batch, self.config.num_channels, s, s), jnp.float32))

    def apply(self, pixel_values):
        """The forward computation, traced op by op; call it under jit."""
        return self.encoder(self.pre_layrnorm(self.embeddings(pixel_values)))


class CLIPTextEmbeddings(nnx.Module):
    def __init__(self, cfg: CLIPTextConfig, dtype):
        self.token_embedding = Weight((cfg.vocab_size, cfg.hidden_size), dtype)
        self.position_embedding = Weight((cfg.max_position_embeddings, cfg.hidden_size), dtype)

    def __call__(self, input_ids):
        return self.token_embedding.weight[...][input_ids] + self.position_embedding.weight[...][: input_ids.shape[1]]


class CLIPTextTransformer(nnx.Module):
    """transformers' `CLIPTextModel` up to `last_hidden_state` (after `final_layer_norm`); see `CLIPVisionTransformer`."""

    def __init__(self, config: CLIPTextConfig, dtype=jnp.float32):
        _check_dtype(dtype)
        self.config = config
        self.embeddings = CLIPTextEmbeddings(config, dtype)
        self.encoder = CLIPEncoder(config, dtype, causal=True, attention_impl=None)
        self.final_layer_norm = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype)

    def __call__(self, input_ids):
        """(B, S) token ids, S ≤ max_position_embeddings → (B, S, hidden); runs compiled."""
        n = self.config.max_position_embeddings
        if input_ids.ndim != 2 or not 1 <= input_ids.shape[1] <= n:
            raise WanInputError(f"CLIP text takes (B, S) token ids with 1 ≤ S ≤ {n}, got shape {tuple(input_ids.shape)}")
        return _run(*nnx.split(self), jnp.asarray(input_ids, jnp.int32))

    def apply(self, input_ids):
        return self.final_layer_norm(self.encoder(self.embeddings(input_ids)))


@functools.partial(jax.jit, static_argnums=0)
def _run(graphdef, state, inputs):
    """A tower on a split model, compiled once per input shape."""
    return nnx.merge(graphdef, state).apply(inputs)


def random_clip(build, seed: int):
    """`build()` (a tower constructor) with seeded random weights (`wan_tpu.loading.random_init.random_module`), the same
    on every machine: linears and the patch kernel N(0, 1/fan_in), LayerNorm weights 1, the rest N(0, 0.02²)."""
    from wan_tpu.loading.random_init import random_module

    return random_module(build, seed, draw=_clip_draw)


def _clip_draw(names, shape, rng):
    """A CLIP parameter's random value: its torch-layout `weight`s do not fit `random_module`'s own rules."""
    import numpy as np

    if names[-1] == "weight" and ("norm" in names[-2] or "layrnorm" in names[-2]):
        return np.ones(shape)
    if names[-1] == "weight" and names[-2] not in ("position_embedding", "token_embedding"):
        fan_in = int(np.prod(shape[1:])) if names[-2] == "patch_embedding" else shape[-1]
        return rng.standard_normal(shape) / np.sqrt(fan_in)
    return 0.02 * rng.standard_normal(shape)
