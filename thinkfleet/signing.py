"""Work signed by the producer: a Redis writer without the key can neither inject prompts nor change a job.

A Redis credential says who may *move* work (push, pop, claim, finalize), not what the work *is*: the producer
password, the Flower password (it may push restored messages onto the queue), a leaked admin password, or a
Redis reachable by mistake all let their holder write a message or a job record. So what a worker generates is
decided by a key that is no Redis credential (``THINKFLEET_SIGNING_KEY_FILE``, the compose secret
``signing_key`` made by deploy/make-secrets.sh): the producer signs with it, workers refuse what it did not sign.

What is signed (HMAC-SHA256 under the key; a signature is ``v1:`` and 64 hex digits):

- **each message** (:class:`~thinkfleet.message.PromptTask`): job, dataset, prompt id, row index, content hash,
  sample index, revision, the per-message sampling overrides and the job record generation. The ids are bound
  through the content hash, which every worker recomputes from them (:meth:`PromptTask.verified_ids`). The
  signature travels as the message's 11th argument; the worker checks it before it reads anything of the job.
- **the job record** (``Keys.job``): every field of the hash as stored (its JSON text), but ``signature`` and
  ``turns``, and the job's name — so sampling, tokenizer, markers, vocabulary, expected model and generation
  cannot change, and a record copied onto another job's key is refused. Carried in the hash's ``signature``.
- **the** ``turns`` **field** of a ``--turns all`` job (its mode, whether its tokenizer asks for remote code),
  **each conversation record** and **each answer record** a worker keeps for the next turn: their own
  ``signature`` key (:meth:`Signer.sign_doc`), bound to the job (and the conversation or turn) they belong to.

A worker with a key refuses: a message with no or a bad signature (recorded in the fleet-wide malformed list as
``unsigned_message`` / ``bad_signature`` and acked — never dead-lettered in the job it names, which would let a
forged copy of a real prompt take that prompt out of the queue's reach); a job record with no or a bad signature
(its messages are dead-lettered ``unsigned_job`` / ``bad_job_signature``, whole: ``producer retry`` resends them
once the record is signed again); a conversation or answer record that fails its check (the chain ends there,
``error: …`` in its answer record). Without a key nothing is signed and nothing is checked (the format before
signing: 9- and 10-argument messages, unsigned records, are accepted as they always were).

Workers hold the key too: they sign the next turn of a ``--turns all`` conversation and the answers it is
rendered from. A GPU host is trusted with the outputs anyway; the key is what a Redis credential alone lacks.
A retired key may still be accepted (``THINKFLEET_SIGNING_KEY_PREVIOUS_FILE``) while work signed with it drains.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping, Sequence
from hmac import compare_digest
from hmac import digest as hmac_digest  # one-shot, C: the fast path signs every message
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack

from thinkfleet.message import MessageRefused, PromptTask

if TYPE_CHECKING:
    from thinkfleet.settings import Settings

#: The job hash field that holds the record's signature.
SIGNATURE_FIELD = "signature"
#: Job hash fields the record's signature does not cover: itself, and ``turns`` (signed in its own value).
UNSIGNED_RECORD_FIELDS = frozenset({SIGNATURE_FIELD, "turns"})
#: The key inside a signed JSON document (turns meta, conversation, answer) that holds its signature.
DOC_SIGNATURE = "signature"
#: Shortest key accepted (`openssl rand -hex 32` makes 64).
MIN_KEY_CHARS = 32
_VERSION = "v1:"
_packb = msgpack.Packer(use_bin_type=True).pack


class SigningKeyError(ValueError):
    """The signing key cannot be read, or is too short to be one."""


def _task_payload(task: PromptTask) -> bytes:
    overrides = sorted(([str(k), v] for k, v in task.overrides.items()), key=lambda kv: kv[0])
    return _packb(
        [
            "tf-message",
            task.job,
            task.dataset,
            task.prompt_id,
            task.row_index,
            task.content_hash,
            task.sample_index,
            task.revision,
            overrides,
            task.generation,
        ]
    )


def _record_payload(job: str, fields: Mapping[Any, Any]) -> bytes:
    pairs = []
    for k, v in fields.items():
        name = k.decode("utf-8", "surrogateescape") if isinstance(k, bytes) else str(k)
        if name in UNSIGNED_RECORD_FIELDS:
            continue
        pairs.append([name, v if isinstance(v, bytes) else str(v).encode()])
    pairs.sort(key=lambda kv: kv[0])
    return _packb(["tf-job-record", job, pairs])


def canonical_json(doc: Any) -> str:
    """The one text of a JSON document its signature is computed over (sorted keys, no spaces)."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _doc_payload(kind: str, job: str, name: str, doc: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in doc.items() if k != DOC_SIGNATURE}
    return _packb(["tf-" + kind, job, name, canonical_json(body)])


