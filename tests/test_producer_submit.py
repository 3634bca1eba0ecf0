"""`producer submit`: the right ids reach the queue, once, all or nothing, and re-submits add only what is missing."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import msgpack
import pytest
import redis

from producer import render
from producer.job import JobRecord
from producer.submit import submit
from producer.submit_options import SubmitError, SubmitOptions
from testing.datasets import chat_rows, write_jsonl
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet import kimi
from thinkfleet.broker.keys import kombu_transport_options
from thinkfleet.message import PromptTask
from thinkfleet.settings import Settings


@pytest.fixture(scope="module")
def tok_dir() -> Path:
    return build_test_tokenizer(default_test_tokenizer_dir())


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> Settings:
    return Settings(redis_url=redis_url, output_uri=str(tmp_path / "out"))


def opts(paths: list[Path], tok_dir: Path, **kw) -> SubmitOptions:
    return SubmitOptions(
        paths=paths, job=kw.pop("job", "j"), tokenizer=str(tok_dir), processes=kw.pop("processes", 1), **kw
    )


def queued_tasks(client: redis.Redis, settings: Settings) -> list[PromptTask]:
    """Decode the queue like a worker would (consumption order: right to left)."""
    out = []
    for raw in reversed(client.lrange(settings.queue, 0, -1)):
        message = json.loads(raw)
        assert message["properties"]["body_encoding"] == "base64"
        args, _kwargs, _embed = msgpack.unpackb(base64.b64decode(message["body"]), raw=False)
        task = PromptTask.from_args(args)
        assert message["headers"]["id"] == task.task_id
        out.append(task)
    return out


def no_staging_left(client: redis.Redis) -> bool:
    return not client.keys("tf:job:*:staging:*")


def test_submit_enqueues_the_chat_template_ids_of_every_row(settings, redis_client, tok_dir, tmp_path) -> None:
    rows = chat_rows(40, words=30)
    path = write_jsonl(tmp_path / "alpha.jsonl", rows)
    report = submit(settings, opts([path], tok_dir, processes=2))
    assert report.enqueued == 40
    tasks = queued_tasks(redis_client, settings)
    assert [t.prompt_id for t in tasks] == [f"alpha/r{i}" for i in range(40)]
    tok = render.load_tokenizer(str(tok_dir))
    for task, row in zip(tasks, rows, strict=True):
        assert task.input_ids == render.render_ids(tok, row["messages"][:2], None, {"thinking": True})
        assert task.input_ids[-1] == kimi.THINK_START
        assert task.dataset == "alpha" and task.revision == 0
    assert no_staging_left(redis_client)


def test_job_record_carries_what_workers_need(settings, redis_client, tok_dir, tmp_path) -> None:
    path = write_jsonl(tmp_path / "alpha.jsonl", chat_rows(5, words=10))
    submit(
        settings,
        opts(
            [path],
            tok_dir,
            sampling={"max_new_tokens": 512, "seed": 7, "temperature": None},
            expected_model="/models/kimi",
        ),
    )
    record = JobRecord.load(redis_client, settings.keys, "j")
    assert record is not None
    assert record.sampling_params == {
        "max_new_tokens": 512,
        "temperature": 1.0,
        "top_p": 0.95,
        "top_k": -1,
        "min_p": 0.0,
        "stop_token_ids": [kimi.IM_END],
        "sampling_seed": 7,
    }
    assert (record.think_start_id, record.think_end_id) == (kimi.THINK_START, kimi.THINK_END)
    assert record.tool_section_begin_id == kimi.TOOL_CALLS_SECTION_BEGIN
    assert record.prompt_ends_with_think_start is True
    assert record.expected_model == "/models/kimi"
    assert record.datasets == {"alpha": 5} and record.prompts == 5
    assert len(record.tokenizer_fingerprint) == 16 and len(record.chat_template_hash) == 16
    assert redis_client.hlen(settings.keys.prompts("j")) == 5
    assert redis_client.hget(settings.keys.dataset_counters("j", "alpha"), "submitted") == b"5"
    # The workers' reader understands the same fields.
    from workers.jobs import JobSpec

    spec = JobSpec.from_record(JobRecord.from_hash(redis_client.hgetall(settings.keys.job("j"))))
    assert spec.max_new_tokens == 512 and spec.expected_model == "/models/kimi"
    assert spec.tokens.stop_token_ids == (kimi.IM_END,)


def test_a_second_identical_submit_enqueues_nothing(settings, redis_client, tok_dir, tmp_path) -> None:
    path = write_jsonl(tmp_path / "alpha.jsonl", chat_rows(30, words=10))
    assert submit(settings, opts([path], tok_dir)).enqueued == 30
    again = submit(settings, opts([path], tok_dir))
    assert again.enqueued == 0
    assert again.datasets["alpha"].already_queued == 30
    assert redis_client.llen(settings.queue) == 30


def store_rows(settings: Settings, job: str, dataset: str, prompt_ids: set[str]) -> None:
    """Commit rows to real storage, as a worker's group commit would."""
    from storage.writer import PartWriter
    from testing.rows import make_row

    rows = [make_row(pid, dataset=dataset, job=job) for pid in sorted(prompt_ids)]
    PartWriter(settings.output_uri, "w1").write(job, dataset, rows)


