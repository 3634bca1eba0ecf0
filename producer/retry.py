"""``producer retry JOB``: resend dead-lettered prompts, or re-run truncated rows with a bigger budget.

Dead letters keep their whole message (ledger.dead_letter), so a retry resends exactly what failed.
A truncated re-run reads the prompt ids back from storage and sends them as the next ``revision``
with a ``max_new_tokens`` override; the committed view keeps the highest revision, so the new row
replaces the old one.

A retry is atomic, like ``producer submit`` (producer/enqueue.py): the messages are staged on a
private list, then ONE ``MULTI`` takes the prompts out of ``dead`` (or ``done``), corrects the counters,
clears their crash-delivery counts and moves the staged list onto the queue. A worker therefore never
sees a retried message while its prompt still looks dead (it would skip and acknowledge it, and the
prompt would be lost), and a retry that dies before the ``MULTI`` changes nothing (its staging list
expires). The job's submit lock is held throughout, so a retry never interleaves with another retry
or a submit of the same job.

``--missing`` regenerates prompts that were submitted (or are done in Redis) but have no committed row, are not
dead-lettered and have no message in flight — typically the rows of a part found damaged and quarantined
(storage/quarantine.py; it first decodes every part, as ``producer verify`` does). Their messages were
acknowledged long ago, so each is rebuilt from what storage still has: the quarantined part's own ``input_ids``
(with its row's revision and per-message sampling keys), decoded column by column with page checksums verified
and accepted only when the ids hash to the prompt's submitted content hash. A prompt with nothing readable left
is taken out of ``done`` without a message and named: re-running ``producer submit`` with the same inputs then
enqueues it.

A ``--turns all`` job re-runs, per conversation, only its earliest truncated turn: the worker that stores the
re-run re-derives every turn after it (workers/turns.py), so a later truncated turn is re-run that way. Only
*settled* conversations are re-run — every turn in the job's submitted set is done or dead — and a chain still
running is skipped (named on stderr and in ``RetryResult.skipped``): its later turns would race the re-run. Turn
rows past their conversation's chain end are superseded (``thinkfleet.turns.beyond_chain_ends``), never re-run.

Host affinity (thinkfleet/broker/affinity.py): a re-sent later turn of a ``--turns all`` or agentic job is offered
first to the host whose server has its history cached — a dead letter's to the worker that stored its conversation's
previous turn (or tool step), a truncated re-run's to the worker that ran it — in the same MULTI that takes it out of
``dead``/``done`` (``offer_resent``: its host list plus its offer time, so the host's pop, the idle steal and the
sweep treat it as any offered next turn; a host without a heartbeat or at its backlog bound gets it on the shared
queue). Claims and fences are unchanged: where it runs is only a preference. ``retry --missing`` re-sends to the
shared queue.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import click
import msgpack
import pyarrow.compute as pc
import redis

from producer.chain_state import chain_end_ids
from producer.enqueue import Stager, job_priority
from producer.row_media import ROW_MEDIA_COLUMNS, RebuildRefused, RowMedia, checked_hash, message_hash_problem
from producer.state import StateError, SubmitLock
from thinkfleet.broker.envelope import Envelope
from thinkfleet.cli import STATE, settings_options
from thinkfleet.message import OVERRIDE_KEYS, PromptTask, pack_ids
from thinkfleet.redis_client import BULK_TIMEOUT_S, sync_client
from thinkfleet.settings import Settings
from thinkfleet.state.scripts import lua
from thinkfleet.turns import TURNS_FIELD, regenerates_all_turns, turns_meta

#: Prompts per Lua call (and messages per encode batch) inside the one MULTI.
CHUNK = 5000

#: Take prompts out of ``dead`` or ``done`` for a re-queue (thinkfleet/state/lua/requeue.lua).
_TAKE_OUT = lua("requeue")


class RetryResult(list[str]):
    """The re-queued prompt ids; ``skipped``: prompt id → why it was not re-queued (a chain still running);
    ``offered``: prompt id → the host whose list it was offered on (host affinity, see the module doc);
    ``refused``: prompt id → why its stored row could not be rebuilt as submitted (producer/row_media.py)."""

    def __init__(
        self,
        ids: list[str],
        skipped: dict[str, str] | None = None,
        offered: dict[str, str] | None = None,
        refused: dict[str, str] | None = None,
    ) -> None:
        super().__init__(ids)
        self.skipped = skipped or {}
        self.offered = offered or {}
        self.refused = refused or {}


#: Why a truncated turn of a conversation whose chain is still running is not re-run.
CHAIN_RUNNING = "chain still running; retry after it finishes"
#: Why a missing prompt was not re-sent (``retry --missing``): nothing of its prompt is readable in storage.
NO_PROMPT_LEFT = "no readable prompt in storage: taken out of done; re-run `producer submit` with the same inputs"


def _chunks(tasks: list[PromptTask]) -> Iterator[list[PromptTask]]:
    for start in range(0, len(tasks), CHUNK):
        yield tasks[start : start + CHUNK]


def _take_out(
    pipe: redis.client.Pipeline, settings: Settings, job: str, field: str, tasks: Sequence[PromptTask | _Bare]
) -> None:
    """Queue the ``_TAKE_OUT`` calls for ``tasks`` on ``pipe`` (field: 'dead' or 'done')."""
    keys = settings.keys
    source = keys.dead(job) if field == "dead" else keys.done(job)
    for chunk in _chunks(tasks):
        datasets = list(dict.fromkeys(t.dataset for t in chunk))
        index = {name: i + 1 for i, name in enumerate(datasets)}
        args: list[str | int] = [field]
        for t in chunk:
            args += [t.prompt_id, index[t.dataset]]
        pipe.eval(
            _TAKE_OUT,
            3 + len(datasets),
            source,
            keys.counters(job),
            keys.deliveries(job),
            *[keys.dataset_counters(job, name) for name in datasets],
            *args,
        )


def _requeue(
    client: redis.Redis,
    settings: Settings,
    job: str,
    field: str,
    tasks: list[PromptTask],
    revisions: Mapping[str, int] | None = None,
    hosts: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Take ``tasks``' prompts out of ``field`` ('dead' or 'done') and put their messages on the queue, at once —
    with ``revisions`` (prompt id → the revision now requested) raised in that same MULTI: one transition, so no
    worker sees the new revision asked for with the prompt still done, or the prompt out of done without it.
    ``hosts`` (prompt id → worker, :func:`_affine_hosts`): those messages are offered on that worker's host list
    in the same MULTI (thinkfleet/broker/affinity.py ``offer_resent``: onto the shared queue when it has no
    heartbeat or no room). Returns the prompts offered on a host list → their host.

    Call with the job's submit lock held.
    """
    if not tasks:
        return {}
    settings.require_supported_broker()  # the queue is in this Redis: one MULTI takes out and enqueues
    from thinkfleet.broker.affinity import offer_resent

    # Back onto the job's priority list, the messages saying that priority (as its submit queued them).
    priority = job_priority(client, settings, job)
    envelope = Envelope(settings, priority)
    hosts = hosts or {}
    by_host: dict[str, list[PromptTask]] = {}
    for t in tasks:
        if hosts.get(t.prompt_id):
            by_host.setdefault(hosts[t.prompt_id], []).append(t)
    shared = [t for t in tasks if not hosts.get(t.prompt_id)]
    stager = Stager(client, settings.keys, job, settings.queue, priority)
    try:
        for chunk in _chunks(shared):
            stager.push(envelope.encode_many(chunk))
        offers: list[tuple[str, list[PromptTask]]] = []
        with client.pipeline(transaction=True) as pipe:
            if revisions:
                pipe.hset(settings.keys.revisions(job), mapping=dict(revisions))
            _take_out(pipe, settings, job, field, tasks)
            stager.commit(pipe)
            for worker, mine in sorted(by_host.items()):
                for chunk in _chunks(mine):
                    offer_resent(pipe, settings, worker, priority, envelope.encode_many(chunk))
                    offers.append((worker, chunk))
            replies = pipe.execute()
    except BaseException:
        stager.discard()
        raise
    offered: dict[str, str] = {}
    for (worker, chunk), n in zip(offers, replies[len(replies) - len(offers) :], strict=True):
        offered.update((t.prompt_id, worker) for t in chunk[: int(n)])  # the first n: the rest had no room
    return offered


