"""Matrix-Game-2 variants in one table: the causal action-conditioned Wan DiT and its sampling.

Values are read from the authors' repository (SkyworkAI/Matrix-Game, folder `Matrix-Game-2/`,
commit 3ceb311):
- transformer: `wan_tpu/configs/distilled_model/{universal,gta_drive,templerun}/config.json` and
  `wan_tpu/configs/foundation_model/config.json` (field names are theirs, so a `config.json` maps onto
  `MatrixGameTransformerConfig` one to one; `image_dim` is ours: their `MLPProj(1280, dim)` hard-codes it);
- sampling: `wan_tpu/configs/inference_yaml/inference_{universal,gta_drive,templerun}.yaml`
  (`denoising_step_list`, `warp_denoising_step`, `timestep_shift`, `num_frame_per_block`, `context_noise`);
- latent shape 16×44×80 (352×640 video): `image_or_video_shape` of the same YAMLs; mp4 at 12 fps:
  `utils/visualize.py`; keyboard dimensions: `pipeline/causal_inference.py` `get_current_action`.

    from wan_tpu.configs.matrix_game import MATRIX_GAME_VARIANTS
    MATRIX_GAME_VARIANTS["universal"].transformer.action_config.blocks   # (0, …, 14)

The foundation model ships no inference YAML (its `local_attn_size` is −1, which the authors'
`CausalInferencePipeline` rejects): it has no default step list, and its window is their default
cache size of 15 latent frames.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from wan_tpu.errors import WanInputError

# `local_attn_size == -1` means "global"; the authors' caches then hold 15 latent frames.
GLOBAL_WINDOW_FRAMES = 15


def _bad(where: str, field: str, value, expected: str):
    raise WanInputError(f"{where} field {field!r} is {value!r}; it must be {expected} — fix config.json")


def _pos_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _int_tuple(where, field, value, n=None) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or (n is not None and len(value) != n) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        _bad(where, field, value, f"a list of {n or 'some'} non-negative integers")
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class ActionConfig:
    """The `action_config` of the authors' config.json (`wan/modules/action_module.py` defaults)."""

    blocks: tuple[int, ...] = ()
    enable_keyboard: bool = True
    enable_mouse: bool = True
    keyboard_dim_in: int = 6
    mouse_dim_in: int = 2
    hidden_size: int = 128
    img_hidden_size: int = 1536
    keyboard_hidden_dim: int = 1024
    mouse_hidden_dim: int = 1024
    heads_num: int = 16
    vae_time_compression_ratio: int = 4
    windows_size: int = 3
    patch_size: tuple[int, int, int] = (1, 2, 2)
    qk_norm: bool = True
    qkv_bias: bool = False
    rope_dim_list: tuple[int, int, int] = (8, 28, 28)
    rope_theta: float = 256.0
    mouse_qk_dim_list: tuple[int, int, int] = (8, 28, 28)

    def __post_init__(self):
        w = "action_config"
        for name, n in (("blocks", None), ("patch_size", 3), ("rope_dim_list", 3), ("mouse_qk_dim_list", 3)):
            object.__setattr__(self, name, _int_tuple(w, name, getattr(self, name), n))
        for name in ("keyboard_dim_in", "mouse_dim_in", "hidden_size", "img_hidden_size", "keyboard_hidden_dim",
                     "mouse_hidden_dim", "heads_num", "vae_time_compression_ratio", "windows_size"):
            if not _pos_int(getattr(self, name)):
                _bad(w, name, getattr(self, name), "a positive integer")
        if not (self.enable_keyboard or self.enable_mouse):
            _bad(w, "enable_keyboard", self.enable_keyboard, "true when enable_mouse is false (an action module needs one branch)")
        for name in ("keyboard_hidden_dim", "mouse_hidden_dim"):
            dim = getattr(self, name)
            if dim % self.heads_num or dim // self.heads_num != sum(self.rope_dim_list):
                _bad(w, name, dim, f"heads_num × sum(rope_dim_list) = {self.heads_num * sum(self.rope_dim_list)} "
                     "(the action RoPE covers each head exactly)")
        if any(d % 2 for d in self.rope_dim_list):
            _bad(w, "rope_dim_list", self.rope_dim_list, "even sizes (rotary embeddings rotate channel pairs)")
        if self.rope_dim_list != self.mouse_qk_dim_list:
            # Their forward builds one RoPE table from mouse_qk_dim_list and uses it for both branches.
            _bad(w, "mouse_qk_dim_list", self.mouse_qk_dim_list, f"equal to rope_dim_list {self.rope_dim_list}")
        if not isinstance(self.rope_theta, (int, float)) or isinstance(self.rope_theta, bool) or self.rope_theta <= 0:
            _bad(w, "rope_theta", self.rope_theta, "a positive number")
        object.__setattr__(self, "rope_theta", float(self.rope_theta))

    @property
    def window_frames(self) -> int:
        """Raw (video) action frames each latent frame sees: windows_size × temporal compression (12)."""
        return self.windows_size * self.vae_time_compression_ratio


