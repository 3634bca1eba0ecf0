"""``producer export JOB --follow``: a running job's rows, each once, in rolling shards that survive the follower's
SIGKILL; a ``retry --truncated`` arrives as replacements; ``--until-idle`` ends it; the torch adapter yields the
same records.

One worker, the module's 400× simulator and one Redis DB (its own key prefix) serve every test here; the follower is
a real ``producer`` process wherever it is killed or its exit is the point. Its output, with the replacements
applied (:func:`applied_lines`), must equal ``producer export``'s committed view of the same format, line for line.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from sglang_sim.testing import SimulatorProcess
from storage.follow import STATE_DIR, ShardDir, current_ids
from testing.fleet import WorkerProcess, job_progress, wait_until
from testing.harness import (
    STEADY_LEASE,
    cli_env,
    fast_env,
    isolated_settings,
    make_prompts,
    producer_cli,
    register_ids,
)
from testing.services import RedisServer
from thinkfleet.broker.celery_app import send_tasks
from thinkfleet.settings import Settings

REPO = Path(__file__).resolve().parent.parent
#: Short outputs: cheap rows, and a budget of 48 new tokens cuts some of them (the retry test's truncated rows).
SHORT = {"max_new_tokens": 48}


# -- reading a follower's output ------------------------------------------------------------------------------
def shard_lines(out: Path) -> list[tuple[int, str, str]]:
    """(shard, id, line) of every JSONL row in the closed shards, in shard order."""
    rows = []
    for n in ShardDir(str(out), "", "", "").closed():
        for path in out.glob(f"shard-{n:06d}.*"):
            for line in path.read_text().splitlines():
                rows.append((n, json.loads(line)["id"], line))
    return rows


def applied_lines(out: Path) -> list[str]:
    """The output as a trainer applies it (a shard's replacements drop that prompt's rows of earlier shards),
    sorted; asserts no row is there twice, and that a prompt found in two shards was replaced (never repeated)."""
    current = current_ids(str(out))
    seen: dict[str, int] = {}
    kept = []
    for n, pid, line in shard_lines(out):
        if pid in seen:
            side = ShardDir(str(out), "", "", "").read_sidecar(n)
            assert pid in {r["id"] for r in side["replaces"]}, f"{pid} repeated in shard {n} with no replacement"
        seen[pid] = n
        if current.get(pid) == n:
            kept.append(line)
    ids = [json.loads(line)["id"] for line in kept]
    assert len(ids) == len(set(ids)), "a prompt's current row twice"
    return sorted(kept)


def given_twice(out: Path) -> list[tuple[str, int, int]]:
    """Feed events (prompt, revision, epoch) that more than one closed shard's sidecar holds: none is expected."""
    shard_dir = ShardDir(str(out), "", "", "")
    seen: set[tuple[str, int, int]] = set()
    twice = []
    for n in shard_dir.closed():
        for pid, revision, epoch, _seq in shard_dir.read_sidecar(n)["rows"]:
            key = (pid, int(revision), int(epoch))
            if key in seen:
                twice.append(key)
            seen.add(key)
    return twice


def export_lines(settings: Settings, job: str, tmp: Path, *extra: str) -> list[str]:
    """``producer export`` of the committed view (specforge), as sorted lines."""
    path = tmp / f"{job}-export.jsonl"
    done = producer_cli(settings, "export", job, "--format", "specforge", "--out", str(path), *extra, in_process=True)
    assert done.returncode == 0, done.stderr
    return sorted(path.read_text().splitlines())


@dataclass
class Follower:
    """One ``producer export --follow`` process; its stderr in ``log``."""

    proc: subprocess.Popen[bytes]
    log: Path

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def finish(self, timeout_s: float = 180) -> str:
        """Its exit (0 expected) and its summary line."""
        rc = self.proc.wait(timeout_s)
        text = self.log.read_text()
        assert rc == 0, text
        return text.strip().splitlines()[-1]


def start_follower(settings: Settings, job: str, out: Path, *extra: str, name: str = "f") -> Follower:
    log = out.parent / f"{out.name}-{name}.err"
    args = [sys.executable, "-m", "producer.cli", "export", job, "--follow", "--format", "specforge"]
    args += ["--out", str(out), *extra]
    with log.open("ab") as err:
        proc = subprocess.Popen(args, env=cli_env(settings), stdout=subprocess.DEVNULL, stderr=err)
    return Follower(proc, log)


