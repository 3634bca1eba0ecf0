"""The front door and the manual: every command README.md and the documentation show, as a new user would meet it.

The repository is cloned (``git clone`` of HEAD into a temp dir: only what is committed, as a user gets it;
``THINKFLEET_FRONT_DOOR_SOURCE=worktree`` copies the working tree's tracked and unignored files instead, to
check a change before committing it). The clone reuses this checkout's ``.venv`` through a symlink — a fresh
install is what ``scripts/test.sh`` and CI do anyway, and installing into the shared venv here would re-point
its editable install — and has itself first on ``PYTHONPATH``, so every command runs the clone's code.

The pages are README.md, every ``docs/*.md``, the operator's guide ``deploy/README.md`` and RELIABILITY.md — those
of them in the clone that have a ```bash block; one test per page, so a failure names the page. Each page is
checked in its own fresh copy of the clone, so a page must be self-contained: whatever one of its commands needs
an earlier command to make (``cp .env.example .env`` before the compose command that reads it) that page shows
first, in its own order. Every shell command of its ```bash blocks is then checked, in the page's order, the
cheapest way that still runs it:

- ``producer SUB …``: parsed by the clone's real click command (unknown flags, bad choices, missing arguments
  fail), without running it — the job names and model paths are examples;
- ``python -m MOD …`` / ``python scripts/X.py …``: the module's or script's ``--help`` from the clone, and every
  ``--flag`` used is one it lists;
- ``pytest PATH…``: every path matches in the clone and every ``-m`` marker is registered;
- ``bash``/``sh SCRIPT …``: the script exists and parses (``bash -n``), a subcommand is one it handles;
  ``deploy/make-secrets.sh`` runs for real, as do ``cp``, ``mkdir`` and ``printf`` (a ``cp`` from a placeholder
  ``/path/to/…`` the reader fills in is not run: its destination must be there);
- ``docker compose``, ``sbatch``: the files they name exist (and parse), and the services a compose command names
  are services of those files; ``kubectl kustomize`` renders for real where kubectl is installed (every document
  then validated against Kubernetes' schemas), ``kubectl apply`` and ``kubectl -n NS get …`` need a cluster and are
  accepted (NS must be the namespace deploy/k8s renders), as is ``squeue`` (a Slurm cluster); ``$EDITOR FILE``
  needs FILE; ``sudo`` only for host administration (firewall, packages); ``jq`` only after ``--json``;
  SpecForge's and speculators' own commands are third-party and accepted as such.

A program with no checker fails the test: a new kind of documented command gets one here. Every relative link of
README.md and the documentation must point to a file that exists (and a ``#fragment`` to a heading of it), every
docs page must be linked from README's list, and README stays a front door (under 260 lines). The demo itself
(``bash scripts/demo.sh``) parses here; running it from a fresh clone, with its own fresh ``.venv``, takes a few
minutes and is the slow test at the end (``.venv/bin/pytest tests/test_readme_commands.py -m slow``).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCE_ENV = "THINKFLEET_FRONT_DOOR_SOURCE"
#: Third-party trainers README shows how to feed; not ours to run.
EXTERNAL = {"specforge", "speculators"}
#: Cheap, local commands run for real in the clone.
REAL = {"cp", "mkdir", "printf"}
#: Scripts whose first argument is a subcommand (``case`` labels): the one shown must be one they handle. They
#: build multi-GB venvs, so they are parsed (``bash -n``), never run here; their tests build and use them.
SUBCOMMAND_SCRIPTS = {"scripts/real_sglang.sh", "scripts/consumers.sh"}
#: A path the reader replaces with their own (``cp /path/to/fleet.env .env``): such a command is not run.
PLACEHOLDER = "/path/to/"
#: What the docs run under ``sudo``: the host's firewall and packages, administration no clone can try.
HOST_ADMIN = {"iptables", "apt-get", "netfilter-persistent"}
#: Read-only kubectl verbs against a running cluster.
KUBECTL_READS = {"get", "logs", "describe"}
#: ``docker compose`` subcommands the docs use, and the options of theirs that take a value (not a service).
COMPOSE_COMMANDS = {"up", "down", "ps", "logs", "stop", "start", "restart", "exec", "pull", "build", "config"}
COMPOSE_VALUE_OPTIONS = {"--tail", "--scale", "-t", "--timeout", "--index", "-u", "--user", "-w", "--workdir"}
#: The pages whose ```bash blocks are checked, in this order: the front door, the manual, the operator's guide and
#: the reliability results (their own re-run command).
PAGE_PATTERNS = ("README.md", "docs/*.md", "deploy/README.md", "RELIABILITY.md")
#: README is the front door; the manual is docs/.
README_MAX_LINES = 260
SEPARATORS = {"&&", "||", "|", ";"}
#: pytest options that take the next argument as their value (so it is no test path).
PYTEST_VALUE_OPTIONS = {"-m", "-k", "-p", "-n", "-c", "-o", "--basetemp", "--durations", "--timeout"}
#: Exit 0 when the module named by argv[1] can be imported (from the clone).
FIND_MODULE = "import importlib.util as u, sys; sys.exit(u.find_spec(sys.argv[1]) is None)"


@dataclass
class Command:
    line: str  # the README line, continuations joined, as a shell would read it
    argv: list[str]  # one simple command of it (split at && || | ;), leading VAR=value assignments dropped
    after: str | None  # the separator before it ("|" for the right side of a pipe)
    previous: list[str]  # the simple command before it on the line


def readme_commands(page: Path) -> list[Command]:
    """Every simple command of ``page``'s ```bash blocks, in the page's order."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            tokens = list(lexer)
            if not tokens:
                continue
            segments: list[tuple[str | None, list[str]]] = [(None, [])]
            for token in tokens:
                if token in SEPARATORS:
                    segments.append((token, []))
                else:
                    segments[-1][1].append(token)
            previous: list[str] = []
            for after, argv in segments:
                while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
                    argv = argv[1:]
                out.append(Command(line.strip(), argv, after, previous))
                previous = argv
    return out


