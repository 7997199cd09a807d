"""Built-in presets: whole pipelines with random weights from a fixed seed, nothing downloaded.

`tiny` is a 2-layer DiT (`wan_tpu.configs.models.VARIANTS["tiny"]`) and a few-channel Wan 2.1 VAE
with 16 latent channels and a 2-layer UMT5 (`wan_tpu.encoders.umt5`; weights of all three drawn by
`random_module`), and the in-process tokenizer of `wan_tpu.encoders.tokenizers`: no torch or transformers.
`tiny-ti2v` is the same over the tiny Wan 2.2 VAE (8 latent channels, 16x spatial): text-and-image to video
as Wan 2.2 TI2V makes it (the image's latents held as the first frame at t=0; no CLIP tower to compile).
They exist to run every stage quickly on any machine:

    python -m wan_tpu.generate --model tiny --prompt "a cat walks on the grass"   # CPU, seconds
    python -m wan_tpu.generate --model tiny-ti2v --image first.png --prompt "a cat walks on the grass"

The same seed gives the same weights on every machine, so tiny runs are reproducible end to end.
`save_diffusers_checkpoint` writes random checkpoints of any size in the diffusers layout (tests,
benchmarks).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from wan_tpu.configs.models import VARIANTS
from wan_tpu.configs.vae import TINY_VAE, VAE_PRESETS
from wan_tpu.loading.random_init import TINY_SEED, random_module
from wan_tpu.wan.transformer import set_attention


def tiny_umt5_config(d_model: int):
    """The tiny preset's 2-layer UMT5 (`wan_tpu.encoders.umt5.UMT5Config`) over the tiny tokenizer's vocabulary."""
    from wan_tpu.encoders.tokenizers import TINY_VOCAB_SIZE
    from wan_tpu.encoders.umt5 import UMT5Config

    return UMT5Config(vocab_size=TINY_VOCAB_SIZE, d_model=d_model, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                      relative_attention_num_buckets=8, relative_attention_max_distance=32)


def hf_umt5_config(cfg):
    """transformers' `UMT5Config` for one of ours (to write checkpoints with `UMT5EncoderModel`)."""
    from transformers import UMT5Config

    return UMT5Config(**dataclasses.asdict(cfg), dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
                      decoder_start_token_id=0)


def umt5_draw(cfg):
    """`random_module`'s `draw` for a `UMT5Encoder`: transformers' (Mesh TensorFlow) init scales, torch layout:
    linears N(0, 1/fan_in) with fan_in the last axis, relative-position tables N(0, 1/d_model), norm
    weights 1."""
    import numpy as np

    def draw(names, shape, rng):
        module = names[-2]
        if module in ("attention_norm", "ffn_norm", "final_layer_norm"):
            return np.ones(shape)
        if module == "relative_attention_bias":
            return rng.standard_normal(shape) / cfg.d_model**0.5
        return rng.standard_normal(shape) / shape[-1] ** 0.5

    return draw


def tiny_umt5(d_model: int, dtype=jnp.float32, seed: int = TINY_SEED):
    """A random-weight `UMT5Encoder` and its `UMT5Embedding` (N(0, 1), as transformers draws it), the
    same for a given seed on every machine."""
    import numpy as np

    from wan_tpu.encoders.umt5 import UMT5Embedding, UMT5Encoder

    cfg = tiny_umt5_config(d_model)
    table = np.random.default_rng(seed).standard_normal((cfg.vocab_size, cfg.d_model)).astype(np.float32)
    embedding = UMT5Embedding(table.astype(dtype), dtype)
    return random_module(lambda: UMT5Encoder(cfg, dtype), seed + 1, draw=umt5_draw(cfg)), embedding


# Each preset's VAE (its variant is `VARIANTS[name]`).
TINY_VAES = {"tiny": TINY_VAE, "tiny-ti2v": VAE_PRESETS["tiny-2.2"]}