def _affine(settings: Settings) -> bool:
    """Whether re-sent turns are offered to a host: affinity on, and a broker whose workers pop host lists."""
    from thinkfleet.broker.transit import uses_transit

    return bool(settings.affinity) and uses_transit(settings.broker_url)


def _affine_hosts(settings: Settings, job: str, tasks: Sequence[PromptTask]) -> dict[str, str]:
    """Dead-lettered turns of a ``--turns all`` (or agentic) job → the worker that stored their conversation's
    previous turn (or tool step): its server's radix cache holds the history the turn starts with. From the job's
    committed rows (their ``worker`` column); a turn 0, or one whose previous row is not stored, has none."""
    from storage.reader import read_committed
    from thinkfleet.turns import split_step_id

    wanted = {t.prompt_id: split_step_id(t.prompt_id) for t in tasks}
    wanted = {pid: parts for pid, parts in wanted.items() if parts is not None and parts[1:] > (0, 0)}
    if not wanted or not _affine(settings):
        return {}
    convs = {parts[0] for parts in wanted.values()}
    datasets = sorted({t.dataset for t in tasks if t.prompt_id in wanted})
    table = read_committed(
        settings.output_uri,
        job,
        columns=["prompt_id", "worker"],
        datasets=datasets,
        s3_endpoint_url=settings.s3_endpoint_url,
    )
    stored: dict[str, list[tuple[tuple[int, int], str]]] = {}
    for row in table.to_pylist():
        parts = split_step_id(row["prompt_id"])
        if parts is not None and parts[0] in convs and row["worker"]:
            stored.setdefault(parts[0], []).append((parts[1:], row["worker"]))
    hosts: dict[str, str] = {}
    for pid, (conv, turn, step) in wanted.items():
        before = [(at, w) for at, w in stored.get(conv, ()) if at < (turn, step)]
        if before:
            hosts[pid] = max(before)[1]
    return hosts


