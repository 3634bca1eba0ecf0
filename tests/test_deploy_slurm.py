"""deploy/slurm/ on a real Slurm: a one-machine cluster (slurmctld, three slurmd node names, munged) runs
``thinkfleet.sbatch`` as a job array with the SGLang simulator standing in for the server.

Given a head Redis started by ``head.sbatch`` (AOF on the "shared" directory) and a job of prompts,
when three array elements join it, one is ``scancel``-ed mid-run (every process SIGTERMed, SIGKILL after
``KillWait``), another gets its time limit's ``--signal=B:TERM`` warning and drains, and a resubmitted element
joins in their place, then every prompt is stored exactly once (``producer verify``, rows byte-equal to the
simulator's, ``producer status`` agreeing) and the workers were named by Slurm node and job id. ``head-ha.sbatch``,
the head that fails over, runs too: three tasks, a Sentinel naming the primary, its URL followed through a failover.

The cluster is this test's own: a private munged socket and key, slurm.conf in a temp dir, slurmd's on free
ports as ``-N n1..n3`` (``NodeName``s sharing this host), all stopped at the end. Without Slurm installed
(``apt-get install slurm-wlm munge``) the test skips, and fails under CI (.ci/run installs them).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from demo.fleet import free_port
from testing.harness import FAST_WORKER, make_prompts, producer_cli, republish, submit_ids
from testing.record import check_job
from testing.services import service_missing
from thinkfleet.settings import Settings

REPO = Path(__file__).resolve().parent.parent
SLURM_DIR = REPO / "deploy" / "slurm"
NODES = ("n1", "n2", "n3", "n4")
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "sinfo")
#: Slurm's KillWait here: SIGTERM → SIGKILL of a cancelled or timed-out job (the default is 30 s).
KILL_WAIT_S = 10


def _missing_tools() -> list[str]:
    return [tool for tool in DAEMONS if shutil.which(tool) is None]


class SlurmCluster:
    """slurmctld + one slurmd per node name + munged, all on this machine, configured in ``root``."""

    def __init__(self, root: Path, nodes: tuple[str, ...] = NODES, cpus: int = 2):
        self.root = root
        self.nodes = nodes
        self.cpus = cpus
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_conf(self) -> None:
        host = socket.gethostname()
        for sub in ("state", "spool", "logs", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        lines = [
            f"ClusterName=tf{os.getpid()}",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}/%n",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'slurmd'}-%n.pid",
            f"SlurmctldLogFile={self.root / 'logs' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'logs'}/slurmd-%n.log",
            # No cgroups in a container: processes are tracked by parentage, tasks not bound.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "ReturnToService=2",
            f"KillWait={KILL_WAIT_S}",
            "MinJobAge=600",
            "InactiveLimit=0",
            "SlurmdTimeout=60",
        ]
        for node in self.nodes:
            lines.append(
                f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} "
                f"CPUs={self.cpus} RealMemory=1000 State=UNKNOWN"
            )
        lines.append(f"PartitionName=tf Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, *argv: str) -> None:
        log = open(self.root / "logs" / f"{name}.stdout", "ab")  # noqa: SIM115 - closed with the process
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()

    def start(self, timeout_s: float = 60.0) -> SlurmCluster:
        self.write_conf()
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.root.chmod(0o700)
        munge = self.root / "munge"
        munge.chmod(0o700)
        self._spawn(
            "munged",
            "munged",
            "--foreground",
            "--force",
            f"--key-file={key}",
            f"--socket={self.munge_socket}",
            f"--pid-file={munge / 'munged.pid'}",
            f"--log-file={munge / 'munged.log'}",
            f"--seed-file={munge / 'munged.seed'}",
        )
        self._wait(lambda: self.munge_socket.exists(), timeout_s, "munged's socket")
        self._spawn("slurmctld", "slurmctld", "-D", "-c", "-i", "-f", str(self.conf))
        for node in self.nodes:
            (self.root / "spool" / node).mkdir(parents=True, exist_ok=True)
            self._spawn(f"slurmd-{node}", "slurmd", "-D", "-N", node, "-f", str(self.conf))
        self._wait(lambda: self.idle_nodes() == set(self.nodes), timeout_s, "every node idle in sinfo")
        return self

    def _wait(self, ready: object, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}) waiting for {what}:\n{self.logs()}")
            if ready():  # type: ignore[operator]
                return
            time.sleep(0.2)
        raise TimeoutError(f"no {what} after {timeout_s}s:\n{self.logs()}")

    def logs(self) -> str:
        out = []
        for path in [*sorted((self.root / "logs").glob("*")), self.root / "munge" / "munged.log"]:
            if path.is_file():
                text = "".join(line for line in path.read_text(errors="replace").splitlines(True) if "pmix" not in line)
                out.append(f"--- {path.name}\n{text[-3000:]}")
        return "\n".join(out)

    def run(self, *argv: str, env: dict[str, str] | None = None, cwd: Path = REPO) -> str:
        done = subprocess.run(
            argv, env={**self.env, **(env or {})}, cwd=cwd, capture_output=True, text=True, timeout=60
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: rc {done.returncode}\n{done.stdout}{done.stderr}")
        return done.stdout

    def idle_nodes(self) -> set[str]:
        try:
            out = self.run("sinfo", "-h", "-N", "-o", "%N %T")
        except (RuntimeError, subprocess.TimeoutExpired):
            return set()
        return {line.split()[0] for line in out.splitlines() if line.split()[1:] == ["idle"]}

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, NodeList, …); one array element by its own id."""
        out = self.run("scontrol", "-o", "show", "job", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", out.splitlines()[0]))

    def queued(self, *filters: str) -> list[str]:
        """Ids of the jobs squeue still lists (pending, running or completing)."""
        try:
            return self.run("squeue", "-h", "-o", "%i", *filters).split()
        except (RuntimeError, subprocess.TimeoutExpired):
            return []

    def cancel_all(self, *filters: str, timeout_s: float) -> None:
        """scancel (SIGTERM, SIGKILL after KillWait) the matching jobs and wait until squeue lists none."""
        subprocess.run(["scancel", *filters], env=self.env, capture_output=True, timeout=60)
        deadline = time.monotonic() + timeout_s
        while self.queued(*filters) and time.monotonic() < deadline:
            time.sleep(0.3)

    def stop(self) -> None:
        # Node elements first, so their workers drain against a live Redis; then the head; then the daemons.
        self.cancel_all("--name=thinkfleet", timeout_s=KILL_WAIT_S + 20)
        self.cancel_all("--partition=tf", timeout_s=KILL_WAIT_S + 20)
        for name in [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self.kill_leftovers()

    def kill_leftovers(self) -> list[int]:
        """SIGKILL whatever this cluster left running. proctrack/linuxproc under a sandboxed kernel (gVisor
        here) does not always reach a job's processes with its SIGKILL, so the test reaps them itself, by pid:
        every process whose environment names this cluster's slurm.conf — the daemons were started with it,
        sbatch exported it to every job, and this test's own process never had it."""
        marker = f"SLURM_CONF={self.conf}".encode()
        killed = []
        for proc_dir in Path("/proc").iterdir():
            if not proc_dir.name.isdigit() or int(proc_dir.name) == os.getpid():
                continue
            try:
                if marker in (proc_dir / "environ").read_bytes().split(b"\0"):
                    os.kill(int(proc_dir.name), signal.SIGKILL)
                    killed.append(int(proc_dir.name))
            except OSError:
                continue
        return killed


@pytest.fixture
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    missing = _missing_tools()
    if missing:
        service_missing(f"Slurm is not installed (missing {', '.join(missing)}): apt-get install slurm-wlm munge")
    # A short root: munged's socket path must fit in sockaddr_un (108 bytes).
    root = Path(tmp_path_factory.mktemp("slurm", numbered=True))
    cluster = SlurmCluster(root)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


# -- the numbers: the drain fits in what Slurm gives ---------------------------------------------------


def sbatch_options(path: Path) -> dict[str, str]:
    """``#SBATCH --name=value`` lines of a script (flags without a value map to '')."""
    options = {}
    for line in path.read_text().splitlines():
        if line.startswith("#SBATCH "):
            flag = line.split(None, 1)[1].strip()
            name, _, value = flag.partition("=")
            options[name] = value
    return options


def node_env_default(name: str) -> str:
    """The default node.env gives ``name`` (``NAME="${NAME:-default}"``)."""
    match = re.search(rf'^(?:export )?{name}="\$\{{{name}:-([^}}]*)\}}"', (SLURM_DIR / "node.env").read_text(), re.M)
    assert match, f"node.env sets no default for {name}"
    return match.group(1)


def test_slurm_drain_fits_in_the_time_limit_warning() -> None:
    from tests.test_deploy_compose import HAND_BACK_MARGIN_S

    options = sbatch_options(SLURM_DIR / "thinkfleet.sbatch")
    signal_opt = re.fullmatch(r"B:TERM@(\d+)", options["--signal"])
    assert signal_opt, f"--signal={options['--signal']}: the warning must go to the batch shell (B:) as SIGTERM"
    grace_s = float(node_env_default("THINKFLEET_SHUTDOWN_GRACE_S"))
    assert grace_s == Settings.model_fields["shutdown_grace_s"].default
    assert int(signal_opt.group(1)) >= grace_s + HAND_BACK_MARGIN_S
    assert "--requeue" in options  # a preempted element comes back and joins again
    # A plain scancel's SIGKILL comes after the cluster's KillWait (30 s by default, under the drain's needs):
    # node.env, where the grace is set, tells the operator the bound.
    assert "KillWait" in (SLURM_DIR / "node.env").read_text()


def test_slurm_scripts_parse() -> None:
    for script in ("thinkfleet.sbatch", "head.sbatch", "head-ha.sbatch", "head-ha.sh", "node.sh", "node.env"):
        done = subprocess.run(["bash", "-n", str(SLURM_DIR / script)], capture_output=True, text=True)
        assert done.returncode == 0, f"{script}: {done.stderr}"


# -- the real thing ------------------------------------------------------------------------------------

#: What the elements run: the simulator in place of SGLang, on a free port each (they share this host).
SIM_ENV = {
    "SGLANG_RUNTIME": "sim",
    "SGLANG_PORT": "auto",
    "SIM_ARGS": "--time-scale 15",
    "SGLANG_START_TIMEOUT_S": "60",
    "THINKFLEET_MAX_INFLIGHT": "6",
    "THINKFLEET_METRICS_PORT": "0",  # any free port: the elements share this host
    **{f"THINKFLEET_{k.upper()}": str(v) for k, v in FAST_WORKER.items()},
    # Long enough that no stall of a loaded box lets a survivor's lease lapse; the cancelled element's
    # prompts come back by its hand-back, or after this lease if SIGKILL lands first.
    "THINKFLEET_LEASE_S": "15",
}


def job_logs(logs: Path) -> str:
    """The tail of every job's output (sbatch --output), for a failure's message."""
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in sorted(logs.glob("*.out")))


def _wait_for(what: str, ready: object, timeout_s: float, cluster: SlurmCluster, logs: Path) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = ready()  # type: ignore[operator]
        if value:
            return value
        time.sleep(0.3)
    raise TimeoutError(f"no {what} after {timeout_s}s\n{cluster.run('squeue')}\n{job_logs(logs)}")


def _stored_by(client: redis.Redis, settings: Settings, job: str) -> dict[str, int]:
    from thinkfleet.keys import Keys

    keys: Keys = settings.keys
    return {k.decode(): int(float(v)) for k, v in client.hgetall(keys.worker_counters(job)).items()}


def test_slurm_array_job_survives_scancel_and_time_limit_exactly_once(slurm: SlurmCluster, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {"THINKFLEET_SHARED_DIR": str(shared), "THINKFLEET_HOME": str(REPO)}
    tag = os.urandom(4).hex()

    # Given: the head's Redis, started by head.sbatch with its AOF in the shared directory.
    head_env = {**env, "REDIS_PORT": str(free_port()), "REDIS_ADVERTISE": "127.0.0.1"}
    slurm.run(
        "sbatch",
        "--parsable",
        f"--output={logs}/head-%j.out",
        "--mem=0",
        "--cpus-per-task=1",
        str(SLURM_DIR / "head.sbatch"),
        env=head_env,
    )
    url_file = shared / "redis.url"
    _wait_for("redis.url from head.sbatch", url_file.exists, 60, slurm, logs)
    settings = Settings(
        redis_url=url_file.read_text().strip(),
        redis_password_file=str(shared / "redis_password"),
        # head.sbatch's signing key, which node.env hands the workers: the producer signs with the same file.
        signing_key_file=str(shared / "signing_key"),
        output_uri=str(tmp_path / "out"),
        key_prefix=f"t{tag}",
        queue=f"q{tag}",
    )
    client = redis.Redis.from_url(settings.redis_url)
    assert client.config_get("appendonly") == {"appendonly": "yes"}
    first = submit_ids(settings, "slurm-first", make_prompts(150, seed=3))

    node_env = {
        **env,
        **SIM_ENV,
        "THINKFLEET_KEY_PREFIX": settings.key_prefix,
        "THINKFLEET_QUEUE": settings.queue,
        "THINKFLEET_OUTPUT_URI": settings.output_uri,
    }

    def sbatch(*args: str) -> str:
        # No GPUs and 1000 MB per node here: the script's --gres=gpu:8 and memory do not apply.
        out = slurm.run(
            "sbatch",
            "--parsable",
            "--gres=none",
            "--mem=0",
            f"--output={logs}/%A_%a.out",
            *args,
            str(SLURM_DIR / "thinkfleet.sbatch"),
            env=node_env,
        )
        return out.strip().split(";")[0]

    # When: three array elements join the job.
    array = sbatch("--array=0-2")
    _wait_for("three workers storing rows", lambda: len(_stored_by(client, settings, first.name)) >= 3, 90, slurm, logs)
    # One is cancelled the hard way (every process SIGTERMed, SIGKILL after KillWait).
    cancelled = f"{array}_1"
    slurm.run("scancel", cancelled)
    # Another's time limit is cut to one minute: Slurm sends it the --signal=B:TERM warning, it drains and ends.
    timed = f"{array}_2"
    slurm.run("scontrol", "update", f"JobId={timed}", "TimeLimit=1")
    # A resubmitted element takes the cancelled one's place and joins.
    replacement = sbatch("--array=1")
    _wait_for(
        "the resubmitted element's worker",
        lambda: any(name.decode().endswith(f"-{replacement}_1") for name in client.hkeys(settings.keys.workers)),
        90,
        slurm,
        logs,
    )
    _wait_for("the two elements to end", lambda: not slurm.queued(f"--jobs={cancelled},{timed}"), 60, slurm, logs)
    # A second job, submitted now, is shared by the survivor and the newcomer.
    second = submit_ids(settings, "slurm-second", make_prompts(60, seed=4))
    # A copy without the producer's signature (what a Redis writer without the key could push) is refused:
    # node.env handed the nodes head.sbatch's signing key.
    republish(dataclasses.replace(second, settings=settings.model_copy(update={"signing_key_file": None})), ["p00000"])
    _wait_for("the unsigned copy refused", lambda: client.llen(settings.keys.malformed) == 1, 90, slurm, logs)
    assert b"unsigned_message" in client.lindex(settings.keys.malformed, 0)
    for job in (first, second):
        finished = producer_wait(settings, job.name)
        assert finished.returncode == 0, finished.stdout + finished.stderr + job_logs(logs)

    # Then: every prompt exactly once, and the workers named by node and Slurm job id.
    for job in (first, second):
        check_job(settings, job.name, job.prompts, job.sampling_params).assert_clean()
    stored = _stored_by(client, settings, first.name) | _stored_by(client, settings, second.name)
    assert all(re.fullmatch(r"n\d-\d+_\d", name) for name in stored), stored
    assert f"{array}_1" in " ".join(stored), f"the cancelled element stored nothing before its cancel: {stored}"
    joined = [name for name in _stored_by(client, settings, second.name) if name.endswith(f"-{replacement}_1")]
    assert joined, f"the resubmitted element stored nothing: {stored}"
    infos = {k.decode(): json.loads(v) for k, v in client.hgetall(settings.keys.workers).items()}
    for name in stored:
        node, job_ref = name.split("-")
        assert infos[name]["slurm_node"] == node
        assert f"{infos[name]['slurm_array_job_id']}_{infos[name]['slurm_array_task_id']}" == job_ref
    assert slurm.job(cancelled)["JobState"] == "CANCELLED"
    timed_log = (logs / f"{array}_2.out").read_text()
    assert "SIGTERM: draining" in timed_log, timed_log
    assert "worker exited (rc 0)" in timed_log, timed_log  # drained and exited by itself, before the SIGKILL
    status = producer_cli(settings, "status", second.name, in_process=True)
    assert status.returncode == 0 and joined[0] in status.stdout, status.stdout + status.stderr


def _free_ports_in_a_row(n: int) -> int:
    """The first of ``n`` consecutive free ports (head-ha.sbatch's tasks share this host: base + rank)."""
    for _ in range(100):
        base = free_port()
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {n} free ports in a row")


def test_slurm_ha_head_starts_names_its_primary_and_fails_over_behind_its_url(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """``head-ha.sbatch``: three tasks on three nodes (here three node names on one host, ports base + rank), each a
    Redis and a Sentinel. The URL it writes opens the primary as the settings do; when the primary's Redis dies the
    Sentinels promote a replica, the same URL writes to it, and redis-ha/primary names the promoted task (where a
    requeued head starts its primary)."""
    from thinkfleet.redis_client import parse_sentinel, sync_client

    shared, logs = tmp_path / "shared", tmp_path / "logs"
    logs.mkdir()
    rport, sport = _free_ports_in_a_row(3), _free_ports_in_a_row(3)
    env = {
        "THINKFLEET_SHARED_DIR": str(shared),
        "THINKFLEET_HOME": str(REPO),
        "REDIS_PORT": str(rport),
        "SENTINEL_PORT": str(sport),
        "HEAD_PORT_STRIDE": "1",
        "REDIS_ADVERTISE": "127.0.0.1",
        "REDIS_MAXMEMORY": "256mb",
        "SENTINEL_DOWN_AFTER_MS": "1000",
        "SENTINEL_FAILOVER_TIMEOUT_MS": "4000",
    }
    slurm.run(
        "sbatch", "--parsable", f"--output={logs}/head-%j.out", "--mem=0", "--cpus-per-task=1",
        str(SLURM_DIR / "head-ha.sbatch"), env=env,
    )  # fmt: skip
    url_file = shared / "redis.url"
    _wait_for("redis.url from head-ha.sbatch", url_file.exists, 90, slurm, logs)
    url = url_file.read_text().strip()
    # Given the URL it wrote: the three Sentinels (one per task), and the nodes' settings as node.env gives them.
    assert [port for _h, port in parse_sentinel(url).sentinels] == [sport, sport + 1, sport + 2]
    given = subprocess.run(
        ["bash", "-c", f"source {SLURM_DIR / 'node.env'} && env"],
        env={**os.environ, "THINKFLEET_SHARED_DIR": str(shared), "THINKFLEET_HOME": str(REPO)},
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    node = dict(line.split("=", 1) for line in given.splitlines() if line.startswith("THINKFLEET_REDIS"))
    assert node["THINKFLEET_REDIS_URL"] == url
    settings = Settings(
        redis_url=url,
        redis_password_file=node["THINKFLEET_REDIS_PASSWORD_FILE"],
        redis_sentinel_password_file=node["THINKFLEET_REDIS_SENTINEL_PASSWORD_FILE"],
    )
    password = (shared / "redis_password").read_text().strip()
    watchers = [redis.Redis(port=sport + rank, password=password, socket_timeout=5) for rank in range(3)]

    def primary() -> int | None:
        try:
            return int(watchers[1].sentinel_get_master_addr_by_name("thinkfleet")[1])
        except (redis.RedisError, TypeError):
            return None

    # Then a Sentinel names task 0's Redis the primary, the URL writes to it (a replica streams from it: the head
    # takes writes once redis.url is there), and its AOF is on.
    # (waited for: the Sentinel names its primary once it has monitored it, later on a loaded box)
    _wait_for("a Sentinel naming task 0's Redis the primary", lambda: primary() == rport, 120, slurm, logs)
    client = sync_client(settings.redis_url)
    client.set("ha:probe", "1")
    assert client.execute_command("ROLE")[0] == b"master" and client.config_get("appendonly") == {"appendonly": "yes"}
    with pytest.raises(redis.AuthenticationError):  # the Sentinels answer only with the password
        redis.Redis(port=sport, socket_timeout=5).sentinel_get_master_addr_by_name("thinkfleet")

    # When every Sentinel knows both replicas online and the others (a Sentinel learns the replicas from the
    # primary's INFO, every 10 s: one elected to fail over before it did finds "no good replica")…
    def ready(watcher: redis.Redis) -> bool:
        replicas = watcher.sentinel_slaves("thinkfleet")
        linked = [r for r in replicas if not r["is_disconnected"] and r.get("master-link-status") == "ok"]
        return len(linked) == 2 and len(watcher.sentinel_sentinels("thinkfleet")) == 2

    _wait_for("every Sentinel seeing it all", lambda: all(ready(w) for w in watchers), 60, slurm, logs)
    # …and task 0's Redis dies,
    pid = int((shared / "redis-ha" / "0" / "redis.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    # then the Sentinels promote a replica, the same URL writes to it, and redis-ha/primary names its task.
    _wait_for("a promoted replica", lambda: primary() in (rport + 1, rport + 2), 60, slurm, logs)
    new = primary()
    assert new is not None
    _wait_for("a write through the URL", lambda: _set(client, "ha:probe", "2"), 60, slurm, logs)
    assert redis.Redis(port=new, password=password).get("ha:probe") == b"2"
    promoted = str(new - rport)
    _wait_for(
        "redis-ha/primary naming the promoted task",
        lambda: (shared / "redis-ha" / "primary").read_text().strip() == promoted,
        30, slurm, logs,
    )  # fmt: skip


def _set(client: redis.Redis, key: str, value: str) -> bool:
    try:
        return bool(client.set(key, value))
    except redis.RedisError:
        return False


def producer_wait(settings: Settings, job: str) -> subprocess.CompletedProcess[str]:
    # in this process (click's runner): what is under test is Slurm's elements, not the producer's process (a new
    # interpreter costs ≈ 1.5 CPU-s on the 2-core CI box)
    return producer_cli(settings, "wait", job, "--timeout", "120", in_process=True)


@pytest.mark.slow
def test_slurm_one_element_over_two_nodes_drains_every_node(
    slurm: SlurmCluster, redis_url: str, tmp_path: Path
) -> None:
    """``--nodes=2``: one srun task per node, each its own worker; the graceful cancel reaches every node's
    task (srun itself would kill the step on SIGTERM, so the script signals the step's tasks instead)."""
    logs = tmp_path / "logs"
    logs.mkdir()
    tag = os.urandom(4).hex()
    env = {
        **SIM_ENV,
        "THINKFLEET_HOME": str(REPO),
        "THINKFLEET_REDIS_URL": redis_url,
        "THINKFLEET_KEY_PREFIX": f"t{tag}",
        "THINKFLEET_QUEUE": f"q{tag}",
        "THINKFLEET_OUTPUT_URI": str(tmp_path / "out"),
    }
    out = slurm.run(
        "sbatch", "--parsable", "--gres=none", "--mem=0", "--array=0", "--nodes=2",
        f"--output={logs}/%A_%a.out", str(SLURM_DIR / "thinkfleet.sbatch"), env=env,
    )  # fmt: skip
    array = out.strip().split(";")[0]
    client = redis.Redis.from_url(redis_url)
    workers_key = Settings(key_prefix=f"t{tag}").keys.workers
    _wait_for("a worker on each node", lambda: len(client.hkeys(workers_key)) == 2, 90, slurm, logs)
    assert {k.decode() for k in client.hkeys(workers_key)} == {f"n1-{array}_0", f"n2-{array}_0"}
    slurm.run("scancel", "--batch", "--signal=TERM", f"{array}_0")
    _wait_for("the element to end", lambda: not slurm.queued(), 60, slurm, logs)
    log = (logs / f"{array}_0.out").read_text()
    assert log.count("worker exited (rc 0)") == 2, log  # both drained and exited by themselves
    assert "node.sh exited (rc 0)" in log, log
