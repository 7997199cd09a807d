"""UniFoLM on a `(dp, sp, tp)` mesh: weights by the "unifolm" rules of `wan_tpu/configs/sharding.py` (FSDP +
tp), the batch over `dp`, attention inside `shard_map` through the shared `ShardedAttention` hooks.

    mesh = wan_tpu.make_mesh(dp=2, sp=1, tp=4)
    model = load_unifolm(path, mesh=mesh)          # or shard_unifolm(random_unifolm(cfg), mesh)
"""

from __future__ import annotations

from wan_tpu.errors import WanInputError
from wan_tpu.parallel.mesh import AXES
from wan_tpu.parallel.sharding import ShardedAttention, shard_module


def shard_unifolm(model, mesh, **attention_kwargs):
    """Place every weight of a `UnifolmWMA` (concrete or abstract) on `mesh` and install mesh-aware
    attention hooks on its UNet (in place). `attention_kwargs` (impl, interpret, block_sizes) go to
    `wan_tpu.attention`."""
    if not set(AXES) <= set(mesh.axis_names):
        raise WanInputError(f"UniFoLM needs a mesh with axes {AXES}, got {tuple(mesh.axis_names)}; use wan_tpu.make_mesh")
    shard_module(model, mesh, "unifolm")
    unet = model.diffusion_model
    unet.self_attention = ShardedAttention(mesh, "self", **attention_kwargs)
    unet.cross_attention = ShardedAttention(mesh, "cross", **attention_kwargs)
    return model
