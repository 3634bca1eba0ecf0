"""What the exports do with an image prompt's images: read them back from the job's image store, and write them as
each format's consumer reads images.

A row of an image prompt carries its images' references (``image_sha256``, ``image_paths``, ``image_tokens``,
``image_positions``: storage/schema.py); its source conversation in the submit manifest carries each image as
``{"type": "image", "image": <store URI>, "sha256": …}`` (producer/image_parts.py), in placeholder order. Every
image an export writes is read from the store and hashed first: an export never ships an image other than the one
the prompt was generated with (a missing or altered one fails the export naming the file, the row and the fix, as
``producer verify`` does).

How a text format points at an image (``--image-urls``):

- ``store`` (the default): where the store keeps it — ``file:///abs/path`` (an OpenAI ``image_url`` is a URL) or
  ``s3://bucket/key`` for ``messages``; the plain path for ``conversations`` (SpecForge opens ``image`` with
  ``os.path.isfile``). The export stays small, and is read where the store is.
- ``data``: the bytes inline as ``data:image/<type>;base64,…`` — self-contained, and what every consumer reads.
"""

from __future__ import annotations

import base64
import hashlib
import posixpath
from collections import OrderedDict
from typing import Any

from storage.exports.base import ExportError
from storage.images import MIME, read_image

#: Bytes of recently read images an export keeps (a repeated image — a dataset asking many questions of one picture
#: — is read once while it keeps coming back; an image may be up to THINKFLEET_MAX_IMAGE_BYTES, 20 MiB).
CACHED_IMAGE_BYTES = 64 << 20


class ImageBytes:
    """Images read back from a job's store, each checked against its sha256 (a small LRU of the last ones)."""

    def __init__(self, s3_endpoint_url: str | None = None) -> None:
        self.s3_endpoint_url = s3_endpoint_url
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._cached_bytes = 0

    def get(self, uri: str, sha256: str, prompt_id: str) -> bytes:
        """The bytes of the image at ``uri``; :class:`ExportError` when they are missing or not ``sha256``'s."""
        data = self._cache.get(sha256)
        if data is not None:
            self._cache.move_to_end(sha256)
            return data
        try:
            data = read_image(uri, self.s3_endpoint_url)
        except FileNotFoundError as exc:
            raise ExportError(
                f"image {uri} (prompt {prompt_id}) is not in the image store: re-run the job's `producer submit` with "
                "the same inputs (it stores the image again), check with `producer verify`, then export again"
            ) from exc
        except OSError as exc:
            raise ExportError(f"image {uri} (prompt {prompt_id}) cannot be read: {type(exc).__name__}: {exc}") from exc
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha256:
            raise ExportError(
                f"image {uri} (prompt {prompt_id}) hashes to {actual}, not {sha256}: it was altered in the store. "
                "Delete the file and re-run the job's `producer submit` with the same inputs (a stored image is "
                "never replaced), check with `producer verify`, then export again"
            )
        self._cache[sha256] = data
        self._cached_bytes += len(data)
        while self._cached_bytes > CACHED_IMAGE_BYTES and len(self._cache) > 1:
            self._cached_bytes -= len(self._cache.popitem(last=False)[1])
        return data


def mime_of(uri: str) -> str:
    """The MIME type the store's file name says (``<sha256>.<ext>``)."""
    ext = posixpath.splitext(uri)[1].lstrip(".").lower()
    return MIME.get(ext, "application/octet-stream")


def data_uri(data: bytes, uri: str) -> str:
    return f"data:{mime_of(uri)};base64,{base64.b64encode(data).decode('ascii')}"


def file_url(uri: str) -> str:
    """A store URI as a URL: an absolute local path → ``file://…``; ``s3://…`` as it is."""
    return uri if "://" in uri else "file://" + uri


def is_image_part(part: Any) -> bool:
    """An image part as the manifest keeps it (producer/image_parts.py)."""
    return isinstance(part, dict) and part.get("type") == "image" and "sha256" in part and "image" in part


def openai_messages(
    messages: list[dict[str, Any]], mode: str, images: ImageBytes, prompt_id: str
) -> list[dict[str, Any]]:
    """``messages`` with each image part as an OpenAI content part ``{"type": "image_url", "image_url": {"url"}}``
    (the store's URL, or the bytes as a data URI: ``mode``), in place; text parts and everything else unchanged."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(is_image_part(p) for p in content):
            parts = [_openai_part(p, mode, images, prompt_id) if is_image_part(p) else p for p in content]
            message = {**message, "content": parts}
        out.append(message)
    return out


def _openai_part(part: dict[str, Any], mode: str, images: ImageBytes, prompt_id: str) -> dict[str, Any]:
    uri = str(part["image"])
    url = data_uri(images.get(uri, str(part["sha256"]), prompt_id), uri) if mode == "data" else file_url(uri)
    return {"type": "image_url", "image_url": {"url": url}}


def specforge_vlm(
    messages: list[dict[str, Any]], mode: str, images: ImageBytes, prompt_id: str
) -> tuple[list[dict[str, Any]], str] | str:
    """``messages`` in SpecForge's VLM shape: the text of each message as a string, and the conversation's one
    image apart (SpecForge puts it back, before the text, into the first user turn): ``(messages, image)``, where
    ``image`` is the store's plain path or a data URI (``mode``). Why not, as a skip reason, for a conversation
    SpecForge cannot hold: more than one image, or one outside the first user turn."""
    found: list[tuple[int, dict[str, Any]]] = []
    first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list) and any(is_image_part(p) for p in content):
            found += [(i, p) for p in content if is_image_part(p)]
            text = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
            message = {**message, "content": text}
        out.append(message)
    if not found:
        return out, ""  # (a text row: nothing to set apart)
    if len(found) > 1:
        return "images_over_one_per_sample"  # SpecForge's VLM path: one image per sample
    index, part = found[0]
    if index != first_user:
        return "image_outside_first_user_turn"  # SpecForge attaches the image to the first user turn
    uri = str(part["image"])
    image = data_uri(images.get(uri, str(part["sha256"]), prompt_id), uri) if mode == "data" else uri
    return out, image