# -- the pages and the clone ---------------------------------------------------------------------------


def source_files() -> list[str]:
    """What the clone will hold (see the module docstring): HEAD's files, or the working tree's."""
    if os.environ.get(SOURCE_ENV) == "worktree":
        args = ["git", "ls-files", "-co", "--exclude-standard", "-z"]
    else:
        args = ["git", "ls-tree", "-r", "--name-only", "-z", "HEAD"]
    names = subprocess.run(args, cwd=REPO, capture_output=True, check=True).stdout.decode().split("\0")
    return sorted(n for n in names if n)


def source_text(name: str) -> str:
    if os.environ.get(SOURCE_ENV) == "worktree":
        return (REPO / name).read_text(encoding="utf-8")
    return subprocess.run(["git", "show", f"HEAD:{name}"], cwd=REPO, capture_output=True, text=True, check=True).stdout


def pages(names: list[str]) -> list[str]:
    """The documentation pages among ``names``, in :data:`PAGE_PATTERNS` order (each pattern's matches sorted)."""
    out: list[str] = []
    for pattern in PAGE_PATTERNS:
        regex = re.escape(pattern).replace(r"\*", "[^/]+")
        out += [n for n in names if re.fullmatch(regex, n) and n not in out]
    return out


def pages_with_commands() -> list[str]:
    """The pages of the clone-to-be that show a ```bash block (collected before the clone exists)."""
    in_source = [n for n in source_files() if os.environ.get(SOURCE_ENV) != "worktree" or (REPO / n).is_file()]
    return [n for n in pages(in_source) if "```bash" in source_text(n)]


def worktree_pages() -> list[str]:
    """The documentation pages of this checkout (the static checks read the working tree)."""
    names = [p.relative_to(REPO).as_posix() for pattern in PAGE_PATTERNS for p in REPO.glob(pattern)]
    return pages(sorted(set(names)))


# -- the clone -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("front-door") / "thinkfleet"
    if os.environ.get(SOURCE_ENV) == "worktree":
        files = (
            subprocess.run(
                ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True
            )
            .stdout.decode()
            .split("\0")
        )
        for name in filter(None, files):
            src = REPO / name
            if src.is_file():
                (root / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, root / name)
    else:
        subprocess.run(["git", "clone", "--quiet", str(REPO), str(root)], check=True)
    (root / ".venv").symlink_to(REPO / ".venv")
    yield root


