"""Command-line flags shared by `up`, `coordinator` and the rank process."""
from __future__ import annotations

import argparse
import logging
import os

from server.common.auth import Security, TlsFiles

TOKEN_ENV = "SHARDSERVE_TOKEN"
PARENT_PID_ENV = "SHARDSERVE_PARENT_PID"  # set by the launcher: its ranks exit when it is gone


def add_security_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token", default=os.environ.get(TOKEN_ENV) or None,
                        help=f"bearer token every call must carry (default: ${TOKEN_ENV}; none = no auth)")
    parser.add_argument("--tls-cert", default=None, help="PEM certificate of this server (enables TLS)")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", default=None, help="PEM CA bundle: require client certificates "
                        "signed by it (mTLS) and trust peers signed by it")
    parser.add_argument("--log-level", default=os.environ.get("SHARDSERVE_LOG_LEVEL", "INFO"),
                        help="logging level (default %(default)s)")


def security_from_args(args: argparse.Namespace) -> Security:
    """Security from --token/--tls-*; ValueError names the flag that is missing or wrong."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key must be given together")
    if args.tls_ca and not args.tls_cert:
        raise ValueError("--tls-ca needs --tls-cert and --tls-key")
    tls = TlsFiles(args.tls_cert, args.tls_key, args.tls_ca) if args.tls_cert else None
    return Security(token=args.token or None, tls=tls)


def configure_logging(level: str) -> None:
    """Log to stderr (stdout is kept for the `coordinator: HOST:PORT` line)."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