def test_resubmit_after_losing_the_queue_enqueues_exactly_what_storage_lacks(
    settings, redis_client, tok_dir, tmp_path
) -> None:
    path = write_jsonl(tmp_path / "alpha.jsonl", chat_rows(30, words=10))
    submit(settings, opts([path], tok_dir))
    stored = {f"alpha/r{i}" for i in range(0, 30, 3)}  # storage (the truth) holds 10 rows
    store_rows(settings, "j", "alpha", stored)
    redis_client.sadd(settings.keys.done("j"), "alpha/r0", "alpha/r1")  # r1: done in Redis too
    redis_client.delete(settings.queue)  # the queue is lost
    report = submit(settings, opts([path], tok_dir))
    missing = {f"alpha/r{i}" for i in range(30)} - stored - {"alpha/r1"}
    assert {t.prompt_id for t in queued_tasks(redis_client, settings)} == missing
    assert report.enqueued == len(missing) == 19
    # The done cache learns what storage holds.
    assert stored <= {m.decode() for m in redis_client.smembers(settings.keys.done("j"))}


def test_redis_lost_entirely_resubmit_rebuilds_the_job(settings, redis_client, tok_dir, tmp_path) -> None:
    path = write_jsonl(tmp_path / "alpha.jsonl", chat_rows(12, words=10))
    submit(settings, opts([path], tok_dir))
    store_rows(settings, "j", "alpha", {"alpha/r0", "alpha/r5"})
    redis_client.flushdb()
    report = submit(settings, opts([path], tok_dir))
    assert report.enqueued == 10
    assert JobRecord.load(redis_client, settings.keys, "j").prompts == 12
    from storage.manifest import read_submitted

    assert read_submitted(settings.output_uri, "j").num_rows == 12


def test_queued_running_and_dead_prompts_are_not_enqueued_again(settings, redis_client, tok_dir, tmp_path) -> None:
    path = write_jsonl(tmp_path / "alpha.jsonl", chat_rows(6, words=10))
    submit(settings, opts([path], tok_dir))
    raw = redis_client.lrange(settings.queue, 0, -1)
    redis_client.delete(settings.queue)
    # One message delivered to a worker (kombu's unacked hash), one back on the queue, one dead-lettered.
    unacked = kombu_transport_options(settings.key_prefix, settings.visibility_timeout_s)["unacked_key"]
    running = json.loads(raw[-1])
    redis_client.hset(unacked, "tag-1", json.dumps([running, "", settings.queue]))
    redis_client.lpush(settings.queue, raw[-2])
    redis_client.hset(settings.keys.dead("j"), "alpha/r2", json.dumps({"error_class": "context_overflow"}))
    report = submit(settings, opts([path], tok_dir))
    assert report.datasets["alpha"].already_queued == 2
    assert report.datasets["alpha"].dead == 1
    assert report.enqueued == 3
    assert {t.prompt_id for t in queued_tasks(redis_client, settings)} == {
        "alpha/r1",
        "alpha/r3",
        "alpha/r4",
        "alpha/r5",
    }


