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
  bounded in bytes (``THINKFLEET_IMAGE_CACHE_BYTES``), and concurrent prompts of one image share one read;
- **bytes in flight bounded**: a prompt's encoded images are charged to the worker's byte budget
  (``THINKFLEET_IMAGE_INFLIGHT_BYTES``, workers/image_store.py) from each file's size *before* they are read, and
  given back when its request ends (:meth:`ImageSender.release`); the request body splices the encoded images in
  (workers/sglang.py ``body_pieces``), so a request holds no second copy of them;
- **an unreadable store is the host's fault, an unreadable file the prompt's**: a store this host cannot read closes
  its gate (no dead letter; the prompt is handed back with a backoff); a file that cannot be read while its store
  can is handed back, counted, and dead-lettered ``image_unreadable`` / ``image_missing`` past its bound.

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
import time
from collections.abc import Callable

import pyarrow.fs as pafs
import redis.asyncio as aioredis

from storage import layout
from storage.images import MIME, ImageStore, read_image
from thinkfleet.message import PromptTask
from thinkfleet.settings import Settings
from thinkfleet.vision import ImageRef, expand_ids, expanded_length
from workers.attempts import HandBack
from workers.image_store import HandBacks, ImageBudget, StoreGates, backoff_s
from workers.jobs import JobSpec
from workers.sglang import ExpectedPrompt, ImagePrompt, ServerInfo

log = logging.getLogger("thinkfleet.worker")

