"""OpenCLIP ViT-H/14 towers of UnifoLM-WMA on JAX: the native CLIP towers of `wan_tpu.encoders.clip`.

The authors' `FrozenOpenCLIPImageEmbedderV2` returns all 257 tokens of the vision transformer
(class + 16×16 patches) *before* `ln_post` and the projection; their `FrozenOpenCLIPEmbedder`
("penultimate") runs the text transformer without its last block, then `ln_final`. OpenCLIP's
ViT-H-14 blocks (pre-LN, exact GELU, fused q/k/v, bias-free patch conv, `ln_pre`) are exactly
transformers' `CLIPVisionModel` (`last_hidden_state` is before `post_layernorm`) and `CLIPTextModel`
(`hidden_act="gelu"`; with the last block dropped, `last_hidden_state` is the penultimate block's
output through `final_layer_norm`), as `tests/test_openclip_encoders.py` checks against open_clip.
`wan-convert-unifolm` (`wan_tpu/unifolm/convert.py`) renames the weights with `open_clip_to_hf` and writes transformers
folders; they load file → device (`wan_tpu.encoders.clip_loading`) and run without torch or transformers
(the converters and `write_tower` use them, offline).

    image_encoder = OpenCLIPImageEncoder.from_pretrained("ckpt/image_encoder")
    tokens = image_encoder.encode(images)          # (B, 3, H, W) in [-1, 1] → (B, 257, 1280)
    text_encoder = OpenCLIPTextEncoder.from_pretrained("ckpt/text_encoder", "ckpt/tokenizer")
    context = text_encoder.encode(["pick up the cup"])     # (B, 77, 1024)

Image preprocessing is the authors' kornia chain (`resize` to 224² bicubic with `align_corners=True`
and antialias: a reflect-padded Gaussian blur when shrinking, then `(x + 1) / 2` and CLIP's mean/std),
done as two constant matrices per input size (blur ∘ bicubic along each axis), computed in float64.
Text is cleaned and framed as `open_clip.tokenize` does: `[sot] + BPE + [eot]`, cut to 77 with the
last token forced to `eot`, zero-padded; the BPE is the folder's tokenizer run by the `tokenizers` library
(`wan_tpu.encoders.clip_tokenizer`).
"""

from __future__ import annotations

import functools
import html
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import regex
from flax import nnx

from wan_tpu.errors import WanInputError
from wan_tpu.loading.checkpoint import require_file
from wan_tpu.runtime import executable_cache

try:  # open_clip's tokenizer fixes mojibake with ftfy; so do we when it is installed.
    import ftfy
except ImportError:
    ftfy = None

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
CONTEXT_LENGTH = 77


# ---- image preprocessing (kornia.geometry.resize, bicubic, align_corners, antialias) -------------


def _reflect(i: int, n: int) -> int:
    while i < 0 or i >= n:
        i = -i if i < 0 else 2 * (n - 1) - i
    return i


