"""deploy/k8s/: the Kubernetes manifests are valid Kubernetes, and their numbers agree with the worker's.

Every document of the base is validated (strict: an unknown field fails) against the Kubernetes OpenAPI
schemas ``kubernetes-validate`` ships (offline; the newest version it has). With ``kubectl`` installed
(its built-in kustomize), the example overlay is rendered — with secrets made by ``deploy/make-secrets.sh``
in a copy of the tree — and every rendered document is validated too, and every ConfigMap and Secret a pod
names exists in the render. Without kubectl that test skips with the reason. So is the HA overlay (a head that fails
over: components/sentinel-head): three Redis and three Sentinels (quorum 2) one per node, their scripts the compose
head's, every client's URL naming the three Sentinels, and every password a file of the pod's own Secret.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.test_deploy_compose import HAND_BACK_MARGIN_S, setting_env_names
from thinkfleet.redis_client import parse_sentinel
from thinkfleet.settings import Settings

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "k8s"
BASE = K8S / "base"
KUBECTL = shutil.which("kubectl")
#: The Kubernetes version validated against: the newest whose schemas kubernetes-validate ships.
K8S_VERSION = kubernetes_validate.utils.latest_version()
WORKLOADS = {"StatefulSet", "Deployment", "Job"}


def base_documents() -> list[dict[str, Any]]:
    """Every document of every resource file the base kustomization lists, in order."""
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((BASE / name).read_text()) if d]
    return docs


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    [c] = [c for c in pod_spec["containers"] if c["name"] == name]
    return c


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def generated_literals(name: str) -> dict[str, str]:
    """The literals of one of the base's configMapGenerator entries."""
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    [gen] = [g for g in kustomization["configMapGenerator"] if g["name"] == name]
    return dict(item.split("=", 1) for item in gen["literals"])


def validate(doc: dict[str, Any]) -> None:
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {e.message} at {list(e.path)}", pytrace=False)


# -- valid Kubernetes ----------------------------------------------------------------------------------


def test_every_base_manifest_matches_the_kubernetes_schema() -> None:
    docs = base_documents()
    kinds = {d["kind"] for d in docs}
    assert {"StatefulSet", "Service", "Deployment", "PodDisruptionBudget", "Job", "PersistentVolumeClaim"} <= kinds
    for doc in docs:
        validate(doc)


def test_a_manifest_with_an_unknown_field_is_refused() -> None:
    """The validator is strict: a misspelt field fails (so the test above proves something)."""
    pdb = dict(named(base_documents(), "PodDisruptionBudget", "inference"))
    pdb["spec"] = {**pdb["spec"], "maxUnavailible": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pdb, K8S_VERSION, strict=True)


