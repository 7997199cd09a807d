"""Will the run fit? Working-set estimates per stage, checked before anything is loaded.

    from wan_tpu.wan.memory import check_fits
    check_fits(pipe, settings)        # WanInputError naming a smaller size or a --mesh if it would not fit

A run that does not fit must be refused in a second with one line, not killed by the kernel's OOM
killer after minutes of loading (on CPU) or stopped by an XLA allocation error after the text encoder
ran (on a GPU/TPU). Each stage's peak, in bytes per device, is estimated from the weights' element
counts (the safetensors headers, `wan_tpu.runtime.validate.check_checkpoint`) and the activation shapes:

- text encode: the UMT5 weights in the run dtype (read from the memory-mapped files straight onto the
  devices: no second host copy); where the encoder alone does not fit (UMT5-XXL's 9 GiB of bf16 blocks on
  an 8 GiB device) its blocks stream as the DiT's do (`text_device_bytes`, `plan_text_resident`).
- image encode (I2V/TI2V): CLIP + VAE weights + 1.15× the 2-strip VAE decode working set (the
  encode/decode peak ratio measured in docs/PERFORMANCE.md: 2.51/2.21 GiB at 480p, 5.34/4.79 at 720p;
  the estimate gives 2.56 and 5.54 GiB).
- denoise: the DiT weights (both A14B experts: both are loaded; `--quantize`d block linears at one byte
  a weight; of an offloaded DiT the weights outside the block stack, its resident blocks and the two
  blocks a streamed pass holds) + one step's activations:
  `tokens · (ffn_dim + 6·dim) · 4` bytes with `tokens = batch · S` (batch 2 with CFG, S the patch
  count): the float32 temporaries of one block, as XLA's buffer assignment reports them for the 1.3B
  DiT at 832×480×81 (4.95 GiB of temporaries for 65,520 tokens, 4.15 GiB without the attention
  chunks: 66 kB per token ≈ (8960 + 4.7·1536)·4, rounded up to 6·dim). With the `reference`
  attention (the CPU default; GPU float32) add `2.5 · batch · heads · S² · 4` bytes, the float32
  logits and softmax of one layer: measured 2.73 GB of resident-set growth for the 1.07 GB of
  logits of the tiny DiT at 832×480×21 (S = 8,190). Every other kernel is a flash kernel and keeps
  attention O(S) (`wan_tpu.layers.attention.MATERIALISES_LOGITS` names the ones that do not). An int8
  DiT on a GPU adds its resident blocks' transposed copy (`int8_layout_copy_bytes`): the 14B int8 step
  with 11 blocks resident asked an H200 for one 11.96 GiB block of temporaries at 480p, 81 frames.
- decode: VAE weights + the VAE's own decode estimate (`WanVAE.decode_bytes`), which matches the
  peaks in docs/PERFORMANCE.md (bf16, default 2 strips): 2.26 vs 2.21 GiB at 480p, 4.85 vs 4.79 GiB at
  720p; for the fewest strips that fit, else the tiled decode (one tile + twice the video: 2.43 vs
  2.17 GiB measured at 720p).

Offload (`plan_offload`, `--offload auto|none|blocks[:N]`): when the denoise stage does not fit with every
DiT block on the device, `auto` keeps the most blocks resident that fit and streams the others from host
memory (`WanTransformer.offload_blocks`); host RAM must then hold the streamed stacks. Each stage's peak is
its own: the encoders leave the device after encoding and the DiT before decoding (`OffloadPlan.release`).

With a mesh the DiT and UMT5 weights are FSDP-sharded over every device and DiT activations over
`dp` (when the batch divides), `sp` and `tp`; VAE weights are replicated and its activations split
on width. On CPU all devices share the host's RAM, so the sum over devices is compared with the
RAM available (`MemAvailable`, capped by the cgroup limit); on GPU/TPU each device's estimate is
compared with its free memory (`memory_stats`). Where neither is known nothing is refused.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax

from wan_tpu.errors import WanInputError
from wan_tpu.loading import stacking
from wan_tpu.runtime.memory import GiB, available_bytes

RESIDENT_PLANNED = object()  # `stage_bytes`'s default: the pipeline's own offload plan


@dataclass(frozen=True)
class Layout:
    """How a run spreads over devices: mesh axis sizes (1 each without a mesh) and the platform."""

    dp: int = 1
    sp: int = 1
    tp: int = 1
    platform: str = "cpu"

    @property
    def devices(self) -> int:
        return self.dp * self.sp * self.tp

    @classmethod
    def of(cls, mesh) -> Layout:
        import jax

        if mesh is None:
            return cls(platform=jax.devices()[0].platform)
        shape = dict(mesh.shape)
        return cls(shape.get("dp", 1), shape.get("sp", 1), shape.get("tp", 1), mesh.devices.flat[0].platform)


def attention_impl(impl: str | None, platform: str, cfg, tokens: int, dtype) -> str:
    """The DiT self-attention kernel: `impl`, else what `wan_tpu.attention(impl=None)` picks for it here."""
    import jax

    from wan_tpu.layers import attention as attention_lib

    if impl is not None:
        return impl
    q = jax.ShapeDtypeStruct((1, tokens, cfg.num_attention_heads, cfg.attention_head_dim), dtype)
    return attention_lib._default_impl(q, q, platform)


def dit_step_bytes(cfg, tokens: int, batch: int, attention: str, layout: Layout) -> int:
    """One denoising step's activations per device (see the module docstring for the formula)."""
    dp = layout.dp if batch % layout.dp == 0 else 1
    split = dp * layout.sp * layout.tp
    act = batch * tokens * (cfg.ffn_dim + 6 * cfg.inner_dim) * 4 / split
    from wan_tpu.layers import attention as attention_lib

    if attention in attention_lib.MATERIALISES_LOGITS:
        # Heads over tp, queries over sp (keys are gathered), batch over dp.
        act += 2.5 * batch * cfg.num_attention_heads * tokens * tokens * 4 / split
    return int(act)