def followed(out: Path) -> int:
    """Feed events the closed shards hold."""
    shard_dir = ShardDir(str(out), "", "", "")
    return sum(len(shard_dir.read_sidecar(n)["rows"]) for n in shard_dir.closed()) if closed(out) else 0


def closed(out: Path) -> int:
    return len(ShardDir(str(out), "", "", "").closed()) if (out / STATE_DIR).exists() else 0


# -- the fleet every test here uses -------------------------------------------------------------------------
@dataclass
class Fleet:
    settings: Settings
    client: redis.Redis

    def run(self, job: str, prompts: dict[str, list[int]], publish: int | None = None) -> list[object]:
        """Register ``job`` and publish its first ``publish`` tasks (all by default); returns the rest, unpublished."""
        _, tasks = register_ids(self.settings, job, prompts, **SHORT)
        cut = len(tasks) if publish is None else publish
        send_tasks(self.settings, tasks[:cut])
        return list(tasks[cut:])

    def done(self, job: str) -> int:
        return job_progress(self.client, self.settings.keys, job)["done"]


@pytest.fixture(scope="module")
def fleet(
    redis_server: RedisServer, sim: SimulatorProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("follow")
    settings = isolated_settings(redis_server.url(0), str(tmp / "out"))
    client = redis.Redis.from_url(redis_server.url(0))
    worker = WorkerProcess("w1", fast_env(settings, sim.url, **STEADY_LEASE), tmp).start()
    try:
        worker.wait_ready(client, settings.keys)
        yield Fleet(settings, client)
    finally:
        worker.terminate()
        client.close()


# -- the tests --------------------------------------------------------------------------------------------------
def test_follower_killed_mid_job_resumes_with_no_row_missing_or_repeated(fleet: Fleet, tmp_path: Path) -> None:
    # Given a job of 100 prompts of which only 30 are published yet, and a follower in small shards.
    job = "follow-kill"
    rest = fleet.run(job, make_prompts(100, seed=11), publish=30)
    out = tmp_path / "shards"
    how = ("--reader", "r1", "--shard-rows", "8", "--shard-seconds", "0.2")
    first = start_follower(fleet.settings, job, out, *how)
    # When it is SIGKILLed once it closed shards of those 30 (waiting on the feed), the rest is published,
    wait_until(lambda: fleet.done(job) == 30 and closed(out) >= 4, 180, what="the first 30 in closed shards")
    first.kill()
    send_tasks(fleet.settings, rest)  # type: ignore[arg-type]
    # and it is started and SIGKILLed twice more while rows flow: each time at a random instant after it closed a
    # shard (any instant must do: a kill mid-write leaves a hidden file or a sidecar with no shard, which the next
    # start removes),
    rng = random.Random(7)
    for i in range(2):
        follower = start_follower(fleet.settings, job, out, *how, name=f"k{i}")
        before = closed(out)
        closes = lambda f=follower, n=before: closed(out) > n or f.proc.poll() is not None  # noqa: E731
        wait_until(closes, 180, what="a shard closed")
        time.sleep(rng.uniform(0, 0.3))
        follower.kill()
    # and once more, to the end.
    summary = start_follower(fleet.settings, job, out, *how, name="last").finish()
    # Then it ended because the job finished, and its output is the committed view: no row missing, none twice.
    assert "ended: job finished" in summary and "resumed after shard" in summary, summary
    assert not given_twice(out)
    lines = applied_lines(out)
    assert len(lines) == 100
    assert lines == export_lines(fleet.settings, job, tmp_path)
    assert not [e for e in os.listdir(out) if e.startswith(".")], "a hidden leftover stayed"


def test_retry_truncated_rows_arrive_as_replacements(fleet: Fleet, tmp_path: Path) -> None:
    # Given a job whose 48-token budget cut some rows, followed into shards; its last prompt is held back, so the
    # follower does not end before the retry.
    job = "follow-retry"
    last = fleet.run(job, make_prompts(30, seed=12), publish=29)
    out = tmp_path / "shards"
    follower = start_follower(fleet.settings, job, out, "--reader", "r1", "--shard-seconds", "0.2")
    wait_until(lambda: followed(out) == 29, 180, what="29 rows followed")
    before = {json.loads(line)["id"]: line for line in applied_lines(out)}
    # When the truncated rows are re-run with a larger budget while it follows, and the last prompt published.
    retry = producer_cli(
        fleet.settings, "retry", job, "--truncated", "--max-new-tokens", "400", "--json", in_process=True
    )
    assert retry.returncode == 0, retry.stderr
    rerun = set(json.loads(retry.stdout)["prompt_ids"])
    assert rerun, "a 48-token budget cut some of the simulator's outputs"
    send_tasks(fleet.settings, last)  # type: ignore[arg-type]
    summary = follower.finish()
    # Then each re-run prompt arrived once more, as a replacement naming the row it replaces, and the output with
    # the replacements applied is the committed view (the new revisions).
    shard_dir = ShardDir(str(out), "", "", "")
    replaced = [r for n in shard_dir.closed() for r in shard_dir.read_sidecar(n)["replaces"]]
    assert sorted(r["id"] for r in replaced) == sorted(rerun), summary
    assert all(tuple(r["replaces"]) < (r["revision"], r["epoch"]) for r in replaced), replaced
    assert f"{len(rerun)} replacements" in summary, summary
    after = applied_lines(out)
    assert after == export_lines(fleet.settings, job, tmp_path)
    ids = {json.loads(line)["id"]: line for line in after}
    changed = {pid for pid, line in before.items() if ids[pid] != line}
    assert changed <= rerun and changed, "the re-run rows are the new ones"
    assert not given_twice(out)


def test_until_idle_ends_a_follow_of_a_job_that_stopped_moving(fleet: Fleet, tmp_path: Path) -> None:
    # Given a job with 10 prompts of which 4 are published: it cannot finish.
    job = "follow-idle"
    fleet.run(job, make_prompts(10, seed=13), publish=4)
    wait_until(lambda: fleet.done(job) == 4, 180, what="4 rows")
    out = tmp_path / "shards"
    # When it is followed with --until-idle 3.
    summary = start_follower(fleet.settings, job, out, "--until-idle", "3").finish()
    # Then it exits 0 once nothing new came for 3 s, with what was committed, saying why it ended.
    assert "ended: idle 3s" in summary, summary
    assert len(applied_lines(out)) == 4
    assert applied_lines(out) == export_lines(fleet.settings, job, tmp_path)


def test_a_restart_removes_what_a_kill_left_half_written(tmp_path: Path) -> None:
    # Given an output directory as a kill leaves it: shard 1 closed, shard 2's sidecar written but the shard not
    # renamed yet, and hidden temporary files of both kinds.
    out = tmp_path / "shards"
    shard_dir = ShardDir(str(out), "j", "specforge", ".jsonl")
    shard_dir.recover()
    doc = {"job": "j", "format": "specforge", "cursor": {"log": "a", "seq": "1-0"}, "rows": [["p1", 0, 0, "1-0"]]}
    shard_dir.close(1, lambda path: Path(path).write_text('{"id":"p1"}\n'), lambda: {**doc, "replaces": []})
    (out / STATE_DIR / "000002.json").write_text(json.dumps({**doc, "rows": [["p2", 0, 0, "2-0"]]}))
    (out / ".partial-shard-000002.jsonl").write_text('{"id":"p2"}\n')
    (out / "..partial-shard-000002.jsonl.tmp-1a2b3c4d").write_text("")
    (out / STATE_DIR / ".000002.json.tmp").write_text("{")
    # When a follower starts there again.
    last, side = ShardDir(str(out), "j", "specforge", ".jsonl").recover()
    # Then shard 1 is where it goes on from, and nothing of shard 2 is left.
    assert (last, side["cursor"] if side else None) == (1, {"log": "a", "seq": "1-0"})
    assert sorted(os.listdir(out)) == [STATE_DIR, "shard-000001.jsonl"]
    assert os.listdir(out / STATE_DIR) == ["000001.json"]
    assert ShardDir(str(out), "j", "specforge", ".jsonl").given() == {"p1": (0, 0)}


#: The adapter's check, run in the consumers' venv (torch, SpecForge) with this checkout's own dependencies after its
#: packages (redis and the rest): the samples as lists, SpecForge's collator's batch shapes, the state to resume at.
ADAPTER_CHECK = """
import json, sys
sys.path.append(sys.argv[2])
from specforge.data.utils import DataCollatorWithPadding
from storage.torch_feed import FeedDataset
from thinkfleet.settings import Settings

data = FeedDataset(Settings(), sys.argv[1], reader="torch", max_length=4096)
samples = list(data)
batch = DataCollatorWithPadding()(samples[:4])
print(json.dumps({
    "samples": [{k: s[k][0].tolist() for k in ("input_ids", "loss_mask", "attention_mask")} for s in samples],
    "shapes": {k: list(v.shape) for k, v in batch.items() if v is not None},
    "lengths": [s["input_ids"].shape[1] for s in samples[:4]],
    "state": data.state_dict(),
}))
"""


@pytest.mark.timeout(1800)  # the consumers' venv is built first where it is missing (minutes), as test_consumers'
def test_torch_adapter_yields_the_specforge_records_as_specforge_collates_them(fleet: Fleet, tmp_path: Path) -> None:
    from test_consumers import consumers_python

    import storage.torch_feed as torch_feed

    # Given a finished job of 12 prompts.
    job = "follow-torch"
    fleet.run(job, make_prompts(12, seed=14))
    wait_until(lambda: fleet.done(job) == 12, 180, what="12 rows")
    want = [json.loads(line) for line in export_lines(fleet.settings, job, tmp_path)]
    # When its feed is read without torch (the records), and through FeedDataset in the consumers' venv.
    records = [r for batch, _ in torch_feed.feed_samples(fleet.settings, job) for r in batch]
    site = next((REPO / ".venv" / "lib").glob("python3*/site-packages"))
    env = {**cli_env(fleet.settings), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [str(consumers_python()), "-W", "ignore", "-c", ADAPTER_CHECK, job, str(site)],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # Then both are the specforge export's records, each once; the samples are [1, L] tensors SpecForge's collator
    # pads into (4, longest) batches; the state names where the feed stood.
    assert sorted(records, key=lambda r: r["id"]) == sorted(want, key=lambda r: r["id"])
    by_ids = sorted((s["input_ids"], s["loss_mask"]) for s in seen["samples"])
    assert by_ids == sorted((r["input_ids"], r["loss_mask"]) for r in want)
    assert all(s["attention_mask"] == [1] * len(s["input_ids"]) for s in seen["samples"])
    assert seen["shapes"] == {k: [4, max(seen["lengths"])] for k in ("input_ids", "attention_mask", "loss_mask")}
    assert seen["state"]["job"] == job and seen["state"]["cursor"]["seq"] != "0-0"


def test_eagle3_follow_writes_parquet_shards_that_read_as_the_export(fleet: Fleet, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    # Given a finished job of 8 prompts.
    job = "follow-eagle3"
    fleet.run(job, make_prompts(8, seed=15))
    wait_until(lambda: fleet.done(job) == 8, 180, what="8 rows")
    # When it is followed as eagle3 (in this process: its exit is not the point) in shards of 3 rows.
    out = tmp_path / "shards"
    args = ("export", job, "--follow", "--format", "eagle3", "--out", str(out), "--shard-rows", "3", "--json")
    done = producer_cli(fleet.settings, *args, in_process=True)
    assert done.returncode == 0, done.stderr
    # Then it wrote Parquet shards of at most 3 rows, no hidden file, its provenance, and they read as the export.
    assert json.loads(done.stdout)["rows"] == 8
    shards = sorted(out.glob("shard-*.parquet"))
    assert len(shards) >= 3 and all(pq.read_metadata(p).num_rows <= 3 for p in shards)
    assert (out / "_provenance.json").exists()
    whole = tmp_path / "export.parquet"
    assert producer_cli(fleet.settings, "export", job, "--out", str(whole), in_process=True).returncode == 0
    followed_rows = sorted(pq.read_table(out).to_pylist(), key=lambda r: r["id"])
    assert followed_rows == sorted(pq.read_table(whole).to_pylist(), key=lambda r: r["id"])


def test_following_a_job_with_no_record_says_so(fleet: Fleet, tmp_path: Path) -> None:
    done = producer_cli(
        fleet.settings, "export", "no-such-job", "--follow", "--out", str(tmp_path / "shards"), in_process=True
    )
    assert done.returncode == 1 and "has no record in Redis" in done.stderr, done.stderr
