"""What a job was made of and made by, kept beside the output so it survives losing Redis.

``producer submit`` writes one ``{job}/_manifest/submitted-{utc}-{rand}.parquet`` per submit call
(atomically, like a part), listing every prompt it enqueued. ``verify`` falls back to it when Redis
no longer has the job. A prompt re-submitted with changed content appears again with a new
``content_hash``; the latest submit wins.

Each row also keeps the prompt's SOURCE conversation — the cleaned ``messages`` and ``tools`` the chat
template rendered, as JSON text (:data:`SOURCE_SCHEMA`) — so ``producer export --format messages`` can
write the conversation as the dataset had it instead of re-parsing rendered ids. Manifests written
before these columns existed read back with them null; re-running the same ``producer submit`` writes
a new manifest with them (it enqueues nothing that is done).

**Provenance records** (``{job}/_provenance/server-{config}-{worker}-{digest}.json``, JSON): what served the job —
one per worker and server configuration, written by the worker before the first part of the job that server's
rows go into (workers/provenance.py), so no stored row names a configuration without its record. Each holds the
server's SGLang version, ``/model_info`` and launch arguments (workers/sglang.py ``launch_record``), the model
directory's config hashes when the worker can read it, thinkfleet's version and git revision, and the job's
sampling, seeds, tokenizer fingerprint and chat-template hash. A row's ``server_config`` names its configuration's
records. ``producer report`` and every export read them (:func:`read_provenance`, :func:`server_configs`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import posixpath
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from storage import layout
from storage.reader import first_per_key
from storage.schema import (
    CONTENT_HASH,
    DATASET,
    MANIFEST_SCHEMA,
    PROMPT_ID,
    PROMPT_TOKENS,
    ROW_INDEX,
    SAMPLE_INDEX,
    SUBMITTED_AT,
)

log = logging.getLogger(__name__)

MANIFEST_PREFIX = "submitted-"
_FILE = "__file"
#: Source-conversation columns (JSON text; null when the submit did not record them).
SOURCE_MESSAGES = "messages"
SOURCE_TOOLS = "tools"
SOURCE_SCHEMA = MANIFEST_SCHEMA.append(pa.field(SOURCE_MESSAGES, pa.large_string())).append(
    pa.field(SOURCE_TOOLS, pa.large_string())
)


def write_submitted(
    output_uri: str,
    job: str,
    rows: Sequence[Mapping[str, Any]],
    s3_endpoint_url: str | None = None,
) -> str:
    """Record submitted prompts (keys: prompt_id, dataset, row_index, sample_index, content_hash,
    prompt_tokens, and optionally ``messages``/``tools``: the source conversation as the chat template
    got it). Returns the manifest file's URI."""
    loc = layout.locate(output_uri, s3_endpoint_url)
    now = datetime.now(UTC)
    columns = {
        PROMPT_ID: [r[PROMPT_ID] for r in rows],
        DATASET: [r[DATASET] for r in rows],
        ROW_INDEX: [r[ROW_INDEX] for r in rows],
        SAMPLE_INDEX: [r.get(SAMPLE_INDEX, 0) for r in rows],
        CONTENT_HASH: [r[CONTENT_HASH] for r in rows],
        PROMPT_TOKENS: [r.get(PROMPT_TOKENS) for r in rows],
        SUBMITTED_AT: [now] * len(rows),
        SOURCE_MESSAGES: [_json_text(r.get(SOURCE_MESSAGES)) for r in rows],
        SOURCE_TOOLS: [_json_text(r.get(SOURCE_TOOLS)) for r in rows],
    }
    table = pa.Table.from_pydict(columns, schema=SOURCE_SCHEMA)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    name = f"{MANIFEST_PREFIX}{layout.utc_stamp(now)}-{uuid.uuid4().hex[:8]}{layout.PARQUET_SUFFIX}"
    path = posixpath.join(loc.manifest_dir(job), name)
    layout.write_atomic(loc, path, memoryview(sink.getvalue()))
    return loc.uri(path)


