"""CPU-seconds per test, for ``scripts/ci_profile.sh``: a pytest plugin and the report that sums it per file.

On the 2-core CI box the suite is CPU-bound for the whole run, so wall time says more about the neighbours than
about a test; what a test costs is the CPU that it and every process it started (Redis, simulators, Celery workers
and their pool children, ``producer`` subprocesses) used while it ran. Enabled with ``-p testing.cpu_profile`` and
``THINKFLEET_CPU_PROFILE=PATH``: each pytest process (each xdist worker) appends one JSON line per test to PATH
(setup + call + teardown, so a module fixture's start lands on the module's first test and its stop on the last).

How CPU is counted, best first (the ``method`` of each row):

- ``cgroup``: the pytest process moves itself into a fresh cgroup of its own (cgroup v1 ``cpuacct`` or cgroup v2,
  where the hierarchy is writable, as for root on the CI box); everything it starts is born inside it, and the
  kernel charges their CPU to it whether they are waited for, daemonized or orphaned. Exact, to the nanosecond.
  What it misses: CPU burnt on the test's behalf by processes it did not start (the shared Redis on 6379, the
  kernel's own threads).
- ``proc``: no writable cgroup. The CPU of this process, of the children it reaped (``RUSAGE_CHILDREN``) and of
  every live descendant (utime + stime + the reaped-children times, from ``/proc/PID/stat``), before and after
  each test. Time moves from a dead process to its parent's children-times, so the sum is conserved, except for
  a process whose parent died first (reparented to init: its CPU is lost, and a daemon alive at a test's start
  and gone at its end makes that test read low).

Report: ``python -m testing.cpu_profile report PATH [--top N]`` prints the per-file markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Generator
from pathlib import Path

import pytest

PROFILE_ENV = "THINKFLEET_CPU_PROFILE"
CGROUP_PREFIX = "thinkfleet-cpu-"
_TICKS_S = os.sysconf("SC_CLK_TCK")


class CgroupMeter:
    """CPU-seconds of a cgroup this process moved itself into (its later children are born inside it)."""

    method = "cgroup"

    def __init__(self, path: Path, usage_file: str) -> None:
        self.path = path
        self.usage_file = usage_file

    @classmethod
    def create(cls) -> CgroupMeter | None:
        """A fresh cgroup holding this process, or None where no writable CPU hierarchy is mounted."""
        name = f"{CGROUP_PREFIX}{os.getpid()}"
        for _, parent, usage_file in _cpu_hierarchies():
            _remove_stale(parent)
            path = parent / name
            try:
                path.mkdir(exist_ok=True)
                (path / "cgroup.procs").write_text(f"{os.getpid()}\n")
            except OSError:
                continue
            meter = cls(path, usage_file)
            try:
                meter.cpu_s()
            except (OSError, ValueError):
                continue
            return meter
        return None

    def cpu_s(self) -> float:
        text = (self.path / self.usage_file).read_text()
        if self.usage_file == "cpuacct.usage":  # nanoseconds
            return int(text) / 1e9
        fields = dict(line.split() for line in text.splitlines())  # cgroup v2 cpu.stat
        return int(fields["usage_usec"]) / 1e6

    def others(self) -> int:
        """Processes in the cgroup besides this one: after a test, what it (or one before it) left running, whose
        CPU the next tests are charged."""
        return sum(1 for line in (self.path / "cgroup.procs").read_text().split() if line != str(os.getpid()))

    def close(self) -> None:
        """Back to the parent cgroup; the empty cgroup is removed (one a process left behind stays, harmless)."""
        try:
            (self.path.parent / "cgroup.procs").write_text(f"{os.getpid()}\n")
            self.path.rmdir()
        except OSError:
            pass


def _remove_stale(parent: Path) -> None:
    """Remove the empty cgroups of profiled runs that were killed before they could (their process is gone)."""
    for stale in parent.glob(f"{CGROUP_PREFIX}*"):
        pid = stale.name[len(CGROUP_PREFIX) :]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            try:
                stale.rmdir()  # refused while a process is still inside: then it stays
            except OSError:
                pass


def _cpu_hierarchies() -> list[tuple[str, Path, str]]:
    """(controller, this process's cgroup dir, usage file) for a v1 cpuacct and a v2 hierarchy, where mounted."""
    found = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        rel = rel.lstrip("/")
        if "cpuacct" in controllers.split(","):
            for mount in ("/sys/fs/cgroup/cpuacct", "/sys/fs/cgroup/cpu,cpuacct"):
                if (Path(mount) / "cpuacct.usage").exists():
                    found.append(("cpuacct", Path(mount) / rel, "cpuacct.usage"))
                    break
        elif controllers == "":
            for mount in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
                if (Path(mount) / "cgroup.procs").exists() and (Path(mount) / rel).is_dir():
                    found.append(("v2", Path(mount) / rel, "cpu.stat"))
                    break
    return found


class ProcMeter:
    """CPU-seconds of this process, its reaped children and its live descendants (see the module's limits)."""

    method = "proc"

    def cpu_s(self) -> float:
        me = resource.getrusage(resource.RUSAGE_SELF)
        reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
        total = me.ru_utime + me.ru_stime + reaped.ru_utime + reaped.ru_stime
        return total + sum(_descendant_ticks(os.getpid())) / _TICKS_S

    def close(self) -> None:
        pass


def _descendant_ticks(root: int) -> list[int]:
    """utime + stime + cutime + cstime (clock ticks) of each live descendant of ``root``."""
    children: dict[int, list[int]] = defaultdict(list)
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "(comm)": fields 3.. of proc(5)
        children[int(fields[1])].append(int(entry))
        ticks[int(entry)] = sum(int(f) for f in fields[11:15])
    out, todo = [], list(children[root])
    while todo:
        pid = todo.pop()
        out.append(ticks[pid])
        todo.extend(children[pid])
    return out


class CpuProfile:
    """The plugin: one JSON line per test, and one per process for what no test ran (imports, collection)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.meter: CgroupMeter | ProcMeter = CgroupMeter.create() or ProcMeter()
        self.started_cpu_s = self.meter.cpu_s()
        self.in_tests_s = 0.0

    def _write(self, row: dict[str, object]) -> None:
        # one write of a short line to an O_APPEND file: the xdist workers' lines do not interleave
        with open(self.out, "a") as f:
            f.write(json.dumps(row) + "\n")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, None, None]:
        cpu0, wall0 = self.meter.cpu_s(), time.monotonic()
        yield
        cpu_s = self.meter.cpu_s() - cpu0
        self.in_tests_s += cpu_s
        row: dict[str, object] = {
            "nodeid": item.nodeid,
            "file": item.nodeid.split("::", 1)[0],
            "cpu_s": round(cpu_s, 3),
            "wall_s": round(time.monotonic() - wall0, 3),
            "method": self.meter.method,
        }
        if isinstance(self.meter, CgroupMeter):
            row["left_running"] = self.meter.others()
        self._write(row)

    def pytest_sessionfinish(self) -> None:
        outside = self.meter.cpu_s() - self.started_cpu_s - self.in_tests_s
        self._write(
            {"nodeid": None, "file": "(outside tests: collection, session teardown)", "cpu_s": round(outside, 3)}
        )
        self.meter.close()


def pytest_configure(config: pytest.Config) -> None:
    out = os.environ.get(PROFILE_ENV)
    if out and not config.pluginmanager.has_plugin("thinkfleet-cpu-profile"):
        # the xdist controller runs no tests: only the processes that do are measured
        if getattr(config, "workerinput", None) is None and config.getoption("numprocesses", None):
            return
        config.pluginmanager.register(CpuProfile(Path(out)), "thinkfleet-cpu-profile")


# -- the report -------------------------------------------------------------------------------------------


def load(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def report(rows: list[dict[str, object]], top: int = 20, top_tests: int = 15) -> str:
    """A markdown table of the ``top`` files by CPU-seconds, then the ``top_tests`` most expensive tests."""
    tests = [r for r in rows if r.get("nodeid")]
    outside = sum(float(r["cpu_s"]) for r in rows if not r.get("nodeid"))  # type: ignore[arg-type]
    by_file: dict[str, list[dict[str, object]]] = defaultdict(list)
    for r in tests:
        by_file[str(r["file"])].append(r)
    total = sum(float(r["cpu_s"]) for r in tests) or 1.0  # type: ignore[arg-type]
    files = sorted(by_file.items(), key=lambda kv: -sum(float(r["cpu_s"]) for r in kv[1]))  # type: ignore[arg-type]
    methods = sorted({str(r.get("method")) for r in tests})
    lines = [
        f"{len(tests)} tests in {len(by_file)} files: {total:.0f} CPU-s in tests, {outside:.0f} CPU-s outside "
        f"them (start-up, collection); measured by {', '.join(methods)}.",
        "",
        "| # | file | tests | CPU-s | share | CPU-s per test | wall-s |",
        "|--:|------|------:|------:|------:|------:|------:|",
    ]
    for i, (name, rs) in enumerate(files[:top], 1):
        cpu = sum(float(r["cpu_s"]) for r in rs)  # type: ignore[arg-type]
        wall = sum(float(r["wall_s"]) for r in rs)  # type: ignore[arg-type]
        lines.append(
            f"| {i} | `{name}` | {len(rs)} | {cpu:.1f} | {100 * cpu / total:.1f} % | {cpu / len(rs):.1f} | {wall:.0f} |"
        )
    leaky = [r for r in tests if r.get("left_running")]
    if leaky:
        first = leaky[0]
        lines += [
            "",
            f"{len(leaky)} tests ended with processes of the run still alive (module or session fixtures, or a leak: "
            f"their CPU is charged to the tests after them); the first: `{first['nodeid']}` "
            f"({first['left_running']}).",
        ]
    lines += ["", "| test | CPU-s | wall-s |", "|------|------:|------:|"]
    for r in sorted(tests, key=lambda r: -float(r["cpu_s"]))[:top_tests]:  # type: ignore[arg-type]
        lines.append(f"| `{r['nodeid']}` | {float(r['cpu_s']):.1f} | {float(r['wall_s']):.0f} |")  # type: ignore[arg-type]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testing.cpu_profile", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    rep = sub.add_parser("report", help="the per-file markdown table of a profile")
    rep.add_argument("profile", type=Path)
    rep.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    sys.stdout.write(report(load(args.profile), top=args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
