"""CPU-seconds per kind of process the suite starts, for ``scripts/ci_processes.sh``.

:mod:`testing.cpu_profile` says which *test files* cost the most; this says which *programs* do: every Celery
worker, simulator, ``producer`` subprocess, redis-server and real SGLang server the suite starts, summed by kind.
Two sources joined by process id:

- the kernel's process accounting (``accton FILE``, Debian package ``acct``; root): one record per process when it
  exits, with its CPU time, whether it exited, was SIGKILLed or was orphaned. Its name is only ``comm`` (15
  characters of the executable, or of the last thread to exit: a Python process with pyarrow may end as
  ``jemalloc_bg_thd``), so:
- a sampler (``sample``) that reads ``/proc/*/cmdline`` every 0.2 s and keeps each process's last non-empty command
  line (a forked child shows its parent's until it execs).

A process that lived less than a sample period may have no command line; it is reported by its ``comm``.
``report`` prints the markdown table that ``scripts/ci_processes.sh`` writes to docs/ci-processes.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import time
from collections import defaultdict
from pathlib import Path

#: The modules and programs a kind is named after (``python -m X`` / a console script / an executable).
_MODULE = re.compile(r"(?:^|\s)-m\s+(\S+)")


def sample(out: Path, stop: Path, period_s: float = 0.2) -> None:
    """Until ``stop`` exists: every live process's last non-empty command line, by pid, into ``out`` (JSON).

    Bound: scripts/ci_processes.sh creates ``stop`` when its run ends, however it ends (an EXIT trap); a script
    killed past its trap (SIGKILL) orphans this sampler, which then sees its parent gone and returns too."""
    seen: dict[str, str] = {}
    me = str(os.getpid())
    parent = os.getppid()
    while not stop.exists() and os.getppid() == parent:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or entry.name == me:
                continue
            try:
                raw = Path(entry.path, "cmdline").read_bytes()
            except OSError:
                continue
            if raw:
                seen[entry.name] = raw.replace(b"\0", b" ").decode(errors="replace").strip()[:300]
        time.sleep(period_s)
        out.write_text(json.dumps(seen))  # each round, so a run cut short still has what it saw


def kind(cmdline: str | None, comm: str) -> str:
    """What a process was, from its command line (``-m MODULE``, a console script, an executable) or its comm."""
    if not cmdline:
        return f"({comm})"
    argv = cmdline.split()
    program = Path(argv[0]).name
    module = _MODULE.search(cmdline)
    if program.startswith("python") or program == "pytest":
        if module:
            return f"python -m {module.group(1)}"
        if "execnet" in cmdline or "exec(eval(sys.stdin" in cmdline:
            return "pytest (xdist worker)"
        if "multiprocessing.spawn" in cmdline or "multiprocessing-fork" in cmdline:
            return "python (a multiprocessing child)"
        args = iter(argv[1:])
        for arg in args:
            if arg == "-c":
                return f"python -c {next(args, '')[:30]}"
            if arg in ("-W", "-X"):
                next(args, None)  # the option's value
            elif not arg.startswith("-"):
                return f"python {Path(arg).name}"
        return "python"
    if program in {"producer", "storage", "worker", "sglang-sim", "celery"}:
        return program + (f" {argv[1]}" if len(argv) > 1 and not argv[1].startswith("-") else "")
    return program


def read_acct(path: Path) -> list[tuple[str, int, float, float]]:
    """(comm, pid, CPU-s, elapsed-s) of every process the accounting file recorded (``dump-acct``)."""
    dump = shutil.which("dump-acct")
    if dump is None:
        raise SystemExit("dump-acct not found: install the acct package (apt-get install acct)")
    rows = []
    for line in subprocess.run([dump, str(path)], capture_output=True, text=True, check=True).stdout.splitlines():
        f = [x.strip() for x in line.split("|")]
        if len(f) < 11:
            continue
        # comm | version | utime | stime | etime | uid | gid | mem | io | pid | ppid …, times in 1/100 s
        rows.append((f[0], int(f[9]), (float(f[2]) + float(f[3])) / 100, float(f[4]) / 100))
    return rows


def report(acct: Path, cmdlines: Path, top: int = 25) -> str:
    """The markdown table: CPU-s by kind of process, most first."""
    seen: dict[str, str] = json.loads(cmdlines.read_text()) if cmdlines.exists() else {}
    by_kind: dict[str, list[float]] = defaultdict(list)
    for comm, pid, cpu, _ in read_acct(acct):
        if cpu > 0:
            by_kind[kind(seen.get(str(pid)), comm)].append(cpu)
    total = sum(sum(v) for v in by_kind.values())
    lines = [
        f"{total:,.0f} CPU-s in {sum(len(v) for v in by_kind.values()):,} processes that used any.",
        "",
        "| kind | processes | CPU-s | share | median CPU-s |",
        "|------|----------:|------:|------:|-------------:|",
    ]
    ranked = sorted(by_kind.items(), key=lambda kv: -sum(kv[1]))
    for name, cpus in ranked[:top]:
        share = 100 * sum(cpus) / total if total else 0.0
        lines.append(f"| `{name}` | {len(cpus)} | {sum(cpus):.1f} | {share:.1f} % | {statistics.median(cpus):.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m testing.process_profile")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sample", help="record command lines by pid until STOP exists")
    s.add_argument("out", type=Path)
    s.add_argument("stop", type=Path)
    r = sub.add_parser("report", help="the table by kind of process")
    r.add_argument("acct", type=Path)
    r.add_argument("cmdlines", type=Path)
    r.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    if args.command == "sample":
        sample(args.out, args.stop)
    else:
        print(report(args.acct, args.cmdlines, args.top))


if __name__ == "__main__":
    main()
