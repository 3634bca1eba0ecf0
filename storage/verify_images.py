"""``producer verify``: every image a job refers to is in its image store and hashes to its sha256.

The references come from two places, so a job is checked before any row is stored as well as after: the storage
manifest's source conversations (each image part the producer wrote carries ``image`` — the store URI — and
``sha256``: producer/images.py) and the committed rows' ``image_paths`` / ``image_sha256`` columns (storage/schema.py).
Each distinct image is read once (a few at a time: S3 reads wait on the network) and hashed; one that is absent,
unreadable or holds other bytes fails verify, named with a prompt that refers to it and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from storage import layout
from storage.images import check_image
from storage.manifest import MANIFEST_PREFIX, SOURCE_MESSAGES
from storage.schema import IMAGE_PATHS, IMAGE_SHA256, PROMPT_ID

#: Images read at once.
READ_THREADS = 8
#: Manifest rows decoded at once.
_BATCH_ROWS = 4096


@dataclass
class ImageRefs:
    """Distinct image references: uri → (sha256, a prompt id that refers to it)."""

    refs: dict[str, tuple[str, str]] = field(default_factory=dict)

    def add(self, uri: str, sha256: str, prompt_id: str) -> None:
        self.refs.setdefault(uri, (sha256, prompt_id))


@dataclass
class ImageCheck:
    checked: int = 0
    #: "uri (prompt p): why" for each image that is missing, unreadable or holds other bytes
    problems: list[str] = field(default_factory=list)


def row_images(refs: ImageRefs, table: pa.Table) -> None:
    """Add the image references of a batch of committed rows (a table with ``image_paths``/``image_sha256``)."""
    if IMAGE_PATHS not in table.column_names or IMAGE_SHA256 not in table.column_names:
        return
    column = table[IMAGE_PATHS]
    if column.null_count == len(column):
        return
    pids, shas = table[PROMPT_ID].to_pylist(), table[IMAGE_SHA256].to_pylist()
    for pid, uris, digests in zip(pids, column.to_pylist(), shas, strict=True):
        for uri, sha in zip(uris or (), digests or (), strict=False):
            refs.add(uri, sha, pid)


def manifest_images(loc: layout.Location, job: str, refs: ImageRefs) -> None:
    """Add the image references of every submitted conversation in the job's manifest (a batch at a time: only
    the rows whose conversation holds an image part are parsed)."""
    infos = loc.fs.get_file_info(pafs.FileSelector(loc.manifest_dir(job), allow_not_found=True))
    for info in sorted(infos, key=lambda i: i.path):
        name = info.base_name
        if info.type != pafs.FileType.File or not name.startswith(MANIFEST_PREFIX) or not name.endswith(".parquet"):
            continue
        with loc.fs.open_input_file(info.path) as f:
            pf = pq.ParquetFile(f)
            if SOURCE_MESSAGES not in pf.schema_arrow.names:
                continue  # a manifest written before source conversations were kept
            for batch in pf.iter_batches(batch_size=_BATCH_ROWS, columns=[PROMPT_ID, SOURCE_MESSAGES]):
                messages = batch.column(SOURCE_MESSAGES)
                hits = pc.fill_null(pc.match_substring(messages, '"sha256"'), False)
                if not pc.any(hits).as_py():
                    continue
                chosen = batch.filter(hits)
                for pid, text in zip(chosen.column(PROMPT_ID).to_pylist(), chosen.column(SOURCE_MESSAGES).to_pylist(),
                                     strict=True):  # fmt: skip
                    for uri, sha in _parts(text):
                        refs.add(uri, sha, pid)


def _parts(text: str | None) -> Iterator[tuple[str, str]]:
    try:
        messages = json.loads(text or "[]")
    except ValueError:
        return
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") == "image" and part.get("sha256") and part.get("image"):
                yield str(part["image"]), str(part["sha256"])


def check_images(refs: ImageRefs, s3_endpoint_url: str | None = None) -> ImageCheck:
    """Read and hash every distinct referenced image."""
    out = ImageCheck(checked=len(refs.refs))
    items: Iterable[tuple[str, tuple[str, str]]] = sorted(refs.refs.items())
    with ThreadPoolExecutor(READ_THREADS) as pool:
        found = pool.map(lambda kv: (kv, check_image(kv[0], kv[1][0], s3_endpoint_url)), items)
        for (uri, (_sha, pid)), problem in found:
            if problem is not None:
                out.problems.append(f"{uri} (prompt {pid}): {problem} → {_fix(uri, problem)}")
    return out


def _fix(uri: str, problem: str) -> str:
    """What brings the image back: a submit stores a missing image again, but never replaces one that is there
    (its name is its content: storage/images.py), so an altered or unreadable file goes first."""
    again = "re-run the job's `producer submit` with the same inputs"
    if problem == "missing":
        return f"{again} (it stores the image again; nothing done is enqueued twice)"
    return f"delete {uri}, then {again} (a stored image is never replaced)"
