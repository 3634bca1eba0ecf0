"""Small images for image-prompt tests: random pixels (nothing compresses them away), as PNG bytes or a data URI."""

from __future__ import annotations

import base64
import io

import numpy as np


def random_png(width: int, height: int, seed: int = 0) -> bytes:
    """A ``width``×``height`` RGB PNG of seeded random pixels (the same seed, the same bytes)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def png_data_uri(data: bytes) -> str:
    """``data`` (PNG bytes) as the ``data:`` URI a dataset row or ``image_data`` carries."""
    return "data:image/png;base64," + base64.b64encode(data).decode()
