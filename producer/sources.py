"""Where a dataset's rows come from, and reading them: ``(location, record)`` per row.

Formats: JSONL, JSON (a list of objects), Parquet, CSV, a directory of such files (one dataset, the
files read in name order) and a Hugging Face ``save_to_disk`` directory — each a local path or an
``s3://bucket/key``, read through ``pyarrow.fs`` (the filesystem layer storage uses, with the same
``THINKFLEET_S3_ENDPOINT_URL`` handling: :func:`storage.layout.locate`) — or a Hugging Face dataset id,
read from the local ``datasets`` cache only (a submit never downloads). A location names the input as
the user wrote it (``data/chat.jsonl:17``, ``s3://b/x.parquet row 16``); :mod:`producer.inputs` turns
the records into conversations. A Hugging Face dataset's ``Image`` columns are read as their files' bytes
(``{bytes, path}``), never decoded here.
"""

from __future__ import annotations

import csv
import io
import json
import os
import posixpath
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

#: File suffixes read as datasets.
SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
#: Input URIs read through pyarrow.fs S3 (``THINKFLEET_S3_ENDPOINT_URL`` for MinIO, moto, …).
S3_SCHEMES = ("s3://", "s3a://")
#: A Hugging Face dataset id: ``name`` or ``owner/name``.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
#: Files of a ``datasets`` ``save_to_disk`` directory (a DatasetDict, or one Dataset).
_HF_DIR_MARKERS = ("dataset_dict.json", "state.json")
#: The fix a row problem names.
SKIP_HINT = "fix the row, or pass --skip-invalid to skip and record it"


class InputError(Exception):
    """A user error that stops the submit before anything is enqueued."""


@dataclass(frozen=True)
class Problem:
    location: str  # "data/train.jsonl:17" or "data/x.parquet row 16"
    reason: str

    def __str__(self) -> str:
        return f"{self.location}: {self.reason}"


@dataclass(frozen=True)
class Source:
    """Where a dataset's rows come from: a file or directory on a pyarrow filesystem (``local`` or
    ``s3``), or a Hugging Face dataset id (``hub``) already loaded from the local cache."""

    given: str  # as the user wrote it: every location names it
    kind: str  # local | s3 | hub
    fs: pafs.FileSystem | None = field(default=None, compare=False)
    path: str = ""  # on fs
    hub: Any = field(default=None, compare=False, repr=False)  # the loaded datasets.Dataset(Dict)

    def __str__(self) -> str:
        return self.given

    def child(self, name: str) -> str:
        """How a file inside this directory is named in locations."""
        return str(Path(self.given) / name) if self.kind == "local" else f"{self.given.rstrip('/')}/{name}"


# Every file is read through pyarrow.fs (local and S3 alike); ``where`` is how locations name it.
def _stream(fs: pafs.FileSystem, path: str) -> io.BufferedReader:
    return io.BufferedReader(fs.open_input_stream(path, compression=None), 1 << 20)


def _read_jsonl(
    fs: pafs.FileSystem, path: str, where: str, problems: list[Problem]
) -> Iterator[tuple[str, dict[str, Any] | None]]:
    with _stream(fs, path) as f:
        yield from _jsonl_lines(f, where, problems)


def _jsonl_lines(f: Any, where: str, problems: list[Problem]) -> Iterator[tuple[str, dict[str, Any] | None]]:
    for line_no, line in enumerate(f, 1):
        if not line.strip():
            continue
        loc = f"{where}:{line_no}"
        try:
            record = json.loads(line)
        except ValueError as e:
            problems.append(Problem(loc, f"not valid JSON ({e}); {SKIP_HINT}"))
            yield loc, None
            continue
        if not isinstance(record, dict):
            problems.append(Problem(loc, f"a JSON {type(record).__name__}, not an object; {SKIP_HINT}"))
            yield loc, None
            continue
        yield loc, record


def _read_json(
    fs: pafs.FileSystem, path: str, where: str, problems: list[Problem]
) -> Iterator[tuple[str, dict[str, Any] | None]]:
    with _stream(fs, path) as f:
        raw = f.read()
    try:
        data = json.loads(raw)
    except ValueError as e:
        # A .json file may really be JSON Lines.
        if raw.lstrip()[:1] == b"{":
            yield from _jsonl_lines(io.BytesIO(raw), where, problems)
            return
        raise InputError(f"{where}: not valid JSON ({e}); a .json input must be a list of objects") from e
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise InputError(f"{where}: a JSON object, not a list of rows; save the rows as a JSON list or JSONL")
        data = lists[0]
    if not isinstance(data, list):
        raise InputError(f"{where}: top level is a {type(data).__name__}; a .json input must be a list of objects")
    for i, record in enumerate(data):
        loc = f"{where} item {i}"
        if not isinstance(record, dict):
            problems.append(Problem(loc, f"a JSON {type(record).__name__}, not an object; {SKIP_HINT}"))
            yield loc, None
        else:
            yield loc, record


