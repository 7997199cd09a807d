"""Golden outputs of the authors' UniFoLM-WMA code (CPU, float32, small random weights) for our tests.

    third_party/uni-ref/bin/python scripts/make_golden_unifolm.py --ref third_party/unifolm-world-model-action

writes `tests/data/unifolm_golden_{unet,parts,sampling}.npz`: the reference commit, the weight manifests (names, shapes,
buffers) of a reduced WMI model and a reduced BASE model, and the outputs of: the Resampler, the
state/action projectors, the action-token Perceiver, the UNet forward (with heads; without action
tokens; the base model without heads), the action head, one DDIM step, 4-step samplings in
decision-making and world-model mode (eta 1 with injected noise) and a guided 2-step sampling.
Weights and large inputs are not stored: `tests/unifolm/unifolm_weights.py` regenerates them from their names.
`--ref` is a checkout of unitreerobotics/unifolm-world-model-action, e.g. cloned into
`third_party/unifolm-world-model-action`, a folder of this checkout that git ignores.

Reduced config (`wan_tpu/configs/unifolm.py` "unifolm-tiny"/"unifolm-tiny-base"): the shipped YAMLs with few
channels; every structural number their code hard-codes kept (4 UNet levels, 16 frames, 77 text
tokens, 16 image tokens and 16 actions per frame, ResNet18 observation encoder).

Reference venv (torch 2.13.0 CPU beside their pins where they install), e.g. in the ignored
`third_party/uni-ref`:

    python3 -m venv third_party/uni-ref
    third_party/uni-ref/bin/pip install "torch==2.13.0" torchvision einops omegaconf "diffusers==0.30.2" \
        safetensors "open-clip-torch==2.22.0" "kornia==0.7.3" "transformers==4.40.1" "timm==0.9.10"

Runtime patches (their checkout is never modified): torchvision imported without its C ops (PyPI's
build does not load beside the CPU torch; only resnet18/Normalize/make_grid are used); stubs for `cv2`, `pytorch_lightning` (a
LightningModule is an nn.Module on the CPU here) and `xformers` (`memory_efficient_attention` as an
exact float32 softmax with the additive bias); `_init_projectors` builds the state/action projectors
and position embeddings at the reduced context width (theirs hard-code 1024); the observation
encoder's `meta.json` (read from the working directory in theirs) is written for 128×128 images;
`torch.randn` is replaced during sampling by named deterministic noise so that we can inject it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import types

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "unifolm"))
from unifolm_weights import det, init_tensor  # noqa: E402

B, T, LAT, IMG, D, CLIP_DIM, A = 2, 16, 16, 128, 64, 32, 16


def install_stubs():
    import torch

    # PyPI's torchvision C ops do not load beside the CPU torch; only pure-Python parts are used
    # (resnet18, Normalize, make_grid), so its fake-kernel registrations are skipped.
    register_fake = torch.library.register_fake
    torch.library.register_fake = lambda *a, **k: (lambda f: f)
    import torchvision  # noqa: F401

    torch.library.register_fake = register_fake
    # Imported before the stubs: they probe for cv2 and xformers.
    import diffusers.optimization  # noqa: F401
    import open_clip  # noqa: F401
    import transformers  # noqa: F401

    sys.modules.setdefault("cv2", types.ModuleType("cv2"))

    pl = types.ModuleType("pytorch_lightning")

    class LightningModule(torch.nn.Module):
        @property
        def device(self):
            return torch.device("cpu")

    pl.LightningModule = LightningModule
    pl.seed_everything = lambda seed: torch.manual_seed(seed)
    utilities = types.ModuleType("pytorch_lightning.utilities")
    utilities.rank_zero_only = lambda f: f
    pl.utilities = utilities
    sys.modules["pytorch_lightning"] = pl
    sys.modules["pytorch_lightning.utilities"] = utilities

    def memory_efficient_attention(q, k, v, attn_bias=None, op=None):
        logits = (q.float() @ k.float().transpose(-2, -1)) * q.shape[-1] ** -0.5
        if attn_bias is not None:
            logits = logits + attn_bias.float()
        return (logits.softmax(-1) @ v.float()).to(q.dtype)

    xformers = types.ModuleType("xformers")
    ops = types.ModuleType("xformers.ops")
    ops.memory_efficient_attention = memory_efficient_attention
    xformers.ops = ops
    sys.modules["xformers"], sys.modules["xformers.ops"] = xformers, ops


def tiny_config(ref: str, meta_path: str, base: bool):
    from omegaconf import OmegaConf

    name = "base_model_inference.yaml" if base else "world_model_interaction.yaml"
    cfg = OmegaConf.load(os.path.join(ref, "configs", "inference", name))
    p = cfg.model.params
    p.image_size = [LAT, LAT]
    p.global_emb_dim = D
    p.cond_stage_config = {"target": "torch.nn.Identity"}
    p.img_cond_stage_config = {"target": "torch.nn.Identity"}
    p.first_stage_config.params.ddconfig.update(ch=32, num_res_blocks=1)
    w = p.wma_config.params
    w.update(model_channels=32, num_head_channels=16, context_dim=D, use_checkpoint=False)
    h = w.unet_head_config.params
    h.update(diffusion_step_embed_dim=32, down_dims=[16, 32, 64, 128])
    h.obs_encoder_config.params.update(spatial_softmax_kp=16, shape_meta_path=meta_path)
    w.stem_process_config.params.update(dim=D, dim_head=16, heads=4, output_dim=D)
    p.image_proj_stage_config.params.update(dim=D, depth=2, dim_head=16, heads=3, embedding_dim=CLIP_DIM,
                                            output_dim=D)
    return cfg


def build(ref: str, meta_path: str, base: bool):
    import torch
    from unifolm_wma.models import ddpms
    from unifolm_wma.utils.utils import instantiate_from_config

    def init_projectors(self):
        d = self.global_emb_dim
        self.state_projector = ddpms.MLPProjector(self.agent_state_dim, d)
        self.action_projector = ddpms.MLPProjector(self.agent_action_dim, d)
        self.agent_action_pos_emb = torch.nn.Parameter(torch.randn(1, 16, d))
        self.agent_state_pos_emb = torch.nn.Parameter(torch.randn(1, self.n_obs_steps_imagen, d))

    ddpms.LatentVisualDiffusion._init_projectors = init_projectors
    model = instantiate_from_config(tiny_config(ref, meta_path, base).model).eval()
    return model


def component_name(name: str):
    if name.startswith("model.diffusion_model."):
        return "unet", name[len("model.diffusion_model."):]
    if name.split(".")[0] in ("image_proj_model", "state_projector", "action_projector", "agent_action_pos_emb",
                              "agent_state_pos_emb"):
        return "conditioning", name
    return None, None


def randomize(model, skip=()):
    """Deterministic weights for the two components; returns (manifest, buffers)."""
    import torch

    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, p in params.items():
            comp, key = component_name(n)
            if comp:
                p.copy_(torch.from_numpy(init_tensor(f"{comp}:{key}", p.shape)))
    manifest, buffers, seen = {"unet": [], "conditioning": []}, {}, {}
    for n, v in model.state_dict(keep_vars=True).items():
        comp, key = component_name(n)
        if not comp or any(s in key for s in skip):
            continue
        ptr = v.data_ptr()
        if ptr in seen:
            kind = f"alias:{seen[ptr]}"
        else:
            seen[ptr] = key
            kind = "param" if n in params else "buffer"
            if kind == "buffer":
                buffers[f"{comp}:{key}"] = v.detach().numpy().copy()
        manifest[comp].append([key, list(v.shape), kind])
    return manifest, buffers


def t(a):
    import torch

    return torch.from_numpy(np.asarray(a))


def inputs():
    x = {
        "resampler": det("in:resampler", (B, 257, CLIP_DIM)),
        "state": det("in:state", (B, 2, A)),
        "action": det("in:action", (B, 16, A)),
        "tokens": det("in:tokens", (B, 1, D)),
        "x": det("in:x", (B, 8, T, LAT, LAT)),
        "context": det("in:context", (B, 2 + 16 + 77 + T * 16, D)),
        "xa": det("in:xa", (B, T, A)),
        "xs": det("in:xs", (B, T, A)),
        "obs_img": np.tanh(det("in:obs_img", (B, 3, 2, IMG, IMG))),
        "obs_state": det("in:obs_state", (B, 2, A)),
        "base_context": det("in:base_context", (B * T, 77 + 16, D)),
    }
    return x


MAP_SHAPES = [(32, 16), (64, 8), (128, 4), (128, 2), (128, 2), (128, 2), (128, 4), (64, 8), (32, 16)]


class NamedNoise:
    """Replaces torch.randn: the i-th call returns det(f"randn:{tag}:{i}")."""

    def __init__(self, tag):
        self.tag, self.count = tag, 0

    def __enter__(self):
        import torch

        self.orig = torch.randn

        def fake(*size, **kw):
            shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
            out = torch.from_numpy(det(f"randn:{self.tag}:{self.count}", shape))
            self.count += 1
            return out

        torch.randn = fake
        return self

    def __exit__(self, *exc):
        import torch

        torch.randn = self.orig


def sampling_cond(model, world: bool, clip_zero=False, text_name=None):
    """Their `image_guided_synthesis_sim_mode` conditioning, from given embeddings (CLIP/VAE excluded)."""
    import torch
    from einops import repeat

    text = t(det(text_name or ("in:empty_text" if world else "in:text"), (1, 77, D)))
    clip = torch.zeros(1, 257, CLIP_DIM) if clip_zero else t(det("in:clip", (1, 257, CLIP_DIM)))
    latent = t(det("in:cond_latent", (1, 4, LAT, LAT)))
    obs_img = t(np.tanh(det("in:obs_img", (B, 3, 2, IMG, IMG)))[:1])
    obs_state = t(det("in:obs_state", (B, 2, A))[:1])
    actions = t(det("in:actions", (1, 16, A)))
    img_emb = model.image_proj_model(clip)
    state_emb = model.state_projector(obs_state) + model.agent_state_pos_emb
    action_emb = model.action_projector(actions) + model.agent_action_pos_emb
    if not world:
        action_emb = torch.zeros_like(action_emb)
    return {
        "c_concat": [repeat(latent[:, :, None], "b c t h w -> b c (repeat t) h w", repeat=T)],
        "c_crossattn": [torch.cat([state_emb, action_emb, text, img_emb], dim=1)],
        "c_crossattn_action": [obs_img, obs_state, world, False],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", required=True, help="checkout of unitreerobotics/unifolm-world-model-action")
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "data"), help="folder for unifolm_golden_*.npz")
    args = ap.parse_args()
    commit = subprocess.run(["git", "-C", args.ref, "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    install_stubs()
    sys.path.insert(0, os.path.join(args.ref, "src"))
    import torch

    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    from unifolm_wma.models.samplers.ddim import DDIMSampler

    tmp = tempfile.mkdtemp()
    meta_path = os.path.join(tmp, "meta.json")
    with open(meta_path, "w") as f:
        json.dump({"obs": {"image": {"shape": [3, IMG, IMG], "type": "rgb"},
                           "agent_pos": {"shape": [A], "type": "low_dim"}}, "action": {"shape": [A]}}, f)

    out = {}
    model = build(args.ref, meta_path, base=False)
    manifest, buffers = randomize(model)
    for k, v in buffers.items():
        out[f"buffer/{k}"] = v
    x = inputs()
    u = model.model.diffusion_model

    out["resampler"] = model.image_proj_model(t(x["resampler"])).numpy()
    out["state_projector"] = model.state_projector(t(x["state"])).numpy()
    out["action_projector"] = model.action_projector(t(x["action"])).numpy()
    out["action_tokens"] = u.action_token_projector(t(x["tokens"])).numpy()

    ts, fs = torch.tensor([999, 500]), torch.tensor([7, 5])
    ctx_action = [t(x["obs_img"]), t(x["obs_state"])]
    y, a, s = u(t(x["x"]), t(x["xa"]), t(x["xs"]), ts, context=t(x["context"]), context_action=ctx_action, fs=fs)
    out["unet/v"], out["unet/action"], out["unet/state"] = y.numpy(), a.numpy(), s.numpy()
    no_action = torch.cat([t(x["context"])[:, :2], t(x["context"])[:, 18:]], dim=1)
    y, a, s = u(t(x["x"]), t(x["xa"]), t(x["xs"]), ts, context=no_action, context_action=ctx_action, fs=fs)
    out["unet_no_action/v"], out["unet_no_action/action"], out["unet_no_action/state"] = y.numpy(), a.numpy(), s.numpy()

    maps = [t(det(f"in:map{i}", (B, T, c, hw, hw))) for i, (c, hw) in enumerate(MAP_SHAPES)]
    out["head/action"] = u.action_unet(t(x["xa"]), ts, maps, ctx_action).numpy()

    sampler = DDIMSampler(model)
    sampler.register_buffer = lambda name, attr: setattr(sampler, name, attr)  # theirs moves buffers to CUDA
    cond = sampling_cond(model, world=True)
    fs1 = torch.tensor([7])
    sampler.make_schedule(4, ddim_discretize="uniform_trailing", ddim_eta=1.0, verbose=False)
    xs = t(det("in:ddim_x", (1, 4, T, LAT, LAT)))
    xa1, xs1 = t(x["xa"][:1]), t(x["xs"][:1])
    with NamedNoise("ddim_step"):
        x_prev, pred_x0, ea, es = sampler.p_sample_ddim(xs, xa1, xs1, cond, torch.tensor([749]), index=2, fs=fs1)
    for sched in (model.dp_noise_scheduler_action, model.dp_noise_scheduler_state):
        sched.set_timesteps(4)
    out["ddim_step/x"] = x_prev.numpy()
    out["ddim_step/action"] = model.dp_noise_scheduler_action.step(ea, 749, xa1).prev_sample.numpy()
    out["ddim_step/state"] = model.dp_noise_scheduler_state.step(es, 749, xs1).prev_sample.numpy()

    for mode, world in (("decision", False), ("world", True)):
        cond = sampling_cond(model, world=world)
        with NamedNoise(f"sample_{mode}"):
            lat, act, st, _ = sampler.sample(
                S=4, conditioning=cond, batch_size=1, shape=(4, T, LAT, LAT), verbose=False,
                unconditional_guidance_scale=1.0, unconditional_conditioning=None, eta=1.0, cfg_img=None, mask=None,
                x0=None, fs=fs1, timestep_spacing="uniform_trailing", guidance_rescale=0.7,
                x_T=t(det("in:x_T", (1, 4, T, LAT, LAT))), unconditional_conditioning_img_nonetext=None)
        out[f"sample_{mode}/latents"], out[f"sample_{mode}/actions"], out[f"sample_{mode}/states"] = (
            lat.numpy(), act.numpy(), st.numpy())

    cond = sampling_cond(model, world=True)
    uc = sampling_cond(model, world=True, clip_zero=True, text_name="in:empty_text")
    with NamedNoise("sample_guided"):
        lat, act, st, _ = sampler.sample(
            S=2, conditioning=cond, batch_size=1, shape=(4, T, LAT, LAT), verbose=False,
            unconditional_guidance_scale=2.0, unconditional_conditioning=uc, eta=0.0, fs=fs1,
            timestep_spacing="uniform_trailing", guidance_rescale=0.7, x_T=t(det("in:x_T", (1, 4, T, LAT, LAT))))
    out["sample_guided/latents"], out["sample_guided/actions"], out["sample_guided/states"] = (
        lat.numpy(), act.numpy(), st.numpy())

    base = build(args.ref, meta_path, base=True)
    # The base model's heads are never run; their ResNets are left out of the test checkpoint.
    base_manifest, base_buffers = randomize(base, skip=("obs_encoder.key_model_map",))
    for k, v in base_buffers.items():
        out[f"base_buffer/{k}"] = v
    y, _, _ = base.model.diffusion_model(t(x["x"]), torch.zeros(B, T, A), torch.zeros(B, T, A), ts,
                                         context=t(x["base_context"]), context_action=None, fs=fs)
    out["base_unet/v"] = y.numpy()

    meta = {"commit": commit, "manifest": manifest, "base_manifest": base_manifest}
    save(out, meta, args.out)


# Three files of a few hundred kB: the UNet forwards (+ the weight manifests), the smaller parts, sampling.
GROUPS = {"unet": ("unet", "unet_no_action", "base_unet", "buffer", "base_buffer"),
          "parts": ("resampler", "state_projector", "action_projector", "action_tokens", "head"),
          "sampling": ("ddim_step", "sample_decision", "sample_world", "sample_guided")}


def save(out: dict, meta: dict, out_dir: str):
    os.makedirs(out_dir, exist_ok=True)
    for group, prefixes in GROUPS.items():
        arrays = {k: v.astype(np.float32) if v.dtype.kind == "f" else v for k, v in out.items()
                  if k.split("/")[0] in prefixes}
        group_meta = meta if group == "unet" else {"commit": meta["commit"]}
        path = os.path.join(out_dir, f"unifolm_golden_{group}.npz")
        np.savez_compressed(path, meta=np.array(json.dumps(group_meta)), **arrays)
        print(f"wrote {path} ({os.path.getsize(path) / 1e3:.0f} kB) from commit {meta['commit']}")

if __name__ == "__main__":
    main()
