"""``producer submit --turns all``: every assistant turn regenerated from the model's own earlier answers.

Given 3-turn conversations (no tools) submitted with the real CLI and the Kimi test tokenizer, two workers
against the simulator, one of them SIGKILLed between writing a part and finalizing it (the failpoint
``after_part_write=kill``: the orphan recovery must then also enqueue the next turn), then every turn of every
conversation is stored exactly once, byte-exact against the simulator, and turn i+1's ``input_ids`` are the
chat template's rendering of the conversation with the model's answers (decoded from the stored ids) for turns
0..i in place of the dataset's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import redis

from producer.render import load_tokenizer, render_ids
from sglang_sim.content import expected_generation
from storage.conversations import ToolMarkers, output_message
from storage.reader import raw_duplicates, read_committed
from testing.datasets import conversation_rows, write_jsonl
from testing.fleet import WorkerProcess, dead_letters, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, producer_cli, simulator
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet import failpoints
from thinkfleet.settings import Settings
from thinkfleet.state.job import JobRecord
from thinkfleet.turns import plan_conversation, turn_messages

if TYPE_CHECKING:
    from testing.services import RedisServer

CONVERSATIONS = 8
TURNS = 3


def _conversations(path: Path) -> Path:
    rows = conversation_rows(CONVERSATIONS, TURNS, 10, "You are a careful assistant.", reasoning="x")
    return write_jsonl(path, rows)


@dataclass
class MultiTurnJob:
    """A finished ``--turns all`` job (module-scoped: other modules import :func:`multiturn_job` to reuse it)."""

    settings: Settings
    client: redis.Redis
    job: str
    data: Path
    tok_dir: Path
    fp_dir: Path
    killed: WorkerProcess


def run_multiturn_job(redis_url: str, tmp_path: Path, job: str = "multi") -> MultiTurnJob:
    """Submit the 3-turn conversations with ``--turns all`` and run them to the end on two workers, one of
    them SIGKILLed between a part write and its finalize."""
    (tmp_path / "logs").mkdir()
    fp_dir = tmp_path / "failpoints"
    fp_dir.mkdir()
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    tok_dir = build_test_tokenizer(default_test_tokenizer_dir())
    data = _conversations(tmp_path / "chat.jsonl")
    total = CONVERSATIONS * TURNS
    with simulator(tmp_path / "logs", "--time-scale", "400") as sim:
        lease = {"lease_s": 3, "reaper_interval_s": 0.5}
        env = fast_env(settings, sim, max_inflight=4, **lease)
        doomed_env = {**env, failpoints.ENV: "after_part_write=kill", failpoints.DIR_ENV: str(fp_dir)}
        doomed_env.pop(failpoints.TIMES_ENV, None)
        # w1 alone until its first part write kills it, then w2: with both consuming from the start, w2 could take
        # every first turn (and, host-affine, every later one) before w1 wrote anything — the failpoint never fired
        # in one CI run of the quiet box.
        w1 = WorkerProcess("w1", doomed_env, tmp_path / "logs").start()
        w2 = WorkerProcess("w2", env, tmp_path / "logs")
        try:
            w1.wait_ready(client, settings.keys)
            submitted = producer_cli(
                settings, "submit", str(data), "--job", job, "--tokenizer", str(tok_dir), "--processes", "1",
                "--no-progress", "--max-new-tokens", "300", "--seed", "3", "--context-length", "131072",
                "--turns", "all", "--json",
                in_process=True,
            )  # fmt: skip
            assert submitted.returncode == 0, submitted.stderr
            wait_until((fp_dir / "failpoint-after_part_write-0").exists, 120, what="w1 killed after its part write")
            w2.start().wait_ready(client, settings.keys)
            wait_until(lambda: job_progress(client, settings.keys, job)["done"] == total, 180, what=f"{total} turns")
        finally:
            for w in (w1, w2):
                w.terminate()
    return MultiTurnJob(settings, client, job, data, Path(tok_dir), fp_dir, w1)


@pytest.fixture(scope="module")
def multiturn_job(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiTurnJob]:
    """One run of :func:`run_multiturn_job` per module (its own key prefix on the session's Redis)."""
    run = run_multiturn_job(redis_server.url(0), tmp_path_factory.mktemp("multiturn"))
    yield run
    run.client.close()


def test_turns_all_chains_every_turn_exactly_once_through_a_sigkill(multiturn_job: MultiTurnJob) -> None:
    run = multiturn_job
    settings, client, job, data, tok_dir, fp_dir, w1 = (
        run.settings, run.client, run.job, run.data, run.tok_dir, run.fp_dir, run.killed,
    )  # fmt: skip
    total = CONVERSATIONS * TURNS
    # The SIGKILL happened (between a part write and its finalize) and w1 is gone.
    assert (fp_dir / "failpoint-after_part_write-0").exists(), "the failpoint fired"
    assert not w1.alive()
    assert dead_letters(client, settings.keys, job) == {}
    assert raw_duplicates(settings.output_uri, job).num_rows == 0, "no turn stored twice"

    record = JobRecord.load(client, settings.keys, job)
    assert record is not None
    meta = json.loads(client.hget(settings.keys.job(job), "turns"))
    assert meta["mode"] == "all" and meta["conversations"] == CONVERSATIONS and meta["turns"] == total
    rows = {r["prompt_id"]: r for r in read_committed(settings.output_uri, job).to_pylist()}
    assert sorted(rows) == sorted(f"chat/c{c}/t{t}" for c in range(CONVERSATIONS) for t in range(TURNS))
    assert client.hlen(settings.keys.prompts(job)) == total, "each later turn joined the submitted set once"

    orphaned = [r for r in rows.values() if r["worker"] == "w1" and r["turn_index"] < TURNS - 1]
    assert orphaned, "the killed worker's part held a turn with a successor: the recovery enqueued it"

    tok = load_tokenizer(str(tok_dir))
    markers = ToolMarkers.of(record)
    source = [json.loads(line) for line in data.read_text().splitlines()]
    for c, conv_row in enumerate(source):
        conv = plan_conversation(conv_row["messages"])
        assert conv is not None
        answers = []
        for t in range(TURNS):
            row = rows[f"chat/c{c}/t{t}"]
            assert (row["conversation_id"], row["turn_index"], row["turn_count"]) == (f"chat/c{c}", t, TURNS)
            # The prompt: the template's rendering with the model's own answers for turns 0..t-1.
            want_prompt = render_ids(tok, turn_messages(conv, answers), None, record.chat_template_kwargs)
            assert row["input_ids"] == want_prompt, f"turn {t} of c{c} is not the template's rendering"
            # The output: byte-exact against the simulator.
            want = expected_generation(row["input_ids"], record.sampling_params)
            assert row["output_ids"] == want.output_ids
            answer = output_message(
                tok,
                row["output_ids"],
                (row["reasoning_start"], row["reasoning_end"]),
                (row["answer_start"], row["answer_end"]),
                [(s["start"], s["end"]) for s in row["tool_call_spans"]],
                markers,
            )
            assert "dataset's answer" not in answer["content"]
            answers.append(answer)
        # The dataset's answers are nowhere in the last prompt; the model's are.
        last = tok.decode(rows[f"chat/c{c}/t{TURNS - 1}"]["input_ids"])
        assert "the dataset's answer" not in last
        assert answers[0]["content"] in last and answers[1]["content"] in last
        # Kimi's template keeps reasoning only after the last plain assistant turn: not in later prompts.
        assert all(a["reasoning_content"] not in last for a in answers[:2] if len(a["reasoning_content"]) > 20)
