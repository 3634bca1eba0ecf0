"""The images of a message rebuilt from a stored row (``producer retry``, the chain replay of a re-submit).

A row keeps its prompt's images as four columns (storage/schema.py: ``image_sha256``, ``image_paths``,
``image_tokens``, ``image_positions``, one entry per placeholder, in order); a message carries them as
:class:`thinkfleet.vision.ImageRef` s, which also name the MIME type (from the store file's extension,
storage/images.py ``MIME``) and the pixel size. A rebuilt message must carry them again: the keyed content hash
covers the images' sha256s, so a message without them is refused by every worker (``content_hash_mismatch``), and
a server would get placeholders with no ``image_data``.

The size comes from what the producer already knows of an image (a ``--turns all`` job's conversation records
hold each image's full reference), else from the image store's file itself (read once per distinct image, as a
worker reads it). :func:`checked_hash` then recomputes the content hash of the rebuilt ids and images and compares
it with the row's before anything is enqueued: a row that does not hash to its own content hash is refused here,
named with the fix, never sent to become a dead letter.
"""

from __future__ import annotations

import io
import json
import posixpath
from collections.abc import Iterable, Mapping
from typing import Any

import redis

from storage.images import MIME, read_image
from storage.schema import IMAGE_PATHS, IMAGE_POSITIONS, IMAGE_SHA256, IMAGE_TOKENS
from thinkfleet.message import PromptTask, content_hash, hash_id_bytes, is_content_hash, unpack_id_bytes
from thinkfleet.vision import ImageRef

#: The row columns a rebuilt message's images come from.
ROW_MEDIA_COLUMNS = [IMAGE_SHA256, IMAGE_PATHS, IMAGE_TOKENS, IMAGE_POSITIONS]


class RebuildRefused(ValueError):
    """A stored row whose message cannot be rebuilt as it was submitted; the text names the row and the fix."""


def row_name(row: Mapping[str, Any]) -> str:
    """How an error names a stored row: its prompt id, dataset row and revision."""
    return (
        f"{row.get('prompt_id')} (dataset {row.get('dataset')!r} row {row.get('row_index')}, "
        f"revision {int(row.get('revision') or 0)})"
    )


