"""The UMT5 text encoder: transformers' `UMT5EncoderModel` run on JAX through torchax.

The torch module is only the program: its weights move to JAX (sharded over a mesh when one is
given) and the whole forward is traced into one `jax.jit` computation, compiled once per batch size.
Prompts are cleaned, tokenized to 512 tokens, encoded, and each embedding is cut to the prompt's
true length and zero-padded back to 512, exactly as diffusers' `WanPipeline._get_t5_prompt_embeds`
(and the official Wan `T5EncoderModel`) hand them to the DiT.
"""

from __future__ import annotations

import html

import jax
import jax.numpy as jnp
import numpy as np
import regex

from wan_tpu.errors import WanInputError

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

    def __init__(self, model, tokenizer, state, max_sequence_length: int = MAX_SEQUENCE_LENGTH):
        self.model = model
        self.tokenizer = tokenizer
        self.state = state
        self.max_sequence_length = max_sequence_length
        self.config = model.config
        self._forward = jax.jit(self._embed)

    @classmethod
    def from_pretrained(cls, text_encoder_dir, tokenizer_dir, dtype=jnp.bfloat16, mesh=None) -> UMT5TextEncoder:
        """diffusers' Wan layout: `text_encoder/` (weights, sharded by the `umt5` rules) and `tokenizer/`."""
        # torch and transformers take seconds to import: only a run that loads the encoder pays.
        from transformers import AutoTokenizer, UMT5EncoderModel

        from wan_tpu import torchax_compat

        torchax_compat.require_file(text_encoder_dir, "config.json", "text_encoder")
        torchax_compat.require_file(tokenizer_dir, "tokenizer_config.json", "tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        model = UMT5EncoderModel.from_pretrained(
            text_encoder_dir, dtype=torchax_compat.torch_dtype(dtype), attn_implementation="sdpa"
        ).eval()
        state = torchax_compat.module_state(model, mesh=mesh, family="umt5")
        return cls(model, tokenizer, state)

    def tokenize(self, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and attention mask, (B, max_sequence_length) int32, padded and truncated."""
        if isinstance(prompts, str) or not prompts:
            raise WanInputError("encode() takes a non-empty list of prompts; wrap a single prompt in a list: [prompt]")
        inputs = self.tokenizer(
            [prompt_clean(p) for p in prompts],
            padding="max_length",
            max_length=self.max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="np",
        )
        return inputs["input_ids"].astype(np.int32), inputs["attention_mask"].astype(np.int32)

    def encode(self, prompts: list[str]) -> jax.Array:
        input_ids, attention_mask = self.tokenize(prompts)
        return self._forward(self.state, input_ids, attention_mask)

    def _embed(self, state, input_ids, attention_mask):
        from wan_tpu import torchax_compat

        # UMT5 passes its position bias as an SDPA mask, so its attention keeps torch's math path.
        hidden = torchax_compat.functional_call(
            self.model, state, (input_ids, attention_mask), output=lambda out: out.last_hidden_state
        )
        # Cut each prompt at its true length (the count of mask ones), then zero-pad to the full length.
        seq_lens = (attention_mask > 0).sum(axis=1)
        keep = jnp.arange(hidden.shape[1])[None, :] < seq_lens[:, None]
        return jnp.where(keep[..., None], hidden, 0)