class Signer:
    """Signs and checks work under one key (and accepts work signed under retired ones)."""

    def __init__(self, key: bytes, accepted: Sequence[bytes] = ()) -> None:
        if len(key) < MIN_KEY_CHARS:
            raise SigningKeyError(f"a signing key has at least {MIN_KEY_CHARS} characters (`openssl rand -hex 32`)")
        self._key = key
        self._keys = (key, *accepted)

    def _mac(self, key: bytes, payload: bytes) -> str:
        return _VERSION + hmac_digest(key, payload, "sha256").hex()

    def _valid(self, signature: object, payload: bytes) -> bool:
        if not isinstance(signature, str) or not signature.startswith(_VERSION):
            return False
        given = signature.encode("ascii", "replace")
        return any(compare_digest(given, self._mac(k, payload).encode()) for k in self._keys)

    # -- messages -----------------------------------------------------------------------------------------------
    def sign_task(self, task: PromptTask) -> PromptTask:
        """``task`` carrying its signature (a new task: PromptTask is frozen)."""
        return dataclasses.replace(task, signature=self.task_signature(task))

    def task_signature(self, task: PromptTask) -> str:
        """The signature of ``task``'s fields (what :meth:`sign_task` puts in it)."""
        return self._mac(self._key, _task_payload(task))

    def check_task(self, task: PromptTask) -> None:
        """Raise :class:`MessageRefused` ``unsigned_message`` or ``bad_signature`` unless the producer (or a worker,
        for a next turn) signed exactly this message."""
        if not task.signature:
            raise MessageRefused(
                "unsigned_message",
                f"message {task.task_id} carries no signature and this worker requires signed work "
                "(THINKFLEET_SIGNING_KEY_FILE is set): not from a producer that holds the key",
            )
        try:
            payload = _task_payload(task)
        except Exception as exc:  # overrides msgpack cannot pack: no producer wrote that
            raise MessageRefused("bad_signature", f"message {task.task_id}: unsignable fields ({exc})") from None
        if not self._valid(task.signature, payload):
            raise MessageRefused(
                "bad_signature",
                f"message {task.task_id}: the signature does not match its job, prompt, hash, sampling or revision "
                "(changed after signing, or signed with another key)",
            )

    # -- job records --------------------------------------------------------------------------------------------
    def record_signature(self, job: str, fields: Mapping[Any, Any]) -> str:
        """The signature of a job hash's ``fields`` (as stored: JSON text), :data:`UNSIGNED_RECORD_FIELDS` aside."""
        return self._mac(self._key, _record_payload(job, fields))

    def sign_record_hash(self, job: str, fields: Mapping[str, str]) -> dict[str, str]:
        """``fields`` plus the :data:`SIGNATURE_FIELD` that signs them (what ``JobRecord.save`` writes)."""
        return {**fields, SIGNATURE_FIELD: json.dumps(self.record_signature(job, fields))}

    def check_record(self, job: str, raw: Mapping[Any, Any]) -> None:
        """Raise :class:`MessageRefused` ``unsigned_job`` / ``bad_job_signature`` unless ``raw`` (a job hash as
        ``HGETALL`` returns it) is the record the producer signed for ``job``."""
        stored = raw.get(SIGNATURE_FIELD.encode(), raw.get(SIGNATURE_FIELD))
        if stored is None:
            raise MessageRefused(
                "unsigned_job",
                f"job {job}: its record carries no signature and this worker requires signed work: written by "
                "something without the signing key (re-run producer submit with THINKFLEET_SIGNING_KEY_FILE)",
            )
        try:
            signature = json.loads(stored)
        except (TypeError, ValueError):
            signature = None
        if not self._valid(signature, _record_payload(job, raw)):
            raise MessageRefused(
                "bad_job_signature",
                f"job {job}: its record does not match its signature (a field was changed or added after the "
                "producer signed it, or it was signed with another key): its sampling, tokenizer and output are "
                "not trusted",
            )

    # -- JSON documents: turns meta, conversations, answers ------------------------------------------------------
    def sign_doc(self, kind: str, job: str, name: str, doc: Mapping[str, Any]) -> dict[str, Any]:
        """``doc`` (after a JSON round trip, so the signed text is the stored one) with its ``signature``."""
        body = json.loads(json.dumps({k: v for k, v in doc.items() if k != DOC_SIGNATURE}))
        return {**body, DOC_SIGNATURE: self._mac(self._key, _doc_payload(kind, job, name, body))}

    def doc_valid(self, kind: str, job: str, name: str, doc: Mapping[str, Any]) -> bool:
        try:
            payload = _doc_payload(kind, job, name, doc)
        except Exception:
            return False
        return self._valid(doc.get(DOC_SIGNATURE), payload)


def read_key(path: str, setting: str = "THINKFLEET_SIGNING_KEY_FILE") -> bytes:
    """A key file's content without surrounding whitespace."""
    try:
        key = Path(path).read_text().strip()
    except OSError as exc:
        raise SigningKeyError(f"{setting}: cannot read {path}: {exc.strerror or exc}") from None
    if len(key) < MIN_KEY_CHARS:
        raise SigningKeyError(
            f"{setting}: {path} holds {len(key)} characters; a signing key has at least {MIN_KEY_CHARS} "
            "(deploy/make-secrets.sh writes one with `openssl rand -hex 32`)"
        )
    return key.encode()


def _stamp(path: str | None) -> tuple[int, int] | None:
    """What tells a key file's versions apart (a rotated file is read again)."""
    if not path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


@functools.lru_cache(maxsize=8)
def _signer(
    key_file: str | None, key: str | None, previous_file: str | None, _stamps: tuple[object, ...] = ()
) -> Signer | None:
    if key_file:
        current = read_key(key_file)
    elif key:
        current = key.strip().encode()
        if len(current) < MIN_KEY_CHARS:
            raise SigningKeyError(f"THINKFLEET_SIGNING_KEY has fewer than {MIN_KEY_CHARS} characters")
    else:
        return None
    previous = [read_key(previous_file, "THINKFLEET_SIGNING_KEY_PREVIOUS_FILE")] if previous_file else []
    return Signer(current, previous)


def signer_for(settings: Settings) -> Signer | None:
    """The settings' signer, or None when no key is configured (nothing is signed or checked)."""
    key = settings.signing_key.get_secret_value() if settings.signing_key is not None else None
    files = (settings.signing_key_file, settings.signing_key_previous_file)
    return _signer(*files[:1], key, files[1], tuple(_stamp(f) for f in files))
