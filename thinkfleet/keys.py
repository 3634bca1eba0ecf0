"""The Redis key layout, in one place.

Everything thinkfleet keeps in Redis lives under ``{prefix}:`` (default ``tf``). Kombu's own keys (the
queue list named after the queue and its priority lists, ``unacked``, ``unacked_index``, ``unacked_mutex``)
are Celery's: :mod:`thinkfleet.broker.keys` names them, from the same prefix, so one Redis can serve several
isolated deployments.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "tf"


@dataclass(frozen=True)
class Keys:
    """Key builder bound to a prefix: ``Keys("tf").job("demo") == "tf:job:demo"``."""

    prefix: str = DEFAULT_PREFIX

    # -- jobs ---------------------------------------------------------------------------------
    @property
    def jobs(self) -> str:
        """SET of job names."""
        return f"{self.prefix}:jobs"

    def job(self, job: str) -> str:
        """HASH: the job record (JSON-encoded fields: datasets, tokenizer, sampling params, …)."""
        return f"{self.prefix}:job:{job}"

    def prompts(self, job: str) -> str:
        """HASH prompt_id → content hash of every prompt submitted to the job."""
        return f"{self.prefix}:job:{job}:prompts"

    def prompt_dataset(self, job: str) -> str:
        """HASH prompt_id → dataset name (status counts per dataset)."""
        return f"{self.prefix}:job:{job}:prompt_dataset"

    def done(self, job: str) -> str:
        """SET of prompt_ids whose row is committed to storage (a cache of storage, which is the truth)."""
        return f"{self.prefix}:job:{job}:done"

    def dead(self, job: str) -> str:
        """HASH prompt_id → JSON dead-letter record {error_class, message, attempts, worker, at}."""
        return f"{self.prefix}:job:{job}:dead"

    def claims(self, job: str) -> str:
        """HASH prompt_id → JSON claim {worker, part, at, epoch}: who is generating/committing a prompt now,
        under which fencing token (``epoch``, a decimal string; thinkfleet/state/lua/claim.lua)."""
        return f"{self.prefix}:job:{job}:claims"

    def epoch_clock(self, job: str) -> str:
        """STRING: the last epoch a claim of the job was given (epochs are max(Redis TIME in µs, this + 1))."""
        return f"{self.prefix}:job:{job}:epoch_clock"

    def committed_epochs(self, job: str) -> str:
        """HASH prompt_id → epoch of the row ``finalize`` made the prompt's committed one (a decimal string): a
        retried finalize of that same row is told it succeeded, any other row is fenced; verify compares it
        with storage's highest epoch."""
        return f"{self.prefix}:job:{job}:committed_epochs"

    def revisions(self, job: str) -> str:
        """HASH prompt_id → the highest revision requested for it (``producer retry`` bumps it; absent = 0):
        a claim of a message of a lower revision is refused (``superseded``)."""
        return f"{self.prefix}:job:{job}:revisions"

    def deliveries(self, job: str) -> str:
        """HASH prompt_id → JSON {x, k, ik, g, lost, error}: deliveries that ended in a crash (poison detection,
        thinkfleet/state/lua/claim.lua). Cleared when the prompt is stored, dead-lettered or re-queued by
        ``producer retry``."""
        return f"{self.prefix}:job:{job}:deliveries"

    def counters(self, job: str) -> str:
        """HASH of job counters (done, output_tokens, think_end, truncated, retried, dead, …)."""
        return f"{self.prefix}:job:{job}:counters"

    def dataset_counters(self, job: str, dataset: str) -> str:
        """HASH of per-dataset counters (submitted, done, dead, output_tokens), kept by the transitions that move
        a prompt (finalize, dead_letter, requeue, refill_done): ``producer status`` counts per dataset from them."""
        return f"{self.prefix}:job:{job}:ds:{dataset}"

    def checked(self, job: str) -> str:
        """STRING: JSON of the job's last full consistency check {at, unaccounted, unaccounted_ids, drift, …}
        (``producer status --deep``, ``wait``/``--watch``'s periodic one; thinkfleet/state/counters.py): what a
        plain ``status``, which reads only counters, reports about prompts in no place."""
        return f"{self.prefix}:job:{job}:checked"

    def finalize_marks(self, job: str) -> str:
        """HASH worker → ``nonce:seq`` of its process's latest finalize or dead letter (finalize.lua, dead_letter.lua
        write it in the same call, thinkfleet/state/lua/_mark.lua), and ``{worker}|lost`` → 1 when such a write found
        the mark behind the writes Redis had answered: a worker that finds either knows Redis lost writes it made (a
        rollback) and makes them again (``Ledger.lost_finalizes``, ``GroupCommitter.recheck``)."""
        return f"{self.prefix}:job:{job}:finalize_marks"

    def check_seen(self, job: str, token: str) -> str:
        """SET with TTL: the job's prompt ids a running place check found on the queue, delivered or claimed
        (thinkfleet/state/places.py); deleted when the check ends."""
        return f"{self.prefix}:job:{job}:check:{token}"

    def worker_counters(self, job: str) -> str:
        """HASH worker → output tokens for this job (per-host throughput in status)."""
        return f"{self.prefix}:job:{job}:worker_tokens"

    def timeline(self, job: str) -> str:
        """ZSET of per-flush samples "ts:rows:tokens" scored by time (tokens/s and ETA)."""
        return f"{self.prefix}:job:{job}:timeline"

    def alarm(self, job: str) -> str:
        """STRING: set when the reasoning alarm fired (JSON with the evidence)."""
        return f"{self.prefix}:job:{job}:alarm"

    def submit_lock(self, job: str) -> str:
        """STRING with TTL: held by the one `producer submit` of this job running now."""
        return f"{self.prefix}:job:{job}:submit_lock"

    def staging(self, job: str, token: str) -> str:
        """LIST with TTL: a submit's messages before they are moved onto the queue all at once."""
        return f"{self.prefix}:job:{job}:staging:{token}"

    def staging_prompts(self, job: str, token: str) -> str:
        """HASH with TTL: a submit's prompt_id → content hash before its commit merges it into ``prompts``."""
        return f"{self.prefix}:job:{job}:staging:{token}:prompts"

    def staging_datasets(self, job: str, token: str) -> str:
        """HASH with TTL: a submit's prompt_id → dataset before its commit merges it into ``prompt_dataset``."""
        return f"{self.prefix}:job:{job}:staging:{token}:datasets"

    def job_state(self, job: str) -> str:
        """STRING: the job's lifecycle state, ``paused`` or ``cancelled`` (absent = active), set by
        ``producer pause``/``resume``/``cancel``; workers read it before each prompt."""
        return f"{self.prefix}:job:{job}:state"

    def parked(self, job: str) -> str:
        """LIST of the job's messages taken off the queue while it is paused (``producer resume`` moves them
        back); the invariant counts them as queued."""
        return f"{self.prefix}:job:{job}:parked"

    def conversations(self, job: str) -> str:
        """HASH conversation id → JSON {dataset, row_index, messages, tools, users, turn_count, cut_at_tool}
        of a ``--turns all`` job (:mod:`thinkfleet.turns`)."""
        return f"{self.prefix}:job:{job}:conversations"

    def turn_answers(self, job: str) -> str:
        """HASH turn prompt id → JSON of the model's answer as an assistant message (+ ``chain_end`` when last)."""
        return f"{self.prefix}:job:{job}:turn_answers"

    def chain_state(self, job: str) -> str:
        """HASH conversation id → its chain's last finalized link, a few bytes: JSON ``[prompt id, link]`` where link
        is ``>{next prompt id}`` (it goes on) or ``={chain_end reason}`` (``=complete`` at its last turn), written by
        finalize.lua with the answer record: what status, wait and retry read instead of the answers."""
        return f"{self.prefix}:job:{job}:chain_state"

    def chain_waiting(self, job: str) -> str:
        """SET of the conversations whose chain state goes on (waits for its next prompt): with the counters'
        ``chains_complete`` / ``chains_ended:{kind}``, where every chain stands without reading each one's state."""
        return f"{self.prefix}:job:{job}:chain_waiting"

    def tool_calls(self, job: str) -> str:
        """HASH ``{step prompt id}@{revision}:{calls digest}`` → JSON of an agentic job's executor results for those
        calls of that step revision (or its ``pending`` mark while the call runs), with the ``epoch`` and ``worker``
        of the run that made them: the idempotency record of workers/tool_exec.py (state/lua/tool_calls.lua)."""
        return f"{self.prefix}:job:{job}:tool_calls"

    def committed_revisions(self, job: str) -> str:
        """HASH prompt_id → revision of the row ``finalize`` made the prompt's committed one, written only for a
        revision above 0 (absent = 0: most rows cost nothing here): with ``committed_epochs``, what a later revision's
        feed entry names as the row it replaces."""
        return f"{self.prefix}:job:{job}:committed_revisions"

    def feed(self, job: str) -> str:
        """STREAM: the job's commit log, one entry per row ``finalize`` moved into done, in finalize order (fields
        ``prompt_id``, ``revision``, ``epoch``, ``part`` (its URI), ``row`` (index in the part) and, for a later row of
        a prompt, ``replaces`` = ``revision:epoch``). Capped at about ``feed_max_len`` entries and trimmed behind the
        slowest registered reader (storage/feed.py)."""
        return f"{self.prefix}:job:{job}:feed"

    def feed_log(self, job: str) -> str:
        """HASH beside the ``feed`` stream, made with its first entry: ``id`` → the log's incarnation (Redis time in
        µs; a lost log — Redis restarted empty, a FLUSH, a DEL — gets a new one, which a reader's cursor no longer
        names: it is rebuilt from storage), ``trimmed`` → the highest entry id trimmed away (a reader below it lost
        entries: rebuilt too)."""
        return f"{self.prefix}:job:{job}:feed:log"

    def feed_readers(self, job: str) -> str:
        """HASH reader name → the last ``feed`` entry id it committed as durably handled (storage/feed.py commit):
        the log is trimmed behind the lowest."""
        return f"{self.prefix}:job:{job}:feed:readers"

    def job_fixed(self, job: str) -> list[str]:
        """The job's record and every per-job key whose name depends on the job alone (``producer purge``'s one Lua
        step, state/lua/purge.lua; the rest — per-dataset counters, check tokens, staging — go by ``job_glob``). Not
        the submit lock: purge holds it while it runs."""
        return [
            self.job(job),
            *(
                f(job)
                for f in (
                    self.prompts, self.prompt_dataset, self.done, self.dead, self.claims, self.epoch_clock,
                    self.committed_epochs, self.revisions, self.deliveries, self.counters, self.checked,
                    self.finalize_marks, self.worker_counters, self.timeline, self.alarm, self.job_state,
                    self.parked, self.conversations, self.turn_answers, self.chain_state,
                    self.chain_waiting, self.tool_calls, self.committed_revisions, self.feed, self.feed_log,
                    self.feed_readers,
                )
            ),
        ]  # fmt: skip

    def job_glob(self, job: str) -> str:
        """Glob of every per-job key but the record itself (``producer purge``)."""
        return f"{self.prefix}:job:{job}:*"

    @property
    def malformed(self) -> str:
        """LIST of messages that are not prompt tasks at all (JSON {message_id, error, args, at}), newest first."""
        return f"{self.prefix}:malformed"

    # -- workers ------------------------------------------------------------------------------
    @property
    def workers(self) -> str:
        """HASH worker identity → JSON info (host, pid, sglang_url, metrics port, started_at)."""
        return f"{self.prefix}:workers"

    def heartbeat(self, worker: str) -> str:
        """STRING with TTL = lease: present while the worker is alive."""
        return f"{self.prefix}:hb:{worker}"

    def suspect_group(self, group: str) -> str:
        """SET of the last-chance runs (``{claims key}|{prompt id}``) one worker life runs at once, ``group`` being
        ``{worker}:{life nonce}`` (thinkfleet/state/lua/claim.lua): when the worker dies, its size is the group's
        that died together. Expires a day after its last join."""
        return f"{self.prefix}:suspects:{group}"

    def held(self, worker: str) -> str:
        """SET of kombu delivery tags this worker holds (their visibility is renewed while alive)."""
        return f"{self.prefix}:held:{worker}"

    def transit(self, worker: str) -> str:
        """LIST of messages this worker popped off the queue and kombu has not yet recorded as unacked."""
        return f"{self.prefix}:transit:{worker}"

    def affinity_offers(self, queue: str) -> str:
        """ZSET ``{worker}\\n{task id}`` → Redis time the message was offered on that worker's host list of ``queue``
        (thinkfleet/broker/affinity.py): written with the offer (finalize.lua), removed with the pop or the steal; a
        sweep moves what waited longer than ``affinity_wait_s`` onto the shared queue."""
        return f"{self.prefix}:affinity:{queue}:offers"
