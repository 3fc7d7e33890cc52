"""Command-line flags shared by `up`, `coordinator`, `node` and the rank process: security, logging, metrics
(a rank's own settings are server/common/rank_options.py's)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from pathlib import Path

from shardserve.server.common.auth import Security, TlsFiles
from shardserve.server.common.principals import ClusterCertificate, ClusterSecret, PrincipalBook

TOKEN_ENV = "SHARDSERVE_TOKEN"
TOKENS_FILE_ENV = "SHARDSERVE_TOKENS_FILE"
CLUSTER_SECRET_FILE_ENV = "SHARDSERVE_CLUSTER_SECRET_FILE"
CLUSTER_CERT_NAME_ENV = "SHARDSERVE_CLUSTER_CERT_NAME"
CLUSTER_SECRET_FILE = (
    "cluster-secret"  # under the state dir, where `up` and `coordinator` keep theirs
)
LOG_LEVEL_ENV = "SHARDSERVE_LOG_LEVEL"
PARENT_PID_ENV = "SHARDSERVE_PARENT_PID"  # set by the launcher: its ranks exit when it is gone


def add_security_args(parser: argparse.ArgumentParser) -> None:
    """--token, --tokens-file, the cluster credential and --tls-* (docs/operations.md#auth-and-tls)."""
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


def add_log_level_arg(parser: argparse.ArgumentParser) -> None:
    """--log-level (default $SHARDSERVE_LOG_LEVEL, else INFO)."""
    parser.add_argument(
        "--log-level",
        default=os.environ.get(LOG_LEVEL_ENV, "INFO"),
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


def security_flags(security: Security) -> list[str]:
    """The flags that give a rank launched by `up` or `node` the files of `security` (its token travels in the
    rank's environment, TOKEN_ENV)."""
    flags: list[str] = []
    tls = security.tls
    if tls is not None:
        flags += ["--tls-cert", tls.cert, "--tls-key", tls.key] + (
            ["--tls-ca", tls.ca] if tls.ca else []
        )
    if security.principals is not None and security.principals.tokens_file is not None:
        flags += ["--tokens-file", str(Path(security.principals.tokens_file).resolve())]
    if security.cluster is not None and security.cluster.path is not None:
        flags += ["--cluster-secret-file", str(Path(security.cluster.path).resolve())]
    if security.cluster_cert is not None:
        flags += ["--cluster-cert-name", security.cluster_cert.name]
    return flags


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