def _dataset(path: str, schema: pa.Schema, fs: Any) -> Any:
    """One manifest file as a ``pyarrow.dataset`` (imported here, not at the top: it imports pandas, ~0.8 CPU-s,
    which every worker importing this module would pay)."""
    import pyarrow.dataset as ds

    return ds.dataset(path, schema=schema, format="parquet", filesystem=fs)


def read_submitted(output_uri: str, job: str, s3_endpoint_url: str | None = None) -> pa.Table:
    """Every submitted prompt once, with its latest content hash; empty if no manifest exists."""
    loc = layout.locate(output_uri, s3_endpoint_url)
    files = _manifest_files(loc, job)
    if not files:
        return MANIFEST_SCHEMA.empty_table()
    tables = []
    for index, path in enumerate(files):  # one per submit call: few files
        t = _dataset(path, MANIFEST_SCHEMA, loc.fs).to_table()
        tables.append(t.append_column(_FILE, pa.array(np.full(t.num_rows, index, dtype=np.int32))))
    table = pa.concat_tables(tables)
    # Latest submit wins: newest submitted_at, then the later file (names sort by time).
    latest = first_per_key(table, [(PROMPT_ID, "ascending"), (SUBMITTED_AT, "descending"), (_FILE, "descending")])
    return table.take(latest).drop([_FILE])


def read_sources(
    output_uri: str, job: str, datasets: Sequence[str] | None = None, s3_endpoint_url: str | None = None
) -> dict[tuple[str, str], tuple[str | None, str | None]]:
    """(prompt_id, content_hash) → (messages JSON, tools JSON) of every submitted prompt that has them.

    Keyed by the content hash too, so a row is matched with the conversation that rendered exactly its
    prompt ids; when one version was submitted more than once, the latest submit wins.
    """
    loc = layout.locate(output_uri, s3_endpoint_url)
    files = _manifest_files(loc, job)
    columns = [PROMPT_ID, DATASET, CONTENT_HASH, SOURCE_MESSAGES, SOURCE_TOOLS]
    found: dict[tuple[str, str], tuple[str | None, str | None]] = {}
    wanted = set(datasets) if datasets is not None else None
    for path in files:  # sorted by time: later submits overwrite
        dataset = _dataset(path, SOURCE_SCHEMA, loc.fs)
        table = dataset.to_table(columns=columns)
        for pid, name, digest, messages, tools in zip(*(table[c].to_pylist() for c in columns), strict=True):
            if messages is not None and (wanted is None or name in wanted):
                found[(pid, digest)] = (messages, tools)
    return found


class SourceLookup:
    """:func:`read_sources` for a batch of prompts at a time: the text exports look up each batch's conversations
    (manifest row groups pruned by their ``prompt_id`` statistics, only matching rows decoded), so what is held is
    a batch's sources, never the whole job's. The same answer as :func:`read_sources` for those prompts."""

    def __init__(
        self, output_uri: str, job: str, datasets: Sequence[str] | None = None, s3_endpoint_url: str | None = None
    ) -> None:
        self.loc = layout.locate(output_uri, s3_endpoint_url)
        self.files = _manifest_files(self.loc, job)
        self.wanted = set(datasets) if datasets is not None else None

    def get(self, prompt_ids: Sequence[str]) -> dict[tuple[str, str], tuple[str | None, str | None]]:
        columns = [PROMPT_ID, DATASET, CONTENT_HASH, SOURCE_MESSAGES, SOURCE_TOOLS]
        found: dict[tuple[str, str], tuple[str | None, str | None]] = {}
        if not len(prompt_ids):
            return found
        wanted = pc.field(PROMPT_ID).isin(pa.array(list(dict.fromkeys(prompt_ids)), pa.string()))
        for path in self.files:  # sorted by time: later submits overwrite
            dataset = _dataset(path, SOURCE_SCHEMA, self.loc.fs)
            table = dataset.to_table(columns=columns, filter=wanted)
            for pid, name, digest, messages, tools in zip(*(table[c].to_pylist() for c in columns), strict=True):
                if messages is not None and (self.wanted is None or name in self.wanted):
                    found[(pid, digest)] = (messages, tools)
        return found


