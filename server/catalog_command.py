"""`catalog`: work on a coordinator's catalog where it is kept, without a coordinator.

`catalog copy SRC DST` copies every tensor version, snapshot and the version counter from one catalog to
another, either of them an SQLite file or a PostgreSQL database (postgresql://USER@HOST:PORT/DB): the way
from the embedded default to PostgreSQL and back. Stop the coordinators of SRC first (a copy is one
consistent read of SRC, but what they write afterwards stays behind); DST must be empty unless --replace.
A cluster started on DST with the same ranks (and their persisted shards) serves what SRC's did.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

from shardserve.server.common.cli_args import add_log_level_arg, configure_logging
from shardserve.server.common.errors import ServiceError
from shardserve.server.coordinator.catalog.locations import check_location
from shardserve.server.coordinator.catalog.urls import is_postgres_url, redacted

log = logging.getLogger(__name__)


def _location(text: str) -> str:
    """argparse's type of a catalog location (a usage error names what is wrong)."""
    try:
        return check_location(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parser() -> argparse.ArgumentParser:
    """The `catalog` command's parser and its subcommands."""
    main = argparse.ArgumentParser(
        prog="shardserve catalog",
        description="Work on a coordinator's catalog where it is kept (an SQLite file or a PostgreSQL "
        "database), without a coordinator.",
    )
    sub = main.add_subparsers(dest="action", metavar="ACTION", required=True)
    copy = sub.add_parser(
        "copy",
        help="copy every tensor version, snapshot and the version counter from SRC to DST",
        description="Copy every tensor version (pending ones too), every snapshot and the version "
        "counter from catalog SRC to catalog DST, in one transaction on each; the lease of leadership "
        "is not copied. Each is an SQLite file or a postgresql://USER@HOST:PORT/DB URL (a password from "
        "the URL, PGPASSWORD or ~/.pgpass). Stop SRC's coordinators first.",
    )
    copy.add_argument("source", metavar="SRC", type=_location, help="the catalog to copy")
    copy.add_argument("destination", metavar="DST", type=_location, help="the catalog to fill")
    copy.add_argument(
        "--replace",
        action="store_true",
        help="replace what DST holds (default: refuse a DST that holds tensors or snapshots)",
    )
    add_log_level_arg(copy)
    return main


def main_catalog(argv: Sequence[str]) -> int:
    """`catalog ACTION ...`; 0 when done, 1 when it failed (the reason on stderr), 2 for usage errors."""
    from shardserve.server.coordinator.catalog.locations import open_catalog

    args = parser().parse_args(argv)
    configure_logging(args.log_level)
    source, destination = redacted(args.source), redacted(args.destination)
    if args.source == args.destination:
        log.error("catalog copy: SRC and DST are the same catalog (%s)", source)
        return 1
    if not is_postgres_url(args.source) and not Path(args.source).is_file():
        log.error("catalog copy: SRC %s is not a file", source)
        return 1
    try:
        src = open_catalog(args.source)
        try:
            contents = src.contents()
        finally:
            src.close()
        dst = open_catalog(args.destination)
        try:
            dst.restore(contents, replace=args.replace)
        finally:
            dst.close()
    except ValueError as err:
        log.error("catalog copy: %s (give --replace to replace them)", err)
        return 1
    except (OSError, RuntimeError, ServiceError) as err:
        log.error("catalog copy: %s", err)
        return 1
    print(
        f"copied {len(contents.tensors)} tensor versions, {len(contents.snapshots)} snapshots and the "
        f"version counter ({contents.version_counter}) from {source} to {destination}",
        flush=True,
    )
    return 0
