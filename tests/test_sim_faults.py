"""Faults on demand: 503s, dropped connections, hangs, outages, a full queue, a warm-up (real HTTP)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import requests

from sglang_sim.errors import QUEUE_FULL_MESSAGE
from sglang_sim.testing import SimulatorThread, run_simulator_process

QUEUE_FULL_BODY = {"object": "error", "message": QUEUE_FULL_MESSAGE, "type": "503", "param": None, "code": 503}
LONG = {"max_new_tokens": 100_000, "ignore_eos": True}


def generate(url: str, body: dict[str, Any], timeout_s: float = 30.0) -> requests.Response:
    return requests.post(f"{url}/generate", json=body, timeout=timeout_s)


def stats(url: str) -> dict[str, Any]:
    return requests.get(f"{url}/control/stats", timeout=10).json()


def eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.02)


def in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except Exception as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def test_503_fault_answers_sglangs_queue_full_body_before_any_work() -> None:
    with SimulatorThread(time_scale=1000, fault_503_rate=1.0) as sim:
        resp = generate(sim.url, {"input_ids": [1, 2, 3], "rid": "r"})
        counts = stats(sim.url)

    assert (resp.status_code, resp.json()) == (503, QUEUE_FULL_BODY)
    assert counts["faults"] == {"503": 1} and counts["by_status"] == {"503": 1}
    assert counts["generation_tokens_total"] == 0 and counts["rids"] == {"r": 1}


def statuses(url: str, rids: list[str]) -> dict[str, int]:
    body = {"input_ids": [7, 8], "sampling_params": {"max_new_tokens": 2}}
    with requests.Session() as session:
        return {rid: session.post(f"{url}/generate", json={**body, "rid": rid}, timeout=10).status_code for rid in rids}


def test_fault_choice_is_reproducible_per_seed_whatever_the_arrival_order() -> None:
    rids = [f"p{i}" for i in range(40)]
    with SimulatorThread(time_scale=1000, fault_503_rate=0.5, fault_seed=11) as sim:
        first = statuses(sim.url, rids)
        retried = statuses(sim.url, rids)  # a retry of the same rid draws afresh
    with SimulatorThread(time_scale=1000, fault_503_rate=0.5, fault_seed=11) as sim:
        reversed_order = statuses(sim.url, rids[::-1])
    with SimulatorThread(time_scale=1000, fault_503_rate=0.5, fault_seed=12) as sim:
        other_seed = statuses(sim.url, rids)

    assert first == reversed_order
    assert first != other_seed and first != retried
    assert 8 <= list(first.values()).count(503) <= 32


def test_runtime_fault_changes_via_control_endpoint() -> None:
    with SimulatorThread(time_scale=1000) as sim:
        assert generate(sim.url, {"input_ids": [1]}).status_code == 200
        changed = requests.post(f"{sim.url}/control/faults", json={"fault_503_rate": 1.0}, timeout=10).json()
        assert changed["fault_503_rate"] == 1.0
        assert generate(sim.url, {"input_ids": [1]}).status_code == 503
        bad = requests.post(f"{sim.url}/control/faults", json={"fault_503_rate": 2}, timeout=10)
        assert bad.status_code == 400
        assert requests.get(f"{sim.url}/control/faults", timeout=10).json()["fault_503_rate"] == 1.0


def test_drop_fault_closes_the_connection_mid_body_after_the_work_is_done() -> None:
    params = {"max_new_tokens": 300, "ignore_eos": True}
    with SimulatorThread(time_scale=1000, fault_drop_rate=1.0) as sim:
        with pytest.raises(requests.exceptions.ChunkedEncodingError):
            generate(sim.url, {"input_ids": [1, 2], "sampling_params": params})
        after_plain = stats(sim.url)
        with pytest.raises(requests.exceptions.ChunkedEncodingError):
            body = {"input_ids": [3], "sampling_params": params, "stream": True}
            requests.post(f"{sim.url}/generate", json=body, timeout=10).raise_for_status()
        counts = stats(sim.url)

    assert after_plain["completed"] == 1 and after_plain["generation_tokens_total"] == 300  # the GPU did the work
    assert counts["by_status"] == {"drop": 2} and counts["faults"] == {"drop": 2}


def test_hang_fault_never_answers_and_frees_the_rid_when_the_client_gives_up() -> None:
    with SimulatorThread(time_scale=1000, fault_hang_rate=1.0) as sim:
        with pytest.raises(requests.exceptions.ReadTimeout):
            generate(sim.url, {"input_ids": [1, 2], "rid": "stuck"}, timeout_s=0.3)
        eventually(lambda: "stuck" not in sim.call(lambda s: set(s.inflight)))
        requests.post(f"{sim.url}/control/faults", json={"fault_hang_rate": 0.0}, timeout=10)
        retry = generate(sim.url, {"input_ids": [1, 2], "rid": "stuck"})
        counts = stats(sim.url)

    assert retry.status_code == 200
    assert counts["faults"] == {"hang": 1} and counts["rids"] == {"stuck": 2}


def test_outage_drops_in_flight_calls_and_answers_503_until_it_ends() -> None:
    with SimulatorThread(time_scale=2) as sim:
        thread, box = in_background(lambda: generate(sim.url, {"input_ids": [1], "sampling_params": LONG}))
        eventually(lambda: stats(sim.url)["running"] == 1)
        requests.post(f"{sim.url}/control/outage", json={"duration_s": 300}, timeout=10)
        thread.join(10)

        assert isinstance(box.get("error"), requests.exceptions.ConnectionError)
        assert requests.get(f"{sim.url}/health", timeout=10).status_code == 503
        assert requests.get(f"{sim.url}/health_generate", timeout=10).status_code == 503
        down = generate(sim.url, {"input_ids": [1]})
        assert down.status_code == 503 and down.json()["code"] == 503
        requests.post(f"{sim.url}/control/outage", json={"duration_s": 0}, timeout=10)  # back up
        assert requests.get(f"{sim.url}/health", timeout=10).status_code == 200
        assert generate(sim.url, {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}).status_code == 200
        counts = stats(sim.url)
    assert counts["faults"]["outage"] == 1 and counts["faults"]["outage_dropped"] == 1
    assert counts["running"] == 0  # the dropped request no longer holds a slot


def test_outage_in_abort_mode_finishes_in_flight_requests_with_abort() -> None:
    with SimulatorThread(time_scale=2) as sim:
        thread, box = in_background(lambda: generate(sim.url, {"input_ids": [1], "sampling_params": LONG}))
        eventually(lambda: stats(sim.url)["running"] == 1)
        requests.post(f"{sim.url}/control/outage", json={"duration_s": 0.2, "mode": "abort"}, timeout=10)
        thread.join(10)

    out = box["result"].json()
    assert box["result"].status_code == 200
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) == out["meta_info"]["completion_tokens"]


def test_a_full_waiting_queue_answers_503() -> None:
    with SimulatorThread(time_scale=2, max_running_requests=1, max_queued_requests=1) as sim:
        running, _ = in_background(lambda: generate(sim.url, {"input_ids": [1], "sampling_params": LONG}))
        eventually(lambda: stats(sim.url)["running"] == 1)
        waiting, box = in_background(lambda: generate(sim.url, {"input_ids": [2], "sampling_params": LONG}))
        eventually(lambda: stats(sim.url)["waiting"] == 1)

        rejected = generate(sim.url, {"input_ids": [3]})
        metrics = requests.get(f"{sim.url}/metrics", timeout=10).text
        requests.post(f"{sim.url}/abort_request", json={"abort_all": True}, timeout=10)
        running.join(10)
        waiting.join(10)

    assert (rejected.status_code, rejected.json()) == (503, QUEUE_FULL_BODY)
    assert 'sglang:num_queue_reqs{model_name="moonshotai/Kimi-K2.5"} 1.0' in metrics
    assert box["result"].json()["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}


def test_stats_prove_which_rids_reached_the_server() -> None:
    with SimulatorThread(time_scale=1000) as sim:
        generate(sim.url, {"input_ids": [1], "rid": "seen", "sampling_params": {"max_new_tokens": 1}})
        generate(sim.url, {"input_ids": [[1], [2]], "rid": "batch", "sampling_params": {"max_new_tokens": 1}})
        counts = stats(sim.url)
        without_rids = requests.get(f"{sim.url}/control/stats?rids=0", timeout=10).json()

    assert counts["rids"] == {"seen": 1, "batch_0": 1, "batch_1": 1}
    assert "never-sent" not in counts["rids"]
    assert (counts["generate_calls"], counts["generate_items"], counts["completed"]) == (2, 3, 3)
    assert "rids" not in without_rids and without_rids["distinct_rids"] == 3


def test_cli_warmup_scheduled_outage_and_clean_sigterm() -> None:
    args = ("--time-scale", "1000", "--warmup-s", "1.5", "--outage-at-s", "2.5", "--outage-duration-s", "1")
    args += ("--health-min-s", "0.1")
    with run_simulator_process(*args) as proc:

        def health() -> int:
            return requests.get(f"{proc.url}/health", timeout=10).status_code

        assert health() == 503  # still warming up
        starting = generate(proc.url, {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}, timeout_s=10)
        assert starting.status_code == 200  # SGLang serves /generate during its warm-up
        eventually(lambda: health() == 200)
        eventually(lambda: health() == 503)  # the scheduled outage
        eventually(lambda: health() == 200)
        exit_code = proc.stop()
        log = proc.log()

    assert exit_code == 0
    assert "sglang-sim serving moonshotai/Kimi-K2.5" in log and "outage for 1.0 s" in log