@pytest.fixture
def fresh_clone(clone: Path, tmp_path: Path) -> Path:
    """A copy of the clone of its own, so no page leans on what another page's commands made."""
    root = tmp_path / "thinkfleet"
    shutil.copytree(clone, root, symlinks=True)
    return root


def clone_env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("THINKFLEET_")}
    env["PATH"] = f"{root / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(root)  # before the venv's editable finder (a meta-path hook appended after it)
    return env


#: Parses each argv with the clone's own producer CLI (click's make_context: options, choices, arguments),
#: invoking nothing. One process for all of them.
PARSE_PRODUCER = r"""
import json, sys
import click
from producer.cli import cli as main  # the console script's group (main() just calls it)
results = []
for argv in json.load(sys.stdin):
    try:
        with main.make_context("producer", list(argv), resilient_parsing=False) as ctx:
            args = [*ctx._protected_args, *ctx.args]
            name, cmd, rest = main.resolve_command(ctx, args)
            with cmd.make_context(name, rest, parent=ctx):
                pass
        results.append(None)
    except click.ClickException as e:
        results.append(e.format_message())
print(json.dumps(results))
"""


class FrontDoor:
    """Checks README's commands in the clone (see the module docstring), collecting what fails."""

    def __init__(self, root: Path):
        self.root = root
        self.env = clone_env(root)
        self.problems: list[str] = []
        self.producer: list[Command] = []
        self.help_text: dict[str, str] = {}
        self.ran: list[str] = []

    def fail(self, cmd: Command, why: str) -> None:
        self.problems.append(f"{cmd.line!r}: {why}")

    def sh(self, text: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", text], cwd=self.root, env=self.env, capture_output=True, text=True, timeout=timeout_s
        )

    def check(self, cmd: Command) -> None:
        if not cmd.argv:
            return
        program, args = cmd.argv[0], cmd.argv[1:]
        checker = {
            "producer": self.check_producer,
            ".venv/bin/python": self.check_python,
            ".venv/bin/pytest": self.check_pytest,
            "bash": self.check_script,
            "sh": self.check_script,
            "docker": self.check_docker,
            "sbatch": self.check_sbatch,
            "kubectl": self.check_kubectl,
            "jq": self.check_jq,
            "squeue": self.check_squeue,
            "sudo": self.check_sudo,
            "$EDITOR": self.check_editor,
        }.get(program)
        if program in REAL:
            self.run_real(cmd)
        elif program in EXTERNAL:
            return
        elif checker is None:
            self.fail(cmd, f"no checker for {program!r} in tests/test_readme_commands.py")
        else:
            checker(cmd, args)

    def run_real(self, cmd: Command) -> None:
        # A line of only real commands runs whole (redirections and $(…) as written); else this command alone.
        if cmd.line in self.ran:
            return
        if any(a.startswith(PLACEHOLDER) for a in cmd.argv):
            # The reader's own file (cp /path/to/fleet.env .env): not run; where it goes must be there.
            target = self.root / cmd.argv[-1]
            if not (target if cmd.argv[-1].endswith("/") else target.parent).is_dir():
                self.fail(cmd, f"{cmd.argv[-1]}: no such directory in the clone (yet: an earlier command makes it?)")
            return
        whole = all(
            c.argv and c.argv[0] in REAL and not any(a.startswith(PLACEHOLDER) for a in c.argv)
            for c in self.by_line.get(cmd.line, [])
        )
        text = cmd.line if whole else shlex.join(cmd.argv)
        if whole:
            self.ran.append(cmd.line)
        done = self.sh(text)
        if done.returncode != 0:
            self.fail(cmd, f"rc {done.returncode}: {done.stderr.strip()[-500:]}")

    def check_producer(self, cmd: Command, args: list[str]) -> None:
        self.producer.append(cmd)

    def finish_producer(self) -> None:
        if not self.producer:
            return
        done = subprocess.run(
            [str(self.root / ".venv" / "bin" / "python"), "-c", PARSE_PRODUCER],
            input=json.dumps([c.argv[1:] for c in self.producer]),
            cwd=self.root,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            self.problems.append(f"the producer CLI did not load from the clone: {done.stderr[-2000:]}")
            return
        for cmd, error in zip(self.producer, json.loads(done.stdout), strict=True):
            if error:
                self.fail(cmd, f"producer refuses it: {error}")

    def check_python(self, cmd: Command, args: list[str]) -> None:
        if args[:1] and args[0].startswith("scripts/") and args[0].endswith(".py"):
            self.check_python_script(cmd, args[0], args[1:])
            return
        if args[:1] != ["-m"] or len(args) < 2:
            self.fail(cmd, "expected `.venv/bin/python -m MODULE …` or `.venv/bin/python scripts/NAME.py …`")
            return
        module = args[1]
        if not args[2:]:
            done = self.sh(f".venv/bin/python -c {shlex.quote(FIND_MODULE)} {shlex.quote(module)}")
            if done.returncode != 0:
                self.fail(cmd, f"no module {module} in the clone")
            return  # nothing to parse, and running it is the benchmark itself
        if module not in self.help_text:
            done = self.sh(f".venv/bin/python -m {shlex.quote(module)} --help")
            if done.returncode != 0:
                self.fail(cmd, f"`python -m {module} --help`: rc {done.returncode}: {done.stderr[-500:]}")
                return
            self.help_text[module] = done.stdout
        for flag in (a.split("=")[0] for a in args[2:] if a.startswith("--")):
            if not re.search(rf"{re.escape(flag)}\b", self.help_text[module]):
                self.fail(cmd, f"`python -m {module}` has no {flag}")

    def check_python_script(self, cmd: Command, script: str, args: list[str]) -> None:
        if not (self.root / script).is_file():
            self.fail(cmd, f"{script} is not in the clone")
            return
        done = self.sh(f".venv/bin/python {shlex.quote(script)} --help")
        if done.returncode != 0:
            self.fail(cmd, f"`python {script} --help`: rc {done.returncode}: {done.stderr[-500:]}")
            return
        for flag in (a.split("=")[0] for a in args if a.startswith("--")):
            if not re.search(rf"{re.escape(flag)}\b", done.stdout):
                self.fail(cmd, f"`python {script}` has no {flag}")

    def check_pytest(self, cmd: Command, args: list[str]) -> None:
        markers = (self.root / "pyproject.toml").read_text()
        rest = iter(args)
        for arg in rest:
            if arg in PYTEST_VALUE_OPTIONS:
                value = next(rest, "")
                if arg == "-m" and not re.search(rf'"{re.escape(value)}:', markers):
                    self.fail(cmd, f"marker {value!r} is not registered")
            elif not arg.startswith("-") and not glob.glob(str(self.root / arg.split("::")[0])):
                self.fail(cmd, f"{arg} matches nothing in the clone")

    def check_script(self, cmd: Command, args: list[str]) -> None:
        script = self.root / args[0]
        if not script.is_file():
            self.fail(cmd, f"{args[0]} is not in the clone")
            return
        done = self.sh(f"bash -n {shlex.quote(args[0])}")
        if done.returncode != 0:
            self.fail(cmd, f"{args[0]} does not parse: {done.stderr}")
        if args[0] == "deploy/make-secrets.sh":
            self.run_real(cmd)  # cheap, and what the next commands need
        elif (
            args[0] in SUBCOMMAND_SCRIPTS
            and len(args) > 1
            and not re.search(rf"^\s*{re.escape(args[1])}\)", script.read_text(), re.M)
        ):
            self.fail(cmd, f"{args[0]} has no subcommand {args[1]!r}")

    def check_docker(self, cmd: Command, args: list[str]) -> None:
        if args[:1] != ["compose"]:
            self.fail(cmd, "expected `docker compose …`")
            return
        rest, files, env_files = iter(args[1:]), [], []
        subcommand, positional = None, []
        for arg in rest:
            if subcommand is None and arg in {"-f", "--file"}:
                files.append(next(rest, ""))
            elif subcommand is None and arg == "--env-file":
                env_files.append(next(rest, ""))
            elif subcommand is None and arg in {"-p", "--project-name"}:
                next(rest, "")
            elif subcommand is None and not arg.startswith("-"):
                subcommand = arg
            elif subcommand is not None and arg in COMPOSE_VALUE_OPTIONS:
                next(rest, "")
            elif subcommand is not None and not arg.startswith("-"):
                positional.append(arg)
        files = files or ["docker-compose.yml"]
        for name in files + env_files:
            if not (self.root / name).is_file():
                self.fail(cmd, f"{name} is not in the clone (yet: the page's earlier commands make it?)")
                return
        if subcommand not in COMPOSE_COMMANDS:
            self.fail(cmd, f"`docker compose {subcommand}`: no checker for that subcommand")
            return
        import yaml

        services: set[str] = set()
        for name in files:
            services |= set((yaml.safe_load((self.root / name).read_text()) or {}).get("services") or {})
        named = positional[:1] if subcommand == "exec" else positional  # exec SERVICE COMMAND…
        for service in named:
            if service not in services:
                self.fail(cmd, f"no service {service!r} in {', '.join(files)} (services: {sorted(services)})")

    def check_sbatch(self, cmd: Command, args: list[str]) -> None:
        script = self.root / args[-1]
        if not script.is_file() or "#SBATCH" not in script.read_text():
            self.fail(cmd, f"{args[-1]} is no sbatch script in the clone")
            return
        done = self.sh(f"bash -n {shlex.quote(args[-1])}")
        if done.returncode != 0:
            self.fail(cmd, f"{args[-1]} does not parse: {done.stderr}")

    def check_kubectl(self, cmd: Command, args: list[str]) -> None:
        if args[:3] == ["apply", "-f", "-"] and cmd.after == "|":
            return  # needs a cluster; what it is fed is rendered and validated below
        if args[:1] in (["-n"], ["--namespace"]) and len(args) > 2 and args[2] in KUBECTL_READS:
            # A read of the running fleet: needs a cluster; its namespace must be the one deploy/k8s renders.
            declared = re.findall(
                r"^namespace:\s*(\S+)", (self.root / "deploy/k8s/base/kustomization.yaml").read_text(), re.M
            )
            if args[1] not in declared:
                self.fail(cmd, f"namespace {args[1]!r} is not deploy/k8s's ({declared})")
            return
        if args[:1] != ["kustomize"]:
            self.fail(cmd, "expected `kubectl kustomize …` or `… | kubectl apply -f -`")
            return
        target = self.root / args[-1]
        if not (target / "kustomization.yaml").is_file():
            self.fail(cmd, f"{args[-1]} has no kustomization.yaml")
            return
        if shutil.which("kubectl") is None:
            return  # rendering is tests/test_deploy_k8s.py's, which says when kubectl is missing
        done = self.sh(shlex.join(cmd.argv))
        if done.returncode != 0:
            self.fail(cmd, f"rc {done.returncode}: {done.stderr[-1000:]}")
            return
        import kubernetes_validate
        import yaml

        version = kubernetes_validate.utils.latest_version()
        for doc in filter(None, yaml.safe_load_all(done.stdout)):
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                self.fail(cmd, f"{doc['kind']}/{doc['metadata']['name']}: {e.message}")

    def check_squeue(self, cmd: Command, args: list[str]) -> None:
        # A read of a running Slurm cluster: accepted. (Its --help is no list of its flags to check against:
        # Slurm 23.02's omits --me, which it takes.)
        return

    def check_sudo(self, cmd: Command, args: list[str]) -> None:
        if not args or args[0] not in HOST_ADMIN:
            self.fail(cmd, f"sudo is for host administration ({sorted(HOST_ADMIN)}), not {args[:1]}")

    def check_editor(self, cmd: Command, args: list[str]) -> None:
        for name in args:
            if not (self.root / name).is_file():
                self.fail(cmd, f"{name} is not in the clone (yet: the page's earlier commands make it?)")

    def check_jq(self, cmd: Command, args: list[str]) -> None:
        if cmd.after != "|" or "--json" not in cmd.previous:
            self.fail(cmd, "jq reads only a --json command's output")

    def run(self, commands: list[Command]) -> None:
        self.by_line: dict[str, list[Command]] = {}
        for c in commands:
            self.by_line.setdefault(c.line, []).append(c)
        for c in commands:
            self.check(c)
        self.finish_producer()


@pytest.mark.parametrize("page", pages_with_commands())
def test_every_documented_command_works_in_a_fresh_clone(page: str, fresh_clone: Path) -> None:
    commands = readme_commands(fresh_clone / page)
    programs = {c.argv[0] for c in commands if c.argv}
    if page == "README.md":
        assert {"producer", "bash"} <= programs, programs
    door = FrontDoor(fresh_clone)
    door.run(commands)
    assert not door.problems, f"{page}:\n" + "\n".join(door.problems)


def test_readme_and_the_manual_are_checked() -> None:
    """The front door and every docs page with a shell block are among the checked pages (else nothing runs them)."""
    checked = pages_with_commands()
    assert "README.md" in checked
    assert any(p.startswith("docs/") for p in checked), checked


def test_the_checker_refuses_a_flag_the_producer_does_not_have(clone: Path) -> None:
    """The producer parse is real: a misspelt flag fails (so the test above proves something)."""
    readme = clone.parent / "README-bad.md"
    readme.write_text("```bash\nproducer status k25 --jsno\nproducer frobnicate k25\n```\n")
    door = FrontDoor(clone)
    door.run(readme_commands(readme))
    assert len(door.problems) == 2, door.problems
    assert "--jsno" in door.problems[0] and "frobnicate" in door.problems[1]


def test_readme_says_how_to_reach_producer_before_its_first_bare_command(clone: Path) -> None:
    text = (clone / "README.md").read_text()
    first_bare = re.search(r"^producer ", text, re.M)
    assert first_bare, "README shows no producer command"
    assert "source .venv/bin/activate" in text[: first_bare.start()]
    assert ".venv/bin/pip install -e '.[hub]'" in text  # export --format hf needs the hub extra


# -- links and length ---------------------------------------------------------------------------------

#: A markdown link or image: ``[text](target)``, ``![alt](target "title")``.
LINK = re.compile(r'!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)')
FENCE = re.compile(r"^\s*```.*?^\s*```[^\n]*$", re.S | re.M)
#: An inline code span (``…`` first, then `…`), never across a blank line.
CODE_SPAN = re.compile(r"``(?:[^\n]|\n(?!\s*\n))*?``|`(?:[^`\n]|\n(?!\s*\n))*?`")


def prose(text: str) -> str:
    """``text`` without its fenced blocks and inline code (a link there is an example, not a link)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def anchors(text: str) -> set[str]:
    """The ``#fragment`` of every heading, as GitHub makes them: lower case, punctuation dropped, spaces to
    hyphens, ``-1``, ``-2`` … on repeats."""
    out: set[str] = set()
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", FENCE.sub("", text), re.M):
        text_only = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
        slug = re.sub(r"[^\w\- ]", "", text_only.lower()).replace(" ", "-")
        n, unique = 0, slug
        while unique in out:
            n += 1
            unique = f"{slug}-{n}"
        out.add(unique)
    return out


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    """Every relative link of ``page`` that points to no file of ``root`` (or a ``#fragment`` to no heading)."""
    problems = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):
            continue  # http(s):, mailto: — not ours to resolve
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page.resolve()
        where = f"{page.relative_to(root)}: ({target})"
        if not dest.is_relative_to(root.resolve()):
            problems.append(f"{where} leaves the repository")
        elif not dest.exists():
            problems.append(f"{where}: {dest.relative_to(root.resolve())} does not exist")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest.read_text(encoding="utf-8")):
            problems.append(f"{where}: {dest.relative_to(root.resolve())} has no heading #{fragment}")
    return problems


