"""Who a call comes from: principals with roles and tensor-name patterns, read from a tokens file.

A tokens file is TOML, one `[[principal]]` table per principal:

    [[principal]]
    name = "trainer"
    token_sha256 = "<hex SHA-256 of the token>"
    role = "write"                 # read | write | admin
    tensors = ["emb_*"]            # optional glob patterns of the tensors it may read and write (default: any)
    max_streams = 8                # optional: streaming calls it may hold open on one server at once
    max_bytes = 1073741824         # optional: bytes of the tensors it may hold (replicas counted each)

Tokens are never stored in the clear: a call's bearer token is hashed and looked
up. `--token T` alone is one admin principal named "admin". The cluster
credential (the internal secret coordinator and ranks share) is its own
principal, "cluster": the only one with the `cluster` right (and every other). In an mTLS
cluster a certificate of the cluster (ClusterCertificate) can stand in for that secret.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import logging
import os
import re
import secrets
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

log = logging.getLogger(__name__)

READ, WRITE, ADMIN, CLUSTER = "read", "write", "admin", "cluster"
ROLE_RIGHTS = {
    READ: frozenset({READ}),
    WRITE: frozenset({READ, WRITE}),
    ADMIN: frozenset({READ, WRITE, ADMIN}),
}
CLUSTER_PRINCIPAL = "cluster"
ANONYMOUS = "anonymous"
_HEX_SHA256 = re.compile(r"[0-9a-f]{64}")
_PRINCIPAL_KEYS = {"name", "token_sha256", "role", "tensors", "max_streams", "max_bytes"}


def token_sha256(token: str) -> str:
    """The hex SHA-256 a tokens file stores for `token`."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    """One caller: its name, the rights its role gives, the tensor names it may write, its stream quota and its
    byte quota (the bytes of the tensors it made that the cluster may hold at once; None = no quota)."""

    name: str
    role: str
    rights: frozenset[str]
    tensors: tuple[str, ...] = ()
    max_streams: int | None = None
    max_bytes: int | None = None

    def may(self, right: str) -> bool:
        return right in self.rights

    def covers(self, tensor: str) -> bool:
        """Whether its patterns cover `tensor`, for reads and writes alike (admins and principals without
        patterns reach any name)."""
        if self.role == ADMIN or not self.tensors:
            return True
        return any(fnmatch.fnmatchcase(tensor, pattern) for pattern in self.tensors)


ANONYMOUS_ADMIN = Principal(ANONYMOUS, ADMIN, ROLE_RIGHTS[ADMIN])  # a server without client auth
CLUSTER_MEMBER = Principal(CLUSTER_PRINCIPAL, CLUSTER, frozenset({CLUSTER, READ, WRITE, ADMIN}))


def parse_tokens_file(text: str, where: str = "tokens file") -> dict[str, Principal]:
    """{token sha256: principal} from the TOML text; ValueError names the table and field that is wrong."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{where}: not TOML: {err}") from None
    unknown = set(document) - {"principal"}
    if unknown:
        raise ValueError(
            f"{where}: unknown top-level keys {sorted(unknown)} (only [[principal]] tables)"
        )
    tables = document.get("principal", [])
    if not isinstance(tables, list):
        raise ValueError(f"{where}: 'principal' must be an array of tables ([[principal]])")
    by_hash: dict[str, Principal] = {}
    names: set[str] = set()
    for index, table in enumerate(tables):
        digest, principal = _parse_principal(table, f"{where}: principal #{index + 1}")
        if principal.name in names or principal.name in (CLUSTER_PRINCIPAL, ANONYMOUS):
            raise ValueError(f"{where}: principal #{index + 1}: name {principal.name!r} is taken")
        if digest in by_hash:
            raise ValueError(
                f"{where}: principal #{index + 1}: token_sha256 repeats that of "
                f"{by_hash[digest].name!r}"
            )
        names.add(principal.name)
        by_hash[digest] = principal
    return by_hash


def _parse_principal(table: Any, where: str) -> tuple[str, Principal]:
    if not isinstance(table, dict):
        raise ValueError(f"{where}: must be a table")
    unknown = set(table) - _PRINCIPAL_KEYS
    if unknown:
        raise ValueError(
            f"{where}: unknown keys {sorted(unknown)} (allowed: {sorted(_PRINCIPAL_KEYS)})"
        )
    name = table.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where}: name must be a non-empty string")
    where = f"{where} ({name!r})"
    digest = table.get("token_sha256")
    if not isinstance(digest, str) or not _HEX_SHA256.fullmatch(digest.lower()):
        raise ValueError(f"{where}: token_sha256 must be 64 hex digits (sha256sum of the token)")
    role = table.get("role")
    if role not in ROLE_RIGHTS:
        raise ValueError(f"{where}: role {role!r} is not one of {sorted(ROLE_RIGHTS)}")
    tensors = table.get("tensors", [])
    if not isinstance(tensors, list) or not all(isinstance(p, str) and p for p in tensors):
        raise ValueError(f"{where}: tensors must be a list of non-empty glob patterns")
    max_streams = table.get("max_streams")
    if max_streams is not None and (
        not isinstance(max_streams, int) or isinstance(max_streams, bool) or max_streams < 1
    ):
        raise ValueError(f"{where}: max_streams must be an integer >= 1")
    max_bytes = table.get("max_bytes")
    if max_bytes is not None and (
        not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0
    ):
        raise ValueError(f"{where}: max_bytes must be an integer >= 0")
    return digest.lower(), Principal(
        name, role, ROLE_RIGHTS[role], tuple(tensors), max_streams, max_bytes
    )