def render_overlay(tmp_path: Path, name: str, extra_secrets: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """``kubectl kustomize`` of ``overlays/NAME`` in a copy of the tree (the overlay reads deploy/head/ next to it),
    with the secrets an operator makes: make-secrets.sh's, Flower's login, and ``extra_secrets`` (random)."""
    for part in ("k8s", "head", "make-secrets.sh"):
        src = REPO / "deploy" / part
        dst = tmp_path / "deploy" / part
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("secrets"))
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dst)
    overlay = tmp_path / "deploy" / "k8s" / "overlays" / name
    subprocess.run(["sh", str(tmp_path / "deploy" / "make-secrets.sh"), str(overlay / "secrets")], check=True)
    (overlay / "secrets" / "flower_basic_auth").write_text("admin:" + "x" * 32)
    for secret in extra_secrets:
        (overlay / "secrets" / secret).write_text(os.urandom(24).hex() + "\n")
    assert KUBECTL is not None
    out = subprocess.run(
        [KUBECTL, "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def pod_specs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every workload's pod spec, by workload name."""
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs if d["kind"] in WORKLOADS}


def assert_valid_and_resolved(docs: list[dict[str, Any]]) -> None:
    """Every document valid Kubernetes in the thinkfleet namespace, every ConfigMap and Secret a pod names rendered."""
    for doc in docs:
        assert doc["metadata"].get("namespace", "thinkfleet") == "thinkfleet" or doc["kind"] == "Namespace"
        validate(doc)
    have = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for pod in pod_specs(docs).values():
        refs = [("Secret", v["secret"]["secretName"]) for v in pod.get("volumes", []) if "secret" in v]
        refs += [("ConfigMap", v["configMap"]["name"]) for v in pod.get("volumes", []) if "configMap" in v]
        for c in pod["containers"]:
            refs += [("ConfigMap", e["configMapRef"]["name"]) for e in c.get("envFrom", [])]
            for e in c.get("env", []):
                source = e.get("valueFrom", {})
                if "configMapKeyRef" in source:
                    refs.append(("ConfigMap", source["configMapKeyRef"]["name"]))
                if "secretKeyRef" in source:
                    refs.append(("Secret", source["secretKeyRef"]["name"]))
        missing = [ref for ref in refs if ref not in have]
        assert not missing, f"referenced but not rendered: {missing}"


def mounted_file(docs: list[dict[str, Any]], pod: dict[str, Any], c: dict[str, Any], path: str) -> bytes:
    """The content of ``path`` in container ``c`` of ``pod``, from the rendered Secret or ConfigMap mounted there."""
    [mount] = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    key = path[len(mount["mountPath"]) + 1 :]
    if "secret" in volume:
        data = named(docs, "Secret", volume["secret"]["secretName"]).get("data", {})
        assert key in data, f"{path}: no key {key} in Secret {volume['secret']['secretName']}"
        return base64.b64decode(data[key])
    data = named(docs, "ConfigMap", volume["configMap"]["name"])["data"]
    assert key in data, f"{path}: no key {key} in ConfigMap {volume['configMap']['name']}"
    return str(data[key]).encode()


@pytest.mark.skipif(KUBECTL is None, reason="kubectl (its built-in kustomize) is not installed")
def test_the_example_overlay_renders_to_valid_kubernetes_with_every_reference_resolved(tmp_path: Path) -> None:
    docs = render_overlay(tmp_path, "example")
    assert_valid_and_resolved(docs)
    # Each password file a pod names is in the Secret it mounts (the keys are the file names).
    inference = pod_specs(docs)["inference"]
    worker = container(inference, "worker")
    for var in ("THINKFLEET_REDIS_PASSWORD_FILE", "THINKFLEET_SIGNING_KEY_FILE"):
        assert mounted_file(docs, inference, worker, env_of(worker)[var])
    assert named(docs, "StatefulSet", "inference")["spec"]["replicas"] == 4


@pytest.mark.skipif(KUBECTL is None, reason="kubectl (its built-in kustomize) is not installed")
def test_the_ha_overlay_renders_a_head_that_fails_over_and_every_client_names_its_sentinels(tmp_path: Path) -> None:
    docs = render_overlay(tmp_path, "ha-example", extra_secrets=("sentinel_client_password",))
    assert_valid_and_resolved(docs)
    pods = pod_specs(docs)
    # What the component adds is in the fleet's namespace too (an object without one lands in "default").
    for doc in docs:
        assert doc["kind"] == "Namespace" or doc["metadata"]["namespace"] == "thinkfleet", doc["metadata"]
    # Three Redis and three Sentinels, one per node, behind headless Services that publish pods before they are ready.
    sentinel_sts, redis_sts = named(docs, "StatefulSet", "sentinel"), named(docs, "StatefulSet", "redis")
    for sts in (redis_sts, sentinel_sts):
        assert sts["spec"]["replicas"] == 3
        [anti] = sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        assert anti["topologyKey"] == "kubernetes.io/hostname"
        service = named(docs, "Service", sts["spec"]["serviceName"])
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
        assert named(docs, "PodDisruptionBudget", sts["metadata"]["name"])["spec"]["maxUnavailable"] == 1
    sentinels = [f"sentinel-{i}.{sentinel_sts['spec']['serviceName']}" for i in range(3)]
    # The Sentinels: quorum 2 of 3 (a majority: one Sentinel's view never fails the head over), names everywhere,
    # started by the compose head's entrypoint, the first primary redis-0.
    sentinel = container(pods["sentinel"], "sentinel")
    senv = env_of(sentinel)
    assert senv["SENTINEL_QUORUM"] == "2" and 2 * int(senv["SENTINEL_QUORUM"]) > sentinel_sts["spec"]["replicas"]
    assert senv["SENTINEL_ANNOUNCE_HOSTNAMES"] == "yes" and senv["SENTINEL_ANNOUNCE_IP"] == "$(POD_NAME).sentinel"
    assert senv["SENTINEL_PEERS"].split() == [f"{s}:26379" for s in sentinels]
    entrypoint = mounted_file(docs, pods["sentinel"], sentinel, sentinel["command"][-1]).decode()
    assert entrypoint == (REPO / "deploy" / "head" / "sentinel" / "entrypoint.sh").read_text()
    sentinel_dir = senv["SENTINEL_DIR"]
    [claim] = sentinel_sts["spec"]["volumeClaimTemplates"]
    assert {m["mountPath"]: m["name"] for m in sentinel["volumeMounts"]}[sentinel_dir] == claim["metadata"]["name"]
    # The Redis: AOF as the base's, the HA ACL users, a start that asks the Sentinels whether it is primary.
    redis = container(pods["redis"], "redis")
    renv = env_of(redis)
    scripts = {name: mounted_file(docs, pods["redis"], redis, f"/usr/local/etc/thinkfleet/{name}").decode()
               for name in ("redis-role.sh", "entrypoint.sh", "users.ha.acl.template")}  # fmt: skip
    assert redis["command"][-1] == "/usr/local/etc/thinkfleet/redis-role.sh"
    assert scripts["redis-role.sh"] == (K8S / "components" / "sentinel-head" / "redis-role.sh").read_text()
    assert redis["args"][redis["args"].index("--appendonly") + 1] == "yes"
    assert renv["REDIS_SELF"] == "$(POD_NAME).redis" and renv["REDIS_FIRST_PRIMARY"] == senv["SENTINEL_PRIMARY_HOST"]
    names = [e["name"] for e in redis["env"]]
    assert names.index("POD_NAME") < names.index("REDIS_SELF")  # $(POD_NAME) expands only from an earlier variable
    assert renv["HEAD_SENTINELS"].split(",") == [f"{s}:26379" for s in sentinels]
    # Every password the Redis and Sentinel scripts read is in the Secret their pod mounts.
    for user in ("admin", "producer", "worker", "flower", "exporter", "replica", "sentinel"):
        assert mounted_file(docs, pods["redis"], redis, f"/run/secrets/redis_{user}_password")
    for name in ("redis_sentinel_password", "sentinel_client_password"):
        assert mounted_file(docs, pods["redis"], redis, f"/run/secrets/{name}")
        assert mounted_file(docs, pods["sentinel"], sentinel, f"/run/secrets/{name}")
    # Every client names the three Sentinels and the primary's name, and takes both passwords from its own Secret:
    # as the settings open it, the URL carries both, and no password is a literal in any manifest.
    secret_values = {v for d in docs if d["kind"] == "Secret" for v in d.get("data", {}).values()}
    clients = {"inference": "worker", "flower": "flower", "producer-submit": "producer"}
    for workload, user in clients.items():
        pod = pods[workload]
        [c] = [c for c in pod["containers"] if "THINKFLEET_REDIS_URL" in env_of(c)]
        env = env_of(c)
        url = parse_sentinel(env["THINKFLEET_REDIS_URL"])
        assert url.sentinels == [(s, 26379) for s in sentinels], workload
        assert (url.master, url.username, url.password, url.sentinel_password) == (
            senv["SENTINEL_MASTER"],
            user,
            None,
            None,
        )
        files = {}
        for var in ("THINKFLEET_REDIS_PASSWORD_FILE", "THINKFLEET_REDIS_SENTINEL_PASSWORD_FILE"):
            files[var] = tmp_path / workload / Path(env[var]).name
            files[var].parent.mkdir(exist_ok=True)
            files[var].write_bytes(mounted_file(docs, pod, c, env[var]))
        opened = Settings(
            redis_url=env["THINKFLEET_REDIS_URL"],
            redis_password_file=str(files["THINKFLEET_REDIS_PASSWORD_FILE"]),
            redis_sentinel_password_file=str(files["THINKFLEET_REDIS_SENTINEL_PASSWORD_FILE"]),
        )
        parsed = parse_sentinel(opened.redis_url)
        assert parsed.password == files["THINKFLEET_REDIS_PASSWORD_FILE"].read_text().strip()
        assert (
            parsed.sentinel_password
            == mounted_file(docs, pods["sentinel"], sentinel, "/run/secrets/sentinel_client_password").decode().strip()
        )
        assert Path(env["THINKFLEET_REDIS_PASSWORD_FILE"]).name == f"redis_{user}_password"
    for doc in docs:
        if doc["kind"] != "Secret":
            text = yaml.safe_dump(doc)
            assert not any(value in text for value in secret_values), doc["metadata"]["name"]
            decoded = [base64.b64decode(v).decode().strip() for v in secret_values]
            assert not any(pw in text for pw in decoded if len(pw) >= 16), doc["metadata"]["name"]


# -- the numbers agree with the worker's -------------------------------------------------------------


def test_inference_pod_grace_covers_the_workers_drain_and_sglang_outlives_it() -> None:
    pod = named(base_documents(), "StatefulSet", "inference")["spec"]["template"]["spec"]
    grace_s = float(generated_literals("thinkfleet")["THINKFLEET_SHUTDOWN_GRACE_S"])
    assert grace_s == Settings.model_fields["shutdown_grace_s"].default
    termination_s = pod["terminationGracePeriodSeconds"]
    assert termination_s >= grace_s + HAND_BACK_MARGIN_S
    # SGLang's preStop keeps the server up until the worker exits, at most DRAIN_WAIT_S: long enough for the
    # drain and the hand-back, and inside the pod's grace so the SIGKILL never cuts the hand-back short.
    sglang = container(pod, "sglang")
    drain_wait_s = float(env_of(sglang)["DRAIN_WAIT_S"])
    assert grace_s + HAND_BACK_MARGIN_S <= drain_wait_s < termination_s
    pre_stop = "\n".join(sglang["lifecycle"]["preStop"]["exec"]["command"])
    assert "DRAIN_WAIT_S" in pre_stop and "9464" in pre_stop  # it waits on the worker's metrics port


def test_inference_pod_is_one_gpu_node_with_sglang_and_its_worker_on_localhost() -> None:
    docs = base_documents()
    sts = named(docs, "StatefulSet", "inference")
    pod = sts["spec"]["template"]["spec"]
    sglang, worker = container(pod, "sglang"), container(pod, "worker")
    # One pod per node: required anti-affinity on the hostname, GPU nodes only, all of a node's GPUs.
    [anti] = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert sglang["resources"]["limits"]["nvidia.com/gpu"] >= 1
    args = " ".join(sglang["args"])
    port = re.search(r"--port (\d+)", args).group(1)  # type: ignore[union-attr]
    # Ready only when the model answers a real generation (exec probes: SGLang listens on the pod's loopback).
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        [script] = [a for a in sglang[probe]["exec"]["command"] if a.endswith(".py")]
        [mount] = [m for m in sglang["volumeMounts"] if script.startswith(m["mountPath"] + "/")]
        [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["configMap"]["name"] == "thinkfleet-sglang-probe"
    probe_code = (BASE / "health.py").read_text()
    assert f"127.0.0.1:{port}/health_generate" in probe_code
    assert sglang["readinessProbe"]["timeoutSeconds"] > 80  # the probe's own timeout, inside the kubelet's
    # The worker talks to the server on the pod's localhost, on the port the server listens on.
    assert "--host 127.0.0.1" in args
    assert env_of(worker)["THINKFLEET_SGLANG_URL"] == f"http://127.0.0.1:{port}"
    # The worker's identity is the pod's stable name; every THINKFLEET_* it is given is a real setting.
    assert env_of(worker)["THINKFLEET_WORKER_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    given = set(env_of(worker)) | set(generated_literals("thinkfleet"))
    assert {name for name in given if name.startswith("THINKFLEET_")} <= setting_env_names()
    # A PodDisruptionBudget covers exactly these pods.
    pdb = named(docs, "PodDisruptionBudget", "inference")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert pdb["spec"]["maxUnavailable"] == 1


def test_redis_keeps_its_aof_on_a_persistent_volume_and_renders_the_acl_per_role() -> None:
    sts = named(base_documents(), "StatefulSet", "redis")
    redis = container(sts["spec"]["template"]["spec"], "redis")
    args = redis["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--appendfsync") + 1] == "everysec"
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    data_dir = args[args.index("--dir") + 1]
    [claim] = sts["spec"]["volumeClaimTemplates"]
    mounts = {m["mountPath"]: m["name"] for m in redis["volumeMounts"]}
    assert mounts[data_dir] == claim["metadata"]["name"]
    assert redis["command"][-1].endswith("/entrypoint.sh")  # deploy/head/redis/entrypoint.sh: ACL users
    clients = [
        env_of(c)["THINKFLEET_REDIS_URL"]
        for d in base_documents()
        if d["kind"] in {"StatefulSet", "Deployment", "Job"}
        for c in d["spec"]["template"]["spec"]["containers"]
        if "THINKFLEET_REDIS_URL" in env_of(c)
    ]
    assert sorted(re.match(r"redis://(\w+)@", url).group(1) for url in clients) == ["flower", "producer", "worker"]  # type: ignore[union-attr]
