"""Where things live under ``OUTPUT_URI``, on which filesystem, and how a file appears atomically.

::

    {OUTPUT_URI}/{job}/dataset={name}/part-{utc}-{worker}-{seq}.parquet    committed rows
    {OUTPUT_URI}/{job}/dataset={name}/.part-….parquet.tmp-…                 local write in progress
    {OUTPUT_URI}/{job}/_manifest/submitted-{utc}-{rand}.parquet            what the producer submitted
    {OUTPUT_URI}/{job}/_quarantine/dataset={name}/part-….parquet[.json]    a damaged part moved aside, its record

``OUTPUT_URI`` is a local path or ``s3://bucket/prefix`` (any S3-compatible store with an endpoint).
Paths returned to callers (part names recorded in Redis) are URIs: an absolute local path or
``s3://bucket/key``, so every host resolves them the same way.

Readers see only names starting with ``part-`` (or ``submitted-``) and ending in ``.parquet``;
in-progress local files start with ``.``, which pyarrow.dataset, and the ``*.parquet`` globs this
project documents, skip.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import quote, unquote, urlparse

import pyarrow.fs as pafs
import pyarrow.parquet as pq

PART_PREFIX = "part-"
PARQUET_SUFFIX = ".parquet"
DATASET_DIR_PREFIX = "dataset="
MANIFEST_DIR = "_manifest"
#: Tag in the name of a part written by compaction; ``@`` never appears in a sanitized worker name.
COMPACT_TAG = "@compact"
#: Parquet key-value metadata on a compacted part: JSON list of the part names it replaces.
COMPACTED_FROM_KEY = b"thinkfleet.compacted_from"

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class Location:
    """A resolved ``OUTPUT_URI``: the filesystem, the root path on it, and how to print paths."""

    fs: pafs.FileSystem
    root: str  # path on ``fs`` (no scheme): "/abs/dir" or "bucket/prefix"
    scheme: str  # "" for local, "s3" for S3

    @property
    def is_local(self) -> bool:
        return self.scheme == ""

    def uri(self, path: str) -> str:
        """Filesystem path → the URI handed to callers."""
        return f"{self.scheme}://{path}" if self.scheme else path

    def path(self, uri_or_path: str) -> str:
        """URI (or a bare filesystem path) → path on ``fs``."""
        if self.scheme and uri_or_path.startswith(f"{self.scheme}://"):
            return uri_or_path[len(self.scheme) + 3 :]
        return uri_or_path

    def job_dir(self, job: str) -> str:
        return posixpath.join(self.root, job_dir_name(job))

    def dataset_dir(self, job: str, dataset: str) -> str:
        return posixpath.join(self.job_dir(job), dataset_dir_name(dataset))

    def manifest_dir(self, job: str) -> str:
        return posixpath.join(self.job_dir(job), MANIFEST_DIR)


class PartPathRefused(ValueError):
    """A part path from Redis (a claim's ``part``) or from a file's metadata that is no part of the job: outside
    ``{OUTPUT_URI}/{job}/``, or not a ``dataset=…/part-….parquet`` there. Never read, moved or deleted."""


def confine_part(loc: Location, job: str, uri: object, dataset: str | None = None) -> str:
    """``uri`` itself when it names a part of ``job`` (of ``dataset`` when given) under ``loc``, else
    :class:`PartPathRefused`.

    A part path read from Redis is written by whoever can write Redis: a worker finalizes a prompt from it, reads
    it, and moves it to quarantine when it does not decode — so it must be what :meth:`PartWriter.part_name`
    makes: ``{root}/{job}/dataset={name}/part-….parquet``, in its normal form (no ``..``, no ``//``, no other
    scheme). A local one must also *resolve* there (symlinks followed: a ``dataset=`` directory or a part that
    links out of the job is refused); an ``s3://`` key is checked by its prefix (S3 has no links).
    """
    if not isinstance(uri, str) or not uri or "\x00" in uri or "\\" in uri:
        raise PartPathRefused(f"part path {str(uri)[:300]!r} is not a path")
    if loc.scheme:
        if not uri.startswith(f"{loc.scheme}://"):
            raise PartPathRefused(f"part path {uri[:300]!r} is not on {loc.uri(loc.root)}")
    elif "://" in uri or not posixpath.isabs(uri):
        raise PartPathRefused(f"part path {uri[:300]!r} is not an absolute path under {loc.root}")
    path = loc.path(uri)
    job_dir = loc.job_dir(job)
    directory, name = posixpath.split(path)
    inside = (
        posixpath.normpath(path) == path
        and posixpath.dirname(directory) == job_dir
        and dataset_from_dir(posixpath.basename(directory)) is not None
        and (dataset is None or directory == loc.dataset_dir(job, dataset))
        and is_part_name(name)
    )
    if not inside:
        raise PartPathRefused(
            f"part path {uri[:300]!r} is not a part of job {job}"
            f"{'' if dataset is None else f'/{dataset}'} (it must be {loc.uri(job_dir)}/dataset=…/part-….parquet)"
        )
    if loc.is_local:
        real, real_job = os.path.realpath(path), os.path.realpath(job_dir)
        if not real.startswith(real_job.rstrip(os.sep) + os.sep):
            raise PartPathRefused(f"part path {uri[:300]!r} resolves to {real[:300]!r}, outside {real_job}")
    return uri


def is_plain_part_name(name: object) -> bool:
    """A bare part file name (what a compacted part lists as replaced): no directory, no ``..``."""
    return isinstance(name, str) and "/" not in name and "\\" not in name and is_part_name(name)


def resolve(output_uri: str, s3_endpoint_url: str | None = None) -> tuple[pafs.FileSystem, str]:
    """``OUTPUT_URI`` → (pyarrow filesystem, root path on it). See :func:`locate` for the details."""
    loc = locate(output_uri, s3_endpoint_url)
    return loc.fs, loc.root


def locate(output_uri: str, s3_endpoint_url: str | None = None) -> Location:
    """Resolve a local path, ``file://`` URI or ``s3://bucket/prefix``.

    S3 credentials come from the usual AWS chain (env vars, profile, instance role). With a custom
    endpoint (MinIO, moto, …) the region only needs to be syntactically valid, so it defaults to
    ``AWS_REGION``/``AWS_DEFAULT_REGION`` or us-east-1; without one, pyarrow looks the bucket's
    region up.
    """
    parsed = urlparse(output_uri)
    if parsed.scheme in ("", "file"):
        path = parsed.path if parsed.scheme == "file" else output_uri
        return Location(pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path)), "")
    if parsed.scheme not in ("s3", "s3a"):
        raise ValueError(f"OUTPUT_URI {output_uri!r}: use a local path or s3://bucket/prefix")
    root = f"{parsed.netloc}{parsed.path}".rstrip("/")
    if not parsed.netloc:
        raise ValueError(f"OUTPUT_URI {output_uri!r} names no bucket: use s3://bucket/prefix")
    if s3_endpoint_url:
        endpoint = urlparse(s3_endpoint_url if "://" in s3_endpoint_url else f"https://{s3_endpoint_url}")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        fs = pafs.S3FileSystem(endpoint_override=endpoint.netloc, scheme=endpoint.scheme or "https", region=region)
    else:
        fs, _ = pafs.FileSystem.from_uri(f"s3://{parsed.netloc}")
    return Location(fs, root, "s3")


def job_dir_name(job: str) -> str:
    """The job's directory name: the job itself, which must be one visible path segment."""
    if not job or "/" in job or "\\" in job or job[0] in "._":
        raise ValueError(
            f"job name {job!r} cannot be a directory under OUTPUT_URI: use letters, digits, '-' or '_' "
            "(not starting with '.' or '_', which readers treat as hidden)"
        )
    return job


def dataset_dir_name(dataset: str) -> str:
    """``dataset=<name>``, percent-encoded the way hive partitioning decodes it."""
    if not dataset:
        raise ValueError("dataset name is empty")
    return DATASET_DIR_PREFIX + quote(dataset, safe="")


def dataset_from_dir(name: str) -> str | None:
    if not name.startswith(DATASET_DIR_PREFIX):
        return None
    return unquote(name[len(DATASET_DIR_PREFIX) :])


def safe_name(text: str) -> str:
    """A worker identity reduced to characters safe in file names and S3 keys."""
    return _UNSAFE.sub("_", text).strip("._") or "worker"


def utc_stamp(now: datetime | None = None) -> str:
    """Sortable UTC timestamp for file names: 20250101T120000123456Z."""
    return (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%S%fZ")


def is_part_name(name: str) -> bool:
    return name.startswith(PART_PREFIX) and name.endswith(PARQUET_SUFFIX)


def is_compacted_name(name: str) -> bool:
    return is_part_name(name) and f"-{COMPACT_TAG}-" in name


def compacted_from(loc: Location, path: str) -> list[str]:
    """The part names a compacted part replaces (from its Parquet key-value metadata)."""
    with loc.fs.open_input_file(path) as f:
        meta = pq.read_metadata(f).metadata or {}
    raw = meta.get(COMPACTED_FROM_KEY)
    return list(json.loads(raw)) if raw else []


def write_atomic(loc: Location, path: str, data: bytes | memoryview) -> None:
    """Make ``path`` appear with exactly ``data``, or not at all.

    Local: a hidden temp file in the same directory, fsynced, then renamed over (rename is atomic
    within a filesystem). S3: one PUT / completed multipart upload of an in-memory buffer — an S3
    object is invisible until its upload completes, so there is never a temp object to clean up.
    """
    if loc.is_local:
        directory, name = os.path.split(path)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        _fsync_dir(directory)
        return
    with loc.fs.open_output_stream(path) as out:
        out.write(data)


def _fsync_dir(directory: str) -> None:
    """Persist the rename itself (the directory entry), so a power cut can't lose a committed part."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def compacted_part_path(loc: Location, job: str, dataset: str, seq: int) -> str:
    """Path of a part written by compaction (its name carries :data:`COMPACT_TAG`)."""
    name = f"{PART_PREFIX}{utc_stamp()}-{COMPACT_TAG}-{seq:06d}{PARQUET_SUFFIX}"
    return posixpath.join(loc.dataset_dir(job, dataset), name)