@functools.lru_cache(maxsize=16)
def dit_bytes(cfg, dtype_name: str = "bfloat16", quantization: str | None = None) -> tuple[int, int]:
    """(bytes of the parameters outside the block stack, bytes of one block) of a DiT config loaded in
    `dtype_name` (float32 where diffusers keeps it); with `quantization` the block linears take one byte
    per weight and a float32 scale per output channel (`wan_tpu.wan.quantize`)."""
    import jax.numpy as jnp
    from flax import nnx

    from wan_tpu.wan.quantize import BLOCK_LINEARS
    from wan_tpu.wan.transformer import WanTransformer

    abstract = stacking.eval_shape(lambda: WanTransformer(cfg, dtype=jnp.dtype(dtype_name), rngs=nnx.Rngs(0)))
    linears = {f"blocks.{parent}.{name}.kernel" for parent, name in BLOCK_LINEARS}
    fixed = stack = 0
    for key, var in nnx.to_flat_state(nnx.state(abstract)):
        path, x = ".".join(map(str, key)), var.get_value()
        if not path.startswith("blocks."):
            fixed += x.size * x.dtype.itemsize
        elif quantization and path in linears:
            stack += x.size + x.shape[0] * x.shape[-1] * 4
        else:
            stack += x.size * x.dtype.itemsize
    return fixed, stack // cfg.num_layers


@functools.lru_cache(maxsize=8)
def umt5_bytes(config, dtype_name: str = "bfloat16") -> tuple[int, int]:
    """(bytes of the UMT5 parameters a device holds outside the block stack, bytes of one block): the token
    embedding is looked up on the host (`UMT5Embedding`) and never counted."""
    import jax.numpy as jnp
    from flax import nnx

    from wan_tpu.encoders.umt5 import UMT5Encoder

    abstract = stacking.eval_shape(lambda: UMT5Encoder(config, jnp.dtype(dtype_name)))
    fixed = stack = 0
    for key, var in nnx.to_flat_state(nnx.state(abstract)):
        x = var.get_value()
        if str(key[0]) == "blocks":
            stack += x.size * x.dtype.itemsize
        else:
            fixed += x.size * x.dtype.itemsize
    return fixed, stack // config.num_layers


def text_step_bytes(config, batch: int = 2, length: int = 512, resident: int | None = None) -> int:
    """One encode's temporaries beside the weights: a block's float32 attention logits and softmax (the
    reference attention, 2.5 × B·H·S², as for the DiT), its feed-forward's float32 temporaries
    (B·S·(2·d_ff + 4·d_model)), and H·S² float32 per resident layer: the relative-position bias gathered
    for a whole stack at once. That last term is an allowance: XLA's buffer assignment on CPU (float32)
    gives 0.81 GiB of temporaries for UMT5-XXL at B=2, S=512 (this formula without it: 0.45 GiB, plus
    the one layer's weights a slice copies: 1.17), while the bf16 encode on an H200 asked for 1.88 GiB;
    with it the formula gives 1.95 GiB there."""
    layers = config.num_layers if resident is None else min(resident, config.num_layers)
    return int(2.5 * batch * config.num_heads * length * length * 4
               + batch * length * (2 * config.d_ff + 4 * config.d_model) * 4
               + layers * config.num_heads * length * length * 4)


