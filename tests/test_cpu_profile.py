"""The CPU profile (testing/cpu_profile.py, scripts/ci_profile.sh): a test is charged the CPU of the processes it
starts — waited for, or orphaned by a parent that exited first — and the report ranks files by it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from testing.cpu_profile import CgroupMeter, ProcMeter, report

BURN = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass\n"
#: A child that starts a grandchild burning CPU and exits at once: the grandchild is orphaned (reparented away from
#: the test's process), as a daemonizing server is.
ORPHAN = (
    "import subprocess, sys\n"
    "p = subprocess.Popen([sys.executable, '-c', sys.argv[1]], start_new_session=True)\n"
    "print(p.pid, flush=True)\n"
)


def _burn(seconds: float) -> None:
    subprocess.run([sys.executable, "-c", BURN.format(s=seconds)], check=True, timeout=300)


def test_a_waited_for_child_is_charged_its_cpu() -> None:
    meter = ProcMeter()
    before = meter.cpu_s()
    _burn(0.5)
    assert meter.cpu_s() - before >= 0.45


def test_an_orphaned_grandchild_is_charged_where_a_cgroup_is_writable() -> None:
    meter = CgroupMeter.create()
    if meter is None:  # no writable cgroup here: the plugin falls back to /proc accounting, which cannot see it
        assert ProcMeter().cpu_s() > 0
        return
    try:
        before = meter.cpu_s()
        out = subprocess.run(
            [sys.executable, "-c", ORPHAN, BURN.format(s=0.5)], capture_output=True, text=True, check=True, timeout=60
        )
        pid = int(out.stdout.split()[0])
        # the orphan is not our child: wait for it to be gone through /proc (reaped by init or a subreaper)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                break
            if state == "Z":
                break
            time.sleep(0.05)
        assert meter.cpu_s() - before >= 0.45
    finally:
        meter.close()


def test_the_report_ranks_files_by_cpu_seconds_and_names_the_costliest_tests() -> None:
    rows = [
        {"nodeid": "tests/a.py::t1", "file": "tests/a.py", "cpu_s": 1.0, "wall_s": 2.0, "method": "cgroup"},
        {"nodeid": "tests/b.py::t1", "file": "tests/b.py", "cpu_s": 4.0, "wall_s": 5.0, "method": "cgroup"},
        {"nodeid": "tests/a.py::t2", "file": "tests/a.py", "cpu_s": 2.0, "wall_s": 1.0, "method": "cgroup"},
        {"nodeid": None, "file": "(outside tests)", "cpu_s": 3.0},
    ]
    text = report(rows, top=1)
    assert text.startswith("3 tests in 2 files: 7 CPU-s in tests, 3 CPU-s outside them")
    table = [line for line in text.splitlines() if line.startswith("| 1 |")]
    assert table == ["| 1 | `tests/b.py` | 1 | 4.0 | 57.1 % | 4.0 | 5 |"]
    assert "tests/a.py` |" not in text  # top=1: only the costliest file
    assert text.index("`tests/b.py::t1`") < text.index("`tests/a.py::t2`") < text.index("`tests/a.py::t1`")
