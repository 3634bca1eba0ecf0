"""A real `celery worker` accepts the producer's fast-path messages and gets the args byte for byte."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from producer import render
from producer.submit import submit
from producer.submit_options import SubmitOptions
from testing.datasets import chat_rows, write_jsonl
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.broker.keys import kombu_transport_options
from thinkfleet.message import TASK_NAME, PromptTask, pack_ids
from thinkfleet.settings import Settings
from thinkfleet.state.job import JobRecord

REPO = Path(__file__).resolve().parents[1]

# The broker side of workers/app.py (serializer, queue, kombu transport keys) without importing it: its
# module-level app registers the real worker runtime's signal handlers.
ECHO_APP = f'''
import os

import msgpack
from celery import Celery
from kombu import Exchange, Queue

from thinkfleet.broker.keys import kombu_transport_options
from thinkfleet.settings import load_settings

settings = load_settings()
app = Celery("echo", set_as_current=False)
app.conf.update(
    broker_url=settings.broker_url,
    broker_transport_options=kombu_transport_options(settings.key_prefix, settings.visibility_timeout_s),
    task_serializer="msgpack",
    accept_content=["msgpack", "json"],
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    task_queues=[Queue(settings.queue, Exchange(settings.queue, type="direct"), routing_key=settings.queue)],
    worker_hijack_root_logger=False,
)


@app.task(name="{TASK_NAME}", bind=True)
def generate(self, *args):
    record = {{"id": self.request.id, "argsrepr": self.request.argsrepr, "args": list(args)}}
    with open(os.environ["ECHO_OUT"], "ab") as f:
        f.write(msgpack.packb(record, use_bin_type=True))
'''


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return list(msgpack.Unpacker(open(path, "rb"), raw=False))


@pytest.mark.timeout(180)
def test_a_real_celery_worker_accepts_fast_path_messages_byte_for_byte(redis_url, redis_client, tmp_path) -> None:
    tok_dir = build_test_tokenizer(default_test_tokenizer_dir())
    settings = Settings(redis_url=redis_url, output_uri=str(tmp_path / "out"), queue="echo-q", key_prefix="tfe")
    rows = chat_rows(5, words=20)
    rows[2]["id"] = 'quote"and/slash é'  # ids survive JSON escaping in the headers
    path = write_jsonl(tmp_path / "beta.jsonl", rows)
    submit(settings, SubmitOptions(paths=[path], job="echo", tokenizer=str(tok_dir), processes=1))
    assert redis_client.llen("echo-q") == 5

    tok = render.load_tokenizer(str(tok_dir))
    generation = JobRecord.load(redis_client, settings.keys, "echo").generation  # every message carries it
    assert generation
    expected = {}
    for i, row in enumerate(rows):
        ids = render.render_ids(tok, row["messages"][:2], None, {"thinking": True})
        digest = render.content_hash(np.asarray(ids))
        task = PromptTask("echo", "beta", f"beta/{row['id']}", i, digest, pack_ids(ids), generation=generation)
        expected[task.task_id] = task

    (tmp_path / "echo_app.py").write_text(ECHO_APP)
    out = tmp_path / "received.msgpack"
    env = {
        **os.environ,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}",
        "THINKFLEET_REDIS_URL": redis_url,
        "THINKFLEET_QUEUE": "echo-q",
        "THINKFLEET_KEY_PREFIX": "tfe",
        "ECHO_OUT": str(out),
    }
    cmd = [sys.executable, "-m", "celery", "-A", "echo_app", "worker", "--pool", "solo", "-Q", "echo-q",
           "--without-heartbeat", "--without-mingle", "--without-gossip", "-l", "warning"]  # fmt: skip
    log = open(tmp_path / "worker.log", "wb")  # noqa: SIM115
    worker = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while len(read_records(out)) < 5 and time.monotonic() < deadline and worker.poll() is None:
            time.sleep(0.2)
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        log.close()
    received = read_records(out)
    assert len(received) == 5, (tmp_path / "worker.log").read_text()[-3000:]
    for record in received:
        task = expected[record["id"]]
        assert record["args"] == task.to_args()  # bytes compare equal byte for byte
        assert isinstance(record["args"][5], bytes)
        assert record["argsrepr"] == task.argsrepr
    assert {r["id"] for r in received} == set(expected)
    # Acknowledged: nothing left waiting or in kombu's unacked hash.
    unacked = kombu_transport_options("tfe", settings.visibility_timeout_s)["unacked_key"]
    assert redis_client.llen("echo-q") == 0
    assert redis_client.hlen(unacked) == 0