def test_every_relative_link_of_the_docs_resolves() -> None:
    problems = [p for page in [*worktree_pages(), "BENCHMARKS.md"] for p in broken_links(REPO / page)]
    assert not problems, "\n".join(problems)


def test_the_link_check_catches_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# B\n\n## Agentic conversations (`--tool-results replay`)\n")
    page = tmp_path / "docs" / "a.md"
    page.write_text(
        "[ok](b.md#agentic-conversations---tool-results-replay) [gone](c.md) [no heading](b.md#nope) "
        "[out](../../x.md) [web](https://example.com) `[code](nowhere.md)`\n```bash\n# [x](y.md)\n```\n"
    )
    problems = broken_links(page, tmp_path)
    assert len(problems) == 3, problems
    assert "c.md" in problems[0] and "#nope" in problems[1] and "leaves the repository" in problems[2]


def test_readme_links_every_docs_page() -> None:
    """README's Documentation list is the index: a docs page it does not link is a page nobody finds."""
    linked = {(REPO / t.partition("#")[0]).resolve() for t in LINK.findall(prose((REPO / "README.md").read_text()))}
    unlinked = [p for p in worktree_pages() if p.startswith("docs/") and (REPO / p).resolve() not in linked]
    assert not unlinked, f"README.md links none of {unlinked}: add each to its Documentation list"


