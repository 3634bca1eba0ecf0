"""An image prompt's images on their way to SGLang: read from the job's image store only, checked, sent as ``data:``
URIs, and what the answer must show of the prompt the server expanded (docs/vision.md).

The message carries each image's reference (:class:`thinkfleet.vision.ImageRef`: sha256, store URI, token count,
placeholder position), never its bytes. :class:`ImageSender` turns them into the request's ``image_data``:

- **only the job's store**: a reference's URI must be the store's own file for its sha256
  (``{store}/<sha256[:2]>/<sha256>.<ext>``; the store's root is the job record's ``image_store``, which the
  producer signs with the record) — a message pointing anywhere else is refused, nothing is fetched;
- **the bytes are the image**: what was read must hash to the reference's sha256, else the prompt is
  dead-lettered ``image_hash_mismatch`` (a store file altered or replaced) — never sent as another image;
- **read once per worker**: the encoded URI of each image is kept by sha256 in a least-recently-used cache
  bounded in bytes (``THINKFLEET_IMAGE_CACHE_BYTES``), and concurrent prompts of one image share one read.

Each image's placeholder must sit where its reference says, and the ids must hold no other placeholder (the server
would take one more image than it is given). :func:`expected_prompt` is what the answer must show:
``len(input_ids) − n_images + Σ tokens`` and, from SGLang 0.5.13, the expanded ids themselves
(workers/sglang.py ``check_image_prompt``).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import hashlib
import logging
import posixpath

from storage.images import MIME, ImageStore, read_image
from thinkfleet.message import PromptTask
from thinkfleet.settings import Settings
from thinkfleet.vision import ImageRef, expand_ids, expanded_length
from workers.attempts import HandBack
from workers.jobs import JobSpec
from workers.sglang import ExpectedPrompt, ImagePrompt, ServerInfo

log = logging.getLogger("thinkfleet.worker")

#: Dead-letter classes of an image prompt that is not sent (each keeps the whole message: ``producer retry``).
IMAGES_UNSUPPORTED = "images_unsupported"  # the server reports has_image_understanding false
IMAGE_MISSING = "image_missing"  # the store has no file for a reference
IMAGE_HASH_MISMATCH = "image_hash_mismatch"  # the store's file is not the image its sha256 names
IMAGE_REFUSED = "image_refused"  # a reference outside the job's store, too large, or a misplaced placeholder
#: The store file's extension of each MIME type a producer writes (storage/images.py names files by it).
_EXTENSION = {mime: ext for ext, mime in MIME.items()}


class ImageNotSent(Exception):
    """The prompt's images cannot be sent: dead-letter it with ``error_class`` and ``detail``."""

    def __init__(self, error_class: str, detail: str) -> None:
        super().__init__(detail)
        self.error_class = error_class
        self.detail = detail


def expected_prompt(input_ids: list[int], media: tuple[ImageRef, ...], with_ids: bool) -> ExpectedPrompt:
    """The prompt the server must report: each placeholder expanded into its image's tokens."""
    ids = expand_ids(input_ids, media) if with_ids else None
    return ExpectedPrompt(len(input_ids), len(media), expanded_length(len(input_ids), media), ids)


def check_placeholders(input_ids: list[int], media: tuple[ImageRef, ...], placeholder_id: int | None) -> str | None:
    """Why the ids do not hold exactly one placeholder per image where the references say (None: they do). The
    placeholder id is the job record's; a record without one (older) takes the id at the first image's position."""
    pid = placeholder_id if placeholder_id is not None else input_ids[media[0].position]
    for k, ref in enumerate(media):
        if input_ids[ref.position] != pid:
            held = input_ids[ref.position]
            return f"image {k + 1}'s position {ref.position} holds id {held}, not the placeholder {pid}"
    found = sum(1 for t in input_ids if t == pid)
    if found != len(media):
        return f"the ids hold {found} placeholder(s) {pid} for {len(media)} image(s): the server would miscount them"
    return None


