"""The image store: every image of a job's prompts, once, content-addressed, beside the job's rows.

::

    {OUTPUT_URI}/{job}/_images/<sha256[:2]>/<sha256>.<ext>      (or {THINKFLEET_IMAGE_STORE_URI}/<sha256[:2]>/…)

``producer submit`` writes each image here before its prompt is enqueued; a message and a row carry the image's
reference (sha256, this URI, size, token count: :class:`thinkfleet.vision.ImageRef`), never its bytes, so Redis
holds a few hundred bytes per image whatever its size. The bytes are exactly what the dataset gave (no
re-encoding): the sha256 of the file is the image's identity, and ``producer verify`` recomputes it.

An image is written atomically (:func:`storage.layout.write_atomic`: a local temp file renamed over, or one S3
PUT) and never replaced: a name is its content, so a second submit, or a second prompt with the same image, finds
it there and writes nothing. ``_images`` starts with ``_``: Parquet readers of the job directory skip it, as they
skip ``_manifest``. Workers read images (issue 33 part 3) and never fetch from anywhere else.
"""

from __future__ import annotations

import hashlib
import posixpath

import pyarrow.fs as pafs

from storage import layout

IMAGES_DIR = "_images"
#: Extension of each Pillow format the producer accepts (producer/images.py); the store names files by it.
EXTENSIONS = {"PNG": "png", "JPEG": "jpg", "MPO": "jpg", "WEBP": "webp", "GIF": "gif", "BMP": "bmp", "TIFF": "tiff"}
#: MIME type of each extension (the ``data:`` URI a worker sends).
MIME = {"png": "image/png", "jpg": "image/jpeg", "webp": "image/webp", "gif": "image/gif", "bmp": "image/bmp",
        "tiff": "image/tiff"}  # fmt: skip


class ImageStore:
    """Where a job's images live (``store_uri``: ``{OUTPUT_URI}/{job}/_images`` unless one is configured)."""

    def __init__(self, store_uri: str, s3_endpoint_url: str | None = None, dry_run: bool = False) -> None:
        self.loc = layout.locate(store_uri, s3_endpoint_url)
        #: A dry run names where each image would go and writes nothing.
        self.dry_run = dry_run
        self._present: set[str] = set()  # sha256s known to be stored (written or found)
        self.written = self.found = 0
        self.bytes_written = 0

    @classmethod
    def for_job(
        cls, output_uri: str, job: str, configured: str | None = None, s3_endpoint_url: str | None = None,
        dry_run: bool = False,
    ) -> ImageStore:  # fmt: skip
        """The job's store: ``configured`` (``THINKFLEET_IMAGE_STORE_URI``) or ``{output_uri}/{job}/_images``."""
        if configured:
            return cls(configured.rstrip("/"), s3_endpoint_url, dry_run)
        loc = layout.locate(output_uri, s3_endpoint_url)
        return cls(loc.uri(posixpath.join(loc.job_dir(job), IMAGES_DIR)), s3_endpoint_url, dry_run)

    @property
    def root_uri(self) -> str:
        """The store's root as a URI (what the job record keeps: workers read images only under it)."""
        return self.loc.uri(self.loc.root)

    def path(self, sha256: str, ext: str) -> str:
        return posixpath.join(self.loc.root, sha256[:2], f"{sha256}.{ext}")

    def uri(self, sha256: str, ext: str) -> str:
        """The URI a message and a row carry (an absolute local path or ``s3://bucket/key``)."""
        return self.loc.uri(self.path(sha256, ext))

    def put(self, sha256: str, ext: str, data: bytes) -> str:
        """Store ``data`` (whose sha256 the caller computed) unless it is there already; its URI."""
        path = self.path(sha256, ext)
        if self.dry_run or sha256 in self._present:
            return self.loc.uri(path)
        if self.loc.fs.get_file_info(path).type == pafs.FileType.File:
            self.found += 1
        else:
            layout.write_atomic(self.loc, path, data)
            self.written += 1
            self.bytes_written += len(data)
        self._present.add(sha256)
        return self.loc.uri(path)


def read_image(uri: str, s3_endpoint_url: str | None = None, max_bytes: int | None = None) -> bytes:
    """The bytes stored at an image URI (OSError when it cannot be read; ValueError past ``max_bytes``)."""
    loc = layout.locate(uri, s3_endpoint_url)
    with loc.fs.open_input_stream(loc.root) as f:
        data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:
        raise ValueError(f"{uri}: over {max_bytes:,} bytes")
    return data


def check_image(uri: str, sha256: str, s3_endpoint_url: str | None = None) -> str | None:
    """Why the image at ``uri`` is not the one its reference names (missing, unreadable, other bytes); None when
    it reads back and hashes to ``sha256``."""
    try:
        data = read_image(uri, s3_endpoint_url)
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError) as exc:
        return f"unreadable ({type(exc).__name__}: {exc})"
    actual = hashlib.sha256(data).hexdigest()
    return None if actual == sha256 else f"hashes to {actual}, not {sha256}"