def text_device_bytes(config, dtype_name: str, resident: int | None, batch: int = 2) -> int:
    """The text stage's peak per device with `resident` UMT5 blocks kept (None: all), the rest streamed
    (two blocks in flight): weights, one block's slice copy, `text_step_bytes`."""
    fixed, block = umt5_bytes(config, dtype_name)
    layers = config.num_layers if resident is None else min(resident, config.num_layers) + 2
    return fixed + block * (layers + 1) + text_step_bytes(config, batch, resident=resident)


def plan_text_resident(config, dtype_name: str, device_free: int | None, batch: int = 2) -> int | None:
    """UMT5 blocks to keep on the device for the text stage alone (None: all of them fit, or memory is
    unknown); the most that fit, 0 when even a fully streamed encoder does not (the stage then fails as
    it would have)."""
    if config is None or device_free is None or text_device_bytes(config, dtype_name, None, batch) <= device_free:
        return None
    return next((n for n in range(config.num_layers - 1, -1, -1)
                 if text_device_bytes(config, dtype_name, n, batch) <= device_free), 0)


def int8_layout_copy_bytes(pipe, resident: int | None, layout: Layout) -> int:
    """A GPU's int8 products want both operands with the contracting dimension minor (XLA's GPU layout
    assignment, for cuBLAS's int8 GEMMs), so the stored (in, out) kernels are transposed; where that
    layout reaches a scanned stack, the copy is of every resident layer at once. Counted per resident
    block (at its stored size) so that the plan leaves room for it; 0 elsewhere."""
    if pipe.quantization != "int8" or layout.platform != "gpu":
        return 0
    cfg = pipe.variant.transformer
    count = cfg.num_layers if resident is None else min(resident, cfg.num_layers)
    return count * dit_bytes(cfg, _dtype_name(pipe.dtype), "int8")[1] // layout.devices


def _experts(pipe):
    variant = pipe.variant
    return [variant.transformer] + ([variant.transformer_2] if variant.transformer_2 is not None else [])


def dit_device_bytes(pipe, resident: int | None) -> int:
    """The DiT weights a device holds while denoising, summed over the experts: all of them (`resident`
    None), or with `resident` blocks kept and the rest streamed (two blocks in flight)."""
    total = 0
    for cfg in _experts(pipe):
        fixed, block = dit_bytes(cfg, _dtype_name(pipe.dtype), pipe.quantization)
        total += fixed + block * (cfg.num_layers if resident is None else min(resident, cfg.num_layers))
    cfg = _experts(pipe)[0]
    if resident is not None and resident < cfg.num_layers:
        total += 2 * dit_bytes(cfg, _dtype_name(pipe.dtype), pipe.quantization)[1]
    return total


def dit_host_bytes(pipe) -> int:
    """Host RAM the streamed block stacks take: every block of every expert (the resident ones too)."""
    return sum(dit_bytes(cfg, _dtype_name(pipe.dtype), pipe.quantization)[1] * cfg.num_layers for cfg in _experts(pipe))


def _dtype_name(dtype) -> str:
    import jax.numpy as jnp

    return jnp.dtype(dtype).name


@functools.lru_cache(maxsize=8)
def _abstract_vae(config, dtype: str = "float32"):
    """(an abstract WanVAE of `config` in `dtype`, its parameter count): shapes only, nothing allocated."""
    import jax
    from flax import nnx

    from wan_tpu.vae.model import WanVAE

    vae = nnx.eval_shape(lambda: WanVAE(config, dtype=dtype, rngs=nnx.Rngs(0)))
    return vae, sum(x.size for x in jax.tree.leaves(nnx.state(vae)))


