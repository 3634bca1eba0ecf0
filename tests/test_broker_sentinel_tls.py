"""A Sentinel head on TLS only (issue 43): ``sentinel://…?ssl=true&sentinel_ssl=true&ssl_ca_certs=CA`` gives the
broker TLS exactly as the state clients (thinkfleet/broker/celery_app.py ``broker_ssl``: kombu's Sentinel-managed
SSL connection class, verified against the CA; the Sentinels asked over TLS too). Before, the broker went plaintext:
against a TLS-only head, submit worked and workers heartbeat while nothing was consumed.

Every Redis and Sentinel here serves ``tls-port`` only, with the CA of the project's deploy/make-tls-certs.sh
(testing/sentinel_tls.py), so a connection that works at all is a TLS one; the test also reads, on the primary, the
workers' blocking pops arriving on the TLS port.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from testing.fleet import in_flight, wait_until
from testing.harness import make_prompts, submit_ids
from testing.record import check_job, record_result
from testing.sentinel import sentinel_fleet
from testing.sentinel_tls import redis_has_tls
from testing.services import needs_service

TLS = needs_service(redis_has_tls(), "redis-server has no TLS support (Debian's redis-server has it)")
PROMPTS = 60


def _pops_on(client: redis.Redis, port: int) -> list[dict[str, object]]:
    """The connections of the Redis behind ``client`` that are waiting in a blocking pop, accepted on ``port``."""
    pops = [c for c in client.client_list() if c.get("cmd") == "blmove"]
    return [c for c in pops if str(c.get("laddr", "")).endswith(f":{port}")]


@TLS
def test_a_job_runs_on_a_tls_only_sentinel_head_with_the_broker_over_tls(tmp_path: Path) -> None:
    started = time.monotonic()
    # Given a head whose Redis servers and Sentinels serve TLS only, and workers on its sentinel:// URL with ssl=true,
    with sentinel_fleet(tmp_path, tls=True) as fleet:
        head, keys = fleet.head, fleet.settings.keys
        primary = head.process_on(head.primary_port() or 0)
        admin = head.client_of(primary)
        # (plain TCP is off: the port speaks TLS and nothing else)
        assert admin.config_get("port")["port"] == "0"
        with pytest.raises(redis.ConnectionError):
            redis.Redis(port=primary.port, socket_timeout=5, retry=None).ping()
        # When a job is submitted,
        job = submit_ids(fleet.settings, "tls", make_prompts(PROMPTS))
        waiter, wait_err = fleet.start_wait("tls")
        fleet.wait_done("tls", 10, "10 rows over TLS", 120)
        # Then both workers consume it, each waiting for messages in a blocking pop over the TLS port,
        wait_until(lambda: len(_pops_on(admin, primary.port)) >= 2, 60, what="two workers' pops on the TLS port")
        # and when the primary is killed mid-job the workers ask the Sentinels (over TLS) for the promoted one.
        wait_until(lambda: in_flight(fleet.client, keys, "tls"), 30, what="work in flight")
        killed_at = time.monotonic()
        primary.stop(kill=True)
        new = head.wait_for_new_primary(primary.port)
        fleet.settle("tls", PROMPTS)
        recovered_s = time.monotonic() - killed_at
        promoted = head.client_of(head.process_on(new))
        assert waiter.wait(timeout=120) == 0, wait_err.read_text()
        fleet.stop_workers()
        outcome = check_job(fleet.settings, "tls", job.prompts, job.sampling_params)
        assert promoted.config_get("port")["port"] == "0"
    record_result(
        "Sentinel head on TLS only (ssl=true, sentinel_ssl=true): broker and state over TLS, primary SIGKILLed",
        outcome,
        f"Redis and Sentinels on tls-port only (deploy/make-tls-certs.sh CA); primary killed, port {new} promoted",
        [recovered_s],
        time.monotonic() - started,
        workers=2,
    )
    outcome.assert_clean()
