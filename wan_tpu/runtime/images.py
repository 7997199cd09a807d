"""Input images for every family: a path, a PIL image or a uint8 array, read once, checked with one-line errors."""

from __future__ import annotations

import os

import numpy as np

from wan_tpu.errors import WanInputError


def load_image(image) -> "PIL.Image.Image":  # noqa: F821
    """A PIL RGB image from a path, a PIL image or an `(H, W, 3)` uint8 array."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, (str, os.PathLike)):
        if not os.path.isfile(image):
            raise WanInputError(f"image {image} does not exist; pass an existing PNG/JPEG file with --image")
        try:
            with Image.open(image) as f:
                return f.convert("RGB")
        except (UnidentifiedImageError, OSError) as e:
            raise WanInputError(f"image {image} cannot be read ({e}); pass a PNG or JPEG file") from None
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
            raise WanInputError(f"image array must be uint8 (H, W, 3), got {image.dtype} {image.shape}")
        return Image.fromarray(image)
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    raise WanInputError(f"image must be a path, a PIL image or a uint8 (H, W, 3) array, got {type(image).__name__}")