def stage_bytes(pipe, s, stages=("text", "image", "denoise", "decode"), attention_impl_name: str | None = None,
                keep_dit: bool = False, image: bool = False, resident=RESIDENT_PLANNED) -> dict[str, tuple[int, str]]:
    """Stage → (peak bytes per device, what dominates it) for run settings `s` of pipeline `pipe`.

    `keep_dit`: the DiT stays loaded while decoding (`--prompts` runs). `image`: an image is encoded.
    `resident`: DiT blocks kept on the device, the rest streamed (None: all; default: the pipeline's
    `offload_plan`). The decode entry is its fastest plan (`decode_plans` lists the others).
    """
    import jax
    import jax.numpy as jnp

    from wan_tpu.layers import attention as attention_lib

    layout = Layout.of(pipe.mesh)
    n = layout.devices
    size = jnp.dtype(pipe.dtype).itemsize
    elements = pipe.weight_elements or {}
    variant = pipe.variant
    if resident is RESIDENT_PLANNED:
        plan = getattr(pipe, "offload_plan", None)
        resident = None if plan is None else plan.resident
    dit_weights = dit_device_bytes(pipe, resident) // n
    latent = pipe.latent_shape(s.height, s.width, s.num_frames)
    z = jax.ShapeDtypeStruct(latent, pipe.vae_dtype)
    out = {}
    if "text" in stages:
        te = elements.get("text_encoder", 0) * size
        out["text encode"] = (te // n, "text encoder weights")
        text_resident = getattr(getattr(pipe, "offload_plan", None), "text_resident", None)
        config = getattr(pipe, "text_encoder_config", None)
        if text_resident is not None and config is not None:
            out["text encode"] = (text_device_bytes(config, _dtype_name(pipe.dtype), text_resident) // n,
                                  f"text encoder, {text_resident} of {config.num_layers} blocks resident")
    if "image" in stages and image:
        model, vae_weights = _vae(pipe)
        clip = elements.get("image_encoder", 0) * 4
        out["image encode"] = (vae_weights + clip + int(1.15 * model.decode_bytes(z, 2)), "VAE encode")
    if "denoise" in stages:
        cfg = variant.transformer
        pt, ph, pw = cfg.patch_size
        tokens = (latent[2] // pt) * (latent[3] // ph) * (latent[4] // pw)
        impl = attention_impl(attention_impl_name, layout.platform, cfg, tokens, pipe.dtype)
        step = dit_step_bytes(cfg, tokens, 2 if s.do_cfg else 1, impl, layout)
        logits = impl in attention_lib.MATERIALISES_LOGITS
        what = f"DiT activations over {tokens:,} tokens" + (f", {impl} attention's logits" if logits else "")
        if resident is not None and resident < cfg.num_layers:
            what += f", {resident} of {cfg.num_layers} blocks resident"
        step += int8_layout_copy_bytes(pipe, resident, layout)
        out["denoise"] = (dit_weights + step + 8 * math.prod(latent) * 4, what)
    if "decode" in stages:
        model, vae_weights = _vae(pipe)
        plan, need = next(decode_plans(model, z, layout))
        out["decode"] = (vae_weights + (dit_weights if keep_dit else 0) + need, f"VAE decode, {plan}")
    return out


def _vae(pipe):
    """(abstract VAE, weight bytes) of the pipeline's VAE."""
    import jax.numpy as jnp

    dtype = jnp.dtype(pipe.vae_dtype)
    model, count = _abstract_vae(pipe.vae_config, dtype.name)
    return model, (pipe.weight_elements or {}).get("vae", count) * dtype.itemsize


def decode_plans(model, z, layout: Layout):
    """(plan, working-set bytes per device) of the VAE decode, in the order `WanVAE.decode` tries them:
    the fewest exact strips first, tiles last (one 256-pixel tile's decode + the tile rows and the
    whole video). Lazy: each costs a trace of the decoder (cached per shape)."""
    import jax

    if layout.devices > 1:
        yield "width-sharded", model.decode_bytes(z, 1) // layout.devices
        return
    for k in model.strip_counts(z) or [1]:
        yield f"{k} strip{'s' * (k > 1)}", model.decode_bytes(z, k)
    b, c, f, h, w = z.shape
    video = 3 * (1 + 4 * (f - 1)) * h * w * model.config.scale_factor_spatial**2 * 4
    tile = jax.ShapeDtypeStruct((b, c, f, min(32, h), min(32, w)), z.dtype)
    yield "tiles", model.decode_bytes(tile, 1) + 2 * video


def check_fits(pipe, s, stages=("text", "image", "denoise", "decode"), attention_impl_name: str | None = None,
               keep_dit: bool = False, image: bool = False) -> None:
    """Raise `WanInputError` (one line: what does not fit, a size that would, `--mesh`) when a stage's
    estimated peak exceeds the memory available; nothing when it fits or the memory is unknown."""
    free, where = available_bytes()
    if free is None:
        return
    layout = Layout.of(pipe.mesh)
    # CPU devices share one RAM: compare the sum over them.
    scale = layout.devices if layout.platform == "cpu" else 1
    for stage, (need, what) in stage_bytes(pipe, s, stages, attention_impl_name, keep_dit, image).items():
        if need * scale <= free:
            continue
        if stage == "decode":
            # The VAE picks more strips, then tiles, from the free memory by itself: fine if any fits.
            import jax

            model, _ = _vae(pipe)
            z = jax.ShapeDtypeStruct(pipe.latent_shape(s.height, s.width, s.num_frames), pipe.vae_dtype)
            plans = list(decode_plans(model, z, layout))
            first = plans[0][1]
            if any((need - first + p) * scale <= free for _, p in plans):
                continue
            need, what = need - first + plans[-1][1], "VAE decode, even tiled"
        raise WanInputError(
            f"this run needs about {need * scale / GiB:.1f} GiB for {stage} ({what}) but {free / GiB:.1f} GiB of "
            f"{where} is free; {_advice(pipe, s, stage, layout, free / scale, attention_impl_name)}"
            " (--no-memory-check runs it anyway)"
        )


@dataclass(frozen=True)
class OffloadPlan:
    """What leaves the device during a run: `resident` DiT blocks kept on it, the others streamed from host
    memory (None: every block on the device, nothing streamed); `release`: each component leaves the device
    when its stage is done (the encoders after encoding, the DiT before decoding)."""

    resident: int | None
    layers: int
    release: bool = False
    device_free: int | None = None  # what the choice was made for (bytes per device)
    host_bytes: int | None = None  # host RAM the streamed stacks take
    text_resident: int | None = None  # UMT5 blocks kept on the device for the text stage (None: all)
    text_layers: int = 0
    measured: int | None = None  # the compiled forward's device bytes at `resident` (`plan_offload(measure=)`)

    @property
    def streamed(self) -> bool:
        return self.resident is not None and self.resident < self.layers

    @property
    def text_streamed(self) -> bool:
        return self.text_resident is not None and self.text_resident < self.text_layers

    def describe(self) -> str:
        """One line saying what was chosen for every stage, with the sizes that decided it."""
        text = (f"; text encoder: blocks:{self.text_resident} ({self.text_resident} of {self.text_layers} UMT5 blocks "
                "on the device, the rest streamed)" if self.text_streamed else "")
        if not self.streamed:
            return "offload: none (every DiT block on the device)" + text
        line = (f"offload: blocks:{self.resident} ({self.resident} of {self.layers} DiT blocks on the device, "
                f"{self.layers - self.resident} streamed from host memory")
        if self.host_bytes is not None:
            line += f" holding {self.host_bytes / GiB:.1f} GiB"
        if self.device_free is not None:
            line += f"; {self.device_free / GiB:.1f} GiB of device memory free"
        if self.measured is not None:
            line += f"; the compiled step needs {self.measured / GiB:.1f} GiB"
        return line + ")" + text


def compiled_device_bytes(compiled, args) -> int:
    """A compiled program's device memory per device: its temporaries and outputs (XLA's
    `memory_analysis()`) plus the bytes of the arguments `args` (arrays or `ShapeDtypeStruct`s) that
    live in device memory (a streamed stack's host arrays do not count)."""
    from wan_tpu.parallel import offload

    analysis = compiled.memory_analysis()
    device_args = 0
    for x in jax.tree.leaves(args):
        if hasattr(x, "shape") and not offload.on_host(x):
            sharding = getattr(x, "sharding", None)
            shape = x.shape if sharding is None else sharding.shard_shape(x.shape)
            device_args += math.prod(shape) * x.dtype.itemsize
    return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes
               + device_args)


def plan_offload(pipe, s, choice="auto", attention_impl_name: str | None = None, device_free: int | None = None,
                 host_free: int | None = None, measure=None) -> OffloadPlan:
    """The offload of a run (`choice`: "auto", None for none, or N resident blocks; see
    `wan_tpu.wan.settings.parse_offload`). `auto` keeps every block on the device when the denoise stage
    fits, else the most blocks that fit; a `WanInputError` (one line) when even a fully streamed DiT does
    not fit the device, or the host RAM cannot hold the streamed blocks. `device_free`, `host_free`: the
    free bytes per device and of the host (default: as the backend and the OS report them; on CPU, where
    the "device" is host RAM, streaming saves nothing and `auto` streams nothing). `measure(resident)`:
    the device bytes of the compiled step at that count (None: every block resident;
    `compiled_device_bytes`), where the caller can compile it; `auto` then streams when the compiled
    resident step does not fit and drops resident blocks until the compiled program fits, whatever XLA's
    temporaries turn out to be. The text stage's own plan rides along (`text_resident`): the UMT5
    blocks kept when the whole encoder does not fit the device alone."""
    from wan_tpu.runtime.memory import host_available_bytes

    layers = pipe.variant.transformer.num_layers
    if choice is None:
        return OffloadPlan(None, layers)
    layout = Layout.of(pipe.mesh)
    where = "device memory per device"
    if device_free is None:
        if layout.platform == "cpu" and choice == "auto":
            return OffloadPlan(None, layers)
        device_free, where = available_bytes()
    if choice != "auto" and choice > layers:
        raise WanInputError(f"--offload blocks:{choice} keeps more blocks resident than the DiT's {layers}; "
                            f"pass a count from 0 to {layers}")
    if device_free is None:  # memory not reported: nothing to decide from
        return OffloadPlan(None, layers) if choice == "auto" else OffloadPlan(choice, layers, True)
    text_config = getattr(pipe, "text_encoder_config", None)
    # UMT5's weights are FSDP-sharded over the mesh like the DiT's: the estimate is per device over n.
    text = {"text_resident": plan_text_resident(text_config, _dtype_name(pipe.dtype), device_free * layout.devices),
            "text_layers": 0 if text_config is None else text_config.num_layers}

    def need(resident):
        return stage_bytes(pipe, s, ("denoise",), attention_impl_name, resident=resident)["denoise"][0]

    everything = dit_device_bytes(pipe, None) // layout.devices + sum(
        n * (4 if c == "image_encoder" else _itemsize(pipe, c)) for c, n in (pipe.weight_elements or {}).items()
        if c not in ("transformer", "transformer_2")) // layout.devices
    if choice == "auto":
        if need(None) <= device_free and (measure is None or measure(None) <= device_free):
            release = everything > device_free or text["text_resident"] is not None
            return OffloadPlan(None, layers, release=release, **text)
        fitting = [n for n in range(layers - 1, -1, -1) if need(n) <= device_free]
        if not fitting:
            raise WanInputError(
                f"this run needs about {need(0) / GiB:.1f} GiB of {where} for denoise even with every DiT block "
                f"streamed from host memory, but {device_free / GiB:.1f} GiB is free; "
                f"{_advice(pipe, s, 'denoise', layout, device_free, attention_impl_name, resident=0)}"
            )
        choice = fitting[0]
    measured = None
    if measure is not None and choice < layers:
        block = dit_bytes(pipe.variant.transformer, _dtype_name(pipe.dtype), pipe.quantization)[1]
        while True:
            measured = measure(choice)
            if measured <= device_free or choice == 0:
                break
            choice = max(0, choice - max(1, math.ceil((measured - device_free) / block)))
        if measured > device_free:
            raise WanInputError(
                f"the compiled denoise step needs {measured / GiB:.1f} GiB of {where} even with every DiT block "
                f"streamed from host memory, but {device_free / GiB:.1f} GiB is free; "
                f"{_advice(pipe, s, 'denoise', layout, device_free, attention_impl_name, resident=0)}")
    host_need = dit_host_bytes(pipe)
    plan = OffloadPlan(choice, layers, True, device_free, host_need, measured=measured, **text)
    host = host_free if host_free is not None else host_available_bytes()
    if plan.streamed and host is not None and host_need > host:
        smaller = "" if pipe.quantization else "--quantize int8 or fp8 (half the bytes), "
        raise WanInputError(
            f"streaming the DiT's blocks from host memory needs about {host_need / GiB:.1f} GiB of host RAM but "
            f"{host / GiB:.1f} GiB is free; use a machine with more RAM, {smaller}or shard over more devices with "
            "--mesh"
        )
    return plan