def _read_parquet(
    fs: pafs.FileSystem, path: str, where: str, problems: list[Problem]
) -> Iterator[tuple[str, dict[str, Any] | None]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(fs.open_input_file(path))
    except Exception as e:
        raise InputError(f"{where}: not a readable Parquet file ({e})") from e
    i = 0
    for batch in pf.iter_batches(batch_size=4096):
        for record in batch.to_pylist():
            yield f"{where} row {i}", record
            i += 1


def _read_csv(
    fs: pafs.FileSystem, path: str, where: str, problems: list[Problem]
) -> Iterator[tuple[str, dict[str, Any] | None]]:
    # The stdlib reader over the pyarrow stream, not pyarrow.csv: every cell stays text (pyarrow.csv
    # infers types, so a prompt "42" or an id "007" would change), and locations keep their line numbers.
    csv.field_size_limit(1 << 30)
    with io.TextIOWrapper(_stream(fs, path), encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        try:
            for record in reader:
                yield f"{where}:{reader.line_num}", dict(record)
        except UnicodeDecodeError as e:
            raise InputError(f"{where}:{reader.line_num + 1}: not UTF-8 text ({e}); re-save the file as UTF-8") from e


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError as e:
        raise InputError(
            "reading a Hugging Face dataset (a hub id or a save_to_disk directory) needs the `datasets` "
            "package: in the checkout, `.venv/bin/pip install -e '.[hub]'`"
        ) from e
    return datasets


def _one_split(ds: Any, split: str | None, where: str) -> Any:
    datasets = _import_datasets()
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds)
        if split is None and len(names) == 1:
            split = names[0]
        if split not in ds:
            raise InputError(f"{where}: a DatasetDict with splits {names}; choose one with --split (job file: split)")
        ds = ds[split]
    return ds


def _read_hf(src: Source, split: str | None) -> Iterator[tuple[str, dict[str, Any] | None]]:
    """A ``save_to_disk`` directory; on S3 it is copied to a temporary directory first (``load_from_disk``
    memory-maps local Arrow files)."""
    datasets = _import_datasets()
    with tempfile.TemporaryDirectory(prefix="thinkfleet-hf-") as tmp:
        local = src.path
        if src.kind != "local":
            local = os.path.join(tmp, "dataset")
            try:
                pafs.copy_files(
                    src.path, local, source_filesystem=src.fs, destination_filesystem=pafs.LocalFileSystem()
                )
            except OSError as e:
                raise InputError(f"{src}: cannot copy the save_to_disk directory ({e})") from e
        try:
            ds = datasets.load_from_disk(local)
        except Exception as e:
            raise InputError(f"{src}: not a readable Hugging Face save_to_disk directory ({e})") from e
        for i, record in enumerate(_hf_rows(_one_split(ds, split, str(src)))):
            yield f"{src} row {i}", record


def _hf_rows(ds: Any) -> Iterator[dict[str, Any]]:
    """A ``datasets.Dataset``'s rows; one with an ``Image`` feature as Arrow stores it — each image the
    ``{bytes, path}`` of its file, never decoded into pixels and re-encoded (producer/images.py stores the bytes
    the dataset holds, and decoding every image here would cost the submit its time twice)."""
    if not _has_image(ds.features):
        yield from ds
        return
    for batch in ds.with_format("arrow").iter(batch_size=256):
        yield from batch.to_pylist()


def _has_image(feature: Any) -> bool:
    if type(feature).__name__ == "Image":
        return True
    if isinstance(feature, dict):
        return any(_has_image(f) for f in feature.values())
    inner = getattr(feature, "feature", None)  # List / Sequence / LargeList
    return inner is not None and _has_image(inner)


def _load_hub(dataset_id: str, split: str | None) -> Any:
    """A hub dataset id from the local ``datasets`` cache (``HF_DATASETS_CACHE``), offline: a submit never
    downloads. Loaded at :func:`open_dataset`, so a missing one fails before anything renders."""
    datasets = _import_datasets()
    cache_dir = os.environ.get("HF_DATASETS_CACHE") or None
    offline = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        ds = datasets.load_dataset(dataset_id, split=split, cache_dir=cache_dir)
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(
            f"{dataset_id}: no such file or directory, and no Hugging Face dataset {dataset_id!r}"
            f"{f' (split {split!r})' if split else ''} in the local cache "
            f"{cache_dir or datasets.config.HF_DATASETS_CACHE} ({reason}); load it once where the hub is "
            f"reachable (datasets.load_dataset({dataset_id!r}) with the same HF_DATASETS_CACHE), or give a path"
        ) from None
    finally:
        datasets.config.HF_HUB_OFFLINE = offline
    return _one_split(ds, split, dataset_id)


def count_rows(path: str | Path) -> int | None:
    """Rows in a local input, cheaply, for a progress bar's total (JSONL lines, Parquet metadata); None if
    unknown (remote inputs, hub ids, save_to_disk directories, CSV)."""
    if isinstance(path, str):
        if path.startswith(S3_SCHEMES):
            return None
        path = Path(path[len("file://") :] if path.startswith("file://") else path)
    try:
        if path.is_dir():
            if is_hf_dataset_dir(path):
                return None
            counts = [count_rows(p) for p in sorted(path.iterdir()) if p.is_file() and p.suffix in SUFFIXES]
            return None if None in counts else sum(c or 0 for c in counts)
        if path.suffix == ".jsonl":
            with path.open("rb") as f:
                return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 24), b""))
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows
    except OSError:
        return None
    return None