def _blur_matrix(n: int, out: int) -> np.ndarray:
    """kornia's antialias: Gaussian (σ = (n/out − 1)/2, odd size ≥ 3) with reflect padding, as (n, n)."""
    factor = n / out
    if factor <= 1:
        return np.eye(n)
    sigma = max((factor - 1.0) / 2.0, 0.001)
    size = int(max(2.0 * 2 * sigma, 3))
    size += 1 - size % 2
    x = np.arange(size) - size // 2
    kernel = np.exp(-(x**2) / (2 * sigma**2))
    kernel /= kernel.sum()
    m = np.zeros((n, n))
    for i in range(n):
        for j, k in enumerate(kernel):
            m[i, _reflect(i + j - size // 2, n)] += k
    return m


def _bicubic_matrix(n: int, out: int, a: float = -0.75) -> np.ndarray:
    """torch `interpolate(mode="bicubic", align_corners=True)` along one axis, as (out, n)."""

    def near(t):  # |t| ≤ 1
        return ((a + 2) * t - (a + 3)) * t * t + 1

    def far(t):  # 1 < |t| < 2
        return ((a * t - 5 * a) * t + 8 * a) * t - 4 * a

    # torch computes the source position in float32 (`area_pixel_compute_scale`, then scale · i):
    # reproduce that rounding, it moves the result by ~1e-5 at 320 → 224.
    m = np.zeros((out, n))
    scale = np.float32(n - 1) / np.float32(out - 1) if out > 1 else np.float32(0)
    for i in range(out):
        src = np.float32(scale * np.float32(i))
        base = math.floor(src)
        t = float(min(max(np.float32(src - np.float32(base)), 0.0), 1.0))
        for offset, w in zip((-1, 0, 1, 2), (far(t + 1), near(t), near(1 - t), far(2 - t))):
            m[i, min(max(base + offset, 0), n - 1)] += w
    return m


@functools.lru_cache(maxsize=16)
def resize_matrix(n: int, out: int) -> np.ndarray:
    """blur ∘ bicubic along one axis, (out, n) float32; the identity when the size is unchanged."""
    if n == out:
        return np.eye(n, dtype=np.float32)
    return (_bicubic_matrix(n, out) @ _blur_matrix(n, out)).astype(np.float32)


def preprocess_images(images, size: int = 224) -> jax.Array:
    """(B, 3, H, W) in [-1, 1] → CLIP pixel values (B, 3, size, size), float32."""
    images = jnp.asarray(images, jnp.float32)
    if images.ndim != 4 or images.shape[1] != 3:
        raise WanInputError(f"the image encoder takes (B, 3, H, W) images in [-1, 1], got shape {tuple(images.shape)}")
    my, mx = resize_matrix(images.shape[2], size), resize_matrix(images.shape[3], size)
    hi = jax.lax.Precision.HIGHEST
    x = jnp.einsum("oh,bchw,pw->bcop", my, images, mx, precision=hi)
    x = (x + 1.0) / 2.0
    return (x - jnp.asarray(CLIP_MEAN)[:, None, None]) / jnp.asarray(CLIP_STD)[:, None, None]


# ---- towers --------------------------------------------------------------------------------------


def write_tower(folder, config, tensors: dict) -> None:
    """A transformers model folder (`CLIPVisionModel` / `CLIPTextModel.from_pretrained` loads it): `config.json`
    of a `wan_tpu.encoders.clip` config + `model.safetensors` (torch tensors, transformers' names)."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config.to_json(), f, indent=2)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def program_key(model, dtype, attention_impl=None) -> tuple:
    """What determines a tower's encode program besides its input's shape: its config, dtype and attention
    setting (the loaders and the abstract builds make equal modules from them)."""
    return (type(model).__name__, model.config, jnp.dtype(dtype).name, attention_impl)


class OpenCLIPImageEncoder:
    """`encode(images) -> (B, 257, width)`: the authors' `FrozenOpenCLIPImageEmbedderV2`.

    `program_key` (`from_pretrained` and `abstract` set it): with it the encode program is kept in the executable
    cache (`wan_tpu.runtime.executable_cache.cached_call`), so a pipeline's `prepare` compiles it ahead, from the
    abstract tower, and a warm start loads it without tracing; without it, `encode` compiles on use."""

    def __init__(self, model, program_key: tuple | None = None):
        self.model = model  # a `CLIPVisionTransformer`
        self.config = model.config
        self.program_key = program_key

    @classmethod
    def from_pretrained(cls, folder, dtype=jnp.float32, mesh=None, attention_impl=None) -> OpenCLIPImageEncoder:
        from wan_tpu.encoders.clip_loading import load_clip_vision

        require_file(folder, "config.json", "image_encoder")
        model = load_clip_vision(folder, dtype=dtype, mesh=mesh, attention_impl=attention_impl)
        return cls(model, program_key(model, dtype, attention_impl))

    @classmethod
    def abstract(cls, folder, dtype=jnp.float32, attention_impl=None) -> OpenCLIPImageEncoder:
        """The encoder `from_pretrained` gives, without weights (its config alone): `encode` under
        `jax.eval_shape` gives the loaded one's output shape and dtype before its weights are read."""
        from wan_tpu.encoders.clip_loading import abstract_clip_vision, clip_vision_config

        model = abstract_clip_vision(clip_vision_config(folder), dtype, attention_impl)
        return cls(model, program_key(model, dtype, attention_impl))

    def encode(self, images) -> jax.Array:
        return executable_cache.cached_call(
            "openclip-image", self.program_key, _image_tokens,
            (*nnx.split(self.model), jnp.asarray(images, jnp.float32)), static_argnums=(0,), key_names_statics=True)


@functools.partial(jax.jit, static_argnums=0)
def _image_tokens(graphdef, state, images):
    model = nnx.merge(graphdef, state)
    return model.apply(preprocess_images(images, model.config.image_size))


@functools.partial(jax.jit, static_argnums=0)
def _text_tokens(graphdef, state, input_ids):
    return nnx.merge(graphdef, state)(input_ids)


def clean_text(text: str) -> str:
    """open_clip's `basic_clean` + `whitespace_clean` + lower-casing."""
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return regex.sub(r"\s+", " ", text).strip().lower()


class OpenCLIPTextEncoder:
    """`encode(prompts) -> (B, 77, width)`: the authors' `FrozenOpenCLIPEmbedder(layer="penultimate")`."""

    def __init__(self, model, tokenizer, program_key: tuple | None = None):
        self.model, self.tokenizer = model, tokenizer  # a `CLIPTextTransformer`, a `CLIPBPETokenizer`
        self.config = model.config
        self.program_key = program_key  # as `OpenCLIPImageEncoder.program_key`

    @classmethod
    def from_pretrained(cls, folder, tokenizer_folder, dtype=jnp.float32, mesh=None) -> OpenCLIPTextEncoder:
        from wan_tpu.encoders.clip_loading import load_clip_text
        from wan_tpu.encoders.clip_tokenizer import CLIPBPETokenizer

        require_file(folder, "config.json", "text_encoder")
        require_file(tokenizer_folder, "tokenizer_config.json", "tokenizer")
        model = load_clip_text(folder, dtype=dtype, mesh=mesh)
        return cls(model, CLIPBPETokenizer.from_folder(tokenizer_folder), program_key(model, dtype))

    @classmethod
    def abstract(cls, folder, tokenizer_folder, dtype=jnp.float32) -> OpenCLIPTextEncoder:
        """The encoder `from_pretrained` gives, without weights (its config and tokenizer alone), as
        `OpenCLIPImageEncoder.abstract`."""
        from wan_tpu.encoders.clip_loading import abstract_clip_text, clip_text_config
        from wan_tpu.encoders.clip_tokenizer import CLIPBPETokenizer

        model = abstract_clip_text(clip_text_config(folder), dtype)
        return cls(model, CLIPBPETokenizer.from_folder(tokenizer_folder), program_key(model, dtype))

    def tokenize(self, prompts: list[str]) -> np.ndarray:
        """(B, 77) int32 ids, exactly `open_clip.tokenize(prompts)`."""
        if isinstance(prompts, str) or not prompts:
            raise WanInputError("encode() takes a non-empty list of prompts; wrap a single prompt in a list: [prompt]")
        n = self.config.max_position_embeddings
        out = np.zeros((len(prompts), n), np.int32)
        for row, prompt in zip(out, prompts):
            ids = [self.config.bos_token_id, *self.tokenizer(clean_text(prompt)), self.config.eos_token_id][:n]
            ids[-1] = self.config.eos_token_id
            row[: len(ids)] = ids
        return out

    def encode(self, prompts: list[str]) -> jax.Array:
        return self.encode_tokens(self.tokenize(prompts))

    def encode_tokens(self, input_ids) -> jax.Array:
        """(B, 77) token ids (as `tokenize` makes them) → (B, 77, width)."""
        return executable_cache.cached_call(
            "openclip-text", self.program_key, _text_tokens, (*nnx.split(self.model), jnp.asarray(input_ids, jnp.int32)),
            static_argnums=(0,), key_names_statics=True)


# ---- open_clip → transformers names ----------------------------------------------------------------

_BLOCK = {
    "ln_1": "layer_norm1",
    "ln_2": "layer_norm2",
    "attn.out_proj": "self_attn.out_proj",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
}


def _blocks(src: dict, prefix: str, dst_prefix: str, layers: int) -> dict:
    out = {}
    for i in range(layers):
        p, q = f"{prefix}transformer.resblocks.{i}.", f"{dst_prefix}encoder.layers.{i}."
        for kind in ("weight", "bias"):
            for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
                fused = src[f"{p}attn.in_proj_{kind}"]
                width = fused.shape[0] // 3
                out[f"{q}self_attn.{name}.{kind}"] = fused[j * width : (j + 1) * width]
            for theirs, ours in _BLOCK.items():
                out[f"{q}{ours}.{kind}"] = src[f"{p}{theirs}.{kind}"]
    return out


def open_clip_vision_to_hf(src: dict, layers: int) -> dict:
    """open_clip `visual.*` tensors (prefix stripped) → `CLIPVisionModel` names; `proj` is not used."""
    out = {
        "vision_model.embeddings.class_embedding": src["class_embedding"],
        "vision_model.embeddings.patch_embedding.weight": src["conv1.weight"],
        "vision_model.embeddings.position_embedding.weight": src["positional_embedding"],
    }
    for kind in ("weight", "bias"):
        out[f"vision_model.pre_layrnorm.{kind}"] = src[f"ln_pre.{kind}"]
        out[f"vision_model.post_layernorm.{kind}"] = src[f"ln_post.{kind}"]
    out.update(_blocks(src, "", "vision_model.", layers))
    return out


def open_clip_text_to_hf(src: dict, layers: int) -> dict:
    """open_clip text tensors → `CLIPTextModel` names, keeping the first `layers` blocks."""
    out = {
        "text_model.embeddings.token_embedding.weight": src["token_embedding.weight"],
        "text_model.embeddings.position_embedding.weight": src["positional_embedding"],
    }
    for kind in ("weight", "bias"):
        out[f"text_model.final_layer_norm.{kind}"] = src[f"ln_final.{kind}"]
    out.update(_blocks(src, "", "text_model.", layers))
    return out


def vision_config(width: int, layers: int, heads: int, patch_size: int, image_size: int = 224, mlp_ratio: float = 4.0):
    """The `CLIPVisionConfig` of an open_clip vision tower (ViT-H-14: 1280, 32, 16, 14)."""
    from wan_tpu.encoders.clip import CLIPVisionConfig

    return CLIPVisionConfig(hidden_size=width, intermediate_size=int(width * mlp_ratio), num_hidden_layers=layers,
                            num_attention_heads=heads, patch_size=patch_size, image_size=image_size, hidden_act="gelu",
                            layer_norm_eps=1e-5)


def text_config(width: int, layers: int, heads: int, vocab_size: int = 49408, context_length: int = CONTEXT_LENGTH):
    """The `CLIPTextConfig` of an open_clip text tower cut to `layers` blocks (ViT-H-14 penultimate: 1024, 23, 16)."""
    from wan_tpu.encoders.clip import CLIPTextConfig

    return CLIPTextConfig(vocab_size=vocab_size, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
                          num_attention_heads=heads, max_position_embeddings=context_length, hidden_act="gelu",
                          layer_norm_eps=1e-5, bos_token_id=vocab_size - 2, eos_token_id=vocab_size - 1, pad_token_id=0)


def tokenizer_from_open_clip(open_clip_tokenizer):
    """A transformers `CLIPTokenizer` with the BPE of an `open_clip.SimpleTokenizer` (vocabulary and merge ranks)."""
    from transformers import CLIPTokenizer

    vocab = dict(open_clip_tokenizer.encoder)
    n = len(vocab)  # open_clip's start/end-of-text tokens are the last two ids
    names = {n - 2: "<|startoftext|>", n - 1: "<|endoftext|>"}
    vocab = {names.get(i, tok): i for tok, i in vocab.items()}
    merges = [tuple(pair) for pair, _ in sorted(open_clip_tokenizer.bpe_ranks.items(), key=lambda kv: kv[1])]
    return CLIPTokenizer(vocab=vocab, merges=merges)
