"""``--logprobs K``: the request fields, SGLang 0.5.9's response shapes (``convert_logprob_style`` →
``detokenize_logprob_tokens``: triples ``[logprob, token_id, text|null]``), the simulator's answer, and an
end-to-end job whose stored rows carry aligned logprob columns (and a job without, null columns)."""

from __future__ import annotations

import asyncio
import itertools
import math
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import redis
from aiohttp.test_utils import TestClient, TestServer

from sglang_sim.config import SimConfig
from sglang_sim.content import expected_generation, expected_logprobs
from sglang_sim.testing import create_app
from storage.reader import read_committed
from storage.schema import OUTPUT_LOGPROBS, SCHEMA, SCHEMA_VERSION, TOP_LOGPROB_IDS, TOP_LOGPROBS, rows_to_table
from testing.fleet import WorkerProcess, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, make_prompts, simulator, submit_ids
from testing.rows import make_row
from thinkfleet.state.job import JobRecord
from workers.sglang import LOGPROBS_KEY, ServerFault, build_request, parse_response

VOCAB = 163840


def _answer(ids: list[int], meta_extra: dict[str, Any]) -> dict[str, Any]:
    meta = {
        "id": "r1",
        "finish_reason": {"type": "stop", "matched": ids[-1]},
        "prompt_tokens": 3,
        "weight_version": "default",
        "total_retractions": 0,
        **meta_extra,
        "completion_tokens": len(ids),
        "cached_tokens": 0,
    }
    return {"text": "", "output_ids": ids, "meta_info": meta}


# -- the request --------------------------------------------------------------------------------------
def test_request_asks_for_output_logprobs_only_when_the_job_does() -> None:
    plain = build_request([1, 2], {"max_new_tokens": 8}, "r")
    assert not {"return_logprob", "top_logprobs_num", "logprob_start_len"} & set(plain)
    body = build_request([1, 2], {"max_new_tokens": 8, LOGPROBS_KEY: 5}, "r")
    assert body["return_logprob"] is True and body["top_logprobs_num"] == 5
    assert body["logprob_start_len"] == -1 and body["return_text_in_logprobs"] is False
    assert LOGPROBS_KEY not in body["sampling_params"], "ours, never an SGLang sampling param"


# -- parsing both shapes ------------------------------------------------------------------------------
def test_parse_chosen_logprobs_without_top_k() -> None:
    ids = [11, 12, 163586]
    data = _answer(
        ids,
        {
            "input_token_logprobs": [[None, 3, None]],
            "output_token_logprobs": [[-0.5, 11, None], [-1.25, 12, None], [None, 163586, None]],
        },
    )
    gen = parse_response(data, "r1", 8, logprobs=0)
    assert gen.output_logprobs == [-0.5, -1.25, -math.inf], "orjson writes -inf as null"
    assert gen.top_logprob_ids is None and gen.top_logprobs is None


def test_parse_top_k_triples_and_text() -> None:
    ids = [11, 12]
    data = _answer(
        ids,
        {
            "output_token_logprobs": [[-0.5, 11, "a"], [-1.0, 12, "b"]],
            "input_top_logprobs": [None],
            "output_top_logprobs": [
                [[-0.5, 11, "a"], [-2.0, 40, "x"]],
                [[-0.25, 41, "y"], [-1.0, 12, "b"]],
            ],
        },
    )
    for k in (2, None):  # None: the client did not say; read what is there
        gen = parse_response(data, "r1", 8, logprobs=k)
        assert gen.output_logprobs == [-0.5, -1.0]
        assert gen.top_logprob_ids == [[11, 40], [41, 12]]
        assert gen.top_logprobs == [[-0.5, -2.0], [-0.25, -1.0]]


def test_no_logprobs_in_the_answer_reads_none() -> None:
    gen = parse_response(_answer([5, 6], {}), "r1", 8)
    assert gen.output_logprobs is None and gen.top_logprob_ids is None and gen.top_logprobs is None


@pytest.mark.parametrize(
    "extra",
    [
        {},  # asked, none came
        {"output_token_logprobs": [[-0.5, 11, None]]},  # one short
        {"output_token_logprobs": [[-0.5, 11, None], [-0.5, 99, None]]},  # not for output_ids[1]
        {"output_token_logprobs": [[-0.5, 11, None], ["x", 12, None]]},  # not a number
        {"output_token_logprobs": [[-0.5, 11, None], [-0.5, 12, None]], "output_top_logprobs": [[]]},  # top short
    ],
)
def test_misaligned_logprobs_are_a_server_fault(extra: dict[str, Any]) -> None:
    with pytest.raises(ServerFault):
        parse_response(_answer([11, 12], extra), "r1", 8, logprobs=2)


def test_misaligned_logprobs_are_a_fault_even_unasked() -> None:
    with pytest.raises(ServerFault):
        parse_response(_answer([11, 12], {"output_token_logprobs": [[-0.5, 11, None]]}), "r1", 8)


# -- the simulator ------------------------------------------------------------------------------------
def _sim_post(body: dict[str, Any], version: str = "0.5.9") -> tuple[int, dict[str, Any]]:
    async def go() -> tuple[int, dict[str, Any]]:
        app = create_app(SimConfig.from_flat(time_scale=1000, sglang_version=version))
        async with TestClient(TestServer(app)) as client:
            resp = await client.post("/generate", json=body)
            return resp.status, await resp.json()

    return asyncio.run(go())


