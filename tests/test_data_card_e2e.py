"""Quality flags and the data card end to end (issue 46): a real worker runs a job on a simulator whose outputs
include degenerate loops and empty answers at a set share; every flag is counted exactly (against what the
simulator says it drew) — live by ``producer status``, which raises the flag alarm, and from storage by ``verify``
—, an export with ``--drop-flag`` holds exactly the rest, and the card's counts equal ``verify``'s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from producer.quality_live import flags_so_far
from sglang_sim.content import ContentConfig, expected_generation
from storage.exports import export_job
from storage.report import report_job
from storage.verify import verify_job
from testing.fleet import WorkerProcess, job_progress, wait_until
from testing.harness import (
    STEADY_LEASE,
    fast_env,
    isolated_settings,
    make_prompts,
    producer_cli,
    simulator,
    submit_ids,
)

PROMPTS = 40
SHARES = {"loop_share": 0.25, "empty_answer_share": 0.2}


def test_flags_of_a_simulated_job_are_counted_exactly_and_the_card_agrees_with_verify(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a simulator that loops on a quarter of its outputs and answers nothing on a fifth
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    sim_args = ["--time-scale", "400", "--loop-share", "0.25", "--empty-answer-share", "0.2"]
    with simulator(tmp_path, *sim_args) as sim:
        worker = WorkerProcess("w1", fast_env(settings, sim, max_inflight=16, **STEADY_LEASE), tmp_path).start()
        try:
            worker.wait_ready(client, settings.keys)
            # When a job runs through it
            job = submit_ids(settings, "flags", make_prompts(PROMPTS, seed=46))
            wait_until(lambda: job_progress(client, settings.keys, "flags")["done"] == PROMPTS, 180, what="rows")
        finally:
            worker.terminate()

    # The simulator's own account of what it drew: the rows that must carry each flag.
    config = ContentConfig(**SHARES)
    drawn = {pid: expected_generation(ids, job.sampling_params, config) for pid, ids in job.prompts.items()}
    loops = {pid for pid, g in drawn.items() if g.degenerate == "loop"}
    empty = {pid for pid, g in drawn.items() if g.degenerate == "empty_answer" and g.finish_reason["type"] == "stop"}
    assert loops and empty, "the shares drew both kinds (else the seed proves nothing)"

    # Then status counted each flag live as the rows were finalized, and raised the flag alarm (45 % degenerate)
    quiet = json.loads(producer_cli(settings, "status", "flags", "--json", in_process=True).stdout)
    assert quiet["flag_alarm"] is None  # the defaults watch 100 rows first
    monkeypatch.setenv("THINKFLEET_ALARM_MIN_ROWS", "20")
    monkeypatch.setenv("THINKFLEET_ALARM_MISSING_SHARE", "0.2")
    st = json.loads(producer_cli(settings, "status", "flags", "--json", in_process=True).stdout)
    live = st["quality_flags_total"]  # (the harness' job record names no datasets: the job's counters)
    assert live["loop"] == len(loops) and live["empty_answer"] == len(empty)
    assert live["truncated"] == sum(1 for g in drawn.values() if g.finish_reason["type"] != "stop")
    per_dataset = flags_so_far(client, settings.keys, "flags", ["synthetic"])[
        "synthetic"
    ]  # what status shows per dataset
    assert per_dataset["loop"] == len(loops) and per_dataset["empty_answer"] == len(empty)
    assert st["flag_alarm"]["loop"] == len(loops) and "degenerate" in st["flag_alarm"]["message"]
    text = producer_cli(settings, "status", "flags", in_process=True).stdout
    assert "FLAG ALARM" in text

    # Then verify counts each flag exactly, and never fails on them
    report = verify_job(settings, "flags")
    assert report.ok, report
    assert report.quality_flags["loop"] == len(loops)
    assert report.quality_flags["empty_answer"] == len(empty)
    truncated = {pid for pid, g in drawn.items() if g.finish_reason["type"] != "stop"}
    assert report.quality_flags["truncated"] == len(truncated) and loops <= truncated

    # and an export leaving out loops and empty answers holds exactly the rest
    out = tmp_path / "clean.jsonl"
    result = export_job(settings, "flags", "eagle3", str(out), drop_flags=["loop", "empty_answer"])
    kept = {json.loads(line)["id"] for line in out.read_text().splitlines()}
    assert kept == set(job.prompts) - loops - empty
    assert result.skipped == {"loop": len(loops), "empty_answer": len(empty)}

    # and the data card says what verify says
    summary, files = report_job(settings, "flags", str(tmp_path / "report"))
    card = summary["card"]["datasets"]["synthetic"]
    assert card["submitted"] == PROMPTS and card["stored"] == PROMPTS and card["dead"] == {}
    assert card["flags"] == report.quality_flags
    text = Path(files[0]).read_text()
    assert text.startswith("# Data card: thinkfleet job `flags`") and "GPU-hours" in text
    assert summary["card"]["cost"]["gpu_hours"] > 0  # the simulator's record says tp 8: its GPUs are counted
    assert summary["card"]["cost"]["servers"][0]["gpus"] == 8
