"""Prometheus, its alerts and the Grafana dashboard agree with the metrics and keys thinkfleet has.

Static checks always run: every ``thinkfleet_*`` name a query uses is one a worker exports, the Redis
keys the dashboard reads are the ones thinkfleet/keys.py writes, provisioning paths match the head
node's mounts. With ``promtool``/``prometheus`` installed (Debian: apt-get install prometheus) the
config, the alert unit tests and every dashboard query are checked by Prometheus itself, and a real
Prometheus scrapes a worker's metrics endpoint and fires the reasoning alarm.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from testing.fleet import free_port, wait_for_port
from tests.test_deploy_compose import REPO, command_args, dotenv, flag, load_compose
from thinkfleet.broker.keys import kombu_transport_options
from thinkfleet.keys import Keys
from workers.metrics import WorkerMetrics

PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
GRAFANA_DIR = REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA_DIR / "dashboards" / "thinkfleet.json"
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs(substitute: bool = False) -> list[str]:
    exprs = [t["expr"] for panel in dashboard()["panels"] for t in panel.get("targets", [])]
    if substitute:  # the dashboard's text variables, at their defaults
        defaults = {v["name"]: v["query"] for v in dashboard()["templating"]["list"]}
        exprs = [re.sub(r"\$(\w+)", lambda m: defaults.get(m.group(1), m.group(0)), e) for e in exprs]
    return exprs


def alert_rules() -> list[dict[str, Any]]:
    return [
        rule
        for group in yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())["groups"]
        for rule in group["rules"]
    ]


def worker_metric_names() -> set[str]:
    """Every sample name a worker process exports (``_total``, ``_bucket``… included)."""
    metrics = WorkerMetrics("probe", 1)
    metrics.completed.labels("d").inc()
    metrics.retried.labels("e").inc()
    metrics.dead.labels("e").inc()
    metrics.errors.labels("k").inc()
    metrics.crashes.labels("KeyError").inc()
    return {sample.name for family in metrics.registry.collect() for sample in family.samples}


# -- Prometheus -------------------------------------------------------------------------------------


def test_prometheus_scrapes_workers_flower_and_redis_where_the_head_node_serves_them() -> None:
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    # Workers: file-based targets, so adding a node is editing a JSON file.
    patterns = [f for sd in jobs["thinkfleet-workers"]["file_sd_configs"] for f in sd["files"]]
    assert any(PROMETHEUS_DIR.glob(p) for p in patterns)
    head = load_compose("head")["services"]
    flower_port = flag(command_args(head["flower"]["command"]), "--port")
    assert jobs["flower"]["static_configs"][0]["targets"] == [f"flower:{flower_port}"]
    assert jobs["redis"]["static_configs"][0]["targets"] == [f"redis-exporter:{head['redis-exporter']['expose'][0]}"]
    # The directory compose mounts is this one, and the rule files it names are in it.
    assert "../prometheus:/etc/prometheus:ro" in head["prometheus"]["volumes"]
    assert all((PROMETHEUS_DIR / f).exists() for f in config["rule_files"])


def test_worker_targets_point_at_the_port_nodes_publish() -> None:
    targets = json.loads((PROMETHEUS_DIR / "targets" / "workers.json").read_text())
    published = dotenv()["WORKER_METRICS_PORT"]
    for group in targets:
        assert group["labels"]["node"]
        assert all(t.rsplit(":", 1)[1] == published for t in group["targets"])


@needs_promtool
def test_prometheus_config_passes_promtool() -> None:
    result = subprocess.run(
        [PROMTOOL or "", "check", "config", "prometheus.yml"], cwd=PROMETHEUS_DIR, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_alert_rules_pass_their_unit_tests() -> None:
    result = subprocess.run(
        [PROMTOOL or "", "test", "rules", "alerts.test.yml"], cwd=PROMETHEUS_DIR, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_reasoning_alarm_alert_exists_and_fires_without_delay() -> None:
    rule = next(r for r in alert_rules() if r.get("alert") == "ThinkfleetReasoningAlarm")
    assert "thinkfleet_reasoning_alarm" in rule["expr"] and "for" not in rule
    assert rule["labels"]["severity"] == "critical"
    assert "deploy/README.md" in rule["annotations"]["description"]
    assert "The reasoning alarm" in (REPO / "deploy" / "README.md").read_text()


# -- the dashboard and alerts use real names -------------------------------------------------------


def test_every_thinkfleet_metric_queried_is_one_a_worker_exports() -> None:
    exported = worker_metric_names()
    queried = set()
    for expr in [*dashboard_exprs(), *(r["expr"] for r in alert_rules())]:
        queried |= set(re.findall(r"\bthinkfleet_[a-z_]+\b", expr))
    assert queried, "no thinkfleet metric queried at all"
    assert queried - exported == set()


def test_dashboard_reads_the_redis_keys_thinkfleet_writes_and_the_exporter_exports() -> None:
    env = dotenv()
    keys = Keys(env["THINKFLEET_KEY_PREFIX"])
    unacked = str(kombu_transport_options(keys.prefix, 60)["unacked_key"])
    exprs = " ".join(dashboard_exprs(substitute=True))
    # The Celery queue is a Redis list named after the queue; job progress is keys.prompts/done/dead.
    assert f'key="{env["THINKFLEET_QUEUE"]}"' in exprs and f'key="{unacked}"' in exprs
    for key in (keys.prompts("JOB"), keys.done("JOB"), keys.dead("JOB")):
        assert re.search(r'key=~"([^"]+)"', exprs)
        assert any(re.fullmatch(p, key) for p in re.findall(r'key=~"([^"]+)"', exprs)), key
    exporter = load_compose("head")["services"]["redis-exporter"]["environment"]
    single = {k.split("=", 1)[1] for k in exporter["REDIS_EXPORTER_CHECK_SINGLE_KEYS"].split(",")}
    assert single == {env["THINKFLEET_QUEUE"], unacked}
    patterns = [k.split("=", 1)[1] for k in exporter["REDIS_EXPORTER_CHECK_KEYS"].split(",")]
    for key in (keys.prompts("JOB"), keys.done("JOB"), keys.dead("JOB")):
        assert any(re.fullmatch(p.replace("*", ".+"), key) for p in patterns), key


def test_dashboard_answers_the_operators_questions() -> None:
    titles = " | ".join(p["title"].lower() for p in dashboard()["panels"])
    for topic in ("in flight per host", "tokens/s", "queue depth", "dead", "reasoning alarm", "eta"):
        assert topic in titles, topic
    datasource_uid = yaml.safe_load((GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ][0]["uid"]
    for panel in dashboard()["panels"]:
        assert panel["datasource"]["uid"] == datasource_uid
        assert all(t["datasource"]["uid"] == datasource_uid for t in panel["targets"])


def test_grafana_provisioning_matches_the_head_node_mounts() -> None:
    grafana = load_compose("head")["services"]["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    provider = yaml.safe_load((GRAFANA_DIR / "provisioning" / "dashboards" / "thinkfleet.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert (REPO / "deploy" / "head" / mounts[path]).resolve() == DASHBOARD.parent
    assert (REPO / "deploy" / "head" / mounts["/etc/grafana/provisioning"]).resolve() == GRAFANA_DIR / "provisioning"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert Path(home).parent.as_posix() == path and (DASHBOARD.parent / Path(home).name).exists()


@needs_promtool
def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    # promtool parses recording rules' expressions: one rule per dashboard query.
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:q{i}", "expr": e} for i, e in enumerate(dashboard_exprs(substitute=True))
                ],
            }
        ]
    }
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    result = subprocess.run(
        [PROMTOOL or "", "check", "rules", "rules.yml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


# -- a real Prometheus against a worker's metrics endpoint -----------------------------------------


@pytest.fixture
def prometheus_scraping_a_worker(tmp_path: Path) -> Iterator[tuple[str, WorkerMetrics]]:
    # Given a worker's metrics endpoint (the same registry a worker process serves)…
    metrics = WorkerMetrics("gpu-node-01", 150)
    for _ in range(7):
        metrics.request_started()
    metrics.output_tokens.inc(12_345)
    metrics.alarm.set(1)
    port = metrics.serve(0)
    # …listed in the targets file the way an operator adds a node, and the head node's config with
    # a fast scrape interval (the only change), run by a real Prometheus
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(PROMETHEUS_DIR / "alerts.yml", tmp_path / "alerts.yml")
    (tmp_path / "targets").mkdir()
    (tmp_path / "targets" / "workers.json").write_text(
        json.dumps([{"targets": [f"127.0.0.1:{port}"], "labels": {"node": "gpu-node-01"}}])
    )
    web = free_port()
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            PROMETHEUS or "prometheus",
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{web}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for_port(web, 30)
        base = f"http://127.0.0.1:{web}"
        # Listening is not ready: queries answer 503 until the TSDB is open.
        deadline = time.monotonic() + 30
        while not _ready(base):
            assert time.monotonic() < deadline, "Prometheus not ready within 30 s"
            time.sleep(0.2)
        yield base, metrics
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def query(base: str, expr: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)["data"]["result"]


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (apt-get install prometheus)")
def test_prometheus_scrapes_a_worker_and_fires_the_reasoning_alarm(
    prometheus_scraping_a_worker: tuple[str, WorkerMetrics],
) -> None:
    base, _metrics = prometheus_scraping_a_worker
    panel = {p["title"]: p for p in dashboard()["panels"]}
    inflight_expr = panel["In flight per host (vs. bound)"]["targets"][0]["expr"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not query(base, inflight_expr):
        time.sleep(0.5)
    # Then the dashboard's in-flight panel shows the node by name, next to its bound
    [series] = query(base, inflight_expr)
    assert series["metric"]["node"] == "gpu-node-01" and float(series["value"][1]) == 7
    bound_expr = panel["In flight per host (vs. bound)"]["targets"][1]["expr"]
    assert float(query(base, bound_expr)[0]["value"][1]) == 150
    # And the alarm stat reads 1, and the alert fires
    assert float(query(base, panel["Reasoning alarm"]["targets"][0]["expr"])[0]["value"][1]) == 1
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{base}/api/v1/alerts", timeout=5) as response:
            alerts = json.load(response)["data"]["alerts"]
        firing = [
            a for a in alerts if a["labels"]["alertname"] == "ThinkfleetReasoningAlarm" and a["state"] == "firing"
        ]
        if firing:
            assert firing[0]["labels"]["node"] == "gpu-node-01"
            return
        time.sleep(0.5)
    pytest.fail("ThinkfleetReasoningAlarm did not fire within 30 s")