@dataclass(frozen=True)
class MatrixGameTransformerConfig:
    """The fields of the authors' `CausalWanModel` config.json, same names and defaults.

    `text_len`, `text_dim` and `inject_sample_info` are accepted and unused (the model has no text
    branch). `image_dim` is the CLIP token width (1280 in theirs, where it is hard-coded).
    """

    model_type: str = "i2v"
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_len: int = 512
    in_dim: int = 36
    dim: int = 1536
    ffn_dim: int = 8960
    freq_dim: int = 256
    text_dim: int = 4096
    out_dim: int = 16
    num_heads: int = 12
    num_layers: int = 30
    local_attn_size: int = -1
    sink_size: int = 0
    qk_norm: bool = True
    cross_attn_norm: bool = True
    eps: float = 1e-6
    inject_sample_info: bool = False
    action_config: ActionConfig | None = None
    image_dim: int = 1280

    def __post_init__(self):
        w = "Matrix-Game transformer config"
        if self.model_type != "i2v":
            _bad(w, "model_type", self.model_type, '"i2v" (the only type CausalWanModel accepts)')
        object.__setattr__(self, "patch_size", _int_tuple(w, "patch_size", self.patch_size, 3))
        if self.patch_size[0] != 1 or not all(p > 0 for p in self.patch_size):
            _bad(w, "patch_size", self.patch_size, "(1, h, w) with positive h, w (the model is causal per latent frame)")
        for name in ("in_dim", "dim", "ffn_dim", "freq_dim", "out_dim", "num_heads", "num_layers", "image_dim"):
            if not _pos_int(getattr(self, name)):
                _bad(w, name, getattr(self, name), "a positive integer")
        if self.dim % self.num_heads or (self.dim // self.num_heads) % 2:
            _bad(w, "dim", self.dim, f"a multiple of num_heads={self.num_heads} with an even head size")
        if self.freq_dim % 2:
            _bad(w, "freq_dim", self.freq_dim, "even (half cosine, half sine)")
        if self.out_dim >= self.in_dim:
            _bad(w, "in_dim", self.in_dim, f"larger than out_dim={self.out_dim} (the noisy latent plus the image condition)")
        if not (self.local_attn_size == -1 or _pos_int(self.local_attn_size)):
            _bad(w, "local_attn_size", self.local_attn_size, "a positive number of latent frames, or -1 (global)")
        if self.sink_size != 0:
            _bad(w, "sink_size", self.sink_size, "0 (attention sinks are not used by any Matrix-Game-2 model)")
        if self.qk_norm is not True:
            _bad(w, "qk_norm", self.qk_norm, "true (every Matrix-Game-2 model normalises q and k)")
        if not isinstance(self.cross_attn_norm, bool):
            _bad(w, "cross_attn_norm", self.cross_attn_norm, "true or false")
        if not isinstance(self.eps, (int, float)) or isinstance(self.eps, bool) or not 0 < self.eps < 1:
            _bad(w, "eps", self.eps, "a small positive float such as 1e-06")
        object.__setattr__(self, "eps", float(self.eps))
        if isinstance(self.action_config, dict):
            object.__setattr__(self, "action_config", action_config_from_json(self.action_config))
        a = self.action_config
        if a is not None:
            if a.img_hidden_size != self.dim:
                _bad(w, "action_config.img_hidden_size", a.img_hidden_size, f"equal to dim={self.dim}")
            if a.patch_size != self.patch_size:
                _bad(w, "action_config.patch_size", a.patch_size, f"equal to patch_size={self.patch_size}")
            if a.blocks and (min(a.blocks) < 0 or max(a.blocks) >= self.num_layers or len(set(a.blocks)) != len(a.blocks)):
                _bad(w, "action_config.blocks", a.blocks, f"distinct block indices below num_layers={self.num_layers}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def window_frames(self) -> int:
        """Latent frames the self-attention, keyboard and mouse caches hold (the window incl. the current chunk)."""
        return GLOBAL_WINDOW_FRAMES if self.local_attn_size == -1 else self.local_attn_size

    @property
    def action_blocks(self) -> frozenset[int]:
        return frozenset(self.action_config.blocks) if self.action_config is not None else frozenset()

    @property
    def patch_volume(self) -> int:
        return math.prod(self.patch_size)


_ACTION_FIELDS = {f.name for f in dataclasses.fields(ActionConfig)}
_FIELDS = {f.name for f in dataclasses.fields(MatrixGameTransformerConfig)}


def action_config_from_json(config: dict) -> ActionConfig:
    unknown = sorted(set(config) - _ACTION_FIELDS)
    if unknown:
        raise WanInputError(f"action_config has unknown field {unknown[0]!r}; known fields: {', '.join(sorted(_ACTION_FIELDS))}")
    return ActionConfig(**config)


def config_from_json(config: dict) -> MatrixGameTransformerConfig:
    """A config from the authors' `CausalWanModel` config.json (`_class_name` etc. ignored)."""
    fields = {k: v for k, v in config.items() if not k.startswith("_")}
    unknown = sorted(set(fields) - _FIELDS)
    if unknown:
        raise WanInputError(
            f"Matrix-Game config.json has unknown field {unknown[0]!r}; this is not a CausalWanModel config "
            f"(known fields: {', '.join(sorted(_FIELDS))})"
        )
    action = fields.get("action_config")
    fields["action_config"] = action_config_from_json(action) if action else None
    return MatrixGameTransformerConfig(**fields)


@dataclass(frozen=True)
class MatrixGameVariant:
    """A model and how the authors sample it.

    `denoising_step_list` are integer steps of the 1000-step schedule; with `warp_denoising_step` the
    model sees the shifted float timesteps at those indices (`wan_tpu.matrix_game.sampling`).
    `keyboard_keys` name the keyboard dimensions in order; `mouse` says whether a mouse input
    ([vertical, horizontal] per video frame) exists.
    """

    name: str
    checkpoint: str  # path in the Hugging Face repo Skywork/Matrix-Game-2.0 ("" for random-weight presets)
    transformer: MatrixGameTransformerConfig
    denoising_step_list: tuple[int, ...] | None
    keyboard_keys: tuple[str, ...]
    mouse: bool
    warp_denoising_step: bool = True
    timestep_shift: float = 5.0
    num_frame_per_block: int = 3
    context_noise: int = 0
    latent_size: tuple[int, int] = (44, 80)  # (height, width) of the latent; video is 8× larger
    fps: int = 12

    def __post_init__(self):
        a = self.transformer.action_config
        if a is None or not a.enable_keyboard or a.keyboard_dim_in != len(self.keyboard_keys):
            raise ValueError(f"{self.name}: keyboard_keys must name the {a and a.keyboard_dim_in} keyboard inputs")
        if a.enable_mouse != self.mouse:
            raise ValueError(f"{self.name}: mouse must match action_config.enable_mouse")
        if self.transformer.window_frames < self.num_frame_per_block:
            raise ValueError(f"{self.name}: the attention window must hold at least one chunk")


def _distilled(keyboard_dim: int, mouse: bool, local: int) -> MatrixGameTransformerConfig:
    action = ActionConfig(blocks=tuple(range(15)), keyboard_dim_in=keyboard_dim, enable_mouse=mouse)
    return MatrixGameTransformerConfig(num_layers=30, local_attn_size=local, ffn_dim=8960, action_config=action)


_VARIANTS = (
    MatrixGameVariant("universal", "base_distilled_model/base_distill.safetensors", _distilled(4, True, 6),
                      denoising_step_list=(1000, 666, 333), keyboard_keys=("w", "s", "a", "d"), mouse=True),
    # Steering is the mouse's horizontal axis ([0, ±0.1]); the keyboard is forward/back only.
    MatrixGameVariant("gta_drive", "gta_distilled_model/gta_keyboard2dim.safetensors", _distilled(2, True, 4),
                      denoising_step_list=(1000, 666, 333), keyboard_keys=("w", "s"), mouse=True),
    # No-op is [1, 0, …, 0] (the `nomove` key held).
    MatrixGameVariant("templerun", "templerun_distilled_model/templerun_7dim_onlykey.safetensors",
                      _distilled(7, False, 6), denoising_step_list=(1000, 750, 500, 250),
                      keyboard_keys=("nomove", "jump", "slide", "turnleft", "turnright", "leftside", "rightside"),
                      mouse=False),
    MatrixGameVariant("foundation", "base_model/", MatrixGameTransformerConfig(
        num_layers=30, local_attn_size=-1, action_config=ActionConfig(blocks=tuple(range(30)), keyboard_dim_in=4)),
        denoising_step_list=None, keyboard_keys=("w", "s", "a", "d"), mouse=True),
    # CPU-sized: 2 blocks, the first with both action branches; every code path of `universal`.
    MatrixGameVariant("matrix-game-tiny", "", MatrixGameTransformerConfig(
        dim=64, ffn_dim=128, freq_dim=32, num_heads=2, num_layers=2, local_attn_size=6, image_dim=32,
        action_config=ActionConfig(blocks=(0,), keyboard_dim_in=4, img_hidden_size=64, hidden_size=16,
                                   keyboard_hidden_dim=64, mouse_hidden_dim=64, heads_num=1)),
        denoising_step_list=(1000, 666, 333), keyboard_keys=("w", "s", "a", "d"), mouse=True, latent_size=(8, 14)),
)

MATRIX_GAME_VARIANTS: dict[str, MatrixGameVariant] = {v.name: v for v in _VARIANTS}


def get_variant(name: str) -> MatrixGameVariant:
    if name not in MATRIX_GAME_VARIANTS:
        raise WanInputError(f"unknown Matrix-Game variant {name!r}; choose one of {', '.join(MATRIX_GAME_VARIANTS)}")
    return MATRIX_GAME_VARIANTS[name]
