"""One storage command on one job, in its own process: ``python bench/scale_command.py CMD OUTPUT_URI JOB OUT``.

``bench/bench_scale_storage.py`` runs it under ``/usr/bin/time``-like accounting (the child's peak RSS from
``resource.getrusage(RUSAGE_CHILDREN)``) for the current tree and for the baseline tree (``PYTHONPATH`` names
which ``storage`` is imported), so it uses only the commands' public entry points, present in both. It prints
one JSON line: what the command produced, reduced to digests that must agree between old and new code.

CMD: ``verify``, ``report``, ``export-eagle3`` (Parquet), ``export-eagle3-jsonl``, ``export-specforge``,
``export-hf``, ``compact`` (compacts the job in place: give it a copy).
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import sys
import time
import uuid

#: ``producer report`` fields of provenance (storage/report.py ``provenance``), and the files an export writes beside
#: its rows (storage/exports/provenance.py): not what old and new code must agree on.
PROVENANCE_FIELDS = ("servers", "job_facts", "unreadable_provenance", "speculative")
PROVENANCE_FILES = ("provenance.json", "README.md")
#: What later versions added beside what old and new code must agree on: the quality flags (schema 12, issue 46) —
#: verify's and the card's counts of them, and the columns a compaction writes them into (tests/test_quality_flags.py
#: and tests/test_data_card_e2e.py check those).
ADDED_FIELDS = ("quality_flags", "card")
ADDED_COLUMNS = ("loop", "loop_period", "no_think_end", "empty_answer", "tool_call_unparsed")


def _digests(root: str) -> dict[str, str]:
    out = {}
    for base, _, files in os.walk(root):
        for name in sorted(files):
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return dict(sorted(out.items()))


def _table_digest(table: object) -> str:
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:  # type: ignore[attr-defined]
        w.write_table(table.combine_chunks())  # type: ignore[attr-defined]
    return hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()


def run(cmd: str, uri: str, job: str, out: str, settings: object | None = None) -> dict[str, object]:
    """Run ``cmd`` on ``job`` under ``uri`` (outputs under ``out``); what it produced, as digests."""
    if settings is None:
        from thinkfleet.settings import Settings

        settings = Settings(output_uri=uri, key_prefix=f"scale-{uuid.uuid4().hex[:8]}")
    import storage

    started = time.perf_counter()
    result: dict[str, object] = {"cmd": cmd, "code": os.path.dirname(os.path.dirname(storage.__file__))}
    if cmd == "verify":
        from storage.verify import verify_job

        report = verify_job(settings, job).to_dict()  # type: ignore[arg-type]
        # Empty fields left out: a later version's report adds fields (a new check), empty on a job it does not fit.
        shown = {k: v for k, v in report.items() if v not in ([], {}, None) and k not in ADDED_FIELDS}
        result["digest"] = hashlib.sha256(json.dumps(shown, sort_keys=True, default=str).encode()).hexdigest()
        result["committed"] = report["committed"]
        result["stored_rows"] = report["stored_rows"]
    elif cmd == "report":
        from storage.report import report_job

        summary, _ = report_job(settings, job)  # type: ignore[arg-type]
        # The numbers must agree; what a later version says of who made the rows (provenance) is left out.
        shown = {k: v for k, v in summary.items() if k not in PROVENANCE_FIELDS and k not in ADDED_FIELDS}
        result["digest"] = hashlib.sha256(json.dumps(shown, sort_keys=True, default=str).encode()).hexdigest()
        result["rows"] = summary["rows"]
    elif cmd.startswith("export-"):
        from storage.exports import export_job

        fmt = cmd.removeprefix("export-")
        target = {
            "eagle3": os.path.join(out, "x.parquet"),
            "eagle3-jsonl": os.path.join(out, "x.jsonl"),
            "specforge": os.path.join(out, "x.jsonl"),
            "hf": os.path.join(out, "hf"),
        }[fmt]
        res = export_job(settings, job, fmt.removesuffix("-jsonl"), target)  # type: ignore[arg-type]
        result["rows"] = res.rows
        # hf's state.json carries a random fingerprint, the provenance sidecar and dataset card the export's time and
        # code: every other file must be identical.
        digests = {k: v for k, v in _digests(out).items() if not k.endswith(("state.json", *PROVENANCE_FILES))}
        result["digest"] = hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()
    elif cmd == "compact":
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        from storage.compact import compact_job

        res = compact_job(settings, job)  # type: ignore[arg-type]
        result["files"] = sum(len(d.files_written) for d in res.datasets)
        result["rows"] = sum(d.rows_after for d in res.datasets)
        result["wall_s"] = time.perf_counter() - started
        # The command's own peak: the digest below reads the whole job into memory (at 1M prompts, GBs).
        result["command_peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        # The committed view after compaction, row for row (row groups may be cut otherwise). Columns null in every
        # row and the schema's metadata are left out: a later schema version adds (null) columns, nothing else.
        table = pq.read_table(os.path.join(uri, job)).drop_columns(["dataset"]).replace_schema_metadata(None)
        table = table.take(pc.sort_indices(table, [("prompt_id", "ascending")]))
        table = table.select([c for c in table.column_names if table[c].null_count < table.num_rows])
        table = table.drop_columns([c for c in ADDED_COLUMNS if c in table.column_names])
        result["digest"] = _table_digest(table)
        return result
    else:
        raise SystemExit(f"unknown command {cmd}")
    result["wall_s"] = time.perf_counter() - started
    return result


def main() -> None:
    cmd, uri, job, out = sys.argv[1:5]
    print(json.dumps(run(cmd, uri, job, out)))


if __name__ == "__main__":
    main()