class ImageSender:
    """Reads, checks and encodes a worker's images, keeping the encoded ones by sha256 within a byte budget."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.budget_bytes = settings.image_cache_bytes
        self._cache: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._cached_bytes = 0
        self._loading: dict[str, asyncio.Future[str]] = {}
        #: Reads from the store and cache hits (an image many prompts share is read once while it stays cached).
        self.reads = self.hits = 0

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    async def prepare(
        self, task: PromptTask, job: JobSpec, input_ids: list[int], info: ServerInfo | None
    ) -> ImagePrompt:
        """The request's images (:class:`ImageNotSent` when the prompt cannot be sent as submitted)."""
        if info is not None and info.image_understanding is False:
            raise ImageNotSent(
                IMAGES_UNSUPPORTED,
                f"the server ({info.model_path or 'its model'}) reports has_image_understanding false: the prompt's "
                f"{len(task.media)} image(s) would be ignored; serve the vision model, then producer retry",
            )
        record = job.record
        problem = check_placeholders(input_ids, task.media, record.image_placeholder_id if record else None)
        if problem is not None:
            raise ImageNotSent(IMAGE_REFUSED, problem)
        root = self.store_root(job)
        uris = await asyncio.gather(*(self._uri(root, ref) for ref in task.media))
        with_ids = info is not None and info.returns_prompt_token_ids
        return ImagePrompt(list(uris), expected_prompt(input_ids, task.media, with_ids), with_ids)

    def store_root(self, job: JobSpec) -> str:
        """The job's image store: the record's ``image_store``, else (a record from before it) where the producer's
        settings put it by default — these workers' ``THINKFLEET_IMAGE_STORE_URI`` or ``{OUTPUT_URI}/{job}/_images``."""
        record = job.record
        if record is not None and record.image_store:
            return record.image_store.rstrip("/")
        s = self.settings
        return ImageStore.for_job(s.output_uri, job.name, s.image_store_uri, s.s3_endpoint_url).root_uri

    async def _uri(self, root: str, ref: ImageRef) -> str:
        cached = self._cache.get(ref.sha256)
        if cached is not None:
            self._cache.move_to_end(ref.sha256)
            self.hits += 1
            return cached
        loading = self._loading.get(ref.sha256)
        if loading is not None:  # another prompt is reading this image now: one read serves both
            self.hits += 1
            return await asyncio.shield(loading)
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._loading[ref.sha256] = future
        try:
            uri = await self._read(root, ref)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a failure no other prompt awaited is not "never retrieved"
            raise
        finally:
            self._loading.pop(ref.sha256, None)
        future.set_result(uri)
        self._keep(ref.sha256, uri)
        return uri

    async def _read(self, root: str, ref: ImageRef) -> str:
        ext = _EXTENSION.get(ref.mime)
        expected = posixpath.join(root, ref.sha256[:2], f"{ref.sha256}.{ext}") if ext else None
        if ref.uri != expected:
            raise ImageNotSent(
                IMAGE_REFUSED,
                f"image {ref.sha256[:16]}… refers to {ref.uri[:300]!r}, not the job's image store's file for it "
                f"({expected or f'no store file is of type {ref.mime}'}): workers read images only from the store",
            )
        s = self.settings
        try:
            data = await asyncio.to_thread(read_image, ref.uri, s.s3_endpoint_url, s.max_image_bytes)
        except FileNotFoundError:
            raise ImageNotSent(
                IMAGE_MISSING, f"{ref.uri}: no such file in the job's image store; re-submit the dataset"
            ) from None
        except ValueError as exc:
            raise ImageNotSent(IMAGE_REFUSED, f"{exc} (THINKFLEET_MAX_IMAGE_BYTES)") from None
        except OSError as exc:  # the store is unreachable now (S3 down): another delivery may read it
            log.warning("image store unreadable (%s: %s): handing the prompt back", type(exc).__name__, exc)
            raise HandBack() from exc
        self.reads += 1
        actual = hashlib.sha256(data).hexdigest()
        if actual != ref.sha256:
            raise ImageNotSent(
                IMAGE_HASH_MISMATCH,
                f"{ref.uri} hashes to {actual}, its reference says {ref.sha256}: the store's file was altered or "
                "replaced; restore it (or re-submit the dataset into a new job)",
            )
        return f"data:{ref.mime};base64,{base64.b64encode(data).decode('ascii')}"

    def _keep(self, sha256: str, uri: str) -> None:
        size = len(uri)
        if size > self.budget_bytes:
            return  # bigger than the whole budget: read each time rather than evict everything for it
        self._cache[sha256] = uri
        self._cached_bytes += size
        while self._cached_bytes > self.budget_bytes:
            _, dropped = self._cache.popitem(last=False)
            self._cached_bytes -= len(dropped)
