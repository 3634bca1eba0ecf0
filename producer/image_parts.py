"""A row's images in the order its conversation places them: image content parts, ``<image>`` markers and an
``images`` column turned into the parts the chat template renders (:class:`RowImages`).

The forms (docs/vision.md): OpenAI ``image_url`` parts and HF processors' ``image`` parts carry their image; a bare
``{"type": "image"}`` (TRL, HF vision datasets) and each ``<image>`` marker (LLaVA, ShareGPT4V, LLaMA-Factory) take
the row's next ``images``/``image`` column entry, in conversation order; a row with images and no marker has them
all before its first user turn's text. Apart from :mod:`producer.images` (fetching, checking and storing one image)
because this is the dataset side: what a row says, not what an image is.
"""

from __future__ import annotations

import json
import re
from typing import Any

from producer.images import DatasetBase, ImageError, ImageResolver
from thinkfleet.vision import MAX_IMAGES_PER_PROMPT, ImageRef

#: The marker LLaVA / ShareGPT-style text carries where an image goes.
MARKER = "<image>"
#: Content-part types that are images.
IMAGE_PART_TYPES = frozenset({"image", "image_url", "input_image"})


_MARKER_SPLIT = re.compile(re.escape(MARKER))


class RowImages:
    """The images of one row, in the order its text places them. Content parts and ``<image>`` markers become
    *pending* parts first (:meth:`part`, :meth:`split`: a marker takes the row's next ``images`` column entry, in
    the order of the whole conversation); :meth:`resolve` then fetches, checks and stores only those of the
    messages kept (trailing assistant turns are regenerated, their images never read) and fills :attr:`refs`.
    ``column``: the row's ``images``/``image`` column values (None: the dataset has no such column)."""

    def __init__(self, resolver: ImageResolver | None, base: DatasetBase | None, column: list[Any] | None) -> None:
        self.resolver, self.base = resolver, base
        self.column = column
        self._next = 0  # the next column image a bare part or a marker takes
        self._pending: list[tuple[Any, str]] = []  # (value, its name in errors)
        self.refs: list[ImageRef] = []

    def part(self, part: dict[str, Any]) -> dict[str, Any]:
        """An image content part → a pending part (its value kept to resolve)."""
        kind = part.get("type")
        value: Any = None
        if kind in ("image_url", "input_image"):
            value = part.get("image_url")
            value = value.get("url") if isinstance(value, dict) else value
        else:
            for key in ("image", "url", "path", "base64"):
                if part.get(key) is not None:
                    value = part[key]
                    if key == "base64" and isinstance(value, str) and not value.startswith("data:"):
                        value = "data:image/*;base64," + value
                    break
        if value is None:  # {"type": "image"}: the row's next image from its images column
            return self._from_column(f"{kind} part")
        return self._pend(value, self._name(value))

    def split(self, text: str) -> str | list[dict[str, Any]]:
        """Text with ``<image>`` markers → text and pending image parts (each marker the next column image)."""
        if self.column is None or MARKER not in text:
            return text
        pieces = _MARKER_SPLIT.split(text)
        parts: list[dict[str, Any]] = []
        for k, piece in enumerate(pieces):
            if k:
                parts.append(self._from_column(f"{MARKER} marker {k}"))
            if piece:
                parts.append({"type": "text", "text": piece})
        return parts

    def leftover(self) -> list[dict[str, Any]]:
        """Column images no part or marker took: all of them when none was taken (the caller puts them before the
        first user turn's text); an error when some were (a row whose markers and images disagree)."""
        if self.column is None or self._next == len(self.column):
            return []
        if self._next:
            raise ImageError(
                f"the row has {len(self.column)} images but its text places {self._next} ({MARKER} markers or image "
                f"parts); put one {MARKER} per image where it belongs"
            )
        return [self._from_column("image") for _ in range(len(self.column))]

    def resolve(self, messages: list[dict[str, Any]]) -> None:
        """Replace each pending part of ``messages`` (in order) by the part the chat template renders — one
        placeholder per image — and the manifest keeps; :attr:`refs` gets each image's reference."""
        kept = sum(1 for m in messages if isinstance(m.get("content"), list) for p in m["content"] if "pending" in p)
        if kept > MAX_IMAGES_PER_PROMPT:
            raise ImageError(
                f"the conversation has {kept} images, over the {MAX_IMAGES_PER_PROMPT} one message may carry; split it"
            )
        for m in messages:
            content = m.get("content")
            if not isinstance(content, list):
                continue
            for j, part in enumerate(content):
                if "pending" not in part:
                    continue
                value, name = self._pending[part["pending"]]
                what = f"image {len(self.refs) + 1} ({name})"
                if self.resolver is None or self.base is None:
                    raise ImageError(f"{what}: images are read by producer submit only")
                ref = self.resolver.resolve(value, self.base, what)
                self.refs.append(ref)
                content[j] = {"type": "image", "image": ref.uri, "sha256": ref.sha256}

    def _from_column(self, what: str) -> dict[str, Any]:
        if self.column is None or self._next >= len(self.column):
            have = 0 if self.column is None else len(self.column)
            raise ImageError(
                f"{what} has no image: the row's images column holds {have}; give the part its image, or add it to "
                "the images column"
            )
        value = self.column[self._next]
        self._next += 1
        return self._pend(value, f"{self._name(value)}, images[{self._next - 1}]")

    def _pend(self, value: Any, name: str) -> dict[str, Any]:
        self._pending.append((value, name))
        return {"type": "image", "pending": len(self._pending) - 1}

    @staticmethod
    def _name(value: Any) -> str:
        if isinstance(value, dict):
            value = value.get("path") or value.get("url") or ("bytes" if value.get("bytes") else value)
        if isinstance(value, bytes | bytearray):
            return f"{len(value):,} bytes"
        text = str(value)
        if text.startswith("data:"):
            return text.split(",", 1)[0] + ",…"
        return text if len(text) <= 120 else text[:117] + "…"


def column_images(value: Any) -> list[Any] | None:
    """An ``images``/``image`` column's value as a list (one image, a list of them, JSON text of either)."""
    if value is None:
        return []
    if isinstance(value, str) and value.strip()[:1] == "[":
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ImageError(f"the images column is text that is not valid JSON ({e})") from e
    if isinstance(value, list | tuple):
        return list(value)
    if hasattr(value, "tolist") and not isinstance(value, bytes | bytearray | str | dict):
        return list(value.tolist())
    return [value]
