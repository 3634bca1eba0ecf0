"""Every export says where its rows came from: a provenance sidecar beside it (and a dataset card for ``hf``).

What it holds: the job's provenance records (``{job}/_provenance/``, storage/manifest.py) grouped by server
configuration — SGLang version, model, weight version, every launch argument, the model directory's config hashes,
the workers and hosts that ran it and how many of the job's rows it made — what the records say of the job
(sampling, seeds, tokenizer fingerprint, chat-template hash), how this export was made (format, filters, rows, files)
and by which thinkfleet (version and git revision).

Where:

- a file ``--out`` (and shards named after one, ``--shard-rows``): ``<out>.provenance.json`` beside it;
- a directory ``--out`` (shards into a directory, ``--format hf``): ``<out>/_provenance.json`` inside it — the
  leading ``_`` keeps it out of ``pq.read_table(dir)`` and other readers of the directory's data files;
- ``--format hf`` also gets a ``README.md`` dataset card in the saved directory, with the same facts.

Written after the data, atomically (storage/layout.py ``write_atomic``), local or S3.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from storage import layout, stream
from storage.card import card_markdown
from storage.exports.base import ExportOptions, ExportResult
from storage.manifest import job_facts, read_provenance, server_configs, software
from storage.report import report_job
from storage.schema import SERVER_CONFIG
from thinkfleet.settings import Settings

#: What the sidecar says it is.
SIDECAR_KIND = "thinkfleet.export.provenance/1"
SIDECAR_SUFFIX = ".provenance.json"
DIRECTORY_SIDECAR = "_provenance.json"
DATASET_CARD = "README.md"
NO_RECORDS = (
    "job {job} has no provenance records ({job}/_provenance/): its rows were written before workers kept them; "
    "each row still names its model, weight_version, sampling, tokenizer fingerprint and chat-template hash"
)


def write_export_provenance(
    settings: Settings, job: str, loc: layout.Location, result: ExportResult, options: ExportOptions
) -> str:
    """Write the sidecar (and for ``hf`` the dataset card) of an export just written to ``loc``; returns the
    sidecar's URI. A job without records (rows from before they were kept) still gets one: its ``servers`` then
    list the rows of no recorded configuration (``server_config`` null, no workers) and ``note`` says why."""
    job_loc = layout.locate(settings.output_uri, settings.s3_endpoint_url)
    records = read_provenance(job_loc, job)
    doc = sidecar(job, result, options, records, _rows_per_config(settings, job_loc, job, options.datasets))
    body = json.dumps(doc, indent=1, sort_keys=False, default=str).encode()
    directory = loc.fs.get_file_info(loc.root).type == pafs.FileType.Directory
    path = posixpath.join(loc.root, DIRECTORY_SIDECAR) if directory else loc.root + SIDECAR_SUFFIX
    layout.write_atomic(loc, path, body)
    if result.format == "hf" and directory:
        facts = report_job(settings, job)[0]["card"]  # the job's data card (storage/card.py), as report writes it
        layout.write_atomic(loc, posixpath.join(loc.root, DATASET_CARD), dataset_card(doc, facts).encode())
    return loc.uri(path)


def sidecar(
    job: str,
    result: ExportResult,
    options: ExportOptions,
    records: list[dict[str, Any]],
    rows: dict[str | None, int],
) -> dict[str, Any]:
    """The sidecar's content; ``rows`` is the committed rows of the exported datasets per configuration (before
    the export's row filters: ``export.skipped`` counts what they left out)."""
    return {
        "kind": SIDECAR_KIND,
        "job": job,
        "export": {
            "format": result.format,
            "path": result.path,
            "rows": result.rows,
            "files": list(result.files),
            "skipped": dict(result.skipped),
            "exported_at": datetime.now(UTC).isoformat(),
            "options": {
                "datasets": list(options.datasets) if options.datasets is not None else None,
                "drop_truncated": options.drop_truncated,
                "drop_flags": list(options.drop_flags),
                "min_reasoning_tokens": options.min_reasoning_tokens,
                "exclude_reasoning": options.exclude_reasoning,
                "merge_turns": options.merge_turns,
                "max_length": options.max_length,
                "shard_rows": options.shard_rows,
                "tokenizer": options.tokenizer,
                "image_urls": options.image_urls,
            },
            "thinkfleet": software(),
        },
        "job_facts": job_facts(records),
        "servers": server_configs(records, rows),
        "unreadable_records": [r for r in records if "error" in r],
        **({} if records else {"note": NO_RECORDS.format(job=job)}),
    }


def dataset_card(doc: dict[str, Any], facts: dict[str, Any] | None = None) -> str:
    """A Hugging Face dataset card (``README.md``): what this export holds and left out, the job's data card
    (``facts``: storage/card.py — prompts, flags, tokens, GPU-hours and cost), what made the rows, then the
    sidecar's JSON whole."""
    lines = [
        "---",
        "tags:",
        "- thinkfleet",
        "- synthetic",
        "---",
        "",
        f"# {doc['job']}",
        "",
        f"Generated by thinkfleet (job `{doc['job']}`), exported as `{doc['export']['format']}`: "
        f"{doc['export']['rows']:,} rows, token ids exactly as the model emitted them.",
        "",
    ]
    skipped = doc["export"].get("skipped") or {}
    left = ", ".join(f"{name.replace('_', ' ')} {n:,}" for name, n in skipped.items()) or "nothing"
    lines += [f"Left out by this export's filters: {left}.", ""]
    if facts is not None:  # the card without its title, its sections one level down
        card = card_markdown(facts).split("\n", 2)[2]
        lines += ["#" + line if line.startswith("## ") else line for line in card.splitlines()]
    lines += [
        "## Servers",
        "",
    ]
    for server in doc["servers"]:
        workers = ", ".join(f"{w.get('worker')} ({w.get('host')})" for w in server.get("workers") or []) or "unrecorded"
        lines.append(
            f"- `{server.get('server_config')}`: SGLang {server.get('sglang_version') or '?'}, "
            f"model `{server.get('model_path')}` (weight version `{server.get('weight_version')}`), "
            f"{server.get('rows', 0):,} rows; workers: {workers}"
        )
        for key, value in (server.get("highlights") or {}).items():
            lines.append(f"  - `{key}`: `{json.dumps(value)}`")
    facts = doc.get("job_facts") or {}
    if facts:
        lines += ["", "## Sampling and tokenizer", ""]
        lines += [f"- `{k}`: `{json.dumps(v, default=str)}`" for k, v in facts.items()]
    lines += ["", "## Provenance (whole)", "", "```json", json.dumps(doc, indent=1, default=str), "```", ""]
    return "\n".join(lines)


def _rows_per_config(
    settings: Settings, loc: layout.Location, job: str, datasets: Sequence[str] | None
) -> dict[str | None, int]:
    """The committed rows of each server configuration (one scalar column read, beside the export's id lists)."""
    counts: dict[str | None, int] = {}
    memory = stream.memory_bytes_of(settings)
    for table in stream.committed_batches(loc, job, [SERVER_CONFIG], datasets, memory_bytes=memory):
        column = table[SERVER_CONFIG] if table.num_rows else pa.chunked_array([], pa.string())
        for entry in pc.value_counts(column).to_pylist():
            counts[entry["values"]] = counts.get(entry["values"], 0) + int(entry["counts"])
    return counts