def test_messages_of_an_earlier_generation_do_not_count_as_queued(settings, redis_client, tok_dir, tmp_path) -> None:
    # Given a job whose Redis lost everything but one message a worker restored into the new, empty Redis
    # (its queue and unacked entries come back on reconnect), and the job's record is gone.
    path = write_jsonl(tmp_path / "alpha.jsonl", chat_rows(4, words=10))
    submit(settings, opts([path], tok_dir))
    before = JobRecord.load(redis_client, settings.keys, "j").generation
    survivor = redis_client.lrange(settings.queue, -1, -1)[0]
    unacked = kombu_transport_options(settings.key_prefix, settings.visibility_timeout_s)["unacked_key"]
    redis_client.delete(settings.queue, settings.keys.job("j"), *redis_client.keys("tf:job:j:*"))
    redis_client.hset(unacked, "tag-old", json.dumps([json.loads(survivor), "", settings.queue]))
    # When the same submit runs again, under a new generation (workers skip the old generation's message).
    report = submit(settings, opts([path], tok_dir))
    after = JobRecord.load(redis_client, settings.keys, "j").generation
    # Then every prompt has a message of the new generation: none is left to the stale one alone.
    assert after != before
    assert report.enqueued == 4 and report.datasets["alpha"].already_queued == 0
    tasks = queued_tasks(redis_client, settings)
    assert {t.prompt_id for t in tasks} == {f"alpha/r{i}" for i in range(4)}
    assert {t.generation for t in tasks} == {after}


def test_changed_content_is_detected_and_nothing_is_enqueued(settings, redis_client, tok_dir, tmp_path) -> None:
    rows = chat_rows(5, words=10)
    path = write_jsonl(tmp_path / "alpha.jsonl", rows)
    submit(settings, opts([path], tok_dir))
    redis_client.delete(settings.queue)
    rows[3]["messages"][1]["content"] = "a different question"
    write_jsonl(path, rows)
    with pytest.raises(SubmitError, match=r"alpha.jsonl:4: content changed .*alpha/r3"):
        submit(settings, opts([path], tok_dir))
    assert redis_client.llen(settings.queue) == 0 and no_staging_left(redis_client)
    report = submit(settings, opts([path], tok_dir, skip_invalid=True))
    assert report.changed == 1 and report.enqueued == 4


def test_bad_rows_fail_the_submit_before_anything_is_enqueued(settings, redis_client, tok_dir, tmp_path) -> None:
    path = write_jsonl(tmp_path / "alpha.jsonl", chat_rows(20, words=10))
    with path.open("a") as f:
        f.write('{"id": "x", "messages": [{"role": "user", "content": 3}]}\n{not json\n')
    with pytest.raises(SubmitError) as err:
        submit(settings, opts([path], tok_dir))
    text = str(err.value)
    assert "2 problem(s); nothing was enqueued" in text
    assert "alpha.jsonl:21: message 0 (user) has non-string content" in text
    assert "alpha.jsonl:22: not valid JSON" in text and "--skip-invalid" in text
    assert redis_client.llen(settings.queue) == 0 and no_staging_left(redis_client)
    assert JobRecord.load(redis_client, settings.keys, "j") is None


def test_skip_invalid_records_skipped_rows_in_the_job_record(settings, redis_client, tok_dir, tmp_path) -> None:
    path = write_jsonl(tmp_path / "alpha.jsonl", chat_rows(10, words=10))
    with path.open("a") as f:
        f.write('{"id": "x", "messages": [{"role": "assistant", "content": "no user"}]}\n')
    report = submit(settings, opts([path], tok_dir, skip_invalid=True))
    assert report.enqueued == 10
    record = JobRecord.load(redis_client, settings.keys, "j")
    assert record.skipped_count == 1
    assert record.skipped[0]["location"].endswith("alpha.jsonl:11")
    assert "no user turn" in record.skipped[0]["reason"]


def test_prompts_over_max_prompt_tokens_are_problems(settings, tok_dir, tmp_path) -> None:
    rows = chat_rows(3, words=10)
    rows[1]["messages"][1]["content"] = "word " * 400
    path = write_jsonl(tmp_path / "alpha.jsonl", rows)
    with pytest.raises(SubmitError, match=r"alpha.jsonl:2: prompt is \d+ tokens, over --max-prompt-tokens 200"):
        submit(settings, opts([path], tok_dir, max_prompt_tokens=200))


def test_an_unloadable_tokenizer_is_a_clear_error(settings, tmp_path) -> None:
    path = write_jsonl(tmp_path / "alpha.jsonl", chat_rows(2))
    with pytest.raises(SubmitError, match=r"(?s)cannot load tokenizer.*no such directory"):
        submit(settings, opts([path], tmp_path / "no-such-tokenizer"))
    with pytest.raises(SubmitError, match="cannot load tokenizer") as err:
        submit(settings, opts([path], Path("some-org/not-in-the-local-cache")))
    assert "submit never downloads" in str(err.value)