def test_readme_is_a_front_door_not_the_manual() -> None:
    lines = len((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines < README_MAX_LINES, (
        f"README.md has {lines} lines (under {README_MAX_LINES}): move a concern to its own page under docs/ "
        "and link it from README's Documentation list"
    )


# -- the front door's fixes ---------------------------------------------------------------------------


def test_producer_jobs_never_cuts_a_job_name(redis_url: str, tmp_path: Path) -> None:
    from testing.fleet import register_id_job
    from testing.harness import isolated_settings
    from thinkfleet.settings import Settings

    settings: Settings = isolated_settings(redis_url, str(tmp_path / "out"))
    name = "k25-eagle3-" + "x" * 90 + "-end"
    import redis

    register_id_job(redis.Redis.from_url(redis_url), settings.keys, name, {"p0": [1, 2]}, {}, "d", "fp")
    env = {
        **os.environ,
        "THINKFLEET_REDIS_URL": redis_url,
        "THINKFLEET_KEY_PREFIX": settings.key_prefix,
        "THINKFLEET_QUEUE": settings.queue,
        "COLUMNS": "80",  # a terminal of 80 columns, or a pipe (rich then assumes 80)
    }
    done = subprocess.run(
        [sys.executable, "-m", "producer.cli", "jobs"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert name in done.stdout, done.stdout


def test_the_demo_keeps_to_its_own_prefix_and_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    from demo.app import DEMO_KEY_PREFIX, DEMO_QUEUE, demo_settings
    from thinkfleet.settings import Settings

    monkeypatch.delenv("THINKFLEET_KEY_PREFIX", raising=False)
    monkeypatch.delenv("THINKFLEET_QUEUE", raising=False)
    settings = demo_settings()
    defaults = Settings.model_fields
    assert (settings.key_prefix, settings.queue) == (DEMO_KEY_PREFIX, DEMO_QUEUE)
    assert settings.key_prefix != defaults["key_prefix"].default and settings.queue != defaults["queue"].default
    monkeypatch.setenv("THINKFLEET_KEY_PREFIX", "mine")
    monkeypatch.setenv("THINKFLEET_QUEUE", "myqueue")
    assert (demo_settings().key_prefix, demo_settings().queue) == ("mine", "myqueue")  # asked for: honoured


def test_install_hints_name_commands_that_exist() -> None:
    import tomllib

    from storage.exports.hf import HF_EXTRA

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    [extra] = re.findall(r"pip install -e '\.\[(\w+)\]'", HF_EXTRA)
    assert "datasets" in " ".join(extras[extra])
    template = (REPO / "thinkfleet" / "template.py").read_text()
    assert "huggingface-cli" not in template and "`hf download" in template
    hf = REPO / ".venv" / "bin" / "hf"
    done = subprocess.run([str(hf), "download", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
@pytest.mark.timeout(1500)  # building the venv from PyPI is most of it (~5 min here), then the demo (~1.5 min)
def test_the_demo_runs_from_a_fresh_clone_with_its_own_venv(tmp_path: Path, redis_url: str) -> None:
    """README's first command exactly as written, in a fresh clone that builds its own .venv (needs PyPI)."""
    root = tmp_path / "thinkfleet"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(root)], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("THINKFLEET_") and k != "VIRTUAL_ENV"}
    env["THINKFLEET_REDIS_URL"] = redis_url  # the session's private Redis, not whatever answers on 6379
    # Its own session, so a timeout stops the demo's workers and simulator too (they are its children).
    proc = subprocess.Popen(
        ["bash", "scripts/demo.sh"], cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=1400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "verify" in done.stdout and "Parquet:" in done.stdout