def _itemsize(pipe, component: str) -> int:
    import jax.numpy as jnp

    return jnp.dtype(pipe.vae_dtype if component == "vae" else pipe.dtype).itemsize


def _advice(pipe, s, stage, layout, free, attention_impl_name, resident=RESIDENT_PLANNED) -> str:
    import jax

    tips = []
    if stage == "denoise":
        smaller = _smaller_run(pipe, s, layout, free, attention_impl_name, resident)
        if smaller:
            tips.append(f"a smaller run fits, e.g. --size {smaller[0]}*{smaller[1]} --frames {smaller[2]}")
        else:
            tips.append("use a smaller --size or fewer --frames")
        plan = getattr(pipe, "offload_plan", None)
        if resident is RESIDENT_PLANNED and (plan is None or plan.resident is None) and layout.platform != "cpu":
            streamed, _ = stage_bytes(pipe, s, ("denoise",), attention_impl_name, resident=0)["denoise"]
            if streamed <= free:
                tips.append("stream the DiT's blocks from host memory with --offload auto")
        if not pipe.quantization and layout.platform != "cpu":
            tips.append("--quantize int8 or fp8 (half the DiT's bytes)")
    elif stage == "decode":
        tips.append("use a smaller --size or fewer --frames (the VAE decode already splits into strips and tiles)")
    else:
        tips.append("use a machine with more memory")
    count = len(jax.devices())
    # CPU "devices" share one RAM: sharding over them saves nothing.
    if count > layout.devices and layout.platform != "cpu":
        tips.append(f"shard over all {count} devices with --mesh 1,{count},1")
    return "; or ".join(tips)