def test_samples_get_suffixed_ids_and_their_own_seeds(settings, redis_client, tok_dir, tmp_path) -> None:
    path = write_jsonl(tmp_path / "alpha.jsonl", chat_rows(2, words=10))
    report = submit(settings, opts([path], tok_dir, samples=3, sampling={"seed": 100}))
    assert report.enqueued == 6
    tasks = queued_tasks(redis_client, settings)
    assert [t.prompt_id for t in tasks][:3] == ["alpha/r0#0", "alpha/r0#1", "alpha/r0#2"]
    assert [t.sample_index for t in tasks][:3] == [0, 1, 2]
    assert [t.overrides for t in tasks][:3] == [{"sampling_seed": 100}, {"sampling_seed": 101}, {"sampling_seed": 102}]
    assert len({t.ids_blob for t in tasks[:3]}) == 1


def test_dry_run_reports_lengths_memory_and_wall_time_and_enqueues_nothing(
    settings, redis_client, tok_dir, tmp_path
) -> None:
    path = write_jsonl(tmp_path / "alpha.jsonl", chat_rows(20, words=40))
    report = submit(settings, opts([path], tok_dir, dry_run=True, hosts=4, server_tok_s=1000, mean_output_tokens=500))
    assert report.enqueued == 20  # would enqueue
    assert redis_client.dbsize() == 0
    assert report.lengths["count"] == 20 and report.lengths["min"] <= report.lengths["median"] <= report.lengths["max"]
    assert report.estimated_redis_bytes > report.prompt_tokens_enqueued  # compact, but not free
    assert report.projected_wall_s == pytest.approx(20 * 500 / 4000)


def test_a_template_that_does_not_open_think_is_warned_about(settings, redis_client, tok_dir, tmp_path) -> None:
    import shutil

    k2 = tmp_path / "k2-thinking-style"
    shutil.copytree(tok_dir, k2)
    template = (k2 / "chat_template.jinja").read_text()
    (k2 / "chat_template.jinja").write_text(
        template.replace(
            "{%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}", ""
        )
    )
    path = write_jsonl(tmp_path / "alpha.jsonl", chat_rows(3, words=10))
    report = submit(settings, opts([path], k2))
    assert report.warnings and "do not end with <think>" in report.warnings[0]
    assert JobRecord.load(redis_client, settings.keys, "j").prompt_ends_with_think_start is False


@pytest.mark.parametrize("family", ["qwen3-thinking", "deepseek"])
def test_a_template_that_opens_think_with_a_newline_is_not_warned_about(
    settings, redis_client, tmp_path, family
) -> None:
    # Given Qwen3-Thinking-2507's / DeepSeek-R1-0528's template, whose prompts end with <think> and a newline.
    fam_dir = build_test_tokenizer(tmp_path / family, family=family)
    path = write_jsonl(tmp_path / "alpha.jsonl", chat_rows(3, words=10))
    # When the job is submitted.
    report = submit(settings, opts([path], fam_dir))
    # Then the prompts open reasoning (storage.spans.prompt_opens_reasoning): no warning, and the record says so.
    assert not [w for w in report.warnings if "<think>" in w], report.warnings
    tok = render.load_tokenizer(str(fam_dir))
    first = queued_tasks(redis_client, settings)[0]
    from thinkfleet.message import unpack_ids

    assert tok.decode(unpack_ids(first.ids_blob, None)[-2:]) == "<think>\n", "the template ends with <think>\\n"
    assert JobRecord.load(redis_client, settings.keys, "j").prompt_ends_with_think_start is True


def test_a_second_submit_with_other_sampling_params_is_refused(settings, tok_dir, tmp_path) -> None:
    path = write_jsonl(tmp_path / "alpha.jsonl", chat_rows(2, words=10))
    submit(settings, opts([path], tok_dir, sampling={"max_new_tokens": 100}))
    submit(settings, opts([path], tok_dir))  # flags not given: the job's values are kept
    with pytest.raises(SubmitError, match=r"(?s)sampling params.*new --job"):
        submit(settings, opts([path], tok_dir, sampling={"max_new_tokens": 200}))
