"""Command-line flags shared by `up`, `coordinator` and the rank process."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from pathlib import Path

from shardserve.server.common.auth import Security, TlsFiles
from shardserve.server.common.principals import ClusterCertificate, ClusterSecret, PrincipalBook
from shardserve.server.common.stream_limits import StreamLimitSettings

TOKEN_ENV = "SHARDSERVE_TOKEN"
TOKENS_FILE_ENV = "SHARDSERVE_TOKENS_FILE"
CLUSTER_SECRET_FILE_ENV = "SHARDSERVE_CLUSTER_SECRET_FILE"
CLUSTER_CERT_NAME_ENV = "SHARDSERVE_CLUSTER_CERT_NAME"
CLUSTER_SECRET_FILE = (
    "cluster-secret"  # under the state dir, where `up` and `coordinator` keep theirs
)
PARENT_PID_ENV = "SHARDSERVE_PARENT_PID"  # set by the launcher: its ranks exit when it is gone


def add_security_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV) or None,
        help=f"one admin token every client call must carry (default: ${TOKEN_ENV}; with neither "
        "this nor --tokens-file: no client auth)",
    )
    parser.add_argument(
        "--tokens-file",
        default=os.environ.get(TOKENS_FILE_ENV) or None,
        help=f"TOML file of principals (name, token_sha256, role read/write/admin, tensors "
        f"patterns), re-read on SIGHUP (default: ${TOKENS_FILE_ENV}; see docs/operations.md)",
    )
    parser.add_argument(
        "--cluster-secret-file",
        default=os.environ.get(CLUSTER_SECRET_FILE_ENV) or None,
        help="file holding the internal credential coordinator and ranks present to each other "
        f"(default: ${CLUSTER_SECRET_FILE_ENV}; `up` makes one, `coordinator` makes "
        f"STATE_DIR/{CLUSTER_SECRET_FILE} when not given)",
    )
    parser.add_argument(
        "--cluster-cert-name",
        default=os.environ.get(CLUSTER_CERT_NAME_ENV) or None,
        help="with mTLS: a client certificate whose CN or a subjectAltName is this name is the "
        "cluster's, accepted as the internal credential, so no --cluster-secret-file is needed; "
        f"--tls-cert must carry it (default: ${CLUSTER_CERT_NAME_ENV}; see docs/operations.md)",
    )
    parser.add_argument(
        "--tls-cert", default=None, help="PEM certificate of this server (enables TLS)"
    )
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument(
        "--tls-ca",
        default=None,
        help="PEM CA bundle: require client certificates "
        "signed by it (mTLS) and trust peers signed by it",
    )
    parser.add_argument(
        "--log-level",
        default=os.environ.get("SHARDSERVE_LOG_LEVEL", "INFO"),
        help="logging level (default %(default)s)",
    )


def security_from_args(args: argparse.Namespace) -> Security:
    """Security from --token/--tls-*; ValueError names the flag that is missing or wrong."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key must be given together")
    if args.tls_ca and not args.tls_cert:
        raise ValueError("--tls-ca needs --tls-cert and --tls-key")
    tls = TlsFiles(args.tls_cert, args.tls_key, args.tls_ca) if args.tls_cert else None
    principals = (
        PrincipalBook(args.tokens_file, args.token) if args.tokens_file or args.token else None
    )
    cluster = (
        ClusterSecret.from_file(args.cluster_secret_file) if args.cluster_secret_file else None
    )
    cluster_cert = (
        ClusterCertificate(args.cluster_cert_name) if args.cluster_cert_name is not None else None
    )
    return Security(
        token=args.token or None,
        tls=tls,
        principals=principals,
        cluster=cluster,
        cluster_cert=cluster_cert,
    )


def with_state_dir_secret(security: Security, state_dir: str | Path) -> Security:
    """`security` with STATE_DIR/cluster-secret (made when missing) where no cluster credential was given (no
    --cluster-secret-file, no --cluster-cert-name)."""
    if security.has_cluster_credential:
        return security
    secret = ClusterSecret.in_state_dir(Path(state_dir) / CLUSTER_SECRET_FILE)
    return dataclasses.replace(security, cluster=secret)


def configure_logging(level: str) -> None:
    """Log to stderr (stdout is kept for the `coordinator: HOST:PORT` line)."""
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"
    )


def add_metrics_args(parser: argparse.ArgumentParser) -> None:
    """--metrics-port (docs/operations.md#metrics)."""
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics at "
        "http://HOST:PORT/metrics on the listen host (0 = any free port; default: no metrics, "
        "and nothing recorded)",
    )


def add_stream_limit_args(parser: argparse.ArgumentParser) -> None:
    """--stall-timeout and --streams-per-principal (server/common/stream_limits.py)."""
    defaults = StreamLimitSettings()
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=defaults.stall_timeout,
        help="seconds a ReadRegion, "
        "Lookup or WriteShard stream may move no message (a reader that stopped reading, a writer "
        "that stopped sending) before the rank cancels it (default %(default)s)",
    )
    parser.add_argument(
        "--streams-per-principal",
        type=int,
        default=defaults.per_principal,
        help="streaming "
        "calls one principal (without client auth: one peer IP) may run at once on one rank; a "
        "principal's max_streams in the tokens file overrides it (default %(default)s)",
    )


def stream_limits_from_args(args: argparse.Namespace) -> StreamLimitSettings:
    """The limits of --stall-timeout/--streams-per-principal; ValueError names the flag that is out of range."""
    if args.streams_per_principal < 1:
        raise ValueError(f"--streams-per-principal must be >= 1, got {args.streams_per_principal}")
    return StreamLimitSettings(
        per_principal=args.streams_per_principal, stall_timeout=args.stall_timeout
    )


def stream_limit_flags(limits: StreamLimitSettings) -> list[str]:
    """The command-line flags that give a rank `limits`."""
    return [
        "--stall-timeout",
        repr(limits.stall_timeout),
        "--streams-per-principal",
        str(limits.per_principal),
    ]