def _manifest_files(loc: layout.Location, job: str) -> list[str]:
    infos = loc.fs.get_file_info(pafs.FileSelector(loc.manifest_dir(job), allow_not_found=True))
    return sorted(
        i.path
        for i in infos
        if i.type == pafs.FileType.File
        and i.base_name.startswith(MANIFEST_PREFIX)
        and i.base_name.endswith(layout.PARQUET_SUFFIX)
    )


def _json_text(value: Any) -> str | None:
    """Messages/tools as compact JSON (already-JSON text kept as it is); None stays None."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=_plain)


def _plain(value: Any) -> Any:
    """numpy scalars/arrays (from Parquet inputs) → Python values; anything else → its text."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


# -- provenance records -----------------------------------------------------------------------------------------
#: ``{job}/_provenance/``: a leading ``_`` keeps it out of every Parquet reader's view of the job directory.
PROVENANCE_DIR = "_provenance"
PROVENANCE_PREFIX = "server-"
#: What a record says it is (a reader refuses to guess at another layout).
PROVENANCE_KIND = "thinkfleet.provenance.server/1"
#: Records read at once (S3: one GET each).
READ_THREADS = 16
#: Seconds a ``git`` call may take (once per process).
GIT_TIMEOUT_S = 5.0


def provenance_dir(loc: layout.Location, job: str) -> str:
    return posixpath.join(loc.job_dir(job), PROVENANCE_DIR)


def write_provenance(loc: layout.Location, job: str, record: Mapping[str, Any]) -> str:
    """Write one record (atomically; its name holds its content's digest, so writing it again is a no-op and a
    record is never replaced by another). Returns its URI."""
    body = json.dumps(record, indent=1, default=str).encode()  # in the record's order: its highlights first
    stable = {k: v for k, v in record.items() if k != "recorded_at"}
    digest = hashlib.sha256(json.dumps(stable, sort_keys=True, default=str).encode()).hexdigest()[:8]
    name = f"{PROVENANCE_PREFIX}{record['server_config']}-{layout.safe_name(str(record['worker']))}-{digest}.json"
    path = posixpath.join(provenance_dir(loc, job), name)
    if loc.fs.get_file_info(path).type != pafs.FileType.File:
        layout.write_atomic(loc, path, body)
    return loc.uri(path)


def read_provenance(loc: layout.Location, job: str) -> list[dict[str, Any]]:
    """Every record of ``job``, oldest first. A record that cannot be read or is not one comes back as
    ``{"file", "error"}`` (logged): a reader says so rather than leave a server out unseen."""
    infos = loc.fs.get_file_info(pafs.FileSelector(provenance_dir(loc, job), allow_not_found=True))
    paths = sorted(
        i.path
        for i in infos
        if i.type == pafs.FileType.File and i.base_name.startswith(PROVENANCE_PREFIX) and i.base_name.endswith(".json")
    )
    with ThreadPoolExecutor(min(READ_THREADS, max(1, len(paths)))) as pool:
        records = list(pool.map(lambda p: _read_record(loc, p), paths))
    return sorted(records, key=lambda r: (str(r.get("recorded_at", "")), str(r.get("file", ""))))


def _read_record(loc: layout.Location, path: str) -> dict[str, Any]:
    try:
        with loc.fs.open_input_stream(path) as f:
            record = json.loads(f.read())
        if not isinstance(record, dict) or record.get("kind") != PROVENANCE_KIND:
            raise ValueError(f"not a {PROVENANCE_KIND} record")
        return record
    except (OSError, ValueError) as exc:
        log.error("provenance record %s cannot be read: %s", loc.uri(path), exc)
        return {"file": loc.uri(path), "error": f"{type(exc).__name__}: {exc}"}