def _lock(client: redis.Redis, settings: Settings, job: str) -> SubmitLock:
    """The job's submit lock (``producer.state``): raises ``StateError`` while a submit or retry holds it."""
    return SubmitLock(client, settings, job)


def retry_dead(settings: Settings, job: str, error_classes: tuple[str, ...] = ()) -> RetryResult:
    """Re-enqueue dead-lettered prompts (optionally only some error classes); returns their ids.

    A dead letter is resent as it was, its signature with it. With a signing key, one whose message the key did not
    sign is *not* resent (``skipped``: prompt id → why): a dead letter is written by whoever can write Redis, and
    resending it would sign what they wrote (thinkfleet/signing.py)."""
    from thinkfleet.message import MessageRefused
    from thinkfleet.signing import signer_for

    signer = signer_for(settings)
    client = sync_client(settings.redis_url, timeout_s=BULK_TIMEOUT_S)
    try:
        with _lock(client, settings, job):
            tasks: list[PromptTask] = []
            refused: dict[str, str] = {}
            broken: dict[str, str] = {}
            for raw in client.hvals(settings.keys.dead(job)):
                record = json.loads(raw)
                if error_classes and not any(record["error_class"].startswith(c) for c in error_classes):
                    continue
                task = PromptTask.from_args(msgpack.unpackb(base64.b64decode(record["task"])))
                mismatch = message_hash_problem(task)
                if mismatch:  # a worker would refuse it again: named here, not resent
                    where = f"{task.prompt_id} (dataset {task.dataset!r} row {task.row_index})"
                    broken[task.prompt_id] = f"{where}: {mismatch}"
                    continue
                if signer is not None:
                    try:
                        signer.check_task(task)
                    except MessageRefused as exc:
                        refused[task.prompt_id] = f"{exc.error_class}: not resent (not signed with this key)"
                        continue
                tasks.append(task)
            tasks.sort(key=lambda t: (t.dataset, t.row_index, t.sample_index, t.prompt_id))
            offered = _requeue(client, settings, job, "dead", tasks, hosts=_affine_hosts(settings, job, tasks))
            for why in broken.values():
                click.echo(f"refused {why}", err=True)
            return RetryResult([t.prompt_id for t in tasks], refused, offered, broken)
    finally:
        client.close()