#: Dead-letter classes of an image prompt that is not sent (each keeps the whole message: ``producer retry``).
IMAGES_UNSUPPORTED = "images_unsupported"  # the server reports has_image_understanding false
IMAGE_MISSING = "image_missing"  # the store has no file for a reference (seen by image_missing_workers workers)
IMAGE_UNREADABLE = "image_unreadable"  # the file cannot be read while its store can (image_handback_max tries)
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

    def __init__(
        self,
        settings: Settings,
        redis: aioredis.Redis | None = None,
        identity: str = "",
        on_gate: Callable[[], None] = lambda: None,
        draining: Callable[[], bool] = lambda: False,
    ) -> None:
        self.settings = settings
        self._draining = draining  # a backoff ends early on a drain: the prompt goes back at once
        self.budget_bytes = settings.image_cache_bytes
        #: Encoded data: URIs (ASCII bytes, spliced into request bodies as they are) by sha256, least recent first.
        self._cache: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._cached_bytes = 0
        self._loading: dict[str, asyncio.Future[bytes]] = {}
        #: Reads from the store and cache hits (an image many prompts share is read once while it stays cached).
        self.reads = self.hits = 0
        #: The gate of each store (closed: this host cannot read it), the hand-back counts and the in-flight bytes.
        self.gates = StoreGates(settings, on_gate)
        self.handbacks = HandBacks(redis, settings, identity)
        self.inflight = ImageBudget(settings.image_inflight_bytes)

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    async def prepare(
        self, task: PromptTask, job: JobSpec, input_ids: list[int], info: ServerInfo | None
    ) -> ImagePrompt:
        """The request's images (:class:`ImageNotSent` when the prompt cannot be sent as submitted, :class:`HandBack`
        after a backoff when it cannot be sent now). The bytes it holds are the caller's to :meth:`release`."""
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
        for ref in task.media:
            _check_in_store(root, ref)
        closed = await self.gates.check(root)
        if closed is not None:
            await self._store_closed(task, root, closed)
        try:
            # Charged before anything is read: each image's encoded size, from the cache or the file's size.
            held = await self.inflight.take(await self._encoded_sizes(task.media))
            try:
                uris = await asyncio.gather(*(self._uri(ref) for ref in task.media))
            except BaseException:
                self.inflight.give(held)
                raise
        except _Unread as exc:
            raise await self._unread(task, job, root, exc) from None
        with_ids = info is not None and info.returns_prompt_token_ids
        return ImagePrompt(list(uris), expected_prompt(input_ids, task.media, with_ids), with_ids, held)

    def release(self, images: ImagePrompt | None) -> None:
        """The request of ``images`` ended: the bytes it held go back to the budget."""
        if images is not None and images.held_bytes:
            self.inflight.give(images.held_bytes)

    def store_root(self, job: JobSpec) -> str:
        """The job's image store: the record's ``image_store``, else (a record from before it) where the producer's
        settings put it by default — these workers' ``THINKFLEET_IMAGE_STORE_URI`` or ``{OUTPUT_URI}/{job}/_images``."""
        record = job.record
        if record is not None and record.image_store:
            return record.image_store.rstrip("/")
        s = self.settings
        return ImageStore.for_job(s.output_uri, job.name, s.image_store_uri, s.s3_endpoint_url).root_uri

    async def _store_closed(self, task: PromptTask, root: str, reason: str) -> None:
        """This host cannot read the job's store: hand the prompt back after a wait, counting nothing."""
        wait = backoff_s(64, self.settings.image_backoff_max_s)  # the cap: a store comes back in minutes, not ms
        log.info("%s/%s: image store %s closed here (%s): handed back in %.1fs", task.job, task.prompt_id, root,
                 reason, wait)  # fmt: skip
        await self._wait(wait)
        raise HandBack()

    async def _unread(self, task: PromptTask, job: JobSpec, root: str, unread: _Unread) -> Exception:
        """An image that could not be read: the store's fault (its gate closes; handed back uncounted), or the
        file's (counted; handed back after a backoff, dead-lettered past the bound). Returns what to raise."""
        closed = await self.gates.recheck(root)
        if closed is not None:
            await self._store_closed(task, root, closed)
        s = self.settings
        exc, uri = unread.error, unread.uri
        missing = isinstance(exc, FileNotFoundError)
        tries, workers = await self.handbacks.count(task.job, task.prompt_id, "missing" if missing else "unreadable",
                                                    job.generation)  # fmt: skip
        if tries == 0:  # finished by another run already (or another generation's): its next delivery sees that
            return HandBack()
        if missing and (workers >= s.image_missing_workers or tries >= s.image_handback_max):
            return ImageNotSent(
                IMAGE_MISSING,
                f"{uri}: no such file, though the job's image store ({root}) is readable — found missing by "
                f"{workers} worker(s) in {tries} tries; restore the file (re-running the job's producer submit with "
                "the same inputs stores it again), then producer retry",
            )
        if not missing and tries >= s.image_handback_max:
            return ImageNotSent(
                IMAGE_UNREADABLE,
                f"{uri} cannot be read ({type(exc).__name__}: {exc}) though its store ({root}) can — {tries} tries "
                f"by {workers} worker(s); make it the readable image file (fix its permissions or the store's "
                "credentials; a directory in its place must go), then producer retry",
            )
        wait = backoff_s(tries, s.image_backoff_max_s)
        log.warning("%s/%s: image %s %s (%s: %s): handed back in %.1fs (try %d of %d)", task.job, task.prompt_id, uri,
                    "missing" if missing else "unreadable", type(exc).__name__, exc, wait, tries,
                    s.image_handback_max)  # fmt: skip
        await self._wait(wait)
        return HandBack()

    async def _wait(self, seconds: float) -> None:
        """A hand-back's backoff, cut short by a drain (SIGTERM: the worker gives its prompts back now)."""
        deadline = time.monotonic() + seconds
        while not self._draining() and (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(left, 0.5))

    async def _encoded_sizes(self, media: tuple[ImageRef, ...]) -> int:
        """The encoded bytes of a prompt's images: a cached one's own size, else from its file's size (a stat; an
        image that cannot be stat'ed is :class:`_Unread`, as its read would be)."""
        total, unknown = 0, []
        for ref in media:
            cached = self._cache.get(ref.sha256)
            if cached is not None:
                total += len(cached)
            else:
                unknown.append(ref)
        if unknown:
            sizes = await asyncio.to_thread(self._stat, [ref.uri for ref in unknown])
            total += sum(_data_uri_size(ref.mime, n) for ref, n in zip(unknown, sizes, strict=True))
        return total

    def _stat(self, uris: list[str]) -> list[int]:
        sizes = []
        for uri in uris:
            local = self.gates.local(uri)
            try:
                loc = layout.locate(local, self.settings.s3_endpoint_url)
                info = loc.fs.get_file_info(loc.root)
            except OSError as exc:
                raise _Unread(uri, exc) from None
            if info.type == pafs.FileType.NotFound:
                raise _Unread(uri, FileNotFoundError(f"no such file: {local}"))
            if info.type != pafs.FileType.File:
                raise _Unread(uri, IsADirectoryError(f"{local} is not a file ({info.type.name})"))
            sizes.append(min(int(info.size or 0), self.settings.max_image_bytes + 1))
        return sizes

    async def _uri(self, ref: ImageRef) -> bytes:
        cached = self._cache.get(ref.sha256)
        if cached is not None:
            self._cache.move_to_end(ref.sha256)
            self.hits += 1
            return cached
        loading = self._loading.get(ref.sha256)
        if loading is not None:  # another prompt is reading this image now: one read serves both
            self.hits += 1
            return await asyncio.shield(loading)
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._loading[ref.sha256] = future
        try:
            uri = await self._read(ref)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a failure no other prompt awaited is not "never retrieved"
            raise
        finally:
            self._loading.pop(ref.sha256, None)
        future.set_result(uri)
        self._keep(ref.sha256, uri)
        return uri

    async def _read(self, ref: ImageRef) -> bytes:
        s = self.settings
        try:
            data = await asyncio.to_thread(read_image, self.gates.local(ref.uri), s.s3_endpoint_url, s.max_image_bytes)
        except ValueError as exc:
            raise ImageNotSent(IMAGE_REFUSED, f"{exc} (THINKFLEET_MAX_IMAGE_BYTES)") from None
        except OSError as exc:  # missing, a directory, a permission error, S3 down: the store's fault or the file's
            raise _Unread(ref.uri, exc) from None
        self.reads += 1
        actual = hashlib.sha256(data).hexdigest()
        if actual != ref.sha256:
            raise ImageNotSent(
                IMAGE_HASH_MISMATCH,
                f"{ref.uri} hashes to {actual}, its reference says {ref.sha256}: the store's file was altered or "
                "replaced; restore it (or re-submit the dataset into a new job)",
            )
        # One bytes object, ASCII: the cache's copy is the one every request body splices in.
        return b"data:" + ref.mime.encode() + b";base64," + base64.b64encode(data)

    def _keep(self, sha256: str, uri: bytes) -> None:
        size = len(uri)
        if size > self.budget_bytes:
            return  # bigger than the whole budget: read each time rather than evict everything for it
        self._cache[sha256] = uri
        self._cached_bytes += size
        while self._cached_bytes > self.budget_bytes:
            _, dropped = self._cache.popitem(last=False)
            self._cached_bytes -= len(dropped)


class _Unread(Exception):
    """An image's file could not be stat'ed or read (``error``: the OSError)."""

    def __init__(self, uri: str, error: OSError) -> None:
        super().__init__(f"{uri}: {error}")
        self.uri = uri
        self.error = error


def _check_in_store(root: str, ref: ImageRef) -> None:
    """A reference must name the store's own file for its sha256 (:class:`ImageNotSent` ``image_refused``)."""
    ext = _EXTENSION.get(ref.mime)
    expected = posixpath.join(root, ref.sha256[:2], f"{ref.sha256}.{ext}") if ext else None
    if ref.uri != expected:
        raise ImageNotSent(
            IMAGE_REFUSED,
            f"image {ref.sha256[:16]}… refers to {ref.uri[:300]!r}, not the job's image store's file for it "
            f"({expected or f'no store file is of type {ref.mime}'}): workers read images only from the store",
        )


def _data_uri_size(mime: str, n: int) -> int:
    """Bytes of the ``data:`` URI of an ``n``-byte image (base64: 4 per 3, padded)."""
    return len("data:;base64,") + len(mime) + 4 * ((n + 2) // 3)