class PrincipalBook:
    """The principals a server knows, by token hash; reload() swaps in a re-read tokens file atomically."""

    def __init__(self, tokens_file: str | None = None, admin_token: str | None = None) -> None:
        self.tokens_file = tokens_file
        self._admin_token = admin_token
        self._lock = threading.Lock()
        self._by_hash: dict[str, Principal] = self._load()

    @property
    def size(self) -> int:
        return len(self._by_hash)

    def _load(self) -> dict[str, Principal]:
        by_hash: dict[str, Principal] = {}
        if self.tokens_file is not None:
            path = Path(self.tokens_file)
            try:
                text = path.read_text()
            except OSError as err:
                raise ValueError(
                    f"--tokens-file {self.tokens_file!r}: cannot read: {err.strerror}"
                ) from None
            by_hash = parse_tokens_file(text, f"--tokens-file {self.tokens_file!r}")
        if self._admin_token:
            by_hash[token_sha256(self._admin_token)] = Principal("admin", ADMIN, ROLE_RIGHTS[ADMIN])
        return by_hash

    def reload(self) -> bool:
        """Re-read the tokens file (on SIGHUP); a file that does not parse keeps the old principals (logged)."""
        if self.tokens_file is None:
            return False
        with self._lock:
            try:
                by_hash = self._load()
            except ValueError as err:
                log.error("tokens not reloaded, the old ones stay: %s", err)
                return False
            self._by_hash = by_hash
        log.info("tokens reloaded from %s: %d principals", self.tokens_file, len(by_hash))
        return True

    def find(self, token: str) -> Principal | None:
        """The principal whose token this is, or None."""
        return self._by_hash.get(token_sha256(token))


class ClusterSecret:
    """The internal credential: a secret every coordinator and rank of one cluster holds and no client does."""

    def __init__(self, secret: str, path: str | None = None) -> None:
        self.path = path  # the file it was read from, handed on to the ranks a launcher starts
        if len(secret) < 16 or not (secret.isascii() and secret.isprintable()):
            raise ValueError("the cluster secret must be at least 16 printable ASCII characters")
        self.secret = secret
        self._presented = secret.encode()

    @classmethod
    def from_file(cls, path: str) -> ClusterSecret:
        """The secret in `path` (its first line); ValueError names --cluster-secret-file."""
        try:
            text = Path(path).read_text().strip()
        except OSError as err:
            raise ValueError(
                f"--cluster-secret-file {path!r}: cannot read: {err.strerror}"
            ) from None
        try:
            return cls(text, path)
        except ValueError as err:
            raise ValueError(f"--cluster-secret-file {path!r}: {err}") from None

    @classmethod
    def generate(cls) -> ClusterSecret:
        return cls(secrets.token_urlsafe(32))

    @classmethod
    def in_state_dir(cls, path: Path) -> ClusterSecret:
        """The secret kept at `path`, made (readable by this user only) when there is none yet."""
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(cls.generate().secret + "\n")
            log.info(
                "wrote a new cluster secret to %s (ranks join with --cluster-secret-file %s)",
                path,
                path,
            )
        return cls.from_file(str(path))

    def write(self, path: Path) -> ClusterSecret:
        """Store the secret at `path`, readable by this user only (the ranks' --cluster-secret-file): itself,
        with that path."""
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + f".{os.getpid()}.tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(self.secret + "\n")
        os.replace(temporary, path)
        return ClusterSecret(self.secret, str(path))

    def matches(self, presented: str) -> bool:
        return hmac.compare_digest(presented.encode(), self._presented)


class ClusterCertificate:
    """The internal credential of an mTLS cluster: a client certificate (verified against --tls-ca by the TLS
    layer) whose subject CN or one of whose subjectAltName entries is `name` is the cluster's. User certificates
    signed by the same CA carry other names, so they stay plain TLS peers that must show a bearer token."""

    def __init__(self, name: str) -> None:
        if not name or not name.strip() or not (name.isascii() and name.isprintable()):
            raise ValueError(
                f"--cluster-cert-name {name!r} must be a non-empty printable ASCII name"
            )
        self.name = name

    def matches(self, auth_context: Mapping[str, Sequence[bytes]]) -> bool:
        """Whether the peer of a TLS call (gRPC's auth context) presented a verified certificate of the cluster."""
        if b"ssl" not in auth_context.get("transport_security_type", ()) or not auth_context.get(
            "x509_pem_cert"
        ):
            return False
        wanted = self.name.encode()
        names = (
            *auth_context.get("x509_common_name", ()),
            *auth_context.get("x509_subject_alternative_name", ()),
        )
        return any(hmac.compare_digest(wanted, presented) for presented in names)
