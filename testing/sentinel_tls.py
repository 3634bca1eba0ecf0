"""TLS for a :class:`testing.sentinel.SentinelHead`: every Redis and every Sentinel serves ``tls-port`` only (plain
TCP off), with a CA and a server certificate made by the project's own ``deploy/make-tls-certs.sh``; replication and
the Sentinels' links speak TLS too (``tls-replication yes``). Clients verify the server against the CA and present
no certificate (``tls-auth-clients no``, the head node's default: passwords authenticate them).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import redis

from testing.redis_process import REDIS_SERVER

REPO = Path(__file__).resolve().parent.parent


def redis_has_tls() -> bool:
    """Whether this redis-server was built with TLS (Debian's is; a plain ``make`` build refuses the directive): with
    no port at all it reads the flags and exits."""
    if REDIS_SERVER is None:
        return False
    probe = subprocess.run(
        [REDIS_SERVER, "--port", "0", "--tls-port", "0", "--save", ""], capture_output=True, text=True, timeout=30
    )
    return "not listen anywhere" in probe.stdout + probe.stderr


@dataclass(frozen=True)
class TlsFiles:
    """The CA and the server's certificate and key (``deploy/make-tls-certs.sh DIR 127.0.0.1``)."""

    directory: Path

    @property
    def ca(self) -> Path:
        return self.directory / "redis_tls_ca.crt"

    @property
    def cert(self) -> Path:
        return self.directory / "redis_tls_server.crt"

    @property
    def key(self) -> Path:
        return self.directory / "redis_tls_server.key"

    @classmethod
    def make(cls, directory: Path) -> TlsFiles:
        if not (directory / "redis_tls_ca.crt").exists():
            made = subprocess.run(
                ["sh", str(REPO / "deploy" / "make-tls-certs.sh"), str(directory), "127.0.0.1"],
                capture_output=True,
                text=True,
            )
            if made.returncode:
                raise RuntimeError(f"deploy/make-tls-certs.sh failed: {made.stderr}")
        return cls(directory)

    def server_args(self, port: int) -> tuple[str, ...]:
        """redis-server flags (after ``--port``: the later one wins) for TLS only on ``port``."""
        return (
            "--port", "0", "--tls-port", str(port),
            "--tls-cert-file", str(self.cert), "--tls-key-file", str(self.key), "--tls-ca-cert-file", str(self.ca),
            "--tls-auth-clients", "no", "--tls-replication", "yes",
        )  # fmt: skip

    def sentinel_conf(self, port: int) -> str:
        """sentinel.conf lines for a Sentinel on TLS only, that reaches the Redis servers and its peers over TLS."""
        return (
            f"port 0\ntls-port {port}\ntls-cert-file {self.cert}\ntls-key-file {self.key}\n"
            f"tls-ca-cert-file {self.ca}\ntls-auth-clients no\ntls-replication yes\n"
        )

    def client(self, port: int, timeout_s: float = 5.0) -> redis.Redis:
        """A client of the Redis or Sentinel on ``port``, over TLS, verifying it against the CA."""
        return redis.Redis(port=port, ssl=True, ssl_ca_certs=str(self.ca), socket_timeout=timeout_s)

    def url_query(self) -> str:
        """What a ``sentinel://`` URL of this head adds: TLS to the Redis servers and to the Sentinels."""
        return f"&ssl=true&sentinel_ssl=true&ssl_ca_certs={self.ca}"