def _multi_turn(client: redis.Redis, settings: Settings, job: str) -> bool:
    return regenerates_all_turns(turns_meta(client.hget(settings.keys.job(job), TURNS_FIELD)))


def _chain_heads(
    client: redis.Redis, settings: Settings, job: str, rows: list[dict]
) -> tuple[list[dict], dict[str, str]]:
    """--turns all: of the truncated turn rows, the earliest of each settled conversation (the rest are
    re-derived from it); the earliest of each unsettled one → why it is skipped. Superseded rows are dropped."""
    from storage.verify_steps import unreachable_steps
    from thinkfleet.turns import beyond_chain_ends, split_step_id, turn_id

    keys = settings.keys
    ends = chain_end_ids(client, keys, job)  # the small chain-state record, not every answer (producer/chain_state.py)
    steps_of: dict[str, list[str]] = {}
    prompts: list[str] = []  # an agentic job's submitted prompts
    if b"tool_results" in (client.hget(keys.job(job), "turns") or b""):
        for raw, _ in client.hscan_iter(keys.prompts(job), count=1000):
            prompts.append(raw.decode())
            step = split_step_id(raw.decode())
            if step is not None and step[2] > 0:
                steps_of.setdefault(step[0], []).append(raw.decode())
    # An agentic job's stale steps (no current chain reaches them: storage/verify_steps.py) are superseded too:
    # never a head, never a chain still running.
    stale = unreachable_steps(settings, job, [*(r["prompt_id"] for r in rows), *prompts])
    superseded = beyond_chain_ends([r["prompt_id"] for r in rows], ends) | stale
    heads: dict[str, tuple[tuple[int, int], dict]] = {}
    for row in rows:
        parts = split_step_id(row["prompt_id"])  # an agentic job's steps …/t{i}s{j} order within their turn
        if parts is None or row["prompt_id"] in superseded:
            continue
        if parts[0] not in heads or parts[1:] < heads[parts[0]][0]:
            heads[parts[0]] = (parts[1:], row)
    done = {m.decode() for m in client.smembers(keys.done(job))}
    dead = {m.decode() for m in client.hkeys(keys.dead(job))}
    chosen, skipped = [], {}
    for conv, (_, row) in sorted(heads.items()):
        count = int(json.loads(client.hget(keys.conversations(job), conv) or "{}").get("turn_count") or 0)
        turns = [turn_id(conv, t) for t in range(count)]
        submitted = [pid for pid, h in zip(turns, client.hmget(keys.prompts(job), turns), strict=True) if h]
        # An agentic job's steps after the first of a turn are submitted prompts too (their ids are not planned).
        submitted += [p for p in steps_of.get(conv, ()) if p not in submitted]
        if all(pid in done or pid in dead or pid in stale for pid in submitted):
            chosen.append(row)
        else:
            skipped[row["prompt_id"]] = CHAIN_RUNNING
    return chosen, skipped


