"""PartWriter: one group commit of rows → one immutable, atomically committed Parquet part.

The worker asks for the part's name first (:meth:`PartWriter.part_name`) and records it in Redis as
its intent, then writes; after a crash, :meth:`PartWriter.exists` tells whoever recovers the prompt
whether that write committed. Parts are never modified after commit — only compaction replaces them,
and a replaced part still "exists" for that question (its rows live on in the compacted file).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import posixpath
import socket
import tempfile
import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from storage import layout, listing, quarantine
from storage.schema import DATASET, JOB, SCHEMA, WORKER, WORKER_HOST, WRITE_OPTIONS, rows_to_table
from storage.spans import KIMI_TOKENS, SpanTokens

_HOST = socket.gethostname()


class StorageNotWritable(RuntimeError):
    """The output location cannot be written (at start: the worker refuses to consume)."""


class PartWriter:
    """Writes parts for one worker identity under ``output_uri`` (local path or ``s3://…``)."""

    def __init__(
        self,
        output_uri: str,
        worker: str,
        s3_endpoint_url: str | None = None,
        *,
        tokens: SpanTokens = KIMI_TOKENS,
    ) -> None:
        self.loc = layout.locate(output_uri, s3_endpoint_url)
        self.worker = worker
        self.tokens = tokens
        self._tag = layout.safe_name(worker)
        self._seq = itertools.count()
        self._lock = threading.Lock()  # part_name may be called from several threads

    def part_name(self, job: str, dataset: str) -> str:
        """A fresh, unique part URI: ``…/{job}/dataset={ds}/part-{utc}-{worker}-{seq}.parquet``."""
        with self._lock:
            seq = next(self._seq)
        name = f"{layout.PART_PREFIX}{layout.utc_stamp()}-{self._tag}-{seq:06d}{layout.PARQUET_SUFFIX}"
        return self.loc.uri(posixpath.join(self.loc.dataset_dir(job, dataset), name))

    def write(
        self,
        job: str,
        dataset: str,
        rows: Sequence[Mapping[str, Any]] | pa.Table,
        part_path: str | None = None,
        *,
        metadata: Mapping[bytes, bytes] | None = None,
    ) -> str:
        """Commit ``rows`` as one zstd Parquet part and return its URI.

        ``job``, ``dataset``, ``worker`` and ``worker_host`` fill rows that leave them out; a row
        naming another job or dataset is refused (it would land in the wrong directory).
        """
        return self.write_encoded(job, dataset, self.encode(job, dataset, rows, metadata=metadata), part_path)

    def encode(
        self,
        job: str,
        dataset: str,
        rows: Sequence[Mapping[str, Any]] | pa.Table,
        *,
        metadata: Mapping[bytes, bytes] | None = None,
    ) -> memoryview:
        """``rows`` as the Parquet bytes of one part (no I/O): raises ValueError/ArrowException for rows the schema
        refuses, which is the rows' fault, never storage's (the committer tells them apart)."""
        if isinstance(rows, pa.Table):
            table = rows.select(SCHEMA.names).cast(SCHEMA)
        else:
            defaults = {JOB: job, DATASET: dataset, WORKER: self.worker, WORKER_HOST: _HOST}
            table = rows_to_table(rows, defaults=defaults, tokens=self.tokens)
        for name, want in ((JOB, job), (DATASET, dataset)):
            if table.num_rows and not pc.all(pc.equal(table[name], want)).as_py():
                bad = sorted(set(table[name].to_pylist()) - {want})
                raise ValueError(f"rows for {name} {bad} passed to write({job!r}, {dataset!r})")
        if metadata:
            table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
        return encode_parquet(table)

    def write_encoded(self, job: str, dataset: str, data: memoryview | bytes, part_path: str | None = None) -> str:
        """Commit bytes from :meth:`encode` as the part ``part_path`` (atomically) and return its URI."""
        uri = part_path or self.part_name(job, dataset)
        path = self.loc.path(uri)
        expected_dir = self.loc.dataset_dir(job, dataset)
        if posixpath.dirname(path) != expected_dir or not layout.is_part_name(posixpath.basename(path)):
            raise ValueError(f"part path {uri!r} is not a part of {job}/{dataset}; use part_name()")
        layout.write_atomic(self.loc, path, data)
        return uri

    def write_stream(
        self,
        job: str,
        dataset: str,
        tables: Iterable[pa.Table],
        part_path: str,
        *,
        metadata: Mapping[bytes, bytes] | None = None,
    ) -> str:
        """Commit a part written table by table (a row group each), never whole in memory: compaction's large
        files. Atomic as :meth:`write`: local, a hidden temporary file fsynced and renamed; S3, a local temporary
        file uploaded once complete (an object is invisible until its upload completes). Returns the part's URI."""
        path = self.loc.path(part_path)
        if posixpath.dirname(path) != self.loc.dataset_dir(job, dataset) or not layout.is_part_name(
            posixpath.basename(path)
        ):
            raise ValueError(f"part path {part_path!r} is not a part of {job}/{dataset}")
        schema = SCHEMA.with_metadata({**(SCHEMA.metadata or {}), **(metadata or {})})

        def write_all(sink: Any) -> None:
            with pq.ParquetWriter(sink, schema, **WRITE_OPTIONS) as out:
                for table in tables:
                    table = table.select(SCHEMA.names).cast(SCHEMA)
                    for name, want in ((JOB, job), (DATASET, dataset)):
                        if table.num_rows and not pc.all(pc.equal(table[name], want)).as_py():
                            raise ValueError(f"rows for another {name} passed to write_stream({job!r}, {dataset!r})")
                    out.write_table(table.replace_schema_metadata(schema.metadata))

        if not self.loc.is_local:
            # Through a local file, uploaded once complete: an S3 stream closed by an error would still complete its
            # upload — a truncated file, and the last one of a compaction declares what it replaces.
            with tempfile.TemporaryDirectory(prefix="thinkfleet-part-") as tmpdir:
                local = os.path.join(tmpdir, posixpath.basename(path))
                with open(local, "wb") as f:
                    write_all(f)
                pafs.copy_files(
                    local, path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=self.loc.fs
                )
            return part_path
        directory, name = os.path.split(path)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "wb") as f:
                write_all(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        layout._fsync_dir(directory)
        return part_path

    def probe(self) -> None:
        """Write and delete a small object under the output root, or raise :class:`StorageNotWritable`
        naming the location, this process's uid and the usual fix (a worker checks this at start)."""
        path = posixpath.join(self.loc.root, f".thinkfleet-probe-{self._tag}-{os.getpid()}")
        try:
            self.loc.fs.create_dir(self.loc.root, recursive=True)
            with self.loc.fs.open_output_stream(path) as out:
                out.write(b"probe")
            self.loc.fs.delete_file(path)
        except Exception as exc:
            uid = os.getuid() if hasattr(os, "getuid") else "?"
            where = self.loc.uri(self.loc.root)
            fix = (
                f"make it writable for uid {uid} (e.g. `chown -R {uid} {self.loc.root}` on the host, or set "
                "THINKFLEET_OUTPUT_URI to a writable place)"
                if self.loc.is_local
                else "check the bucket, the credentials (AWS_* / THINKFLEET_S3_ENDPOINT_URL) and their write permission"
            )
            reason = f"{type(exc).__name__}: {exc}"
            raise StorageNotWritable(f"output location {where} is not writable ({reason}); {fix}") from exc
        # pyarrow imports pandas on its first numpy → Arrow conversion (≈ 0.15 s of CPU): pay for it and the
        # encoder's set-up here, at start, rather than in the first group commit.
        encode_parquet(rows_to_table([]))

    def final_counts(self, job: str, dataset: str, part_path: str, prompt_id: str) -> dict[str, Any] | None:
        """``completion_tokens``, ``has_think_end``, ``finish_reason``, ``revision``, ``epoch`` and ``content_hash`` of
        ``prompt_id``'s row in a committed part (or in the compacted file that replaced it); None when the row is not
        there — also when the part is damaged (it is quarantined: storage/quarantine.py)."""
        columns = [
            "prompt_id",
            "completion_tokens",
            "has_think_end",
            "finish_reason",
            "revision",
            "epoch",
            "content_hash",
        ]
        path = self.loc.path(part_path)
        table = None
        if self.loc.fs.get_file_info(path).type == pafs.FileType.File:
            try:
                table = quarantine.read_checked(self.loc, path, columns)
            except quarantine.PartVanished:
                pass  # compacted since the look: the committed view holds the row
            else:
                if table is None:
                    return None
        if table is None:  # compacted since: the committed view holds the row
            from storage.reader import read_committed

            table = read_committed(self.loc.uri(self.loc.root), job, columns=columns, datasets=[dataset])
        table = table.filter(pc.equal(table["prompt_id"], prompt_id))
        return table.to_pylist()[0] if table.num_rows else None

    def exists(self, part_path: str) -> bool:
        """Did this part commit? True also after compaction folded it into a larger file. A part that is there
        but does not decode whole (zero bytes, truncated, a page whose checksum fails) did not: it is
        quarantined (storage/quarantine.py) and False is the answer."""
        path = self.loc.path(part_path)
        fs = self.loc.fs
        if fs.get_file_info(path).type == pafs.FileType.File:
            try:
                return quarantine.check_part(self.loc, path)
            except quarantine.PartVanished:
                pass  # compacted since the look: asked of the compacted file below
        siblings = fs.get_file_info(pafs.FileSelector(posixpath.dirname(path), allow_not_found=True))
        return path in listing.superseded(self.loc, siblings)


def encode_parquet(table: pa.Table) -> memoryview:
    """The table as Parquet bytes, serialized fully in memory before any byte reaches storage."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, **WRITE_OPTIONS)
    return memoryview(sink.getvalue())
