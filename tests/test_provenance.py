"""Provenance, per job and per row (issue 36): what served a job is recorded beside its rows, shown by
``producer report`` and written into every export; a speculative server's acceptance figures land in each row.

The end-to-end test runs real ``worker`` processes against two simulators launched with different arguments (one
with ``--speculative-algorithm EAGLE3``), a real Redis and real Parquet; the rest prove the pieces one at a time.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow.parquet as pq
import pytest
import redis
import requests

from sglang_sim.speculative import figures
from sglang_sim.testing import SimulatorThread
from storage import layout
from storage.exports import export_job
from storage.exports.provenance import DIRECTORY_SIDECAR, SIDECAR_SUFFIX
from storage.manifest import read_provenance, write_provenance
from storage.reader import read_committed
from storage.report import report_job
from storage.writer import PartWriter
from testing.fleet import WorkerProcess, job_progress, wait_until
from testing.harness import cli_env, fast_env, isolated_settings, make_prompts, register_ids, simulator
from testing.rows import make_row
from thinkfleet.broker.celery_app import send_tasks
from thinkfleet.settings import Settings
from workers.hooks import CommitGroup
from workers.provenance import ProvenanceRecorder
from workers.sglang import REDACTED, launch_record, parse_response, parse_server_info

FAST = ("--time-scale", "400", "--health-min-s", "0.05")
#: Two servers launched differently: the deployed release with EAGLE3 speculative decoding, and the current one
#: without it, on half the GPUs with FP8 weights.
SPECULATIVE = ("--sglang-version", "0.5.9", "--speculative-algorithm", "EAGLE3", "--weight-version", "w-a")
SPECULATIVE += ("--speculative-draft-model-path", "/models/k25-eagle3", "--tp-size", "8")
PLAIN = ("--sglang-version", "0.5.23", "--tp-size", "4", "--quantization", "fp8", "--weight-version", "w-b")
SPEC_COLUMNS = ["spec_verify_ct", "spec_accepted_tokens", "spec_draft_tokens", "spec_accept_histogram"]


def _generate(url: str, n: int = 300) -> dict[str, Any]:
    prompt = next(iter(make_prompts(1, seed=3).values()))
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 1.0}, "rid": "r1"}
    return requests.post(f"{url}/generate", json=body, timeout=30).json()


def _assert_consistent(row: dict[str, Any]) -> None:
    """SGLang's own arithmetic (tokenizer_manager._calculate_spec_decoding_metrics) holds for a row's figures."""
    steps, accepted, proposed, hist = (row[c] for c in SPEC_COLUMNS)
    assert steps > 0 and proposed == steps * 3, row  # 4 draft tokens per step: 3 proposed
    assert sum(hist) == steps and sum(i * n for i, n in enumerate(hist)) == accepted, row
    assert steps + accepted + 1 == row["completion_tokens"], "every step emits its accepted drafts + 1; prefill 1"


# -- the simulator answers as the release it imitates -------------------------------------------------------------
@pytest.mark.parametrize(
    ("version", "accepted_key", "proposed_key", "histogram_key"),
    [
        ("0.5.9", "spec_accept_token_num", "spec_draft_token_num", "spec_accept_histogram"),
        ("0.5.23", "spec_num_correct_drafts", "spec_num_proposed_drafts", "spec_correct_drafts_histogram"),
    ],
)
def test_a_speculative_simulator_reports_acceptance_as_its_release_does(
    version: str, accepted_key: str, proposed_key: str, histogram_key: str
) -> None:
    with SimulatorThread(time_scale=2000, health_min_s=0.05, sglang_version=version) as plain:
        assert not [k for k in _generate(plain.url)["meta_info"] if k.startswith("spec_")], "only when speculative"
        args = requests.get(f"{plain.url}/server_info", timeout=10).json()
        assert args["speculative_algorithm"] is None and isinstance(args["random_seed"], int)
    options = {"speculative_algorithm": "EAGLE3", "speculative_accept_rate": 0.6}
    with SimulatorThread(time_scale=2000, health_min_s=0.05, sglang_version=version, **options) as spec:
        out = _generate(spec.url)
        again = _generate(spec.url)
        info = requests.get(f"{spec.url}/server_info", timeout=10).json()
    meta, ids = out["meta_info"], out["output_ids"]
    keys = [k for k in meta if k.startswith("spec_")]
    names = [accepted_key, proposed_key, "spec_verify_ct", histogram_key]
    assert keys == ["spec_accept_rate", "spec_accept_length", *names], "SGLang's keys, in its order"
    assert list(meta).index("spec_accept_rate") == list(meta).index("e2e_latency") + 1, "right after e2e_latency"
    assert meta["spec_accept_rate"] == meta[accepted_key] / meta[proposed_key]
    assert meta["spec_accept_length"] == meta["completion_tokens"] / meta["spec_verify_ct"]
    assert {k: again["meta_info"][k] for k in keys} == {k: meta[k] for k in keys}, "the same output, the same figures"
    want = figures(ids, 4, 0.6)
    got = (meta["spec_verify_ct"], meta[accepted_key], meta[histogram_key])
    assert got == (want.verify_ct, want.accepted, want.histogram)
    launched = [info[f"speculative_{k}"] for k in ("algorithm", "num_steps", "eagle_topk", "num_draft_tokens")]
    assert launched == ["EAGLE3", 3, 1, 4], "SGLang's automatic choice, reported as it resolved it"
    assert info["internal_states"][0]["avg_spec_accept_length"] > 1


def test_the_worker_reads_both_releases_acceptance_figures() -> None:
    for version in ("0.5.9", "0.5.23"):
        options = {"sglang_version": version, "speculative_algorithm": "EAGLE"}
        with SimulatorThread(time_scale=2000, health_min_s=0.05, **options) as s:
            out = _generate(s.url)
        gen = parse_response(out, "r1", 300)
        row = {"completion_tokens": gen.completion_tokens, **{c: getattr(gen, c) for c in SPEC_COLUMNS}}
        _assert_consistent(row)
    with SimulatorThread(time_scale=2000, health_min_s=0.05) as plain:
        gen = parse_response(_generate(plain.url), "r1", 300)
    assert all(getattr(gen, c) is None for c in SPEC_COLUMNS)


def test_the_launch_record_keeps_every_argument_but_secrets_and_names_the_configuration() -> None:
    model = {"model_path": "/models/k25", "weight_version": "default"}
    base = {"model_path": "/models/k25", "tp_size": 8, "port": 30000, "random_seed": 1, "version": "0.5.9"}
    base |= {"api_key": "sk-secret", "internal_states": [{"last_gen_throughput": 3.0}], "status": "ready"}
    args, digest = launch_record(model, base)
    assert args["api_key"] == REDACTED and "internal_states" not in args and "version" not in args
    assert args["port"] == 30000 and args["random_seed"] == 1, "the instance's own arguments are recorded"
    same = launch_record(model, {**base, "port": 30001, "random_seed": 99, "internal_states": []})[1]
    assert same == digest, "another host, port or drawn seed is the same configuration"
    assert launch_record(model, {**base, "tp_size": 4})[1] != digest
    assert launch_record(model, {**base, "version": "0.5.23"})[1] != digest
    assert launch_record({**model, "weight_version": "v2"}, base)[1] != digest
    info = parse_server_info(model, base)
    assert info.config_digest == digest and info.launch_args["tp_size"] == 8


# -- the worker's hook --------------------------------------------------------------------------------------------
def test_the_hook_records_a_configuration_once_before_its_rows_and_stamps_them(tmp_path: Path) -> None:
    model = {"model_path": str(tmp_path / "model"), "weight_version": "default"}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"architectures": ["X"]}')
    first = parse_server_info(model, {"tp_size": 8, "version": "0.5.9", "speculative_algorithm": "EAGLE3"})
    second = parse_server_info(model, {"tp_size": 4, "version": "0.5.9"})
    spec = SimpleNamespace(
        sampling_params={"temperature": 1.0, "sampling_seed": 7}, dataset_sampling={}, tokenizer="/tok",
        tokenizer_fingerprint="fp", chat_template_hash="th", expected_model=None, record=None, generation="g1",
    )  # fmt: skip

    class Jobs:
        async def get(self, job: str) -> Any:
            return spec

    loc = layout.locate(str(tmp_path / "out"))
    recorder = ProvenanceRecorder(loc, Jobs(), "w1", "http://127.0.0.1:30000")  # type: ignore[arg-type]
    gate = SimpleNamespace(info=first, known={first.config_digest: first, second.config_digest: second})
    recorder.gate = gate  # type: ignore[assignment]
    rows = [{"prompt_id": "a", "server_config": None}, {"prompt_id": "b", "server_config": second.config_digest}]
    asyncio.run(recorder.before_write(CommitGroup("job", "ds", rows)))
    assert rows[0]["server_config"] == first.config_digest, "a row built without one gets the current server's"
    records = read_provenance(loc, "job")
    assert sorted(r["server_config"] for r in records) == sorted([first.config_digest, second.config_digest])
    spec_record = next(r for r in records if r["server_config"] == first.config_digest)
    assert spec_record["server"]["highlights"]["speculative_algorithm"] == "EAGLE3"
    files = spec_record["model_config"]["files"]
    assert spec_record["model_config"]["read"] and files["config.json"].startswith("sha256:"), "the worker read it"
    assert spec_record["job_facts"]["sampling_seed"] == 7 and spec_record["thinkfleet"]["version"]
    where = tmp_path / "out" / "job" / "_provenance"
    before = sorted((p.name, p.stat().st_mtime_ns) for p in where.iterdir())
    asyncio.run(recorder.before_write(CommitGroup("job", "ds", [{"prompt_id": "c", "server_config": None}])))
    write_provenance(loc, "job", spec_record)  # the same record again (another life of the worker): no new file
    assert sorted((p.name, p.stat().st_mtime_ns) for p in where.iterdir()) == before, "recorded once"


# -- rows from before records were kept ---------------------------------------------------------------------------
def test_a_job_without_records_says_so_in_report_and_export(tmp_path: Path) -> None:
    PartWriter(str(tmp_path), "w0").write("old", "ds", [make_row(f"p-{i}", job="old") for i in range(5)])
    settings = Settings(output_uri=str(tmp_path))
    summary, _ = report_job(settings, "old")
    assert summary["servers"] == [{"server_config": None, "workers": [], "rows": 5}]
    assert summary["speculative"] is None
    out = tmp_path / "old.jsonl"
    export_job(settings, "old", "specforge", str(out))
    sidecar = json.loads(Path(str(out) + SIDECAR_SUFFIX).read_text())
    assert sidecar["servers"] == summary["servers"] and sidecar["export"]["rows"] == 5
    assert "no provenance records" in sidecar["note"]


# -- end to end ---------------------------------------------------------------------------------------------------
def _run_worker(name: str, settings: Settings, sim: str, client: redis.Redis, logs: Path, tasks: list[Any], done: int):
    worker = WorkerProcess(name, fast_env(settings, sim, max_inflight=4), logs).start()
    try:
        worker.wait_ready(client, settings.keys)
        send_tasks(settings, tasks)
        wait_until(
            lambda: job_progress(client, settings.keys, "prov")["done"] == done,
            180,
            what=f"{done} rows",
            explain=lambda: worker.tail(),
        )
    finally:
        worker.terminate()


def test_each_server_is_recorded_reported_and_exported_and_rows_carry_acceptance(
    redis_url: str, tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    _, tasks = register_ids(settings, "prov", make_prompts(16, seed=11))
    # Given two servers launched differently, each the one server of its worker, and half the job for each
    with simulator(logs, *FAST, *SPECULATIVE) as fast_spec:
        _run_worker("wa", settings, fast_spec, client, logs, tasks[:8], 8)
    with simulator(logs, *FAST, *PLAIN) as plain:
        _run_worker("wb", settings, plain, client, logs, tasks[8:], 16)

    # Then the job holds one record per server, each with its arguments, version and weights
    loc = layout.locate(settings.output_uri)
    records = {r["worker"]: r for r in read_provenance(loc, "prov")}
    assert set(records) == {"wa", "wb"}
    a, b = records["wa"], records["wb"]
    assert (a["server"]["version"], b["server"]["version"]) == ("0.5.9", "0.5.23")
    assert (
        a["server"]["launch_args"]["speculative_algorithm"] == "EAGLE3" and a["server"]["launch_args"]["tp_size"] == 8
    )
    assert a["server"]["launch_args"]["speculative_draft_model_path"] == "/models/k25-eagle3"
    assert b["server"]["launch_args"]["quantization"] == "fp8" and b["server"]["launch_args"]["tp_size"] == 4
    assert (a["server"]["model_info"]["weight_version"], b["server"]["model_info"]["weight_version"]) == ("w-a", "w-b")
    assert a["server_config"] != b["server_config"]
    assert a["job_facts"]["sampling_seed"] == 7 and a["job_facts"]["tokenizer_fingerprint"] == "test-ids"
    assert a["thinkfleet"]["version"] and a["job"] == "prov"

    # And each row names its server, with the acceptance figures where the server decoded speculatively
    rows = read_committed(settings.output_uri, "prov").to_pylist()
    assert len(rows) == 16
    by_worker = {w: [r for r in rows if r["worker"] == w] for w in ("wa", "wb")}
    assert {r["server_config"] for r in by_worker["wa"]} == {a["server_config"]}
    assert {r["server_config"] for r in by_worker["wb"]} == {b["server_config"]}
    for row in by_worker["wa"]:
        _assert_consistent(row)
    assert all(r[c] is None for r in by_worker["wb"] for c in SPEC_COLUMNS), "null without speculative decoding"

    # And `producer report` names both servers, their versions and launch arguments — also with Redis gone
    client.flushdb()
    env = {**cli_env(settings), "COLUMNS": "200"}
    report = subprocess.run(
        [sys.executable, "-m", "producer.cli", "report", "prov"], env=env, capture_output=True, text=True, timeout=120
    )
    assert report.returncode == 0, report.stderr
    text = report.stdout
    for fact in (a["server_config"], b["server_config"], "SGLang 0.5.9", "SGLang 0.5.23", "EAGLE3", "fp8", "w-a"):
        assert fact in text, f"{fact!r} not in the report:\n{text}"
    assert "speculative decoding" in text and "accept rate" in text and "wa on" in text
    summary = json.loads(
        subprocess.run(
            [sys.executable, "-m", "producer.cli", "report", "prov", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
    )
    assert {s["server_config"]: s["rows"] for s in summary["servers"]} == {a["server_config"]: 8, b["server_config"]: 8}
    assert summary["speculative"]["rows"] == 8 and 0 < summary["speculative"]["accept_rate"] < 1

    # And every export writes the same provenance beside its rows
    out = tmp_path / "prov-eagle3.jsonl"
    export_job(settings, "prov", "specforge", str(out))
    sidecar = json.loads(Path(str(out) + SIDECAR_SUFFIX).read_text())
    servers = {s["server_config"]: s for s in sidecar["servers"]}
    assert set(servers) == {a["server_config"], b["server_config"]}
    assert servers[a["server_config"]]["launch_args"]["speculative_algorithm"] == "EAGLE3"
    assert servers[b["server_config"]]["sglang_version"] == "0.5.23"
    assert sidecar["job_facts"]["chat_template_hash"] == "test-ids" and sidecar["export"]["rows"] == 16
    shards = tmp_path / "shards"
    export_job(settings, "prov", "eagle3", str(shards), shard_rows=10)
    assert json.loads((shards / DIRECTORY_SIDECAR).read_text())["servers"] == sidecar["servers"]
    assert pq.read_table(str(shards)).num_rows == 16, "the directory's readers skip the sidecar"
    assert not os.path.exists(str(shards) + SIDECAR_SUFFIX)