def retry_truncated(settings: Settings, job: str, max_new_tokens: int) -> list[str]:
    """Re-run every row of the committed view that stopped on length, as the next revision (a ``--turns all``
    job: the earliest truncated turn of each settled conversation, see the module doc; a :class:`RetryResult`)."""
    from storage.reader import read_committed

    client = sync_client(settings.redis_url, timeout_s=BULK_TIMEOUT_S)
    try:
        with _lock(client, settings, job):
            table = read_committed(
                settings.output_uri,
                job,
                columns=[
                    "dataset",
                    "prompt_id",
                    "row_index",
                    "sample_index",
                    "revision",
                    "content_hash",
                    "input_ids",
                    "finish_reason",
                    "worker",
                    "sampling_params",
                    *ROW_MEDIA_COLUMNS,
                ],
                s3_endpoint_url=settings.s3_endpoint_url,
            )
            table = table.filter(pc.equal(table["finish_reason"], "length"))
            rows, skipped, hosts = table.to_pylist(), {}, {}
            if _multi_turn(client, settings, job):
                rows, skipped = _chain_heads(client, settings, job, rows)
                # A re-run turn goes first to the host that ran it: its server's cache holds the whole prompt (the
                # previous turn's history and this turn's user message); its re-derived turns follow it there.
                if _affine(settings):
                    hosts = {r["prompt_id"]: r["worker"] for r in rows if r.get("worker")}
            tasks, refused = _rebuilt(client, settings, job, rows, max_new_tokens)
            # Not "done" until the new revision is stored (workers skip prompts in the done set); the counters
            # follow so that status and verify agree while the re-runs are in flight. The new revision is asked for
            # in the same transition: a worker's claim refuses a message of a lower one from then on, so a leftover
            # copy of the old message cannot run with the old budget and be acked for the new one (claim.lua).
            revisions = {t.prompt_id: t.revision for t in tasks}
            offered = _requeue(client, settings, job, "done", tasks, revisions, hosts)
            for pid, why in skipped.items():
                click.echo(f"skipped {pid}: {why}", err=True)
            for why in refused.values():
                click.echo(f"refused {why}", err=True)
            return RetryResult([t.prompt_id for t in tasks], skipped, offered, refused)
    finally:
        client.close()


def row_overrides(row: dict[str, Any]) -> dict[str, Any]:
    """The per-message keys (:data:`OVERRIDE_KEYS`: a sample's seed, a revision's budget) of the sampling a stored
    row was generated with; {} when its ``sampling_params`` do not parse."""
    try:
        used = json.loads(row.get("sampling_params") or "{}")
    except ValueError:
        return {}
    used = used if isinstance(used, dict) else {}
    return {k: used[k] for k in sorted(OVERRIDE_KEYS) if used.get(k) is not None}


def _rebuilt(
    client: redis.Redis, settings: Settings, job: str, rows: list[dict], max_new_tokens: int
) -> tuple[list[PromptTask], dict[str, str]]:
    """The next revision's message of each truncated row, its images with it (producer/row_media.py), each checked
    to hash to the row's content hash; rows that do not → why (named, never enqueued)."""
    media = RowMedia(settings.s3_endpoint_url)
    media.learn_conversations(client, settings.keys.conversations(job), rows)
    generation = _generation(client, settings, job)
    tasks, refused = [], {}
    for row in rows:
        try:
            refs = media.refs(row)
            digest = checked_hash(row, row["input_ids"], refs)
        except RebuildRefused as exc:
            refused[row["prompt_id"]] = str(exc)
            continue
        tasks.append(
            PromptTask(
                job=job,
                dataset=row["dataset"],
                prompt_id=row["prompt_id"],
                row_index=row["row_index"],
                content_hash=digest,
                ids_blob=pack_ids(row["input_ids"]),
                sample_index=row["sample_index"],
                revision=row["revision"] + 1,
                # The row's own per-message keys (its sample's seed: --samples N) with the new budget; without them
                # sample k's re-run would draw sample 0's seed and repeat its answer on a deterministic server.
                overrides={**row_overrides(row), "max_new_tokens": max_new_tokens},
                generation=generation,
                media=refs,
            )
        )
    return tasks, refused


#: Columns of a quarantined part's rows that rebuild their message (``retry --missing``).
_SALVAGE = ["prompt_id", "dataset", "row_index", "sample_index", "revision", "content_hash", "input_ids",
            "sampling_params", *ROW_MEDIA_COLUMNS]  # fmt: skip