def _smaller_run(pipe, s, layout, free, attention_impl_name, resident=RESIDENT_PLANNED) -> tuple[int, int, int] | None:
    """The largest (width, height, frames) among simple reductions of this run whose denoise fits."""
    multiple = pipe.vae_config.scale_factor_spatial * pipe.variant.transformer.patch_size[1]
    t = pipe.vae_config.scale_factor_temporal
    candidates = set()
    for scale in (1.0, 0.75, 0.5, 0.375, 0.25):
        w = max(multiple, int(s.width * scale) // multiple * multiple)
        h = max(multiple, int(s.height * scale) // multiple * multiple)
        for div in (1, 2, 4, 8, 16):
            frames = ((s.num_frames - 1) // t // div) * t + 1
            if (w, h, frames) != (s.width, s.height, s.num_frames):
                candidates.add((w, h, frames))
    for w, h, frames in sorted(candidates, key=lambda c: -(c[0] * c[1] * c[2])):
        smaller = type(s)(h, w, frames, s.num_inference_steps, s.guidance_scale, s.guidance_scale_2, s.flow_shift)
        need, _ = stage_bytes(pipe, smaller, ("denoise",), attention_impl_name, resident=resident)["denoise"]
        if need <= free:
            return w, h, frames
    return None


def weights_fit(weight_bytes: dict[str, int], names, mesh) -> bool:
    """Whether the weights of `names` fit together in 90% of the free memory of a device (their bytes
    split over the mesh's devices); True where the backend does not report memory (CPU) or sizes are unknown."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats or not weight_bytes:
        return True
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    devices = 1 if mesh is None else mesh.devices.size
    return sum(weight_bytes.get(n, 0) for n in names) / devices <= 0.9 * free


def decode_compiles_beside_denoise(pipe, s) -> bool:
    """Whether the VAE decode may compile while the DiT denoises. On a GPU, XLA's autotuner runs the
    decode's convolutions on device buffers of their real sizes while it compiles, so that compile needs
    about the decode's working set beside the denoise's; where both do not fit in 90% of a device's
    memory, the decode compiles before the first step instead (a 14B 720p run from an empty compile
    cache on an 80 GB H100 ran out of memory in its first steps otherwise). True off GPUs (TPU
    compiles take no device memory) and where the memory is unknown."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if device.platform != "gpu" or "bytes_limit" not in stats:
        return True
    need = stage_bytes(pipe, s, ("denoise", "decode"))
    return sum(b for b, _ in need.values()) <= 0.9 * stats["bytes_limit"]


def free_bytes_after_release(vae) -> int | None:
    """The free device memory `decode` will see once the encoders and the DiT are released: all of it
    but the VAE's weights (None where the backend does not report memory)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    from flax import nnx

    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(vae)))
    return stats["bytes_limit"] - weights