@pytest.mark.parametrize("k", [0, 5])
def test_simulator_answers_in_sglang_shape(k: int) -> None:
    prompt = [100, 200, 300, 163606]
    params = {"max_new_tokens": 64, "stop_token_ids": [163586], "sampling_seed": 3}
    body = build_request(prompt, {**params, LOGPROBS_KEY: k}, "rid-1")
    status, data = _sim_post(body)
    assert status == 200, data
    meta, ids = data["meta_info"], data["output_ids"]
    keys = list(meta)
    assert keys.index("output_token_logprobs") < keys.index("completion_tokens"), "_handle_batch_output's order"
    assert meta["input_token_logprobs"] == [[None, 163606, None]], "logprob_start_len -1: the last prompt id"
    chosen, top = expected_logprobs(prompt, 3, ids, k, VOCAB)
    assert meta["output_token_logprobs"] == [[v, t, None] for v, t in zip(chosen, ids, strict=True)]
    if k:
        assert meta["input_top_logprobs"] == [None]
        assert top is not None
        assert meta["output_top_logprobs"] == [[[v, t, None] for v, t in alts] for alts in top]
        assert all(len(alts) == k for alts in meta["output_top_logprobs"])
        assert all(a[0] >= b[0] for alts in meta["output_top_logprobs"] for a, b in itertools.pairwise(alts))
    else:
        assert "output_top_logprobs" not in meta
    gen = parse_response(data, "rid-1", 64, logprobs=k)
    assert gen.output_ids == expected_generation(prompt, params).output_ids
    assert gen.output_logprobs == chosen


def test_simulator_without_return_logprob_has_no_logprob_keys() -> None:
    status, data = _sim_post(build_request([1, 2, 3], {"max_new_tokens": 16}, "r"))
    assert status == 200 and not any("logprob" in k for k in data["meta_info"])


# -- storage ------------------------------------------------------------------------------------------
def test_schema_columns_and_old_parts_read_back_null(tmp_path: Path) -> None:
    from storage import layout
    from storage.writer import PartWriter

    assert int(SCHEMA_VERSION) >= 3  # 4: + the --turns all columns
    for name in (OUTPUT_LOGPROBS, TOP_LOGPROB_IDS, TOP_LOGPROBS):
        assert SCHEMA.field(name).nullable
    writer = PartWriter(str(tmp_path), "w1")
    new = make_row("new", dataset="d")
    n = len(new["output_ids"])
    new.update(output_logprobs=[-0.5] * n, top_logprob_ids=[[1, 2]] * n, top_logprobs=[[-0.5, -1.5]] * n)
    writer.write("job", "d", [new, make_row("plain", dataset="d")])
    old = rows_to_table([make_row("old", dataset="d")]).drop_columns([OUTPUT_LOGPROBS, TOP_LOGPROB_IDS, TOP_LOGPROBS])
    old = old.replace_schema_metadata({b"thinkfleet.schema_version": b"2"})  # as a part of version 2 says
    pq.write_table(old, layout.locate(str(tmp_path)).path(writer.part_name("job", "d")))
    got = {r["prompt_id"]: r for r in read_committed(str(tmp_path), "job").to_pylist()}
    assert got["new"][OUTPUT_LOGPROBS] == [-0.5] * n and got["new"][TOP_LOGPROBS][0] == [-0.5, -1.5]
    for pid in ("plain", "old"):
        assert got[pid][OUTPUT_LOGPROBS] is None and got[pid][TOP_LOGPROB_IDS] is None
        assert got[pid][TOP_LOGPROBS] is None


# -- end to end ---------------------------------------------------------------------------------------
def test_job_with_logprobs_stores_aligned_columns(redis_url: str, tmp_path: Path) -> None:
    """A job with ``--logprobs 5`` and one without, through a real worker against the simulator: the
    first's rows carry the simulator's exact values, aligned with output_ids; the second's are null."""
    (tmp_path / "logs").mkdir()
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    prompts = make_prompts(12, seed=5)
    with simulator(tmp_path / "logs", "--time-scale", "400", "--sglang-version", "0.5.9") as sim:
        worker = WorkerProcess("w1", fast_env(settings, sim), tmp_path / "logs").start()
        try:
            worker.wait_ready(client, settings.keys)
            with_lp = submit_ids(settings, "lp", prompts, max_new_tokens=256, logprobs=5)
            plain = submit_ids(settings, "plain", prompts, max_new_tokens=256)
            for job in ("lp", "plain"):
                wait_until(lambda job=job: job_progress(client, settings.keys, job)["done"] == 12, 120, what=job)
        finally:
            worker.terminate()
    record = JobRecord.load(client, settings.keys, "lp")
    assert record is not None and record.logprobs == 5
    seed = int(with_lp.sampling_params["sampling_seed"])  # type: ignore[call-overload]
    cols = ["prompt_id", "output_ids", OUTPUT_LOGPROBS, TOP_LOGPROB_IDS, TOP_LOGPROBS]
    rows = read_committed(settings.output_uri, "lp", columns=cols).to_pylist()
    assert len(rows) == 12
    for row in rows:
        ids = row["output_ids"]
        chosen, top = expected_logprobs(prompts[row["prompt_id"]], seed, ids, 5, VOCAB)
        assert top is not None
        assert len(row[OUTPUT_LOGPROBS]) == len(ids) == len(row[TOP_LOGPROBS]) == len(row[TOP_LOGPROB_IDS])
        assert row[OUTPUT_LOGPROBS] == chosen, "float32 values stored exactly"
        assert row[TOP_LOGPROB_IDS] == [[t for _, t in alts] for alts in top]
        assert row[TOP_LOGPROBS] == [[v for v, _ in alts] for alts in top]
    assert plain.sampling_params.get(LOGPROBS_KEY) is None
    for row in read_committed(settings.output_uri, "plain", columns=cols).to_pylist():
        assert row[OUTPUT_LOGPROBS] is None and row[TOP_LOGPROB_IDS] is None and row[TOP_LOGPROBS] is None