def retry_missing(settings: Settings, job: str) -> RetryResult:
    """Re-send every prompt of ``job`` that has no committed row, is not dead-lettered and has no message in flight
    (see the module doc); returns the re-sent ids, with ``skipped``: prompt id → why it was not re-sent."""
    from storage.listing import job_has_storage
    from storage.reader import check_parts, stored_prompt_ids
    from thinkfleet.state.invariant import queued_prompt_ids, transit_prompt_ids, unacked_prompt_ids
    from thinkfleet.turns import beyond_chain_ends

    keys = settings.keys
    client = sync_client(settings.redis_url, timeout_s=BULK_TIMEOUT_S)
    try:
        with _lock(client, settings, job):
            if not job_has_storage(settings.output_uri, job, settings.s3_endpoint_url):
                raise StateError(
                    f"{settings.output_uri} holds no part of job {job!r}: is --output-uri the workers' "
                    "(THINKFLEET_OUTPUT_URI)? Nothing there is no evidence that a row was lost"
                )
            # Every part decoded whole first (page checksums): a damaged one is quarantined, its prompts missing.
            check_parts(settings.output_uri, job, s3_endpoint_url=settings.s3_endpoint_url)
            # As load_existing does: in flight before and after the queue, done/dead last.
            flying = unacked_prompt_ids(client, settings, job) | transit_prompt_ids(client, settings, job)
            flying |= queued_prompt_ids(client, settings, job)
            flying |= unacked_prompt_ids(client, settings, job) | transit_prompt_ids(client, settings, job)
            submitted = {k.decode(): v.decode() for k, v in client.hgetall(keys.prompts(job)).items()}
            done = {m.decode() for m in client.smembers(keys.done(job))}
            dead = {m.decode() for m in client.hkeys(keys.dead(job))}
            stored = stored_prompt_ids(settings.output_uri, job, s3_endpoint_url=settings.s3_endpoint_url)
            missing = (set(submitted) | done) - stored - dead - flying
            ends = chain_end_ids(client, keys, job)
            missing -= beyond_chain_ends(missing, ends)  # past a chain end: superseded, never re-run
            tasks = _salvaged_tasks(settings, job, missing, submitted)
            sent = {t.prompt_id for t in tasks}
            left = sorted(missing - sent)
            _requeue(client, settings, job, "done", tasks)
            # Nothing to re-send: out of done, so that a re-submit of the same inputs enqueues them.
            datasets = dict(zip(left, client.hmget(keys.prompt_dataset(job), left), strict=True)) if left else {}
            bare = [_Bare(p, datasets[p].decode()) for p in left if p in done and datasets[p]]
            if bare:
                with client.pipeline(transaction=True) as pipe:
                    _take_out(pipe, settings, job, "done", bare)
                    pipe.execute()
            for pid in left:
                click.echo(f"not re-sent {pid}: {NO_PROMPT_LEFT}", err=True)
            return RetryResult(sorted(sent), {pid: NO_PROMPT_LEFT for pid in left})
    finally:
        client.close()


class _Bare(NamedTuple):
    """A prompt taken out of ``done`` with no message (what ``_take_out`` reads of a task)."""

    prompt_id: str
    dataset: str


def _salvaged_tasks(settings: Settings, job: str, missing: set[str], submitted: dict[str, str]) -> list[PromptTask]:
    """Messages for ``missing`` prompts rebuilt from the quarantined parts' rows whose prompt still decodes and
    hashes to the submitted content hash (the highest revision of a prompt)."""
    from storage import layout
    from storage.quarantine import salvage
    from thinkfleet.message import content_hash, is_content_hash

    if not missing:
        return []
    loc = layout.locate(settings.output_uri, settings.s3_endpoint_url)
    media = RowMedia(settings.s3_endpoint_url)
    rows: dict[str, tuple[dict, tuple]] = {}
    for row in salvage(loc, job, _SALVAGE).to_pylist():
        pid = row["prompt_id"]
        if pid not in missing or (pid in rows and rows[pid][0]["revision"] >= row["revision"]):
            continue
        try:  # an image prompt's ids hash with its images (the row's, rebuilt: producer/row_media.py)
            refs = media.refs(row)
        except RebuildRefused:
            continue
        wanted = submitted.get(pid) or row["content_hash"]
        digest = content_hash(row["input_ids"], [m.sha256 for m in refs]) if row["input_ids"] else None
        sound = digest == wanted if is_content_hash(wanted) else row["content_hash"] == wanted
        if sound and row["input_ids"]:
            rows[pid] = (row, refs)
    with sync_client(settings.redis_url, timeout_s=BULK_TIMEOUT_S) as client:
        generation = _generation(client, settings, job)
    tasks = []
    for pid, (row, refs) in sorted(rows.items()):
        try:
            used = json.loads(row["sampling_params"]) if row["sampling_params"] else {}
        except ValueError:
            continue
        # The per-message keys of the sampling the lost row was generated with (its sample's seed, its revision's
        # budget): the rest is the job's, which the worker adds.
        used = used if isinstance(used, dict) else {}
        overrides = {k: used[k] for k in sorted(OVERRIDE_KEYS) if used.get(k) is not None}
        tasks.append(
            PromptTask(
                job=job,
                dataset=row["dataset"],
                prompt_id=pid,
                row_index=row["row_index"],
                content_hash=row["content_hash"],
                ids_blob=pack_ids(row["input_ids"]),
                sample_index=row["sample_index"],
                revision=row["revision"],
                overrides=overrides,
                generation=generation,
                media=refs,
            )
        )
    return tasks


