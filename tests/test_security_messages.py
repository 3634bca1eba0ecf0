"""Anyone who can write the broker or Redis can write a message, a job record or a row: none of it is
trusted. Hostile messages — a zstd bomb in the ids, a kombu ``compression`` header (a zlib bomb), a
forged content hash, an oversize body, an out-of-vocabulary id, a job named ``x:claims``, an override
that is no per-message sampling key — are each refused with a counted, logged reason and dead-lettered
(or recorded in the malformed list), while a job beside them is stored byte for byte. ``producer
verify`` recomputes content hashes from the stored ids, and ``producer export`` runs no tokenizer code
it was not told to trust.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import zlib
from pathlib import Path

import kombu.compression
import kombu.message
import numpy as np
import pytest
import redis
import redis.asyncio as aioredis
import zstandard
from click.testing import CliRunner

from storage.cli import export, verify
from storage.verify import verify_job
from storage.writer import PartWriter
from testing.fleet import WorkerProcess, dead_letters, job_progress, wait_until
from testing.harness import (
    fast_env,
    isolated_settings,
    make_prompts,
    metric_counter,
    register_ids,
    simulator,
    worker_metrics,
)
from testing.record import check_job, record_result
from testing.rows import make_row
from thinkfleet.broker.celery_app import send_tasks as _publish
from thinkfleet.broker.guard import CompressionRefused, refuse_compression
from thinkfleet.keys import Keys
from thinkfleet.message import (
    TASK_NAME,
    MessageLimits,
    MessageRefused,
    PromptTask,
    content_hash,
    pack_ids,
    unpack_ids,
)
from thinkfleet.settings import Settings
from thinkfleet.state.job import JobRecord
from thinkfleet.state.ledger import Ledger
from workers.app import make_app

#: 64 MiB of zeros: a 2 KB zstd frame, a 64 KB zlib stream.
BOMB_BYTES = 64 << 20
#: The worker's limit in the end-to-end test: 4096 ids (16 KiB of ids, an 80 KiB message).
MAX_PROMPT_TOKENS = 4096


def _zstd_bomb() -> bytes:
    return b"\x01" + zstandard.ZstdCompressor(level=3).compress(bytes(BOMB_BYTES))


def _header_declaring(size: int) -> bytes:
    """An id blob whose zstd frame header declares ``size`` bytes (and holds almost nothing)."""
    header = (0xFD2FB528).to_bytes(4, "little") + bytes([0b11000000, 0x70]) + size.to_bytes(8, "little")
    return b"\x01" + header + b"\x01\x00\x00"


def _task(ids: list[int], **kw: object) -> PromptTask:
    values: dict[str, object] = {
        "job": "job",
        "dataset": "ds",
        "prompt_id": "p",
        "row_index": 0,
        "content_hash": content_hash(ids),
        "ids_blob": pack_ids(ids),
    }
    values.update(kw)
    return PromptTask(**values)  # type: ignore[arg-type]


def _refusal(task: PromptTask, limits: MessageLimits = MessageLimits()) -> str:
    with pytest.raises(MessageRefused) as info:
        task.verified_ids(limits)
    return info.value.error_class


# -- the message's own checks (thinkfleet/message.py) -------------------------------------------------------
def test_a_zstd_bomb_and_a_frame_declaring_a_terabyte_are_refused_before_anything_is_allocated() -> None:
    bomb = _zstd_bomb()
    assert len(bomb) < 4096, "a 2 KB message"
    started = time.perf_counter()
    with pytest.raises(MessageRefused, match="oversize: zstd frame declares 67,108,864 bytes"):
        unpack_ids(bomb)
    # 1 TiB declared: decompressing would raise MemoryError; refused from the header alone.
    with pytest.raises(MessageRefused, match="declares 1,099,511,627,776 bytes"):
        unpack_ids(_header_declaring(1 << 40))
    assert time.perf_counter() - started < 1.0, "nothing was inflated"
    assert _refusal(_task([1, 2, 3], ids_blob=bomb)) == "oversize"
    # The limit is the setting: 4 bytes per id.
    ids = list(range(100, 200))
    assert _task(ids).verified_ids(MessageLimits(max_prompt_tokens=100)) == ids
    assert _refusal(_task(ids), MessageLimits(max_prompt_tokens=99)) == "oversize"
    assert _refusal(_task(ids, ids_blob=pack_ids(ids, compress=False)), MessageLimits(max_prompt_tokens=99)) == (
        "oversize"
    )


def test_sizeless_truncated_or_lying_frames_are_corrupt_messages() -> None:
    ids = list(range(1000))
    sizeless = b"\x01" + zstandard.ZstdCompressor(write_content_size=False).compress(np.asarray(ids, "<u4").tobytes())
    lying = bytearray(pack_ids([0] * 50_000))  # declares 200,000 bytes …
    lying[6:10] = (16).to_bytes(4, "little")  # … now 16: the frame holds more than it declares
    for blob in (sizeless, pack_ids(ids)[:-7], bytes(lying), b"\x07abc", b"\x00abc"):
        assert _refusal(_task(ids, ids_blob=blob)) == "corrupt_message", blob[:12]


def test_ids_must_hash_to_the_content_hash_and_stay_below_the_vocabulary() -> None:
    ids = [5, 6, 7, 163_606]
    assert _task(ids).verified_ids() == ids
    # A forged hash: the submitted prompt's hash, other ids.
    assert _refusal(_task([5, 6, 8, 163_606], content_hash=content_hash(ids))) == "content_hash_mismatch"
    # The hash is mandatory: one that is not hash-shaped cannot be checked, so the ids are not run.
    for shapeless in ("h-p", "", "0" * 15, "0" * 17, "ABCDEF0123456789", " " + content_hash(ids)):
        assert _refusal(_task(ids, content_hash=shapeless)) == "bad_content_hash", shapeless
    assert _task(ids).verified_ids(MessageLimits(vocab_size=163_607)) == ids
    assert _refusal(_task(ids), MessageLimits(vocab_size=163_606)) == "invalid_ids"
    assert _refusal(_task([1, 2**32 - 1]), MessageLimits(vocab_size=163_840)) == "invalid_ids"


@pytest.mark.parametrize(
    "overrides,ok",
    [
        ({}, True),
        ({"sampling_seed": 7}, True),
        ({"max_new_tokens": 20_480}, True),
        ({"sampling_seed": 8, "max_new_tokens": 1}, True),
        ({"temperature": 0.0}, False),
        ({"stop_token_ids": []}, False),
        ({"sampling_seed": True}, False),
        ({"sampling_seed": "7"}, False),
        ({"sampling_seed": 2**70}, False),
        ({"max_new_tokens": 0}, False),
        ({"max_new_tokens": 2**40}, False),
        ({"max_new_tokens": None}, False),
    ],
)
def test_overrides_are_a_whitelist_of_per_message_sampling_keys(overrides: dict, ok: bool) -> None:
    task = _task([1, 2, 3], overrides=overrides)
    if ok:
        assert task.verified_ids() == [1, 2, 3]
    else:
        assert _refusal(task) == "bad_overrides"


@pytest.mark.parametrize(
    "job,dataset,error",
    [
        ("x:claims", "ds", "bad_job_name"),
        ("a/b", "ds", "bad_job_name"),
        ("", "ds", "bad_job_name"),
        (".hidden", "ds", "bad_job_name"),
        ("j" * 129, "ds", "bad_job_name"),
        ("job", "../up", "bad_dataset_name"),
        ("job", "a:b", "bad_dataset_name"),
    ],
)
def test_a_task_with_a_name_that_is_not_plain_cannot_exist(job: str, dataset: str, error: str) -> None:
    args = _task([1]).to_args()
    args[0], args[1] = job, dataset
    with pytest.raises(MessageRefused) as info:
        PromptTask.from_args(args)
    assert info.value.error_class == error
    with pytest.raises(MessageRefused):
        _task([1], job=job, dataset=dataset)
    assert PromptTask.from_args(_task([1], job="k25-eagle3.v2_a", dataset="gsm8k").to_args()).job == "k25-eagle3.v2_a"


def test_submit_refuses_a_job_name_that_is_not_plain() -> None:
    from producer.submit import submit
    from producer.submit_options import SubmitError, SubmitOptions

    with pytest.raises(SubmitError, match="job name 'x:claims' is not plain"):
        submit(Settings(), SubmitOptions(paths=[], job="x:claims", tokenizer="/nonexistent"))


# -- before kombu or Celery decode anything (workers/tasks.py) ----------------------------------------------
def test_compression_is_refused_before_kombu_inflates_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    # Restore kombu's codecs after the test (refuse_compression patches this process, as a worker's does).
    monkeypatch.setattr(kombu.message, "decompress", kombu.message.decompress)
    monkeypatch.setattr(kombu.compression, "_decoders", dict(kombu.compression._decoders))
    inflated: list[int] = []
    monkeypatch.setitem(kombu.compression._decoders, "application/x-gzip", lambda b: inflated.append(len(b)) or b"")
    refuse_compression()
    bomb = zlib.compress(bytes(BOMB_BYTES), 9)
    for codec in ("application/x-gzip", "gzip", "zlib", "bzip2", "no-such-codec"):
        message = kombu.message.Message(body=bomb, headers={"compression": codec})
        assert message.errors, codec
        assert isinstance(message.errors[0][1], CompressionRefused), message.errors[0]
        assert message.body is bomb, "the body stays as it came"
    assert inflated == [], "no decoder ran"
    assert kombu.message.Message(body=b"plain", headers={}).errors == []


# -- the worker's start: abandon_claims skips names that are not jobs (thinkfleet/state/ledger.py) --------
def test_abandon_claims_skips_job_names_that_are_not_plain_and_foreign_keys(redis_client: redis.Redis, redis_url):
    keys = Keys("tfsec")
    redis_client.sadd(keys.jobs, "x:claims", "wrongtype", "good")
    redis_client.set(keys.claims("wrongtype"), "a string where a hash belongs")
    mine = json.dumps({"worker": "w1", "part": "p.parquet", "at": 0})
    redis_client.hset(keys.claims("good"), mapping={"p1": mine, "p2": json.dumps({"worker": "w2"})})
    redis_client.hset(keys.claims("x:claims"), "p9", mine)  # would only be reached through a hostile name

    async def run() -> int:
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await Ledger(client, keys, "w1").abandon_claims()
        finally:
            await client.aclose()

    assert asyncio.run(run()) == 1
    assert json.loads(redis_client.hget(keys.claims("good"), "p1"))["worker"] == ""
    assert json.loads(redis_client.hget(keys.claims("x:claims"), "p9"))["worker"] == "w1", "never touched"


# -- producer verify: hashes recomputed from the stored ids (storage/checks.py) ---------------------------
def test_verify_catches_a_row_injected_with_a_forged_hash(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    keys = Keys("tfv")
    rows = [make_row(f"p-{i}", seed=i) for i in range(6)]
    for row in rows:
        row["content_hash"] = content_hash(row["input_ids"])
    PartWriter(str(tmp_path), "w1").write("job", "ds", rows[:5])
    redis_client.hset(keys.prompts("job"), mapping={r["prompt_id"]: r["content_hash"] for r in rows})
    redis_client.hset(keys.prompt_dataset("job"), mapping={r["prompt_id"]: "ds" for r in rows})
    settings = Settings(output_uri=str(tmp_path), redis_url=redis_url, key_prefix=keys.prefix)
    assert verify_job(settings, "job").missing == ["p-5"]
    # The injected row: p-5's submitted hash (so it is not stale) on other prompt ids.
    forged = make_row("p-5", seed=99, content_hash=rows[5]["content_hash"])
    assert content_hash(forged["input_ids"]) != rows[5]["content_hash"]
    PartWriter(str(tmp_path), "w666").write("job", "ds", [forged])
    report = verify_job(settings, "job")
    assert report.hash_mismatch == ["p-5"] and not report.stale and not report.missing
    assert not report.ok
    # A row with no hash at all is held to the submitted one.
    redis_client.hset(keys.prompts("job"), "p-6", content_hash([7, 8, 9]))
    redis_client.hset(keys.prompt_dataset("job"), "p-6", "ds")
    PartWriter(str(tmp_path), "w667").write("job", "ds", [make_row("p-6", input_ids=[7, 8, 10], content_hash="")])
    report = verify_job(settings, "job")
    assert report.hash_mismatch == ["p-5", "p-6"] and not report.stale
    args = ["job", "--output-uri", str(tmp_path), "--redis-url", redis_url, "--key-prefix", keys.prefix]
    result = CliRunner().invoke(verify, args)
    assert result.exit_code == 1 and "HASH MISMATCH" in result.output and "p-5" in result.output


# -- producer export: no code runs unless trusted (storage/exports/) -------------------------------------
def test_export_refuses_a_tokenizer_that_needs_remote_code_without_trust_remote_code(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    # A job record (anyone who can write Redis can write one) naming a tokenizer that ships code.
    tok = tmp_path / "evil-tokenizer"
    tok.mkdir()
    canary = tmp_path / "remote-code-ran"
    (tok / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}})
    )
    (tok / "evil.py").write_text(
        f"import pathlib\npathlib.Path({str(canary)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n\nclass EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    keys = Keys("tfx")
    JobRecord(name="job", tokenizer=str(tok)).save(redis_client, keys)
    args = ["job", "--format", "conversations", "--out", str(tmp_path / "out.jsonl")]
    args += ["--output-uri", str(tmp_path / "store"), "--redis-url", redis_url, "--key-prefix", keys.prefix]
    result = CliRunner().invoke(export, args)
    assert result.exit_code == 1, result.output
    assert "--trust-remote-code" in result.output and "ships its own code" in result.output
    assert not canary.exists(), "the tokenizer's code ran"
    assert not (tmp_path / "out.jsonl").exists()


# -- a real worker: every hostile message refused, the job beside them whole ------------------------------
def _publish_hostile(settings: Settings, real_hash: str, ids: list[int]) -> None:
    """Messages that are refused before any job state is touched (the malformed list)."""
    app = make_app(settings, register=False)
    q = settings.queue
    with app.producer_or_acquire() as producer:
        # A job name that builds another job's keys ("x" + ":claims").
        bad = ["x:claims", "synthetic", "p-name", 0, real_hash, pack_ids(ids), 0, 0, {}]
        app.send_task(TASK_NAME, args=bad, task_id="bad-name", producer=producer, queue=q)
        # A well-formed task, kombu-compressed: never inflated, never run (its prompt was never submitted).
        zipped = PromptTask("sec", "synthetic", "p-zip", 0, real_hash, pack_ids(ids)).to_args()
        app.send_task(TASK_NAME, args=zipped, task_id="zipped", compression="zlib", producer=producer, queue=q)
        # A zlib bomb: 64 KB that kombu would inflate to 64 MiB.
        producer.publish(
            zlib.compress(bytes(BOMB_BYTES), 9),
            exchange=q,
            routing_key=q,
            content_type="application/x-msgpack",
            content_encoding="binary",
            headers={"lang": "py", "task": TASK_NAME, "id": "zlib-bomb", "argsrepr": "()", "kwargsrepr": "{}",
                     "compression": "application/x-gzip"},
        )  # fmt: skip
        # A body over max_message_bytes (30,000 raw ids ≈ 120 KB > 80 KiB): refused before msgpack decodes it.
        big = list(range(30_000))
        oversize = PromptTask("sec", "synthetic", "p-big", 0, content_hash(big), pack_ids(big, compress=False))
        app.send_task(TASK_NAME, args=oversize.to_args(), task_id="oversize", producer=producer, queue=q)


def test_hostile_messages_are_each_refused_with_a_counted_reason_and_the_job_beside_them_is_exact(
    redis_url: str, tmp_path: Path
) -> None:
    # Given a job of 8 good prompts and 4 submitted prompts whose messages are hostile, plus 4 messages
    # that are refused before any job state is touched, and a jobs set with a hostile name and a foreign key.
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    prompts = make_prompts(8)
    extra = make_prompts(4, seed=1)
    hostile = dict(zip(["x-bomb", "x-forged", "x-vocab", "x-override"], extra.values(), strict=True))
    hostile["x-vocab"] = [*hostile["x-vocab"][:-1], 300_000, hostile["x-vocab"][-1]]  # >= the vocabulary
    everything = {**prompts, **hostile}
    job, tasks = register_ids(settings, "sec", everything)
    real = {pid: content_hash(ids) for pid, ids in everything.items()}
    client.hset(keys.prompts("sec"), mapping=real)  # real hashes: verify checks them against the stored ids
    client.hset(keys.job("sec"), "vocab_size", json.dumps(163_840))
    by_pid = {t.prompt_id: dataclasses.replace(t, content_hash=real[t.prompt_id]) for t in tasks}
    by_pid["x-bomb"] = dataclasses.replace(by_pid["x-bomb"], ids_blob=_zstd_bomb())
    by_pid["x-forged"] = dataclasses.replace(by_pid["x-forged"], ids_blob=pack_ids(prompts["p00000"]))
    by_pid["x-override"] = dataclasses.replace(by_pid["x-override"], overrides={"temperature": 0.0, "top_k": 1})
    client.sadd(keys.jobs, "x:claims", "wrongtype")
    client.set(keys.claims("wrongtype"), "a string where a claims hash belongs")
    expected_dead = {
        "x-bomb": "oversize",
        "x-forged": "content_hash_mismatch",
        "x-vocab": "invalid_ids",
        "x-override": "bad_overrides",
    }
    expected_malformed = {
        "bad-name": "bad_job_name",
        "zipped": "compressed_message",
        "zlib-bomb": "compressed_message",
        "oversize": "oversize",
    }
    started = time.monotonic()
    with simulator(tmp_path, "--time-scale", "400") as sim:
        env = fast_env(settings, sim, max_prompt_tokens=MAX_PROMPT_TOKENS)
        worker = WorkerProcess("w1", env, tmp_path)
        _publish_hostile(settings, real["p00000"], prompts["p00000"])
        _publish(settings, list(by_pid.values()))
        worker.start()
        try:
            worker.wait_ready(client, keys)  # abandon_claims skipped "x:claims" and the foreign key
            wait_until(lambda: job_progress(client, keys, "sec")["done"] == 8, 120, what="8 rows")
            wait_until(lambda: job_progress(client, keys, "sec")["dead"] == 4, 60, what="4 dead letters")
            wait_until(lambda: client.llen(keys.malformed) == 4, 60, what="4 malformed records")
            metrics = worker_metrics(client, keys, "w1")
            assert worker.alive() and worker.starts == 1, "no hostile message took the worker down"
        finally:
            worker.terminate()
    log = worker.log_path.read_text(errors="replace")
    dead = {pid: d["error_class"] for pid, d in dead_letters(client, keys, "sec").items()}
    malformed = {m["message_id"]: m["error"] for m in map(json.loads, client.lrange(keys.malformed, 0, -1))}
    outcome = check_job(settings, "sec", everything, job.sampling_params, expected_dead=set(expected_dead))
    record_result(
        "hostile messages: zstd/zlib bombs, compression header, forged hash, oversize, bad id, bad name, override",
        outcome,
        "4 hostile prompts of a 12-prompt job + 4 messages refused before decoding + 2 hostile jobs-set entries",
        [],
        time.monotonic() - started,
        notes="dead letters oversize/content_hash_mismatch/invalid_ids/bad_overrides; tf:malformed bad_job_name, "
        "compressed_message ×2 (never inflated), oversize; worker never restarted; the 8 good rows exact",
    )
    # Then each is refused with its reason: dead-lettered in the job, or recorded as malformed …
    assert dead == expected_dead
    kinds = {mid: err.removeprefix("MessageRefused: ").split(":")[0] for mid, err in malformed.items()}
    assert kinds == expected_malformed, malformed
    # … counted …
    for error_class in expected_dead.values():
        assert metric_counter(metrics, "thinkfleet_dead_lettered", "error_class", error_class) == 1, error_class
    assert metric_counter(metrics, "thinkfleet_internal_errors", "kind", "compressed_message") == 2
    assert metric_counter(metrics, "thinkfleet_internal_errors", "kind", "oversize") == 1
    assert metric_counter(metrics, "thinkfleet_internal_errors", "kind", "malformed_message") == 1
    # … and logged.
    assert "refused message zipped (compressed_message)" in log and "refused message zlib-bomb" in log
    assert "refused message oversize (oversize)" in log
    assert "malformed message bad-name dead-lettered" in log and "bad_job_name" in log
    for pid, error_class in expected_dead.items():
        assert f"dead-lettered sec/{pid}: {error_class}" in log
    assert "abandon_claims: skipping job 'x:claims'" in log and "abandon_claims: skipping job 'wrongtype'" in log
    # Nothing else is disturbed: no key was built from the hostile name, nothing ran for the refused
    # messages, the queue is empty, and the job's 8 good rows are byte-exact.
    prefix = settings.key_prefix.encode()
    assert not [k for k in client.scan_iter(match=prefix + b":*") if b"x:claims" in k]
    assert not client.exists(keys.claims("x"))
    assert client.llen(settings.queue) == 0
    outcome.assert_clean()
