"""`WanVAE`: the Wan 2.1 / 2.2 video VAE in Flax NNX, computing what diffusers' `AutoencoderKLWan` does.

Public I/O is diffusers': `encode(video (B, 3, T, H, W) in [-1, 1]) -> posterior mean (B, z, F, h, w)`
(== `latent_dist.mode()`), `decode(z) -> video (B, 3, T, H, W)` clamped to [-1, 1] (== `.sample`).

The causal time loop is diffusers' (encode: the first frame alone, then chunks of 4 frames; decode:
one latent frame at a time), but each kind of chunk is one jitted function traced once per spatial
shape, whatever the number of frames: the feature caches are its carried, donated arguments. Inside
a chunk, the layers run one frame at a time where they can (`lax.scan`): the encoder's layers before
its first temporal downsample, and the decoder's after each temporal upsample, level by level (see
`_nested`), so the largest activations hold one frame and their convs are 2D (see CausalConv3d).
Decode runs in two passes: the mid block's output for every latent frame (its attention sees whole
frames), then the rest over all frames one vertical strip at a time, exactly (halos, see
`Decoder3d.strip_plan`), so only one strip's caches (a 3-frame ring per causal conv, see
`vae_blocks.RingCache`) are alive. With a mesh, activations are split along width over all its
devices (weights replicated; XLA exchanges the conv halos). On one small device `decode` takes more
strips, then tiles space (diffusers' tiled decode: overlapping latent tiles, linear blend,
approximate), chosen from free device memory or forced with `strips=` / `tiling=True`.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from wan_tpu.configs.vae import WanVAEConfig
from wan_tpu.errors import WanInputError
from wan_tpu.runtime.xla_defaults import NO_SOFTMAX_REWRITER, PER_RUN
from wan_tpu.vae.blocks import CausalConv3d, ChunkState, Decoder3d, Encoder3d, RingCache


class WanVAE(nnx.Module):
    def __init__(self, config: WanVAEConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.dtype = dtype
        self.mesh = None
        z = config.z_dim
        self.encoder = Encoder3d(config, dtype=dtype, rngs=rngs)
        self.quant_conv = CausalConv3d(2 * z, 2 * z, 1, dtype=dtype, rngs=rngs)
        self.post_quant_conv = CausalConv3d(z, z, 1, dtype=dtype, rngs=rngs)
        self.decoder = Decoder3d(config, dtype=dtype, rngs=rngs)

    # ---- public API ----
    def encode(self, video, mesh: Mesh | None = None):
        """Video (B, C, T, H, W) in [-1, 1], T = 4n+1 → posterior mean (B, z_dim, n+1, H/s, W/s)."""
        cfg = self.config
        video = jnp.asarray(video)
        if video.ndim != 5 or video.shape[1] != cfg.video_channels:
            raise WanInputError(f"encode expects video (B, {cfg.video_channels}, T, H, W), got shape {tuple(video.shape)}")
        t, h, w = video.shape[2:]
        if (t - 1) % 4:
            raise WanInputError(f"encode needs 4n+1 frames, got {t}; pass e.g. {4 * ((t - 1) // 4) + 1} or {4 * ((t - 1) // 4) + 5}")
        s = cfg.scale_factor_spatial
        if h % s or w % s:
            raise WanInputError(f"encode needs height and width divisible by {s}, got {h}x{w}; resize or crop the video")
        graphdef, state = nnx.split(self)
        wmesh = width_mesh(mesh or self.mesh)
        video = _place(video.astype(self.dtype), wmesh)
        caches, mu = _encode_chunk(graphdef, state, video[:, :, :1], None, wmesh)
        means = [mu]
        for i in range((t - 1) // 4):
            caches, mu = _encode_chunk(graphdef, state, video[:, :, 1 + 4 * i : 5 + 4 * i], caches, wmesh)
            means.append(mu)
        return jnp.concatenate(means, axis=2)

    def decode(self, z, *, tiling: bool | None = None, tile_sample_size=(256, 256), tile_sample_stride=(192, 192),
               mesh: Mesh | None = None, strips: int | None = None):
        """Latents (B, z_dim, F, h, w) → video (B, C, 4(F-1)+1, h·s, w·s) in [-1, 1].

        `tiling=None` tiles only when the untiled decode would not fit in free device memory;
        tiles are `tile_sample_size` pixels (height, width), at most `tile_sample_stride` apart.
        `strips`: the untiled decode runs the layers after the mid block on this many vertical strips
        one after the other (exact: each strip reads a halo, see `Decoder3d.strip_plan`), so only one
        strip's caches are alive. None picks 2 where the latent is at least 4 halos wide, and more
        (up to 8, each strip at least 2 halos wide) when free device memory calls for it: strips are
        exact, so they are tried before tiles.
        """
        cfg = self.config
        z = jnp.asarray(z)
        if z.ndim != 5 or z.shape[1] != cfg.z_dim:
            raise WanInputError(f"decode expects latents (B, {cfg.z_dim}, F, h, w), got shape {tuple(z.shape)}")
        wmesh = width_mesh(mesh or self.mesh)
        z = _place(z.astype(self.dtype), wmesh)
        if strips is None:
            strips = 1 if wmesh is not None else self._auto_strips(z)
        if not 1 <= strips <= z.shape[-1] or (wmesh is not None and strips != 1):
            raise WanInputError(f"strips must be between 1 and the latent width {z.shape[-1]} (1 with a mesh), got {strips}")
        if tiling is None:
            tiling = wmesh is None and self._needs_tiling(z, strips)
        if tiling:
            return self._tiled_decode(z, tile_sample_size, tile_sample_stride)
        return self._decode(z, wmesh, strips=strips)

    def compile_decode(self, shape, *, mesh: Mesh | None = None, strips: int | None = None,
                       free_bytes: int | None = None, stop=None, compiles=None) -> jax.ShapeDtypeStruct | None:
        """Compile, without running, the programs `decode` runs on latents of `shape` (B, z_dim, F, h, w),
        so that a later `decode` (same shape, strips, mesh) starts at once; e.g. in a background thread
        while the DiT denoises. Also on an abstract VAE (`nnx.eval_shape`, `abstract_vae`): the programs
        need no weight, and serve the loaded VAE where `compile_ahead.serves` says so. `free_bytes` stands
        for the free device memory `decode` will see (the strip count depends on it; default: what is free
        now). Returns the video's shape and dtype, or None where `decode` would tile (many tile shapes: they
        compile on use). The programs are lowered one after the other and compile side by side
        (`compile_ahead.SideBySide`): in `compiles` where the caller gives one (its block waits for them),
        else in one of its own that this call waits for, which stops at `stop` (a `threading.Event`: once
        set, no further program starts compiling and `compile_ahead.Cancelled` is raised)."""
        from wan_tpu.runtime.compile_ahead import SideBySide

        wmesh = width_mesh(mesh or self.mesh)
        z = jax.ShapeDtypeStruct(tuple(shape), self.dtype)
        if wmesh is not None:  # placed as `decode` places its input
            z = jax.ShapeDtypeStruct(z.shape, z.dtype, sharding=_placement(z, wmesh))
        if strips is None:
            strips = 1 if wmesh is not None else self._auto_strips(z, free_bytes)
        if wmesh is None and self._needs_tiling(z, strips, free_bytes):
            return None
        if compiles is None:
            with SideBySide(stop) as own:
                out = self._decode(z, wmesh, strips=strips, run=_Run(own, wmesh))
        else:
            out = self._decode(z, wmesh, strips=strips, run=_Run(compiles, wmesh))
        return jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=getattr(out, "sharding", None))

    def encode_chunk(self, video, caches=None, *, per_run: bool = False):
        """Streaming encode: the next frames of a video → (posterior mean of their latent frame
        (B, z_dim, 1, h, w), the caches for the next call). `caches=None` starts a video with its first
        frame alone (B, C, 1, H, W); every later call takes 4 frames. The latents of the calls
        concatenated equal `encode` of the whole video (the same chunk function). Pure: a caller's jitted
        program can include it. `per_run`: a program compiled with `xla_defaults.PER_RUN` and `NO_SOFTMAX_REWRITER`, for
        a top-level call made once per stream (Matrix-Game-2's image; JAX refuses compiler options on a jit nested in
        another)."""
        video = jnp.asarray(video)
        want = 1 if caches is None else 4
        if video.ndim != 5 or video.shape[1] != self.config.video_channels or video.shape[2] != want:
            raise WanInputError(f"encode_chunk expects video (B, {self.config.video_channels}, {want}, H, W) "
                                f"({'the first frame' if caches is None else 'the next 4 frames'}), got shape {tuple(video.shape)}")
        graphdef, state = nnx.split(self)
        program = _encode_chunk_per_run if per_run else _encode_chunk
        caches, mu = program(graphdef, state, video.astype(self.dtype), caches, None)
        return mu, caches

    def lower_encode_chunk(self, shape, caches=None, *, per_run: bool = False):
        """The program `encode_chunk` runs on video of `shape` after `caches` (abstract, or None for a video's
        first frame), lowered, without running it; also on an abstract VAE (`nnx.eval_shape`), before any
        weight exists. Its `out_info` is the abstract (caches, latent frame) it gives; called compiled, it
        takes (state, video, caches), the VAE's `nnx.split` state."""
        graphdef, state = nnx.split(self)
        program = _encode_chunk_per_run if per_run else _encode_chunk
        return program.lower(graphdef, state, jax.ShapeDtypeStruct(tuple(shape), self.dtype), caches, None)

    def decode_chunk(self, z, caches=None, start=None):
        """Streaming decode: the next latent frames (B, z_dim, F, h, w) of a video → (video frames
        (B, C, T, H, W) in [-1, 1], the caches for the next call).

        `caches=None` starts a video: its first latent frame gives 1 video frame, every later one 4, and
        the chunks' frames concatenated equal `decode` of the whole latent video (the same causal caches,
        carried across calls instead of across frames). The caches keep one shape from the first call on,
        so a video takes two traces (its first chunk and all later ones of the same size); the function is
        pure, so a caller's jitted program can include it and carry and donate the caches. Full width on
        one device: no strips, tiles or mesh (a streamed chunk is a few frames).

        `start` (a bool, traced or not) with `caches` (`start_decode_caches` for a video's first chunk):
        one trace for every chunk. Where `start` holds, the first latent frame takes the first frame's
        path (the caches' values unused) and its video frame comes after 3 of zeros, so every chunk gives
        4 per latent frame; the frames are bitwise those of the two-trace form."""
        z = jnp.asarray(z)
        if z.ndim != 5 or z.shape[1] != self.config.z_dim or z.shape[2] < 1:
            raise WanInputError(f"decode_chunk expects latents (B, {self.config.z_dim}, F ≥ 1, h, w), got shape {tuple(z.shape)}")
        if start is not None and caches is None:
            raise WanInputError("decode_chunk with start= needs caches; pass start_decode_caches(z.shape) for a video's first chunk")
        graphdef, state = nnx.split(self)
        caches, video = _decode_chunk(graphdef, state, z.astype(self.dtype), caches, start)
        return video, caches

    def start_decode_caches(self, z_shape):
        """Zeros shaped as the caches `decode_chunk` carries for latents of `z_shape`: what
        `decode_chunk(z, caches, start=True)` takes for a video's first chunk. Traceable (shapes only)."""
        graphdef, state = nnx.split(self)
        # The caches have their shape from the first latent frame on: one frame's trace (one pass of the decoder
        # instead of the first frame's and the scan's) gives it.
        one = jax.ShapeDtypeStruct((*z_shape[:2], 1, *z_shape[3:]), self.dtype)
        caches, _ = _decode_chunk.eval_shape(graphdef, state, one, None)
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), caches)

    def normalize_latents(self, z):
        """diffusers WanPipeline's encode-side scaling: (z - mean) * (1 / std)."""
        mean, inv_std = self._latent_stats(z)
        return (z - mean) * inv_std

    def denormalize_latents(self, z):
        """diffusers WanPipeline's scaling before `vae.decode`: z / (1 / std) + mean."""
        mean, inv_std = self._latent_stats(z)
        return z / inv_std + mean

    # ---- internals ----
    def _latent_stats(self, z):
        shape = (1, self.config.z_dim, 1, 1, 1)
        mean = jnp.asarray(self.config.latents_mean, jnp.float32).reshape(shape).astype(z.dtype)
        inv_std = (1.0 / jnp.asarray(self.config.latents_std, jnp.float32)).reshape(shape).astype(z.dtype)
        return mean, inv_std

    def _decode(self, z, wmesh, raw=False, strips=1, run=None):
        """The mid block's output for every latent frame first (its attention sees whole frames), then
        the rest of the decoder over all frames, one strip after another. `run=_Run(compiles)`: compile every
        program on the way instead (z abstract), visiting each distinct call once."""
        run = run or _RUN
        graphdef, state = nnx.split(self)
        b, _, f, _, w = z.shape
        caches, mids = _stem_start_caches(graphdef, state, run.frame(z, 0), wmesh, run), None
        for i in run.frames(f, distinct=1):
            caches, mid = run(_decode_stem, graphdef, state, run.frame(z, i), caches, wmesh)
            if mids is None:
                mids = run.zeros((b, f, *mid.shape[2:]), mid.dtype, wmesh)
            mids = run(_write, mids, mid, (0, i, 0, 0, 0))
        del caches, mid
        scale = self.config.scale_factor_spatial // ((self.config.patch_size or 1) if raw else 1)
        out = None
        for k in range(strips):
            start, stop = k * w // strips, (k + 1) * w // strips
            (lo, hi), widths, offsets = self.decoder.strip_plan(w, start, stop)
            caches = None
            for i in run.frames(f, distinct=2):  # the first frame is not upsampled in time: its own program
                columns = run(_frame_columns, mids, i, lo, hi - lo)
                caches, frames = run(_decode_strip, graphdef, state, columns, caches, wmesh, raw, widths, offsets)
                if out is None:
                    out = run.zeros((b, frames.shape[1], 1 + 4 * (f - 1), frames.shape[3], w * scale), frames.dtype, wmesh)
                out = run(_write, out, frames, (0, 0, max(0, 4 * i - 3), 0, start * scale))
        return out

    def _decode_bytes(self, z, strips=1) -> int:
        """Device bytes an untiled decode of `z` needs: the mid block's outputs, the widest strip's carried
        caches, the output, and the temporaries, which measured 5.7-6.5 full-resolution, full-width frames
        of `decoder_dim` channels on an H200 (480p and 720p, 2 to 4 strips): 7 here."""
        graphdef, state = nnx.split(self)
        key = (graphdef, z.shape, z.dtype, strips)
        if key not in _DECODE_BYTES:
            b, _, f, h, w = z.shape
            (lo, hi), widths, offsets = self.decoder.strip_plan(w, 0, -(-w // strips))
            mids = jax.ShapeDtypeStruct((b, f, h, w, self.config.decoder_dim * self.config.dim_mult[-1]), z.dtype)
            strip = jax.ShapeDtypeStruct((b, 1, h, hi - lo, mids.shape[-1]), z.dtype)
            # The jit's own eval_shape: the trace is cached, and the decode's first strip call reuses it.
            caches, first = _decode_strip.eval_shape(graphdef, state, strip, None, None, False, widths, offsets)
            cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(caches))
            video_frame = first.size // first.shape[-1] * w * self.config.scale_factor_spatial
            frame = video_frame // first.shape[1] * self.config.decoder_dim * first.dtype.itemsize
            video = video_frame * (1 + 4 * (f - 1)) * first.dtype.itemsize
            _DECODE_BYTES[key] = mids.size * mids.dtype.itemsize + cache_bytes + video + 7 * frame
        return _DECODE_BYTES[key]

    def decode_bytes(self, z, strips: int = 1) -> int:
        """Device bytes `decode(z, strips=strips)` needs (`z` may be a `jax.ShapeDtypeStruct`)."""
        return self._decode_bytes(z, strips)

    def strip_counts(self, z) -> list[int]:
        """The strip counts `decode` chooses from for latents `z`, fewest (fastest) first."""
        return [n for n in (2, 3, 4, 6, 8) if z.shape[-1] >= 2 * n * self.decoder.halos[0]]

    def _auto_strips(self, z, free: int | None = None) -> int:
        """The fewest strips (fastest) whose decode fits in free device memory, 2 where it is not known."""
        counts = self.strip_counts(z)
        if not counts:
            return 1
        free = free if free is not None else _free_device_bytes()
        if free is None:
            return counts[0]
        return next((n for n in counts if self._decode_bytes(z, n) <= 0.9 * free), counts[-1])

    def _needs_tiling(self, z, strips=1, free: int | None = None) -> bool:
        free = free if free is not None else _free_device_bytes()
        return free is not None and self._decode_bytes(z, strips) > 0.9 * free

    def _tiled_decode(self, z, tile_sample_size, tile_sample_stride):
        """diffusers' `tiled_decode`: tiles start every `stride` latents, each decoded over all frames, then
        blended into its upper and left neighbours (linear ramps over the overlap) and cropped to the stride.
        Only two rows of tiles are alive at a time."""
        s, p = self.config.scale_factor_spatial, self.config.patch_size or 1
        _, _, _, h, w = z.shape
        lat_size = [n // s for n in tile_sample_size]
        lat_stride = [n // s for n in tile_sample_stride]
        if min(lat_size) < 1 or min(lat_stride) < 1 or any(a < b for a, b in zip(tile_sample_size, tile_sample_stride)):
            raise WanInputError(
                f"tile_sample_size {tuple(tile_sample_size)} and tile_sample_stride {tuple(tile_sample_stride)} must be "
                f"at least {s} pixels, stride ≤ size; pass e.g. (256, 256) and (192, 192)"
            )
        out_stride = [n // p for n in tile_sample_stride]
        blend = [(a - b) // p for a, b in zip(tile_sample_size, tile_sample_stride)]
        rows, prev = [], None
        for i in range(0, h, lat_stride[0]):
            row = []
            for j in range(0, w, lat_stride[1]):
                tile = self._decode(z[:, :, :, i : i + lat_size[0], j : j + lat_size[1]], None, raw=True)
                if prev is not None:
                    tile = _blend(prev[len(row)], tile, blend[0], axis=3)
                if row:
                    tile = _blend(row[-1], tile, blend[1], axis=4)
                row.append(tile)
            if prev is not None:
                rows.append(jnp.concatenate([t[:, :, :, : out_stride[0], : out_stride[1]] for t in prev], axis=4))
            prev = row
        rows.append(jnp.concatenate([t[:, :, :, : out_stride[0], : out_stride[1]] for t in prev], axis=4))
        video = jnp.concatenate(rows, axis=3)[:, :, :, : h * s // p, : w * s // p]
        return _finish_tiled(video, p)


_DECODE_BYTES: dict = {}  # (graphdef, latent shape, dtype) → estimate; tracing the decoder takes seconds


def _free_device_bytes() -> int | None:
    """Free memory on the first device (the host's free RAM on CPU), None where it is not known."""
    if jax.devices()[0].platform == "cpu":
        from wan_tpu.runtime.memory import host_available_bytes

        return host_available_bytes()
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def frames_to_uint8(video):
    """(B, 3, T, H, W) in [-1, 1] → (B, T, H, W, 3) uint8, rounded like diffusers' video postprocess."""
    return to_uint8(jnp.asarray(video))


@jax.jit
def to_uint8(video):
    x = jnp.clip(video.astype(jnp.float32) / 2 + 0.5, 0.0, 1.0)
    return jnp.round(x * 255).astype(jnp.uint8).transpose(0, 2, 3, 4, 1)


# ---- compiled chunk functions (traced once per spatial shape) ----
def width_mesh(mesh: Mesh | None) -> Mesh | None:
    """All devices of `mesh` on one automatic axis, the one activations are split on (width)."""
    if mesh is None or mesh.devices.size == 1:
        return None
    return Mesh(np.asarray(mesh.devices).reshape(-1), ("w",), axis_types=(AxisType.Auto,))


def _width_spec(shape, wmesh):
    if wmesh is None or shape[-2] % wmesh.devices.size:
        return None
    return NamedSharding(wmesh, PartitionSpec(*[None] * (len(shape) - 2), "w", None))


def _constrain(wmesh):
    if wmesh is None:
        return None

    def constrain(x):
        spec = _width_spec(x.shape, wmesh)
        return x if spec is None else lax.with_sharding_constraint(x, spec)

    return constrain


def _place(x, wmesh):
    """Inputs: width-split (channels-first layouts put width last, hence the transpose-free spec)."""
    return x if wmesh is None else jax.device_put(x, _placement(x, wmesh))


def _placement(x, wmesh) -> NamedSharding:
    if x.shape and x.shape[-1] % wmesh.devices.size == 0:
        return NamedSharding(wmesh, PartitionSpec(*[None] * (len(x.shape) - 1), "w"))
    return NamedSharding(wmesh, PartitionSpec())


def _zeros(shape, dtype, wmesh):
    return _place(_filled(tuple(shape), 0, dtype), wmesh)


@partial(jax.jit, static_argnums=(0, 1, 2))
def _filled(shape, value, dtype):
    # A named program rather than jnp.full's: `_Run` compiles it ahead of time with the rest.
    return jnp.full(shape, value, dtype)


@jax.jit
def _frame(z, i):
    """Latent frame i of (B, C, F, h, w), kept as a length-1 axis."""
    return lax.dynamic_slice_in_dim(z, i, 1, axis=2)


def patchify(x, p):
    """diffusers' patchify in channels-last: (B, T, H, W, C) → (B, T, H/p, W/p, C·p·p), channel c·p²+pw·p+ph."""
    if p is None or p == 1:
        return x
    b, t, h, w, c = x.shape
    x = x.reshape(b, t, h // p, p, w // p, p, c).transpose(0, 1, 2, 4, 6, 5, 3)
    return x.reshape(b, t, h // p, w // p, c * p * p)


def unpatchify(x, p):
    if p is None or p == 1:
        return x
    b, t, h, w, cp = x.shape
    x = x.reshape(b, t, h, w, cp // (p * p), p, p).transpose(0, 1, 2, 6, 3, 5, 4)
    return x.reshape(b, t, h * p, w * p, cp // (p * p))


def _frame_by_frame(fn, x, caches, constrain):
    """Run `fn` over axis 1 of x one frame at a time, threading its causal caches; each call may return
    several frames (a temporal upsample), concatenated in order."""

    def body(c, xf):
        st = ChunkState(c, constrain)
        y = fn(xf[:, None], st)
        return st.out, y

    caches, ys = lax.scan(body, caches, jnp.moveaxis(x, 1, 0))
    ys = jnp.moveaxis(ys, 0, 1)
    return caches, ys.reshape(ys.shape[0], -1, *ys.shape[3:])


def _nested(levels, constrain):
    """levels[0], then the remaining levels frame by frame over each of its output frames, so the larger
    activations of the later levels hold one frame and their convs are 2D. The inner loop's caches are
    one entry of the outer step's cache list."""
    if len(levels) == 1:
        return levels[0]
    inner = _nested(levels[1:], constrain)

    def fn(x, st: ChunkState):
        x = levels[0](x, st)
        caches = st.take()
        if caches is None:  # the first chunk: one frame at every level
            sub = ChunkState(None, constrain)
            x = inner(x, sub)
            st.put(sub.out)
            return x
        caches, x = _frame_by_frame(inner, x, caches, constrain)
        st.put(caches)
        return x

    return fn


def _encode_chunk(graphdef, state, video, caches, wmesh):
    """One encoder chunk (the first frame when `caches` is None, else 4 frames) → (caches, mean)."""
    model: WanVAE = nnx.merge(graphdef, state)
    constrain = _constrain(wmesh)
    x = patchify(video.transpose(0, 2, 3, 4, 1), model.config.patch_size)
    if caches is None:
        frame_st, chunk_st = ChunkState(None, constrain), ChunkState(None, constrain)
        x = model.encoder.per_frame(x, frame_st)
        frame_caches = frame_st.out
    else:
        frame_caches, x = _frame_by_frame(model.encoder.per_frame, x, caches[0], constrain)
        chunk_st = ChunkState(caches[1], constrain)
    x = model.encoder.rest(x, chunk_st)
    mu = model.quant_conv(x, chunk_st)[..., : model.config.z_dim]
    return (frame_caches, chunk_st.out), mu.transpose(0, 4, 1, 2, 3)


# Both programs keep the function's name (`jit(_encode_chunk)` in traces and timelines).
_encode_chunk_per_run = jax.jit(_encode_chunk, static_argnums=(0, 4), donate_argnums=(3,),
                                compiler_options={**PER_RUN, **NO_SOFTMAX_REWRITER})
_encode_chunk = jax.jit(_encode_chunk, static_argnums=(0, 4), donate_argnums=(3,))


def _stem_start_caches(graphdef, state, z, wmesh, run):
    """The stem's caches before the first latent frame: zero rings, exactly what `_decode_stem` builds
    itself when given None. Passing them makes the first frame run the same program as the others."""
    caches, _ = _decode_stem.eval_shape(graphdef, state, z, None, wmesh)  # traced once per shape (jit's cache)
    return [RingCache(run.zeros(c.frames.shape, c.frames.dtype, wmesh), run.full((), 2, jnp.int32, wmesh)) for c in caches]


class _Run:
    """How `WanVAE._decode` makes its calls: run them (`_RUN`), or compile them for abstract inputs
    (`_Run(compiles)`, a `compile_ahead.SideBySide`: each jitted call is lowered, its abstract outputs feed
    the next call at once, and its compile runs in `compiles`, beside the others')."""

    def __init__(self, compiles=None, wmesh=None):
        self.compiles = compiles
        self.compile_only = compiles is not None
        self.wmesh = wmesh

    def __call__(self, fn, *args):
        if not self.compile_only:
            return fn(*args)
        if self.wmesh is not None:  # the weights as jit sees them: uncommitted ones follow the sharded input
            from wan_tpu.runtime.compile_ahead import Cancelled, abstract

            if self.compiles.stop is not None and self.compiles.stop.is_set():
                raise Cancelled()
            args = abstract(args)
        lowered = fn.lower(*args)
        if self.wmesh is None:
            self.compiles.add(lowered)
            return lowered.out_info
        # On a mesh the next call's inputs are this one's outputs, placed as XLA's partitioner chose: known
        # only once this program is compiled, so the walk compiles one program after the other. A program
        # given no placed argument gives uncommitted outputs (they follow their next call's other arguments).
        compiled = lowered.compile()
        if all(getattr(x, "sharding", None) is None for x in jax.tree.leaves(args)):
            return lowered.out_info
        return jax.tree.map(lambda info, sharding: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sharding),
                            lowered.out_info, compiled.output_shardings)

    def frames(self, count: int, distinct: int):
        """The frame indices to visit: all of them, or (compiling) the first `distinct` (the rest repeat one
        program). On a mesh all of them: a frame's caches are the previous call's outputs, placed as the
        partitioner chose for that program, so the programs repeat only from where those placements do (a
        repeated program is found in JAX's caches, not compiled again)."""
        return range(min(count, distinct) if self.compile_only and self.wmesh is None else count)

    def frame(self, z, i: int):
        return self(_frame, z, i)

    def zeros(self, shape, dtype, wmesh):
        if not self.compile_only:
            return _zeros(shape, dtype, wmesh)
        info = self(_filled, tuple(shape), 0, dtype)
        return info if wmesh is None else jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=_placement(info, wmesh))

    def full(self, shape, value, dtype, wmesh=None):
        """`_filled`, placed on `wmesh` like `zeros`: then every frame's call gets the same placements (an
        uncommitted counter would make the first frame's program differ from the rest's)."""
        info = self(_filled, tuple(shape), value, dtype)
        if wmesh is None:
            return info
        if not self.compile_only:
            return jax.device_put(info, _placement(info, wmesh))
        return jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=_placement(info, wmesh))


_RUN = _Run()


@partial(jax.jit, static_argnums=(0, 4), donate_argnums=(3,))
def _decode_stem(graphdef, state, z, caches, wmesh):
    """One latent frame → (caches, the mid block's output (B, 1, h, w, C))."""
    model: WanVAE = nnx.merge(graphdef, state)
    st = ChunkState(caches, _constrain(wmesh))
    x = model.post_quant_conv(z.transpose(0, 2, 3, 4, 1), st)
    return st.out, model.decoder.stem(x, st)


@partial(jax.jit, static_argnums=(0, 4, 5, 6), donate_argnums=(3,))
def _decode_strip(graphdef, state, mid, caches, wmesh, raw, widths, offsets):
    """The mid block's output for one latent frame, a strip's input columns → (caches, video frames
    (B, C, 1 or 4, H, strip width) clamped to [-1, 1]); `widths` (static) and `offsets` (traced: one
    program for strips of one width) from `Decoder3d.strip_plan`.

    `raw`: the decoder's output as is (still patchified, not clamped), for tiled decoding."""
    model: WanVAE = nnx.merge(graphdef, state)
    constrain = _constrain(wmesh)
    st = ChunkState(caches, constrain)
    x = _nested(model.decoder.levels(widths, offsets), constrain)(mid, st)
    if not raw:
        x = jnp.clip(unpatchify(x, model.config.patch_size), -1.0, 1.0)
    return st.out, x.transpose(0, 4, 1, 2, 3)


@partial(jax.jit, static_argnums=(0,), donate_argnums=(3,))
def _decode_chunk(graphdef, state, z, caches, start=None):
    """`WanVAE.decode_chunk`: each latent frame through the stem and then the up blocks and head (one
    strip as wide as the frame), the first frame of a video alone (its own trace), the rest scanned;
    with `start`, every frame scanned, the first one's path chosen by `lax.cond`."""
    model: WanVAE = nnx.merge(graphdef, state)
    w = z.shape[-1]
    _, widths, offsets = model.decoder.strip_plan(w, 0, w)
    levels = _nested(model.decoder.levels(widths, offsets), None)

    def frame(caches, zf):
        stem_caches, level_caches = (None, None) if caches is None else caches
        st = ChunkState(stem_caches)
        mid = model.decoder.stem(model.post_quant_conv(zf.transpose(0, 2, 3, 4, 1), st), st)
        lst = ChunkState(level_caches)
        x = jnp.clip(unpatchify(levels(mid, lst), model.config.patch_size), -1.0, 1.0)
        return (st.out, lst.out), x.transpose(0, 4, 1, 2, 3)

    if start is not None:
        def opening(caches, zf):
            with jax.named_scope("VAE_Decode_Frame_0"):
                caches, x = frame(None, zf)
            pad = model.config.scale_factor_temporal - x.shape[2]
            return caches, jnp.pad(x, ((0, 0), (0, 0), (pad, 0), (0, 0), (0, 0)))

        def step(caches, zi):
            zf, first = zi
            return lax.cond(first, opening, frame, caches, zf[:, :, None])

        with jax.named_scope("VAE_Decode_Frame"):
            firsts = (jnp.arange(z.shape[2]) == 0) & jnp.asarray(start)
            caches, video = lax.scan(step, caches, (jnp.moveaxis(z, 2, 0), firsts))
        video = jnp.moveaxis(video, 0, 2)
        return caches, video.reshape(*video.shape[:2], -1, *video.shape[4:])

    videos = []
    if caches is None:
        with jax.named_scope("VAE_Decode_Frame_0"):
            caches, first = frame(None, z[:, :, :1])
        videos.append(first)
        z = z[:, :, 1:]
    if z.shape[2]:
        with jax.named_scope("VAE_Decode_Frame"):
            caches, rest = lax.scan(lambda c, zf: frame(c, zf[:, :, None]), caches, jnp.moveaxis(z, 2, 0))
        rest = jnp.moveaxis(rest, 0, 2)  # (B, C, F, T per frame, H, W)
        videos.append(rest.reshape(*rest.shape[:2], -1, *rest.shape[4:]))
    return caches, jnp.concatenate(videos, axis=2)


@partial(jax.jit, static_argnums=(3,))
def _frame_columns(x, i, lo, width):
    """Frame i, `width` columns from `lo` of (B, T, H, W, C); one executable per strip width."""
    return lax.dynamic_slice(x, (0, i, 0, lo, 0), (x.shape[0], 1, x.shape[2], width, x.shape[4]))


@partial(jax.jit, donate_argnums=(0,))
def _write(out, x, start):
    return lax.dynamic_update_slice(out, x.astype(out.dtype), start)


# ---- spatial tiling ----
@partial(jax.jit, static_argnums=(2, 3))
def _blend(a, b, extent, axis):
    """diffusers' blend_v/blend_h: b's first `extent` rows/columns fade in from a's last ones."""
    extent = min(a.shape[axis], b.shape[axis], extent)
    if extent == 0:
        return b
    ramp = jnp.asarray(np.arange(extent) / extent, jnp.float32).reshape((extent,) + (1,) * (4 - axis))
    head = lax.slice_in_dim(a, a.shape[axis] - extent, a.shape[axis], axis=axis) * (1 - ramp)
    head = head + lax.slice_in_dim(b, 0, extent, axis=axis) * ramp
    return lax.dynamic_update_slice_in_dim(b, head.astype(b.dtype), 0, axis=axis)


@partial(jax.jit, static_argnums=(1,))
def _finish_tiled(video, p):
    video = unpatchify(video.transpose(0, 2, 3, 4, 1), p).transpose(0, 4, 1, 2, 3)
    return jnp.clip(video, -1.0, 1.0)
