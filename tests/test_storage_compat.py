"""A job written by PartWriter reads back, ids intact, with the tools users train with."""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import polars as pl
import pyarrow.parquet as pq
import pytest

from storage.manifest import write_submitted
from storage.writer import PartWriter
from testing.rows import kimi_output, kimi_prompt, make_row


@pytest.fixture
def job_dir(tmp_path: Path) -> tuple[Path, dict[str, dict]]:
    """Two datasets in hive dirs, several parts each, plus a manifest and a stray temp file."""
    rng = np.random.default_rng(7)
    writer = PartWriter(str(tmp_path), "w1")
    rows: dict[str, dict] = {}
    for dataset in ("alpha", "beta gamma"):
        for part in range(3):
            batch = [
                make_row(
                    f"{dataset}-{part}-{i}",
                    dataset=dataset,
                    input_ids=kimi_prompt(rng, 30),
                    output_ids=kimi_output(rng, 50 + i, 5, tool_calls=i % 2),
                )
                for i in range(4)
            ]
            writer.write("job", dataset, batch)
            rows.update({r["prompt_id"]: r for r in batch})
    write_submitted(str(tmp_path), "job", [{**r, "row_index": 0} for r in rows.values()])
    (tmp_path / "job" / "dataset=alpha" / ".part-x.parquet.tmp-1").write_bytes(b"partial")
    return tmp_path / "job", rows


def _check(records: list[dict], rows: dict[str, dict]) -> None:
    assert len(records) == len(rows)
    for rec in records:
        want = rows[rec["prompt_id"]]
        assert str(rec["dataset"]) == want["dataset"]
        assert [int(t) for t in rec["output_ids"]] == want["output_ids"]
        assert [int(t) for t in rec["input_ids"]] == want["input_ids"]


def test_pyarrow_reads_the_job_directory(job_dir: tuple[Path, dict]) -> None:
    path, rows = job_dir
    _check(pq.read_table(path).to_pylist(), rows)


def test_pandas_reads_the_job_directory(job_dir: tuple[Path, dict]) -> None:
    path, rows = job_dir
    df = pd.read_parquet(path)
    _check(df.to_dict("records"), rows)
    assert set(df["dataset"].astype(str)) == {"alpha", "beta gamma"}


def test_polars_reads_a_glob(job_dir: tuple[Path, dict]) -> None:
    path, rows = job_dir
    df = pl.read_parquet(f"{path}/dataset=*/*.parquet")
    _check(df.to_dicts(), rows)


def test_duckdb_reads_a_glob(job_dir: tuple[Path, dict]) -> None:
    path, rows = job_dir
    query = "SELECT prompt_id, dataset, input_ids, output_ids FROM read_parquet('{}/dataset=*/*.parquet')"
    rel = duckdb.sql(query.format(path))
    records = [dict(zip(rel.columns, r, strict=True)) for r in rel.fetchall()]
    _check(records, rows)


def test_hf_datasets_loads_the_parquet(job_dir: tuple[Path, dict], tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    ds = datasets.load_dataset(
        "parquet", data_files=f"{job_dir[0]}/dataset=*/*.parquet", split="train", cache_dir=str(tmp_path / "hf")
    )
    _check(list(ds), job_dir[1])
