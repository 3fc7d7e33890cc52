"""How `up` and `coordinator` tell the world where the coordinator listens: one stdout line, an address file.

The line `coordinator: HOST:PORT` goes out in one write. Under PYTHONUNBUFFERED (most containers) print()
writes a line's text and its newline separately, and the ranks, which share the terminal, may log in
between; a script reading the line would then read a broken address. The address file (--address-file)
is for scripts and orchestrators that would rather not parse stdout: it appears, whole, once the
coordinator serves (written beside its final name, then renamed over it), and goes when the process stops.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

ADDRESS_LINE_PREFIX = "coordinator: "


def add_address_file_arg(parser: argparse.ArgumentParser) -> None:
    """--address-file, for `up` and `coordinator`."""
    parser.add_argument(
        "--address-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="once serving, write the coordinator's HOST:PORT (and a newline) to PATH, atomically "
        "(a file in PATH's folder renamed over it), for scripts and orchestrators; removed on exit",
    )


def check_address_file(parser: argparse.ArgumentParser, path: Path | None) -> None:
    """A usage error (exit 2) when --address-file's folder is missing or PATH is a folder."""
    if path is None:
        return
    if path.is_dir():
        parser.error(f"--address-file {path} is a directory")
    if not path.parent.is_dir():
        parser.error(f"--address-file {path}: its folder {path.parent} does not exist")


def announce_address(address: str, address_file: Path | None = None) -> None:
    """Write `address` to `address_file` (when given), then print the `coordinator: HOST:PORT` line."""
    if address_file is not None:
        write_address_file(address_file, address)
    write_line(f"{ADDRESS_LINE_PREFIX}{address}\n")


def withdraw_address(address_file: Path | None) -> None:
    """Remove the address file on the way out (or a stale one before serving), so that no script reads an
    address nobody serves; a missing file is fine."""
    if address_file is not None:
        with contextlib.suppress(FileNotFoundError):
            address_file.unlink()


def write_address_file(path: Path, address: str) -> None:
    """Write `address` and a newline to `path` atomically: a reader sees no file or the whole address."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as file:
            file.write(f"{address}\n")
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def write_line(line: str) -> None:
    """Write `line` to stdout in one os.write (after anything already buffered), so that no other process's
    output sharing the terminal or pipe lands inside it; a stdout without a file descriptor (a test's
    capture) gets one write and a flush instead."""
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        sys.stdout.write(line)
        sys.stdout.flush()
        return
    data = line.encode()
    while (
        data
    ):  # a pipe takes a line this short whole; the loop only guards against a partial write
        data = data[os.write(fd, data) :]
