"""`shardserve verify NAME|PREFIX`: read every copy of every shard and check it against its checksum.

Unlike a read with verify=True, which stops at the first copy that matches, the command reads each copy of each
box from its own rank, so a corrupt replica behind a healthy one is found too. It prints one line per tensor
(and one per corrupt copy) and exits 1 when any copy does not match.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when the command runs: the CLI starts without torch and grpc
    from shardserve.client.errors import ChecksumMismatchError


def add_verify_command(sub: Any) -> None:
    """Add the `verify` subcommand to the CLI's subparsers."""
    verify = sub.add_parser(
        "verify",
        help="check every copy of a tensor (or of every tensor under a prefix) against its checksums",
        description="Read every copy of every shard of NAME, or of every tensor named PREFIX/... or "
        "PREFIX@... (a snapshot's), from its own rank and compare it with the checksum the catalog keeps. "
        "Exit status 0 when every copy matches, 1 when one does not (named: tensor, shard, rank).",
    )
    verify.add_argument("name", metavar="NAME|PREFIX", help="a tensor name or a prefix of names")


def run_verify(cluster: Any, args: argparse.Namespace) -> None:
    """Verify the tensors `args.name` names; ChecksumMismatchError (after every line is printed) when a copy
    does not match."""
    names = _names(cluster, args.name)
    first_bad: ChecksumMismatchError | None = None
    for name in names:
        bad = _verify_tensor(cluster.tensor(name))
        first_bad = first_bad or bad
    if first_bad is not None:
        raise first_bad


def _names(cluster: Any, wanted: str) -> list[str]:
    """The READY tensors `wanted` names: itself, or those under it as a prefix."""
    from shardserve.client.errors import TensorNotFoundError

    names = [
        t.name
        for t in cluster.list()
        if t.name == wanted or t.name.startswith((f"{wanted}/", f"{wanted}@"))
    ]
    if not names:
        raise TensorNotFoundError(f"no tensor named {wanted!r} or under the prefix {wanted!r}")
    return sorted(names)


def _verify_tensor(proxy: Any) -> ChecksumMismatchError | None:
    """Check every copy of `proxy`'s shards, printing the result; the first mismatch, or None."""
    from shardserve.client.errors import ChecksumMismatchError
    from shardserve.client.verify import expected_checksum
    from shardserve.core.checksums import UNKNOWN, checksum_text, tensor_checksum

    copies = [shard for shards in proxy.remote_shards().values() for shard in shards]
    checked = unknown = 0
    first: ChecksumMismatchError | None = None
    for shard in sorted(copies, key=lambda s: s.index):
        expected = expected_checksum(shard.summary, shard.index)
        if expected == UNKNOWN:
            unknown += 1
            continue
        got = tensor_checksum(shard.fetch())
        checked += 1
        if got != expected:
            print(
                f"CORRUPT {proxy.name} version {shard.version} shard {shard.index} on rank {shard.rank}: "
                f"checksum {checksum_text(got)}, expected {checksum_text(expected)}"
            )
            first = first or ChecksumMismatchError(
                f"tensor {proxy.name!r} version {shard.version}: shard {shard.index} on rank "
                f"{shard.rank} does not match its checksum",
                metadata={"tensor": proxy.name, "shard": str(shard.index), "rank": str(shard.rank)},
            )
    state = "CORRUPT" if first else "ok"
    extra = f", {unknown} without a checksum" if unknown else ""
    print(f"{state} {proxy.name} version {proxy.version}: {checked} copies checked{extra}")
    return first
