"""UnifoLM-WMA-0 in one table: the video UNet, the action/state heads, the projectors and the samplers.

Values are the authors' inference configs (unitreerobotics/unifolm-world-model-action at 3e198de):
`wan_tpu/configs/inference/world_model_interaction.yaml` (WMI; `world_model_decision_making.yaml` differs only
in the training-time `decision_making_only` flag) and `base_model_inference.yaml` (BASE: one observed
step, generation only, no heads). Numbers the authors hard-code in Python rather than in the YAML are
cited where they are set (`wma_model.py`, `ddpms.py`, `attention.py`, `multi_image_obs_encoder.py`).

    from wan_tpu.configs.unifolm import CONFIGS, config_from_json, config_to_json
    CONFIGS["unifolm-wma-0"].unet.model_channels      # 320
    CONFIGS["unifolm-tiny"]                           # random-weight preset that runs on a CPU in seconds

A converted checkpoint folder stores `config_to_json(cfg)` as its `config.json`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from wan_tpu.errors import WanInputError


@dataclass(frozen=True)
class UnifolmUNetConfig:
    """`WMAModel` (modules/networks/wma_model.py), `wma_config.params` of the YAML.

    Always on, as in every shipped config: temporal conv in every ResBlock, temporal self-attention,
    linear projections in the transformers, the extra `init_attn`, per-modality cross-attention and
    fps conditioning.
    """

    in_channels: int = 8
    out_channels: int = 4
    model_channels: int = 320
    channel_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attention_resolutions: tuple[int, ...] = (4, 2, 1)
    num_head_channels: int = 64
    transformer_depth: int = 1
    context_dim: int = 1024
    temporal_length: int = 16
    init_attn_heads: int = 8  # `init_attn = TemporalTransformer(..., n_heads=8, ...)` in wma_model.py
    n_obs_steps: int = 2  # state tokens in the context (n_obs_steps_imagen)
    num_stem_token: int = 16  # action tokens per action and frame (SATokenProjector num_queries)
    text_context_len: int = 77  # attention.py default
    image_tokens_per_frame: int = 16  # the Resampler's num_queries
    default_fs: int = 10
    base_model_gen_only: bool = False

    @property
    def time_embed_dim(self) -> int:
        return 4 * self.model_channels

    @property
    def action_context_len(self) -> int:
        """Action tokens per frame in the input and middle blocks (temporal_length · num_stem_token)."""
        return self.temporal_length * self.num_stem_token


@dataclass(frozen=True)
class UnifolmHeadConfig:
    """`ConditionalUnet1D` (models/diffusion_head/conditional_unet1d.py), `unet_head_config.params`.

    The observation encoder is torchvision's ResNet18 with BatchNorm replaced by GroupNorm(C/16),
    spatial-softmax keypoints and ImageNet normalisation (`obs_encoder_config` + wan_tpu/configs/train/meta.json:
    one RGB image and a 16-d `agent_pos`).
    """

    input_dim: int = 16
    horizon: int = 16
    n_obs_steps: int = 2
    diffusion_step_embed_dim: int = 128
    down_dims: tuple[int, ...] = (256, 512, 1024, 2048)
    kernel_size: int = 5
    n_groups: int = 8
    act_proj_dim: int = 32
    spatial_softmax_kp: int = 128
    agent_pos_dim: int = 16


@dataclass(frozen=True)
class PerceiverConfig:
    """A Perceiver resampler: `Resampler` (modules/encoders/resampler.py, image tokens, exact GELU) or
    `SATokenProjector` (modules/encoders/condition.py, action tokens, tanh GELU, no input projection)."""

    dim: int = 1024
    depth: int = 4
    dim_head: int = 64
    heads: int = 12
    num_queries: int = 16
    output_dim: int = 1024
    ff_mult: int = 4
    embedding_dim: int | None = 1280  # None: no proj_in (SATokenProjector)
    repeat: int = 16  # latents = num_queries · repeat (video_length / chunk_size)
    gelu_tanh: bool = False

    @property
    def num_latents(self) -> int:
        return self.num_queries * self.repeat


@dataclass(frozen=True)
class UnifolmConfig:
    name: str
    unet: UnifolmUNetConfig = field(default_factory=UnifolmUNetConfig)
    head: UnifolmHeadConfig | None = field(default_factory=UnifolmHeadConfig)  # None: BASE (no heads)
    resampler: PerceiverConfig = field(default_factory=PerceiverConfig)
    action_tokens: PerceiverConfig | None = field(
        default_factory=lambda: PerceiverConfig(depth=1, heads=16, embedding_dim=None, gelu_tanh=True)
    )
    agent_state_dim: int = 16
    agent_action_dim: int = 16
    # Video diffusion (ddpms.py LatentDiffusion/DDPM): linear betas rescaled to zero terminal SNR,
    # v-prediction, dynamic rescale of x0 (scale_arr = linspace(1, base_scale, turning_step) then base_scale).
    num_train_timesteps: int = 1000
    linear_start: float = 0.00085
    linear_end: float = 0.012
    rescale_betas_zero_snr: bool = True
    parameterization: str = "v"
    use_dynamic_rescale: bool = True
    base_scale: float = 0.7
    turning_step: int = 400  # LatentDiffusion default
    latent_size: tuple[int, int] = (40, 64)
    scale_factor: float = 0.18215
    # The heads' scheduler: diffusers DDIMScheduler (noise_scheduler_config).
    head_beta_schedule: str = "squaredcos_cap_v2"
    head_clip_sample: bool = True
    head_set_alpha_to_one: bool = True

    def __post_init__(self):
        u = self.unet
        if u.model_channels % 32 or any((m * u.model_channels) % 32 for m in u.channel_mult):
            _bad(self, "unet.model_channels", u.model_channels, "a multiple of 32 (GroupNorm32) at every level")
        if any((m * u.model_channels) % u.num_head_channels for m in u.channel_mult):
            _bad(self, "unet.num_head_channels", u.num_head_channels, "a divisor of every level's channels")
        if self.head is not None:
            if len(u.channel_mult) != 4:
                _bad(self, "unet.channel_mult", u.channel_mult, "4 levels (the heads read 9 feature maps: 4 down, middle, 4 up)")
            if self.head.horizon != u.temporal_length:
                _bad(self, "head.horizon", self.head.horizon, f"equal to unet.temporal_length {u.temporal_length}")
            if any(d % self.head.n_groups for d in self.head.down_dims):
                _bad(self, "head.down_dims", self.head.down_dims, f"multiples of n_groups {self.head.n_groups}")
        if self.parameterization != "v":
            _bad(self, "parameterization", self.parameterization, "'v' (the only one the checkpoints use)")
        if self.resampler.num_queries != u.image_tokens_per_frame or self.resampler.repeat != u.temporal_length:
            _bad(self, "resampler", self.resampler, "num_queries = unet.image_tokens_per_frame, repeat = unet.temporal_length")
        if self.resampler.output_dim != u.context_dim:
            _bad(self, "resampler.output_dim", self.resampler.output_dim, f"unet.context_dim {u.context_dim}")

    @property
    def has_heads(self) -> bool:
        return self.head is not None and not self.unet.base_model_gen_only


def _bad(cfg, name, value, expected):
    raise WanInputError(f"UniFoLM config {cfg.name!r}: {name}={value!r} must be {expected}")


WMA0 = UnifolmConfig(name="unifolm-wma-0")
BASE = UnifolmConfig(
    name="unifolm-wma-0-base",
    unet=UnifolmUNetConfig(n_obs_steps=1, base_model_gen_only=True),
    head=None,
    action_tokens=None,
)
# Tiny: few channels, but every structural number the authors hard-code kept (4 UNet levels for the
# heads, 16 frames, 77 text tokens, 16 image tokens and 16 actions per frame, ResNet18).
TINY = UnifolmConfig(
    name="unifolm-tiny",
    unet=UnifolmUNetConfig(model_channels=32, num_head_channels=16, context_dim=64),
    head=UnifolmHeadConfig(diffusion_step_embed_dim=32, down_dims=(16, 32, 64, 128), spatial_softmax_kp=16),
    resampler=PerceiverConfig(dim=64, depth=2, dim_head=16, heads=3, output_dim=64, embedding_dim=32),
    action_tokens=PerceiverConfig(dim=64, depth=1, dim_head=16, heads=4, output_dim=64, embedding_dim=None,
                                  gelu_tanh=True),
    latent_size=(16, 16),
)
TINY_BASE = dataclasses.replace(
    TINY, name="unifolm-tiny-base", unet=dataclasses.replace(TINY.unet, n_obs_steps=1, base_model_gen_only=True),
    head=None, action_tokens=None,
)

CONFIGS = {c.name: c for c in (WMA0, BASE, TINY, TINY_BASE)}


def config_to_json(cfg: UnifolmConfig) -> dict:
    return dataclasses.asdict(cfg)


_SUB = {"unet": UnifolmUNetConfig, "head": UnifolmHeadConfig, "resampler": PerceiverConfig,
        "action_tokens": PerceiverConfig}


def _build(cls, data: dict, where: str):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise WanInputError(f"config.json: unknown field(s) {unknown} in {where}; is this a UniFoLM checkpoint folder?")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def config_from_json(data: dict) -> UnifolmConfig:
    """Inverse of `config_to_json`; unknown fields are an error naming them."""
    if not isinstance(data, dict) or "name" not in data:
        raise WanInputError("config.json has no 'name': not a UniFoLM checkpoint config (write it with config_to_json)")
    top = {}
    for k, v in data.items():
        if k in _SUB:
            top[k] = None if v is None else _build(_SUB[k], v, k)
        else:
            top[k] = v
    return _build(UnifolmConfig, top, "the top level")
