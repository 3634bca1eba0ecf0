"""The house's floors, read from the source: who may import whom, and where the broker's knowledge lives.

- producer/ and workers/ are peers: neither imports the other, not even inside a function; they meet in the
  foundation package thinkfleet/.
- thinkfleet/, every module of it, imports none of the packages built on it (producer, workers, storage,
  sglang_sim, demo, bench, testing), not even inside a function, and holds no demo code: the demo (demo/: the
  README's first command, its worker processes, the test tokenizer) stands on the foundation alone.
- testing/ (test support: services, fleet processes, the worker harness, tokenizers, rows, datasets) stands above
  every package it uses: no product code imports it, and nothing it imports imports it back.
- kombu is imported only by thinkfleet/broker/ (Celery itself also by the worker's workers/app.py and
  workers/tasks.py and the worker's pool workers/pool.py, and by benchmarks), and only there is kombu's key
  separator (``"\\x06\\x16"``) spelled.

- No two files import each other, directly or around a circle, at any depth (``if TYPE_CHECKING:`` too): a circle is
  two files that are one idea, or one idea split in the wrong place.
- No module is longer than a reader can follow (:data:`LONG_FILE` lines) unless its docstring says why it is one
  file, in a paragraph that starts ``One file because``.

Each failure names the file and line of the offending import or literal.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("producer", "workers", "storage", "sglang_sim", "thinkfleet", "demo", "bench", "testing")
FOUNDATION = "thinkfleet/"
#: Every package built on the foundation.
ABOVE_FOUNDATION = frozenset(PACKAGES) - {"thinkfleet"}
TESTING = "testing/"
BROKER = "thinkfleet/broker/"
#: Past this many lines a reader loses the thread of a module: split it where its concepts split, or say why not.
LONG_FILE = 600
#: How a long module's docstring says why it is one file.
LONG_REASON = "One file because"
#: kombu's separator between a queue and its priority step (thinkfleet/broker/keys.py: PRIORITY_SEP).
KOMBU_SEP = "\x06\x16"


@dataclass(frozen=True)
class Import:
    path: str  # relative to the repository root, with forward slashes
    line: int
    module: str  # the absolute module imported (``from . import x`` resolved)

    @property
    def top(self) -> str:
        return self.module.split(".")[0]

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: imports {self.module}"


def _sources() -> Iterator[tuple[str, ast.Module]]:
    for package in PACKAGES:
        for file in sorted((ROOT / package).rglob("*.py")):
            rel = file.relative_to(ROOT).as_posix()
            yield rel, ast.parse(file.read_text(encoding="utf-8"), filename=rel)


def _package_of(path: str) -> str:
    return path.rsplit("/", 1)[0].replace("/", ".")


def _imports_of(path: str, tree: ast.Module) -> list[Import]:
    """Every import statement of one file, at any depth (function bodies, ``if TYPE_CHECKING:``, try blocks)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(path, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = _package_of(path).split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            # ``from thinkfleet import broker`` imports thinkfleet.broker: name the submodules too.
            found += [Import(path, node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _imports() -> list[Import]:
    return [i for path, tree in _sources() for i in _imports_of(path, tree)]


IMPORTS = _imports()


def _offending(rule: str, bad: list[Import]) -> str:
    return f"{rule}:\n  " + "\n  ".join(map(str, bad))


def test_producer_never_imports_workers() -> None:
    bad = [i for i in IMPORTS if i.path.startswith("producer/") and i.top == "workers"]
    assert not bad, _offending("producer/ imports workers (they meet in thinkfleet/)", bad)


def test_workers_never_import_producer() -> None:
    bad = [i for i in IMPORTS if i.path.startswith("workers/") and i.top == "producer"]
    assert not bad, _offending("workers/ imports producer (they meet in thinkfleet/)", bad)


def test_the_scan_sees_imports_at_any_depth() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    import storage.reader\n"
        "def f():\n"
        "    from sglang_sim import content\n"
        "class C:\n"
        "    def g(self):\n"
        "        try:\n"
        "            import testing.fleet\n"
        "        except ImportError:\n"
        "            pass\n"
        "from .keys import Keys\n"
    )
    found = {i.module for i in _imports_of("thinkfleet/x.py", ast.parse(source))}
    assert {"storage.reader", "sglang_sim.content", "testing.fleet", "thinkfleet.keys.Keys"} <= found


def test_foundation_imports_nothing_built_on_it() -> None:
    bad = [i for i in IMPORTS if i.path.startswith(FOUNDATION) and i.top in ABOVE_FOUNDATION]
    assert not bad, _offending(f"{FOUNDATION} imports a package built on it", bad)


def test_product_code_never_imports_test_support() -> None:
    product = ("producer/", "workers/", "storage/", "sglang_sim/", "demo/", FOUNDATION)
    bad = [i for i in IMPORTS if i.path.startswith(product) and i.top == "testing"]
    assert not bad, _offending(f"product code imports the test-support package {TESTING}", bad)


def test_the_demo_is_an_application_nothing_in_the_product_imports() -> None:
    product = ("producer/", "workers/", "storage/", "sglang_sim/", FOUNDATION)
    bad = [i for i in IMPORTS if i.path.startswith(product) and i.top == "demo"]
    assert not bad, _offending("product code imports the demo (demo/ stands on the foundation, testing/ on it)", bad)


def test_test_support_stands_above_everything_it_uses() -> None:
    used = {i.top for i in IMPORTS if i.path.startswith(TESTING) and i.top in PACKAGES and i.top != "testing"}
    bad = [i for i in IMPORTS if i.path.split("/")[0] in used and i.top == "testing"]
    assert not bad, _offending(f"a package {TESTING} uses ({', '.join(sorted(used))}) imports it back", bad)
    # ... and it is not built on the benchmarks (they are built on it).
    bad = [i for i in IMPORTS if i.path.startswith(TESTING) and i.top == "bench"]
    assert not bad, _offending(f"{TESTING} imports bench", bad)


def test_kombu_is_imported_only_by_the_broker() -> None:
    bad = [i for i in IMPORTS if i.top == "kombu" and not i.path.startswith(BROKER)]
    assert not bad, _offending(f"kombu imported outside {BROKER}", bad)


def test_celery_is_imported_only_by_the_broker_and_the_worker() -> None:
    # The worker registers its task and signal hooks on the broker's app (workers/app.py, workers/tasks.py) and
    # runs its own Celery pool (workers/pool.py);
    # benchmarks may time Celery's own publish against ours (bench/).
    allowed = ("workers/app.py", "workers/tasks.py", "workers/pool.py")
    bad = [
        i for i in IMPORTS if i.top == "celery" and not i.path.startswith((BROKER, "bench/")) and i.path not in allowed
    ]
    assert not bad, _offending(f"celery imported outside {BROKER} and {allowed}", bad)


def test_kombu_key_separator_is_spelled_only_by_the_broker() -> None:
    bad = []
    for path, tree in _sources():
        if path.startswith(BROKER):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str | bytes):
                value = node.value.encode() if isinstance(node.value, str) else node.value
                if KOMBU_SEP.encode() in value:
                    bad.append(f"{path}:{node.lineno}: spells kombu's key separator")
    assert not bad, f"kombu key layout outside {BROKER}:\n  " + "\n  ".join(bad)


def test_importing_the_broker_loads_no_worker_runtime() -> None:
    code = (
        "import sys\n"
        "import thinkfleet.broker.celery_app, thinkfleet.broker.envelope, thinkfleet.broker.queues\n"
        "import thinkfleet.broker.transit, thinkfleet.broker.visibility, thinkfleet.broker.guard\n"
        "import thinkfleet.broker.bodies\n"
        "roots = {'aiohttp', 'producer', 'workers', 'storage', 'sglang_sim'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in roots))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"importing thinkfleet.broker loaded: {out.stdout.strip()}"


def test_importing_the_demo_loads_no_upper_floor() -> None:
    # The demo runs workers and the simulator as subprocesses (their CLIs); in its own process it needs only
    # the foundation, whatever a module imports at run time (importlib included).
    code = (
        "import sys\n"
        "import demo.app, demo.fleet, demo.tokenizer\n"
        f"roots = {sorted(ABOVE_FOUNDATION - {'demo'})!r}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in roots))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"importing the demo loaded: {out.stdout.strip()}"


def _file_of(module: str) -> str | None:
    """The project file a module name is (``a.b`` → ``a/b.py`` or ``a/b/__init__.py``), None when it is none."""
    path = module.replace(".", "/")
    for candidate in (f"{path}.py", f"{path}/__init__.py"):
        if (ROOT / candidate).is_file():
            return candidate
    return None


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one file (Tarjan, iterative: no recursion limit to meet)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_two_files_import_each_other() -> None:
    edges: dict[str, set[str]] = {}
    for imp in IMPORTS:
        # ``from pkg import name``: the submodule when there is one, else the package's module itself.
        target = _file_of(imp.module) or _file_of(imp.module.rsplit(".", 1)[0])
        if target and target != imp.path and not target.endswith("__init__.py"):
            edges.setdefault(imp.path, set()).add(target)
    circles = _circles(edges)
    detail = [
        f"{' ↔ '.join(group)}: " + "; ".join(str(i) for i in IMPORTS if i.path in group and (
            (_file_of(i.module) or _file_of(i.module.rsplit(".", 1)[0])) in group))
        for group in circles
    ]  # fmt: skip
    assert not circles, "files that import each other:\n  " + "\n  ".join(detail)


def test_no_module_is_long_without_a_reason_at_its_top() -> None:
    long = []
    for path, tree in _sources():
        lines = (ROOT / path).read_text(encoding="utf-8").count("\n")
        if lines > LONG_FILE and LONG_REASON not in (ast.get_docstring(tree) or ""):
            long.append(f"{path}: {lines} lines")
    assert not long, (
        f"modules over {LONG_FILE} lines whose docstring does not say why they are one file ('{LONG_REASON} …'): "
        "split them where their concepts split, or write the reason:\n  " + "\n  ".join(long)
    )
