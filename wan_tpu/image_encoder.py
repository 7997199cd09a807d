"""The CLIP vision encoder of Wan 2.1 I2V: transformers' `CLIPVisionModel` run on JAX through torchax.

As diffusers' `WanImageToVideoPipeline.encode_image`: the `CLIPImageProcessor` of the checkpoint's
`image_processor/` folder prepares the image, and the DiT's image branch takes the penultimate
hidden state (`hidden_states[-2]`, 257 tokens at 224 px), not the pooled output. The forward is one
`jax.jit` computation; its attention (no mask, default scale) runs through `wan_tpu.attention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from transformers import CLIPImageProcessor, CLIPVisionModel

from wan_tpu import torchax_compat


class CLIPImageEncoder:
    """`encode(images) -> (B, tokens, hidden_size)` jax array: CLIP's penultimate hidden state."""

    def __init__(self, model: CLIPVisionModel, image_processor, state, attention_impl: str | None = None):
        self.model = model
        self.image_processor = image_processor
        self.state = state
        self.attention_impl = attention_impl
        self.config = model.config
        self._forward = jax.jit(self._penultimate_hidden_state)

    @classmethod
    def from_pretrained(
        cls, image_encoder_dir, image_processor_dir, dtype=jnp.float32, mesh=None, attention_impl=None
    ) -> CLIPImageEncoder:
        """diffusers' I2V layout: `image_encoder/` (weights) and `image_processor/` (preprocessing)."""
        torchax_compat.require_file(image_encoder_dir, "config.json", "image_encoder")
        torchax_compat.require_file(image_processor_dir, "preprocessor_config.json", "image_processor")
        image_processor = CLIPImageProcessor.from_pretrained(image_processor_dir)
        model = CLIPVisionModel.from_pretrained(
            image_encoder_dir, dtype=torchax_compat.torch_dtype(dtype), attn_implementation="sdpa"
        ).eval()
        state = torchax_compat.module_state(model, mesh=mesh, family="clip")
        return cls(model, image_processor, state, attention_impl)

    def preprocess(self, images):
        """Pixel values (B, 3, H, W) float32 from PIL images or uint8 HWC arrays, as the processor makes them."""
        pixel_values = self.image_processor(images=images, return_tensors="pt").pixel_values
        return pixel_values.to(torch.float32).numpy()

    def encode(self, images) -> jax.Array:
        # float32 pixels, as diffusers passes them: CLIP casts them to its weight dtype itself.
        return self._forward(self.state, self.preprocess(images))

    def _penultimate_hidden_state(self, state, pixel_values):
        with torchax_compat.attention_impl(self.attention_impl):
            return torchax_compat.functional_call(
                self.model,
                state,
                (pixel_values,),
                {"output_hidden_states": True},
                output=lambda out: out.hidden_states[-2],
            )