def tiny(pipeline_class, dtype=jnp.bfloat16, mesh=None, attention=None, vae_dtype=jnp.float32,
         seed: int = TINY_SEED, name: str = "tiny"):
    """The `name` preset (`tiny` or `tiny-ti2v`, see the module docstring), an instance of `pipeline_class`
    (`WanPipeline`, which passes itself: this module does not import the pipeline's). `attention`: the DiT's
    kernel name."""

    variant, vae_config = VARIANTS[name], TINY_VAES[name]

    def transformer():
        from flax import nnx

        from wan_tpu.wan.transformer import WanTransformer

        dit = random_module(lambda: WanTransformer(variant.transformer, dtype=dtype, rngs=nnx.Rngs(0)), seed)
        return set_attention(dit, attention, mesh)

    def vae():
        from flax import nnx

        from wan_tpu.vae.model import WanVAE

        model = random_module(lambda: WanVAE(vae_config, dtype=vae_dtype, rngs=nnx.Rngs(0)), seed + 1)
        model.mesh = mesh
        return model

    def text_encoder():
        from wan_tpu.encoders.tokenizers import tiny_tokenizer
        from wan_tpu.encoders.umt5_text import UMT5TextEncoder

        model, embed_tokens = tiny_umt5(variant.transformer.text_dim, dtype, seed + 2)
        if mesh is not None:
            from wan_tpu.parallel.sharding import shard_module

            shard_module(model, mesh, "umt5")
        return UMT5TextEncoder(model, embed_tokens, tiny_tokenizer())

    loaders = {"transformer": transformer, "vae": vae, "text_encoder": text_encoder}
    return pipeline_class(variant, vae_config, loaders, name=name, dtype=dtype, mesh=mesh, vae_dtype=vae_dtype,
                          attention=attention, text_encoder_config=tiny_umt5_config(variant.transformer.text_dim))


PRESETS = {name: functools.partial(tiny, name=name) for name in TINY_VAES}


def save_diffusers_checkpoint(path: str, transformer, vae, *, transformer_2=None, boundary_ratio: float | None = None,
                              expand_timesteps: bool = False, text_encoder=None, image_encoder=None,
                              flow_shift: float = 5.0, seed: int = 0, torch_dtype=None) -> None:
    """Write a random-weight checkpoint in the diffusers layout (`model_index.json`, `transformer/`, ...).

    `transformer` / `transformer_2`: `WanTransformerConfig`s; `vae`: a `WanVAEConfig`;
    `text_encoder`: a transformers `UMT5Config` (default: the tiny one, with the in-process
    tokenizer); `image_encoder`: a `CLIPVisionConfig` for a Wan 2.1 I2V checkpoint (saved with a
    `CLIPImageProcessor` at its image size). Any size works, the real ones included: the DiT and
    encoders are built directly in `torch_dtype` (default float32; the VAE always float32, as the
    official checkpoints ship it), so host memory is about one copy of the weights. Weights come from
    `torch.manual_seed(seed)`; VAE parameters are redrawn at a scale that keeps activations O(1)
    (diffusers' default init shrinks them layer by layer, and norm gains of exactly 1 would hide
    layout bugs). Needs diffusers (the `test` extra): this is for tests and benchmarks.
    """
    import dataclasses as dc

    import diffusers
    import torch
    from transformers import CLIPImageProcessor, CLIPVisionModel, UMT5EncoderModel

    from wan_tpu.configs.models import config_to_json
    from wan_tpu.encoders.tokenizers import tiny_hf_tokenizer

    def dit(cfg):
        return diffusers.WanTransformer3DModel(**config_to_json(cfg))

    def build(make, dtype=None):
        # Building directly in the target dtype halves host memory at real sizes (a 14B DiT).
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype or torch.float32)
        try:
            return make()
        finally:
            torch.set_default_dtype(default)

    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        parts = {"transformer": build(lambda: dit(transformer), torch_dtype)}
        if transformer_2 is not None:
            parts["transformer_2"] = build(lambda: dit(transformer_2), torch_dtype)
        vae_kwargs = {f.name: getattr(vae, f.name) for f in dc.fields(vae) if f.name != "clip_output"}
        parts["vae"] = diffusers.AutoencoderKLWan(**{k: list(v) if isinstance(v, tuple) else v
                                                     for k, v in vae_kwargs.items()})
        for name, p in parts["vae"].named_parameters():
            if "gamma" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 / max(1, p[0].numel()) ** 0.5 if p.dim() > 1 else 0.05))
        umt5 = text_encoder or hf_umt5_config(tiny_umt5_config(transformer.text_dim))
        parts["text_encoder"] = build(lambda: UMT5EncoderModel(umt5).eval(), torch_dtype)
        parts["tokenizer"] = tiny_hf_tokenizer()
        parts["scheduler"] = diffusers.UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=flow_shift)
        if image_encoder is not None:
            parts["image_encoder"] = build(lambda: CLIPVisionModel(image_encoder).eval(), torch_dtype)
            size = image_encoder.image_size
            parts["image_processor"] = CLIPImageProcessor(size={"shortest_edge": size},
                                                          crop_size={"height": size, "width": size})
        cls = diffusers.WanImageToVideoPipeline if image_encoder is not None else diffusers.WanPipeline
        pipe = cls(**parts, boundary_ratio=boundary_ratio, expand_timesteps=expand_timesteps)
        pipe.save_pretrained(path)
