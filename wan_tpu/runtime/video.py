"""mp4 files: frames in, a playable H.264 file out (and back, for checks).

Encoding goes through `imageio` + `imageio-ffmpeg`, which carries its own ffmpeg binary, so nothing
has to be installed on the host. The file is written under a temporary name beside the target and
renamed into place, so an interrupted run never leaves a truncated mp4 under the requested name
(a Ctrl-C stops between frames: `wan_tpu.runtime.interrupt`). In a job of several processes only process 0
writes (`wan_tpu.runtime.distributed.is_writer`); the others check the output and count the frames.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import numpy as np

from wan_tpu.errors import WanInputError
from wan_tpu.runtime import distributed, interrupt
from wan_tpu.runtime.validate import check_output


def write_video(path: str, frames: np.ndarray, fps: int, overwrite: bool = False) -> str:
    """Write uint8 frames `(T, H, W, 3)` as an H.264 mp4 at `fps`; returns the path.

    Height and width must be even (yuv420p chroma subsampling); every Wan size is a multiple of 16.
    """
    with VideoWriter(path, fps, overwrite) as writer:
        writer.append(frames)
    return path


class VideoWriter:
    """An mp4 written as frames arrive (a stream's chunks), renamed into place when the `with` block ends
    without an error; on an error or an interrupt, or when no frame came, nothing is left behind.

        with VideoWriter("out.mp4", fps=12) as video:
            for chunk in chunks:
                video.append(chunk)          # uint8 (T, H, W, 3), encoded now, not held in memory
    """

    def __init__(self, path: str, fps: int, overwrite: bool = False):
        check_output(path, overwrite, ".mp4")
        self.path, self.fps, self.frames = path, fps, 0
        parent, name = os.path.split(os.path.abspath(path))
        # The temporary name keeps the .mp4 suffix because ffmpeg picks the container from it.
        self._tmp = os.path.join(parent, f".{name}.{os.getpid()}.partial.mp4")
        self._writer = None
        self._stack = contextlib.ExitStack()
        self.writes = distributed.is_writer()

    def __enter__(self) -> VideoWriter:
        if self.writes:
            self._stack.enter_context(interrupt.temporary(self._tmp))
        return self

    def append(self, frames: np.ndarray) -> None:
        import imageio.v2 as imageio

        frames = np.asarray(frames)
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"frames must be uint8 (T, H, W, 3), got {frames.dtype} {frames.shape}")
        if frames.shape[1] % 2 or frames.shape[2] % 2:
            raise WanInputError(f"video size {frames.shape[2]}x{frames.shape[1]} must be even for H.264; use a multiple of 16")
        if not self.writes:
            self.frames += len(frames)
            interrupt.check("write")
            return
        with _ffmpeg_subprocess():
            if self._writer is None:
                # format="FFMPEG": without imageio-ffmpeg imageio would silently pick another plugin (tiff)
                # for this name; macro_block_size=1: never let imageio resize the frames behind our back.
                # quality 8 is x264's CRF 10 (near lossless); preset veryfast encodes 81 frames of 832×480
                # 2.3× faster than the default (medium) at the same PSNR against the frames (42.2 dB) and
                # a 4% smaller file (this repository's 2-core CPU). A warm 1.3B command's write on an
                # H200: 1.7 → 0.6 s.
                self._writer = imageio.get_writer(self._tmp, format="FFMPEG", fps=self.fps, codec="libx264", quality=8,
                                                  macro_block_size=1, pixelformat="yuv420p",
                                                  output_params=["-preset", "veryfast"])
            for frame in frames:
                self._writer.append_data(frame)
                self.frames += 1
                interrupt.check("write")

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self._writer is not None:
                with _ffmpeg_subprocess():
                    self._writer.close()
            if exc_type is None and self.frames and self.writes:
                os.replace(self._tmp, self.path)
        finally:
            if os.path.exists(self._tmp):
                os.remove(self._tmp)
            self._stack.close()


def read_video(path: str) -> tuple[np.ndarray, float]:
    """Frames `(T, H, W, 3)` uint8 and the fps of an mp4 (used by tests to check what was written)."""
    import imageio.v2 as imageio

    with _ffmpeg_subprocess():
        reader = imageio.get_reader(path, format="FFMPEG")
        try:
            fps = float(reader.get_meta_data()["fps"])
            frames = np.stack([np.asarray(f) for f in reader])
        finally:
            reader.close()
    return frames, fps


@contextlib.contextmanager
def _ffmpeg_subprocess():
    # imageio runs ffmpeg with fork+exec; JAX warns about any fork, but exec follows at once.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        yield
