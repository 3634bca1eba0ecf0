"""The vision sample's pictures (demo/data/images/*.png): drawn here, so what the repository ships can be remade.

Flat shapes on white, a few hundred bytes each as PNG — small enough to commit, real enough for a vision model's
processor (each is a few image tokens: thinkfleet/vision.py). Drawing is pure integer arithmetic, so the pixels are
the same on every machine; the PNG bytes depend on Pillow's zlib, which is why tests compare pixels, not bytes.

``python -m demo.vision_images`` rewrites the files (only needed when a picture here changes).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

#: Where the vision sample's rows (demo/data/vision.jsonl) find them: a path relative to the dataset file.
IMAGES_DIR = Path(__file__).parent / "data" / "images"
WHITE, RED, BLUE, GREEN, GREY = (255, 255, 255), (220, 40, 40), (40, 80, 220), (40, 160, 70), (90, 90, 90)


def shapes() -> Any:
    """A red circle and a blue square."""
    image, draw = _canvas(96, 64)
    draw.ellipse((8, 12, 48, 52), fill=RED)
    draw.rectangle((58, 16, 88, 46), fill=BLUE)
    return image


def bars() -> Any:
    """A bar chart of four green bars, rising."""
    image, draw = _canvas(80, 60)
    for i, height in enumerate((14, 26, 34, 48)):
        draw.rectangle((8 + i * 18, 56 - height, 20 + i * 18, 56), fill=GREEN)
    draw.line((4, 56, 76, 56), fill=GREY, width=2)
    return image


def grid() -> Any:
    """A 3×3 checkerboard (5 dark squares)."""
    image, draw = _canvas(48, 48)
    for row in range(3):
        for col in range(3):
            if (row + col) % 2 == 0:
                draw.rectangle((col * 16, row * 16, col * 16 + 15, row * 16 + 15), fill=GREY)
    return image


#: File name → how it is drawn.
PICTURES = {"shapes.png": shapes, "bars.png": bars, "grid.png": grid}


def _canvas(width: int, height: int) -> tuple[Any, Any]:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), WHITE)
    return image, ImageDraw.Draw(image)


def write(directory: Path = IMAGES_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in PICTURES.items():
        path = directory / name
        draw().save(path, format="PNG", optimize=True)
        written.append(path)
    return written


if __name__ == "__main__":
    for path in write(Path(sys.argv[1]) if len(sys.argv) > 1 else IMAGES_DIR):
        print(f"{path} ({path.stat().st_size:,} bytes)")