def server_configs(
    records: Sequence[Mapping[str, Any]], rows: Mapping[str | None, int] | None = None
) -> list[dict[str, Any]]:
    """The records grouped by server configuration: per ``server_config`` its SGLang version, model, weight
    version, launch arguments (the highlights first) and model config hashes, every worker that ran it (host,
    SGLang URL, thinkfleet version and revision) and, given ``rows`` (``server_config`` → committed rows), its
    rows. Rows of no recorded configuration (written before schema 9, or by a worker without the hook) are
    ``server_config`` None."""
    groups: dict[str | None, dict[str, Any]] = {}
    for record in records:
        if "error" in record:
            continue
        server = record.get("server") or {}
        config = record.get("server_config")
        group = groups.setdefault(
            config,
            {
                "server_config": config,
                "sglang_version": server.get("version"),
                "model_path": (server.get("model_info") or {}).get("model_path"),
                "weight_version": (server.get("model_info") or {}).get("weight_version"),
                "highlights": server.get("highlights") or {},
                "launch_args": server.get("launch_args") or {},
                "model_config": record.get("model_config") or {},
                "workers": [],
            },
        )
        software = record.get("thinkfleet") or {}
        group["workers"].append(
            {
                "worker": record.get("worker"),
                "host": record.get("worker_host"),
                "sglang_url": record.get("sglang_url"),
                "thinkfleet_version": software.get("version"),
                "git_revision": software.get("git_revision"),
                "random_seed": (server.get("launch_args") or {}).get("random_seed"),
                "recorded_at": record.get("recorded_at"),
            }
        )
    if rows is not None:
        for config in rows:
            groups.setdefault(config, {"server_config": config, "workers": []})
        for config, group in groups.items():
            group["rows"] = rows.get(config, 0)
    return list(groups.values())


def job_facts(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What the records say of the job itself (sampling, seeds, tokenizer, template): each distinct value once."""
    seen: dict[str, list[Any]] = {}
    for record in records:
        for key, value in (record.get("job_facts") or {}).items():
            values = seen.setdefault(key, [])
            if value not in values:
                values.append(value)
    return {k: v[0] if len(v) == 1 else v for k, v in seen.items()}


def software(revision: str | None = None) -> dict[str, Any]:
    """thinkfleet's version (its installed metadata) and git revision: ``revision`` when the deployment names it,
    else one an installer recorded (``pip install git+…``: ``direct_url.json``), else the checkout the code runs
    from (``git rev-parse HEAD``, and whether tracked files differ from it), else None — an image built without
    ``.git`` knows its revision only if its build passes one. Read once per process."""
    return dict(_software(revision or None))


@functools.cache
def _software(revision: str | None) -> dict[str, Any]:
    try:
        dist = metadata.distribution("thinkfleet")
        version: str | None = dist.version
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
    except (metadata.PackageNotFoundError, ValueError):
        version, direct = None, {}
    out: dict[str, Any] = {"version": version, "git_revision": None, "git_source": None, "git_dirty": None}
    commit = revision or (direct.get("vcs_info") or {}).get("commit_id")
    if commit:
        return {**out, "git_revision": commit, "git_source": "configured" if revision else "direct_url.json"}
    root = Path(__file__).resolve().parent.parent
    if (root / ".git").exists():
        out["git_revision"] = _git(root, "rev-parse", "HEAD")
        status = _git(root, "status", "--porcelain", "--untracked-files=no")
        out["git_source"] = "git" if out["git_revision"] else None
        out["git_dirty"] = None if status is None else bool(status)
    return out


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(root), *args],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            check=True,
            env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"},  # a read must not take the index lock
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()
