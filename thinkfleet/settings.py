"""One settings object for every entry point (producer, worker, simulator helpers, bench).

Values come from, in increasing precedence: defaults here, a ``.env`` file, ``THINKFLEET_*``
environment variables, then CLI flags (entry points call :meth:`Settings.with_overrides`).
Units live in the names (``_s`` seconds, ``_ms`` milliseconds).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from thinkfleet.keys import DEFAULT_PREFIX, Keys
from thinkfleet.redis_client import is_sentinel, redacted, with_password, with_sentinel_password

#: Connections of a worker's Redis pool beyond one per request and commit thread: its own loops (lease renewal,
#: transit and visibility sweeps, the committer, health probes, metrics) and a reconnect's overlap.
REDIS_SPARE_CONNECTIONS = 32
#: Shortest Redis password accepted for a Redis that is not on loopback (`openssl rand -hex 24` makes 48).
MIN_REDIS_PASSWORD_LEN = 16
_PASSWORD_FIX = (
    "generate one with `openssl rand -hex 24` (deploy/make-secrets.sh makes one per Redis user) and give it "
    "in THINKFLEET_REDIS_PASSWORD_FILE or the URL"
)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="THINKFLEET_", env_file=".env", extra="ignore")

    # -- where things are ---------------------------------------------------------------------------
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis for job state (and broker): redis://, rediss:// (TLS), or a head that fails over, "
        "sentinel://[USER[:PASSWORD]@]HOST:PORT,HOST:PORT,HOST:PORT/DB?master=NAME (docs/operating.md).",
    )
    broker_url: str | None = Field(
        None,
        description="Celery broker: must be redis_url itself (the default); a broker apart from the job-state Redis "
        "(RabbitMQ, another Redis) is refused at start.",
    )
    redis_password_file: str | None = Field(
        None,
        description="File holding the Redis password (a compose secret); it replaces any password in redis_url "
        "(which may name the ACL user: redis://worker@head:6379/0) and in a redis:// broker_url.",
    )
    redis_sentinel_password_file: str | None = Field(
        None,
        description="File holding the password the Sentinels themselves require (a secret; not the primary's): it "
        "replaces ?sentinel_password= in a sentinel:// redis_url and broker_url. Ignored for other URLs.",
    )
    sglang_url: str = Field("http://127.0.0.1:30000", description="This host's SGLang server.")
    output_uri: str = Field(
        "./thinkfleet-output", description="Root for Parquet parts: a local path or s3://bucket/prefix."
    )
    s3_endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto, …).")
    key_prefix: str = Field(DEFAULT_PREFIX, description="Prefix of every thinkfleet key in Redis.")
    queue: str = Field("thinkfleet", description="Celery queue the prompts travel on.")

    # -- worker: concurrency ------------------------------------------------------------------------
    max_inflight: int = Field(
        512,
        ge=1,
        description="Requests in flight to the local SGLang server: the upper cap of the adaptive bound "
        "(inflight_mode auto), or the bound itself (fixed). It also sizes Celery's prefetch and the connection pools.",
    )
    inflight_mode: str = Field(
        "auto",
        pattern="^(auto|fixed)$",
        description="auto: the bound starts from the server's max_running_requests (/server_info) and follows its "
        "load (/v1/loads, /metrics; workers/adaptive.py), never above max_inflight; fixed: max_inflight.",
    )
    inflight_interval_s: float = Field(
        5.0, gt=0, description="inflight_mode auto: seconds between two decisions on the bound (4 load reads each)."
    )
    worker_name: str | None = Field(None, description="Worker identity; default hostname-pid.")
    git_revision: str | None = Field(
        None,
        description="The code's git revision, for the provenance records (an image built without .git: the "
        "Dockerfile's GIT_REVISION build argument sets it); default read from the install or the checkout.",
    )
    metrics_port: int = Field(
        0, ge=0, description="Prometheus port of this worker; 0 picks a free one (registered in Redis)."
    )

    # -- worker: requests ---------------------------------------------------------------------------
    connect_timeout_s: float = Field(10.0, gt=0, description="TCP connect timeout to SGLang.")
    request_timeout_floor_s: float = Field(
        120.0, gt=0, description="Fixed part of a request's deadline (queueing + prefill)."
    )
    request_min_decode_tok_s: float = Field(
        5.0, gt=0, description="Slowest acceptable decode rate: deadline += max_new_tokens / this."
    )
    retry_max_attempts: int = Field(8, ge=1, description="Attempts per prompt for transient faults.")
    retry_base_s: float = Field(0.5, gt=0, description="First backoff; doubles per attempt, jittered.")
    retry_max_backoff_s: float = Field(30.0, gt=0, description="Backoff ceiling.")
    health_interval_s: float = Field(5.0, gt=0, description="Health probe period while serving.")
    preflight_timeout_s: float = Field(30.0, gt=0, description="Timeout of one /model_info or /server_info read.")
    health_probe_timeout_s: float = Field(
        70.0,
        gt=0,
        description="Timeout of one /health_generate probe; above SGLANG_HEALTH_CHECK_TIMEOUT (60 in compose) so "
        "the server's own verdict decides.",
    )

    # -- worker: durability -------------------------------------------------------------------------
    lease_s: float = Field(60.0, gt=0, description="A silent worker's prompts are re-run by others after this long.")
    reaper_interval_s: float = Field(5.0, gt=0, description="How often live workers look for dead ones.")
    redis_start_wait_s: float = Field(
        60.0,
        ge=0,
        description="How long a starting worker waits for an unreachable Redis (the head node restarting) before "
        "it exits naming the cause; a refused password or certificate stops it at once.",
    )
    redis_timeout_s: float | None = Field(
        None,
        gt=0,
        description="How long a Redis command — the broker's included — waits for its reply before its connection "
        "is dropped and opened again (a sentinel:// URL then finds the promoted primary); the broker's health checks "
        "run at half of it. Unset: lease_s / 3, between 5 and 20 s, so a silent primary is noticed within the lease.",
    )
    consumer_stuck_s: float | None = Field(
        None,
        gt=0,
        description="A worker whose broker consumer (kombu's event loop) makes no turn for this long exits with "
        "status 75 for its supervisor to restart it (thinkfleet/broker/watchdog.py). Unset: two leases, at least "
        "120 s.",
    )
    clock_skew_warn_s: float = Field(
        5.0,
        gt=0,
        description="A worker whose host clock differs from Redis's by more than this warns at start, and "
        "`producer status` warns about it (leases and visibility run on Redis time either way).",
    )
    flush_rows: int = Field(512, ge=1, description="Group commit: rows per Parquet part at most.")
    flush_interval_s: float = Field(
        30.0,
        gt=0,
        description="Group commit: longest a row waits to commit (a flush also starts early when many rows wait; "
        "long intervals mean few, large Parquet parts on slow real servers).",
    )
    shutdown_grace_s: float = Field(
        20.0, ge=0, description="On SIGTERM, how long in-flight requests may finish before hand-back."
    )
    waitaof_ms: int = Field(
        1000,
        ge=0,
        description="After each finalize and before the ack, wait up to this long for Redis to fsync it to its AOF "
        "(WAITAOF; Redis 7.2+ with appendonly yes, else off by itself). 0 = off.",
    )
    wait_replicas: int = Field(
        0,
        ge=0,
        description="After each finalize and before the ack, wait up to waitaof_ms (1 s when 0) for this many "
        "replicas to have received it (WAIT, on the finalize's own connection). A short count is logged and the "
        "row stands: it is durable in storage, and a failover that loses its finalize is found by the finalize "
        "marks and finalized again from the stored part. 0 = off (a head without replicas); with a Sentinel head, "
        "1 keeps a promoted replica from missing what was acked.",
    )
    claim_wait_s: float = Field(
        0.0,
        ge=0,
        description="Longest a redelivered copy waits on another live worker's claim before taking it over (the "
        "other run, if it is still going, is fenced). 0 = the prompt's request deadline + one lease.",
    )

    # -- worker: poison prompts ---------------------------------------------------------------------
    max_deliveries: int = Field(
        3,
        ge=1,
        description="Deliveries of one prompt that end in an unexpected crash (an exception or a killed worker) "
        "before it is dead-lettered as poison:<ExceptionClass>.",
    )
    suspect_group_max: int = Field(
        0,
        ge=0,
        description="Worker: most last-chance prompts (one crash short of max_deliveries) run at once; a group that "
        "dies is split in halves until a culprit runs alone. 0 = no bound (bystanders of host deaths run at full "
        "concurrency); 1 = one at a time (cheapest way to find a poison prompt, slowest tail).",
    )

    # -- worker: placement of a conversation's next turn (thinkfleet/broker/affinity.py) ----------------
    affinity: bool = Field(
        True,
        description="Worker: offer a --turns all or agentic conversation's next turn first to this host, whose "
        "server has its prefix cached (its host list, popped before the shared queue); any host takes it after "
        "affinity_wait_s, or at once when this host is dead, draining or not consuming. Off: onto the shared queue.",
    )
    affinity_wait_s: float = Field(
        3.0,
        gt=0,
        description="Longest an offered next turn waits for its host (on Redis's clock) before any host may take it "
        "(it then goes to the consuming end of the shared queue; every worker sweeps every quarter of this, ≤ 1 s).",
    )
    affinity_idle_wait_s: float = Field(
        0.5,
        ge=0,
        description="Worker: an idle worker (nothing on the queue or its own host list) takes another host's "
        "offered next turn once it waited this long, rather than idle while that host is full (work stealing; "
        "its prefix is prefilled again). At or above affinity_wait_s: never (the sweep hands it over first).",
    )
    affinity_backlog: int = Field(
        16,
        ge=0,
        description="Worker: an offer that finds this many next turns already waiting for this host goes onto the "
        "shared queue instead. 0 = no bound (affinity_wait_s alone bounds the wait).",
    )

    # -- storage ------------------------------------------------------------------------------------
    storage_retry_max_s: float = Field(
        30.0, gt=0, description="Longest backoff between retries of a failed Parquet commit (rows kept in memory)."
    )
    stall_flush_intervals: int = Field(
        4,
        ge=1,
        description="A worker holding rows with no commit (or prompts while its server gate is closed) for this many "
        "flush intervals (at least 10 s) is shown stalled, with its reason, by producer status and Prometheus.",
    )
    commit_stuck_exit_s: float = Field(
        900.0,
        ge=0,
        description="A worker whose commit stream is stuck this long (rows waiting, an attempt that does not return "
        "or an error that is not I/O) exits with code 75 for its supervisor to restart it; 0: never. An I/O outage "
        "is waited out behind the storage gate instead.",
    )
    part_target_bytes: int = Field(
        64 << 20,
        ge=1 << 16,
        description="Group commit: a part's Parquet size target, bytes (rows are ~4 B per id): a flush starts early "
        "once the waiting rows reach it, and a larger group is written as several parts (flush_rows caps the rows).",
    )
    storage_memory_mb: int = Field(
        1024,
        ge=16,
        description="verify/report/export/compact: the peak memory they aim for, MiB — their batches, part groups "
        "and sort runs take what the interpreter and the job's per-prompt keys (~100 B a stored row) leave of it, at "
        "least a quarter; a larger job spills sorted runs to local temp files.",
    )

    # -- the commit log a trainer follows (storage/feed.py, producer export --follow) -----------------
    feed_max_len: int = Field(
        200_000,
        ge=0,
        description="Worker: the job's commit log keeps about this many entries at most (a few hundred bytes each), "
        "whoever reads it; a reader it outran is rebuilt from storage. 0: no cap (trimmed only behind the readers).",
    )

    # -- reasoning alarm ----------------------------------------------------------------------------
    alarm_min_rows: int = Field(100, ge=1, description="Rows observed before the alarm may fire.")
    alarm_missing_share: float = Field(
        0.95, gt=0, le=1, description="Fire when this share of rows lacks a think-end token."
    )

    # -- messages: what a worker accepts ----------------------------------------------------------
    max_prompt_tokens: int = Field(
        1 << 20,
        ge=1,
        description="Longest prompt, in ids, a worker decodes (4 bytes each: 4 MiB by default); a longer one is "
        "dead-lettered as oversize and refused by producer submit.",
    )
    max_message_bytes: int = Field(
        0,
        ge=0,
        description="Largest message body a worker decodes; bigger ones go to the malformed list as oversize. "
        "0 = derived from max_prompt_tokens (4 bytes per id + 64 KiB).",
    )

    # -- images in prompts: what producer submit accepts and where it keeps them (docs/vision.md) -------------
    image_store_uri: str | None = Field(
        None,
        description="Where producer submit stores each prompt image once, by sha256 (a local path or s3://…); "
        "workers read images only from there. Unset: {OUTPUT_URI}/{job}/_images.",
    )
    max_image_bytes: int = Field(
        20 << 20, ge=1, description="Largest image file producer submit accepts (20 MiB); a bigger one is refused."
    )
    max_image_pixels: int = Field(
        64_000_000, ge=1, description="Most pixels (width × height) of an image producer submit accepts."
    )
    image_fetch_timeout_s: float = Field(
        30.0, gt=0, description="Timeout of one http(s):// or s3:// image fetch at submit (workers never fetch)."
    )
    image_cache_bytes: int = Field(
        256 << 20,
        ge=0,
        description="Worker: byte budget of the images it keeps encoded (data: URIs, by sha256; least recently used "
        "dropped first), so an image many prompts share is read from the store once (256 MiB). 0: read every time.",
    )
    # -- the image store on a worker: its gate, hand-backs and bytes in flight (docs/vision.md) -----------------
    image_inflight_bytes: int = Field(
        1 << 30,
        ge=1,
        description="Worker: byte budget of the encoded images its requests hold (1 GiB), taken before an image "
        "prompt's images are read and given back when its request ends; a prompt over the whole budget runs alone.",
    )
    image_handback_max: int = Field(
        5,
        ge=1,
        description="Worker: hand-backs of one image prompt whose image cannot be read while its store can (a "
        "permission error, a directory in its place) or is missing, before it is dead-lettered image_unreadable "
        "or image_missing.",
    )
    image_missing_workers: int = Field(
        2,
        ge=1,
        description="Worker: distinct workers that must find an image missing (its store readable) before the "
        "prompt is dead-lettered image_missing (fewer when image_handback_max tries come first).",
    )
    image_backoff_max_s: float = Field(
        30.0,
        gt=0,
        description="Worker: longest wait before an image prompt is handed back (doubling from a second per "
        "hand-back), and between two checks of an image store whose gate is closed.",
    )
    image_store_map: str = Field(
        "",
        description="Worker: where this host mounts image stores that the job records name by the producer's "
        "path, as FROM=TO[,FROM=TO] path prefixes (e.g. /data/out=/mnt/out). Unset: the recorded path.",
    )

    # -- trust: what a worker runs and what it believes (thinkfleet/signing.py, workers/jobs.py) ----------
    signing_key_file: str | None = Field(
        None,
        description="File holding the key work is signed with (deploy/make-secrets.sh's signing_key; not a Redis "
        "credential). The producer signs job records and messages with it; a worker with it refuses unsigned or "
        "badly signed work. Unset: nothing is signed or checked.",
    )
    signing_key: SecretStr | None = Field(
        None, description="The signing key itself (tests, bare-metal trials); prefer signing_key_file."
    )
    signing_key_previous_file: str | None = Field(
        None,
        description="A retired signing key that workers still accept (never sign with): set it while work signed "
        "before a key rotation drains.",
    )
    trust_remote_code: bool = Field(
        False,
        description="Worker: may a --turns all job's tokenizer run its own Python code (auto_map)? Off: such a "
        "job's prompts are dead-lettered remote_code_refused (producer retry resends them once this is on).",
    )
    tokenizer_roots: str = Field(
        "",
        description="Worker: directories a --turns all job's tokenizer may be loaded from (os.pathsep-separated). "
        "Empty: the model directory this node's server serves. A job naming another path is dead-lettered "
        "tokenizer_refused.",
    )

    # -- worker: tool executors (an agentic job's live results: workers/tool_exec.py) -------------------
    tool_executors: str = Field(
        "",
        description="Worker: the --tool-executor specs it runs (comma-separated module:function, file.py:function "
        "or http(s) URLs; * = any). The spec comes from the job record in Redis, so a worker runs only those listed.",
    )
    tool_timeout_s: float = Field(30.0, gt=0, description="Worker: longest one executor call may take (then retried).")
    tool_retries: int = Field(2, ge=0, description="Worker: executor retries after an error or timeout, per step.")
    tool_concurrency: int = Field(4, ge=1, description="Worker: executor calls in flight at once, per job.")

    # -- logging ------------------------------------------------------------------------------------
    log_level: str = Field("INFO", description="Python logging level.")

    @field_validator("output_uri")
    @classmethod
    def _strip_slash(cls, value: str) -> str:
        return value.rstrip("/") or value

    @model_validator(mode="after")
    def _password_from_file(self) -> Settings:
        if not self.redis_password_file:
            return self
        password = read_password_file(self.redis_password_file)
        old = self.redis_url
        self.redis_url = with_redis_password(old, password)
        if not self.broker_url or self.broker_url == old:
            self.broker_url = self.redis_url
        elif not urlsplit(self.broker_url).password:
            self.broker_url = with_redis_password(self.broker_url, password)
        return self

    @model_validator(mode="after")
    def _sentinel_password_from_file(self) -> Settings:
        if not self.redis_sentinel_password_file:
            return self
        password = read_password_file(self.redis_sentinel_password_file, "THINKFLEET_REDIS_SENTINEL_PASSWORD_FILE")
        old = self.redis_url
        self.redis_url = with_sentinel_password(old, password)
        if not self.broker_url or self.broker_url == old:
            self.broker_url = self.redis_url
        elif is_sentinel(self.broker_url):
            self.broker_url = with_sentinel_password(self.broker_url, password)
        return self

    @model_validator(mode="after")
    def _default_broker(self) -> Settings:
        if not self.broker_url:
            self.broker_url = self.redis_url
        return self

    # -- derived --------------------------------------------------------------------------------------
    @property
    def keys(self) -> Keys:
        return Keys(self.key_prefix)

    @property
    def visibility_timeout_s(self) -> float:
        """Celery's visibility timeout equals the lease: live workers renew it, dead ones lose it."""
        return self.lease_s

    @property
    def commit_headroom(self) -> int:
        """Worker threads beyond the in-flight bound.

        A finished request waits for its group commit before its task may ack; these threads let the
        next prompts take the freed request slots meanwhile, so in-flight stays at the bound. They hold
        at most this many messages that are not yet sending.
        """
        return max(4, self.max_inflight // 4)

    @property
    def worker_redis_connections(self) -> int:
        """Connections a worker's Redis pool may hold at once: one per request in flight (each runs its own
        claim, mark_part, finalize or release), one per commit-headroom thread, and REDIS_SPARE_CONNECTIONS for
        the process's own loops (lease, sweeper, committer, health). redis-py's asyncio pool allows 100 by default
        and refuses the 101st ("Too many connections"): fewer than the seed's --max-inflight 128 needed."""
        return self.max_inflight + self.commit_headroom + REDIS_SPARE_CONNECTIONS

    @property
    def producer_redis_connections(self) -> int:
        """Connections ``producer status``/``wait`` may hold: they run one command at a time."""
        return 4

    @property
    def message_byte_limit(self) -> int:
        """``max_message_bytes``, or what the largest plausible prompt's message needs: its ids raw (zstd never
        expands them by more than a few bytes per 128 KiB) plus room for names, hash and overrides."""
        return self.max_message_bytes or self.max_prompt_tokens * 4 + (64 << 10)

    @property
    def worker_identity(self) -> str:
        return self.worker_name or f"{socket.gethostname()}-{os.getpid()}"

    def request_deadline_s(self, max_new_tokens: int) -> float:
        """Per-request deadline scaled to the generation budget (no fixed 300 s ceiling)."""
        return self.request_timeout_floor_s + max_new_tokens / self.request_min_decode_tok_s

    def require_safe_redis_password(self, error: type[Exception] = ValueError) -> None:
        """Raise ``error`` naming the fix when a Redis that is not on loopback gets a placeholder or short
        password (the producer CLI and the worker's start call this before they touch Redis)."""
        urls = {"THINKFLEET_REDIS_URL": self.redis_url}
        if self.broker_url != self.redis_url:
            urls["THINKFLEET_BROKER_URL"] = self.broker_url
        for setting, url in urls.items():
            problem = redis_password_problem(url, setting)
            if problem:
                raise error(problem)

    def require_supported_broker(self, error: type[Exception] = ValueError) -> None:
        """Raise ``error`` naming the fix when the broker is not the job-state Redis itself (the producer CLI and the
        worker's start call this before anything is enqueued or consumed).

        The queue must live in ``redis_url``: a next turn, a retry and a re-derived step are enqueued in the same
        Redis transaction as the state change that makes them (``thinkfleet/state/lua/finalize.lua``, the submit
        commit, ``producer retry``), so each is enqueued exactly when it is owed. A second broker (RabbitMQ, another
        Redis) cannot share that transaction: its next turns were pushed where no worker read them."""
        if self.broker_url in (None, self.redis_url):
            return
        scheme = urlsplit(str(self.broker_url)).scheme or "?"
        raise error(
            f"THINKFLEET_BROKER_URL is a {scheme}:// broker apart from THINKFLEET_REDIS_URL: not supported. thinkfleet "
            "keeps its queue in the job-state Redis, because next turns, retries and re-derived steps are enqueued "
            "in the same Redis transaction as the state change that owes them. Unset THINKFLEET_BROKER_URL (or set "
            "it to THINKFLEET_REDIS_URL)."
        )

    def with_overrides(self, **overrides: Any) -> Settings:
        """A copy with CLI flags applied; ``None`` means "flag not given"."""
        given = {k: v for k, v in overrides.items() if v is not None}
        if not given:
            return self
        data = self.model_dump()
        if "redis_url" in given and "broker_url" not in given and self.broker_url == self.redis_url:
            data["broker_url"] = None
        data.update(given)
        return Settings.model_validate(data)


def read_password_file(path: str, setting: str = "THINKFLEET_REDIS_PASSWORD_FILE") -> str:
    """A password file's content without surrounding whitespace (``openssl rand -hex 24 > FILE`` adds a newline)."""
    try:
        password = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"{setting}: cannot read {path}: {exc.strerror or exc}") from None
    if not password:
        raise ValueError(f"{setting}: {path} is empty")
    return password


