"""The UMT5 text encoder of Wan: our JAX `UMT5Encoder` (`wan_tpu.encoders.umt5`) and its tokenizer.

    encoder = UMT5TextEncoder.from_pretrained("ckpt/text_encoder", "ckpt/tokenizer", dtype=jnp.bfloat16)
    encoder = UMT5TextEncoder.from_pretrained("umt5_xxl_fp8_e4m3fn_scaled.safetensors", "ckpt/tokenizer")
    embeds = encoder.encode(["a cat walks on the grass"])        # (1, 512, 4096)

No torch, transformers or torchax: the weights go from the safetensors to the devices
(`wan_tpu.encoders.umt5_loading`, sharded over a mesh when one is given), all but the token embedding,
which is looked up on the host from the checkpoint's memory map (`UMT5Embedding`); the tokenizer is the folder's
tokenizer.json (`wan_tpu.encoders.tokenizers.UMT5Tokenizer`), and the encoder is one `jax.jit` program per
batch size, its layers a `lax.scan`. `compile_encode(config, dtype, batch)` compiles that program from
shapes alone, before any weight is read (what `WanPipeline.prepare` does in a background thread).
Prompts are cleaned, tokenized to 512 tokens, encoded, and each embedding is cut to the prompt's true
length and zero-padded back to 512, exactly as diffusers' `WanPipeline._get_t5_prompt_embeds` (and
the official Wan `T5EncoderModel`) hand them to the DiT.
"""

from __future__ import annotations

import functools
import html

import jax
import jax.numpy as jnp
import numpy as np
import regex

from wan_tpu.errors import WanInputError
from wan_tpu.runtime.compile_ahead import abstract

try:  # diffusers and the official Wan code fix mojibake with ftfy when it is installed; so do we.
    import ftfy
except ImportError:
    ftfy = None

MAX_SEQUENCE_LENGTH = 512

# `sample_neg_prompt` of the official Wan repository (wan/configs/shared_config.py), the negative
# prompt its generate.py uses when none is given.
WAN_NEGATIVE_PROMPT = (
    "色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，"
    "JPEG压缩残留，丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，"
    "手指融合，静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走"
)


def prompt_clean(text: str) -> str:
    """diffusers' Wan `prompt_clean`: ftfy (if installed), HTML unescaped twice, whitespace collapsed."""
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    # `regex`, not `re`: its `\s` is Unicode White_Space, the class diffusers collapses.
    return regex.sub(r"\s+", " ", text).strip()


class UMT5TextEncoder:
    """`encode(prompts) -> (B, 512, d_model)` jax array; rows past each prompt's length are zero."""

    def __init__(self, model, embed_tokens, tokenizer, max_sequence_length: int = MAX_SEQUENCE_LENGTH):
        from flax import nnx

        self.model = model
        self.embed_tokens = embed_tokens
        self.tokenizer = tokenizer
        self.max_sequence_length = max_sequence_length
        self.config = model.config
        self.graphdef, self.state = nnx.split(model)

    @classmethod
    def from_pretrained(cls, text_encoder, tokenizer_dir, dtype=jnp.bfloat16, mesh=None,
                        offload: bool = False) -> UMT5TextEncoder:
        """diffusers' Wan layout: `text_encoder/` (weights, sharded by the `umt5` rules) and `tokenizer/`; or
        one text encoder file (Wan's `models_t5_umt5-xxl-enc-bf16.pth`, ComfyUI's `umt5_xxl_*.safetensors`:
        the config from its shapes, `wan_tpu.encoders.umt5_loading`) and a tokenizer folder. `offload=True`:
        the blocks are read straight into host memory and streamed from there (`load_umt5`)."""
        from wan_tpu.encoders.tokenizers import UMT5Tokenizer
        from wan_tpu.encoders.umt5_loading import load_umt5, umt5_config

        umt5_config(text_encoder)  # a missing config.json or a wrong file is named before the tokenizer is read
        tokenizer = UMT5Tokenizer.from_folder(tokenizer_dir, MAX_SEQUENCE_LENGTH)
        return cls(*load_umt5(text_encoder, dtype=dtype, mesh=mesh, offload=offload), tokenizer)

    def offload_blocks(self, resident: int = 0) -> UMT5TextEncoder:
        """Stream the encoder's blocks from host memory, `resident` of them kept on the device
        (`UMT5Encoder.offload_blocks`); in place, bit-identical embeddings."""
        from flax import nnx

        self.model.offload_blocks(resident)
        self.graphdef, self.state = nnx.split(self.model)
        return self

    def tokenize(self, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and attention mask, (B, max_sequence_length) int32, padded and truncated."""
        if isinstance(prompts, str) or not prompts:
            raise WanInputError("encode() takes a non-empty list of prompts; wrap a single prompt in a list: [prompt]")
        return self.tokenizer([prompt_clean(p) for p in prompts])

    def encode(self, prompts: list[str]) -> jax.Array:
        input_ids, attention_mask = self.tokenize(prompts)
        return _embed(self.graphdef, self.state, self.embed_tokens(input_ids), attention_mask)

    def compile(self, batch: int) -> None:
        """Compile (without running) the program `encode` runs for `batch` prompts, from shapes alone (the
        lookup gives host rows: its output has no placement; the weights' placements are the loader's)."""
        _lower(self.graphdef, abstract(self.state), self.config, self.model.dtype, batch,
               self.max_sequence_length).compile()


def compile_encode(config, dtype, batch: int, max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> None:
    """Compile the program `UMT5TextEncoder.encode` runs for `batch` prompts on an unsharded encoder of
    `config` (a `wan_tpu.encoders.umt5.UMT5Config`) in `dtype`, before any weight exists: the encoder
    loaded later finds it compiled (same function, same argument shapes and placements)."""
    from flax import nnx

    from wan_tpu.encoders.umt5 import UMT5Encoder

    graphdef, state = nnx.split(nnx.eval_shape(lambda: UMT5Encoder(config, dtype)))
    _lower(graphdef, abstract(state), config, dtype, batch, max_sequence_length).compile()


def _lower(graphdef, state, config, dtype, batch: int, length: int):
    embeds = jax.ShapeDtypeStruct((batch, length, config.d_model), dtype)
    return _embed.lower(graphdef, state, embeds, jax.ShapeDtypeStruct((batch, length), jnp.int32))


@functools.partial(jax.jit, static_argnums=0)
def _embed(graphdef, state, inputs_embeds, attention_mask):
    from flax import nnx

    hidden = nnx.merge(graphdef, state).apply(inputs_embeds, attention_mask)
    # Cut each prompt at its true length (the count of mask ones), then zero-pad to the full length.
    seq_lens = (attention_mask > 0).sum(axis=1)
    keep = jnp.arange(hidden.shape[1])[None, :] < seq_lens[:, None]
    return jnp.where(keep[..., None], hidden, 0)