def is_hf_dataset_dir(path: Path) -> bool:
    return any((path / marker).exists() for marker in _HF_DIR_MARKERS)


def _is_hf_dir(fs: pafs.FileSystem, path: str) -> bool:
    infos = fs.get_file_info([posixpath.join(path, m) for m in _HF_DIR_MARKERS])
    return any(i.type == pafs.FileType.File for i in infos)


_READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet, ".csv": _read_csv}


def records(src: Source, problems: list[Problem], split: str | None) -> Iterator[tuple[str, dict | None]]:
    """Every row of ``src`` as (location, record); a row that is no object is (location, None) with its
    problem appended. A file-level problem raises :class:`InputError`."""
    if src.kind == "hub":
        for i, record in enumerate(_hf_rows(src.hub)):
            yield f"{src} row {i}", record
        return
    assert src.fs is not None
    try:
        info = src.fs.get_file_info(src.path)
        if info.type == pafs.FileType.Directory:
            if _is_hf_dir(src.fs, src.path):
                yield from _read_hf(src, split)
                return
            found = src.fs.get_file_info(pafs.FileSelector(src.path))
            files = sorted(
                (i for i in found if i.type == pafs.FileType.File and posixpath.splitext(i.base_name)[1] in SUFFIXES),
                key=lambda i: i.base_name,
            )
            if not files:
                raise InputError(f"{src}: a directory with no {', '.join(SUFFIXES)} files and no save_to_disk dataset")
            for f in files:
                yield from _READERS[posixpath.splitext(f.base_name)[1]](
                    src.fs, f.path, src.child(f.base_name), problems
                )
            return
        reader = _READERS.get(posixpath.splitext(src.path)[1])
        if reader is None:
            raise InputError(
                f"{src}: unknown format; use {', '.join(SUFFIXES)}, a directory, or a save_to_disk dataset"
            )
        yield from reader(src.fs, src.path, str(src), problems)
    except OSError as e:  # a remote store failing mid-read, a permission error, …
        raise InputError(f"{src}: cannot read ({e})") from e


def locate_input(text: str, s3_endpoint_url: str | None = None, split: str | None = None) -> Source:
    """``s3://bucket/key`` → S3 (the object or prefix must exist); an existing local path (or
    ``file://``) → local; otherwise a hub dataset id, loaded from the local cache (split ``split``)."""
    if text.startswith(S3_SCHEMES):
        from storage.layout import locate

        try:
            loc = locate(text, s3_endpoint_url)
            info = loc.fs.get_file_info(loc.root)
        except (ValueError, OSError) as e:
            raise InputError(f"{text}: cannot reach it ({e}); check the URI, credentials and --s3-endpoint-url") from e
        if info.type == pafs.FileType.NotFound:
            raise InputError(
                f"{text}: no such object or prefix; check the bucket and key (and THINKFLEET_S3_ENDPOINT_URL)"
            )
        return Source(text, "s3", loc.fs, loc.root)
    local = Path(text[len("file://") :] if text.startswith("file://") else text)
    if local.exists():
        return Source(text, "local", pafs.LocalFileSystem(), os.path.abspath(local))
    if _HUB_ID.fullmatch(text) and Path(text).suffix not in SUFFIXES:
        return Source(text, "hub", hub=_load_hub(text, split))
    raise InputError(f"{text}: no such file or directory")