class RowMedia:
    """Rebuilds the :class:`ImageRef` s of stored rows; ``known``: references the producer already holds, by sha256
    (their MIME type and size are taken from there instead of the store)."""

    def __init__(self, s3_endpoint_url: str | None = None, known: Iterable[ImageRef] = ()) -> None:
        self.s3_endpoint_url = s3_endpoint_url
        self._sizes: dict[str, tuple[int, int]] = {ref.sha256: (ref.width, ref.height) for ref in known}
        #: store files read for their size (an image the producer knew nothing of)
        self.reads = 0

    def learn(self, wire_refs: Iterable[Any]) -> None:
        """Remember the size of images given as wire references (a conversation record's ``images``)."""
        for value in wire_refs:
            try:
                ref = ImageRef.from_wire(value)
            except ValueError:
                continue  # not one a producer wrote: the store's file says its size instead
            self._sizes.setdefault(ref.sha256, (ref.width, ref.height))

    def learn_conversations(
        self, client: redis.Redis, conversations_key: str, rows: Iterable[Mapping[str, Any]]
    ) -> None:
        """A ``--turns all`` job's conversation records hold each image's full reference: read those of the image
        rows' conversations (``conversations_key``: ``Keys.conversations``), so no store file is read for a size."""
        from thinkfleet.turns import split_step_id

        convs = sorted({p[0] for r in rows if r.get(IMAGE_SHA256) and (p := split_step_id(r["prompt_id"]))})
        for start in range(0, len(convs), 5000):
            for raw in client.hmget(conversations_key, convs[start : start + 5000]):
                if raw:
                    self.learn(json.loads(raw).get("images") or [])

    def refs(self, row: Mapping[str, Any]) -> tuple[ImageRef, ...]:
        """The images of ``row``'s prompt, in placeholder order (() for a text prompt); :class:`RebuildRefused` when
        its image columns disagree or an image is no longer readable in the store."""
        shas = row.get(IMAGE_SHA256)
        if not shas:
            return ()
        paths, tokens, positions = (row.get(c) or [] for c in (IMAGE_PATHS, IMAGE_TOKENS, IMAGE_POSITIONS))
        if not len(shas) == len(paths) == len(tokens) == len(positions):
            raise RebuildRefused(
                f"{row_name(row)}: its image columns disagree ({len(shas)} sha256, {len(paths)} paths, "
                f"{len(tokens)} token counts, {len(positions)} positions): not re-sent; `producer verify` names the "
                "damage, and a re-submit of the dataset regenerates the prompt"
            )
        out = []
        for sha, uri, n, at in zip(shas, paths, tokens, positions, strict=True):
            ext = posixpath.splitext(uri)[1].lstrip(".").lower()
            if ext not in MIME:
                raise RebuildRefused(
                    f"{row_name(row)}: image {uri!r} is not an image-store file (no known extension): not re-sent; "
                    "re-submit the dataset to regenerate the prompt"
                )
            width, height = self._size(row, sha, uri)
            out.append(ImageRef(sha, uri, MIME[ext], width, height, int(n), int(at)))
        return tuple(out)

    def _size(self, row: Mapping[str, Any], sha256: str, uri: str) -> tuple[int, int]:
        size = self._sizes.get(sha256)
        if size is not None:
            return size
        from PIL import Image

        try:
            data = read_image(uri, self.s3_endpoint_url)
            with Image.open(io.BytesIO(data)) as image:  # the header alone: nothing is decoded
                size = image.size
        except FileNotFoundError:
            raise RebuildRefused(
                f"{row_name(row)}: its image {uri} is missing from the image store: not re-sent; restore the store "
                "(or re-submit the dataset, which stores its images again)"
            ) from None
        except Exception as exc:  # unreadable now, or not an image: nothing the retry can send
            raise RebuildRefused(
                f"{row_name(row)}: its image {uri} cannot be read ({type(exc).__name__}: {exc}): not re-sent; "
                "check the image store and retry"
            ) from exc
        self.reads += 1
        self._sizes[sha256] = size
        return size


def checked_hash(row: Mapping[str, Any], ids: Any, media: tuple[ImageRef, ...]) -> str:
    """The content hash of ``ids`` with ``media``'s images, which must be the row's own ``content_hash`` (what its
    prompt was submitted and generated as); :class:`RebuildRefused` naming the row otherwise."""
    digest = content_hash(ids, [m.sha256 for m in media]) if media else content_hash(ids)
    if digest != row.get("content_hash"):
        what = f"input_ids and {len(media)} image(s)" if media else "input_ids"
        raise RebuildRefused(
            f"{row_name(row)}: its stored {what} hash to {digest}, the row says {row.get('content_hash')}: not "
            "re-sent (a worker would refuse it); run `producer verify` to see the damage, and re-submit the dataset "
            "to regenerate the prompt"
        )
    return digest


def message_hash_problem(task: PromptTask) -> str:
    """Why a dead letter's message cannot pass a worker's content-hash check ('' when it can): its ids (and images)
    do not hash to its ``content_hash`` — e.g. one an older ``retry --truncated`` rebuilt without its images."""
    if not is_content_hash(task.content_hash):
        return ""  # the worker names this one itself (bad_content_hash)
    try:
        actual = hash_id_bytes(unpack_id_bytes(task.ids_blob, None), [m.sha256 for m in task.media])
    except ValueError:
        return ""  # undecodable: the worker dead-letters it as corrupt_message, as before
    if actual == task.content_hash:
        return ""
    images = f" and {len(task.media)} image(s)" if task.media else " (no images)"
    return (
        f"content_hash_mismatch: its ids{images} hash to {actual}, the message says {task.content_hash}: not resent "
        "(a worker would refuse it again); re-submit the dataset (or `producer retry --truncated` its stored row)"
    )