def with_redis_password(url: str, password: str) -> str:
    """``url`` (redis://, rediss:// or sentinel://) with ``password``, keeping its user: redis://worker@h/0 →
    redis://worker:PW@h/0."""
    return with_password(url, password)


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def redis_password_problem(url: str | None, setting: str = "THINKFLEET_REDIS_URL") -> str | None:
    """Why ``url``'s password is unsafe, or None: a placeholder (``change-me``) or fewer than
    :data:`MIN_REDIS_PASSWORD_LEN` characters, for a Redis that is not on loopback (a local test or demo
    Redis may have none)."""
    parts = urlsplit(url or "")
    if parts.scheme not in ("redis", "rediss", "sentinel"):
        return None
    # A sentinel:// URL names the Sentinels (h1:p,h2:p,…): the primary they name is remote when any of them is.
    hosts = [h.rpartition(":")[0].strip("[]") or h for h in parts.netloc.rpartition("@")[2].split(",")]
    remote = [h for h in hosts if h and not _loopback(h)]
    if not remote:
        return None
    host = remote[0]
    password = unquote(parts.password or "")
    if "change-me" in password.lower():
        return f"{setting}: the password for Redis at {host} is the .env.example placeholder; {_PASSWORD_FIX}"
    if len(password) < MIN_REDIS_PASSWORD_LEN:
        have = f"has only {len(password)} characters" if password else "is missing"
        return (
            f"{setting}: the password for Redis at {host} {have} (at least {MIN_REDIS_PASSWORD_LEN} for a Redis "
            f"reachable over the network); {_PASSWORD_FIX}"
        )
    return None


def load_settings(**overrides: Any) -> Settings:
    """Settings from env/.env with CLI overrides applied."""
    return Settings().with_overrides(**overrides)


def redacted_url(url: str) -> str:
    """The URL without its passwords (it goes into logs and messages)."""
    return redacted(url)