@click.command("retry")
@click.argument("job")
@click.option("--error-class", "error_classes", multiple=True, help="Only dead letters of this class (prefix).")
@click.option("--truncated", is_flag=True, help="Re-run rows that hit max_new_tokens instead of dead letters.")
@click.option("--max-new-tokens", type=int, help="New budget for --truncated re-runs.")
@click.option(
    "--missing",
    is_flag=True,
    help="Regenerate submitted prompts with no stored row (e.g. of a quarantined, damaged part) instead of dead "
    "letters; prompts with nothing readable left are named for a re-submit.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the re-queued prompt ids as JSON.")
@settings_options(STATE)
def retry(
    job: str,
    error_classes: tuple[str, ...],
    truncated: bool,
    max_new_tokens: int | None,
    missing: bool,
    as_json: bool,
    settings: Settings,
) -> None:
    """Re-queue JOB's dead-lettered prompts (or, with --truncated, its length-stopped rows; with --missing, its
    prompts that have no stored row)."""
    if truncated and missing:
        raise click.UsageError("--truncated and --missing are separate retries: run one, then the other")
    try:
        if missing:
            ids = retry_missing(settings, job)
            what = "missing prompts re-queued"
        elif truncated:
            if not max_new_tokens:
                raise click.UsageError("--truncated needs --max-new-tokens (the larger budget for the re-run)")
            ids = retry_truncated(settings, job, max_new_tokens)
            what = f"truncated rows re-queued with max_new_tokens={max_new_tokens}"
        else:
            ids = retry_dead(settings, job, error_classes)
            what = "dead-lettered prompts re-queued"
    except StateError as e:
        raise click.ClickException(f"nothing re-queued: {e}") from e
    if as_json:
        skipped = getattr(ids, "skipped", {})  # turns of conversations whose chain still runs
        offered = getattr(ids, "offered", {})  # turns offered to the host that ran their previous turn
        out = {"job": job, "requeued": len(ids), "prompt_ids": list(ids), "skipped": skipped, "offered": offered}
        out["refused"] = getattr(ids, "refused", {})  # stored rows that do not rebuild as submitted (row_media.py)
        click.echo(json.dumps(out))
    else:
        click.echo(f"{len(ids)} {what} for job {job}")
        if missing and ids.skipped:
            click.echo(
                f"{len(ids.skipped)} missing prompts have no readable prompt left in storage: re-run `producer submit "
                f"--job {job}` with the same inputs to regenerate them"
            )
        elif not missing and not truncated and getattr(ids, "skipped", None):
            click.echo(
                f"{len(ids.skipped)} dead letters were NOT resent: their messages are not signed with this signing "
                f"key (written into Redis by something without it?), e.g. {sorted(ids.skipped)[:5]}",
                err=True,
            )
    if getattr(ids, "refused", None):
        click.echo(
            f"{len(ids.refused)} prompts were NOT re-queued: their messages would not pass a worker's content-hash "
            "check (each named above with its fix)",
            err=True,
        )
        raise SystemExit(1)


def _generation(client: redis.Redis, settings: Settings, job: str) -> str:
    """The job record's generation, which the re-queued messages carry ('' when the record has none)."""
    from thinkfleet.state.job import JobRecord

    record = JobRecord.load(client, settings.keys, job)
    return record.generation if record else ""
