"""`shardserve load PATH` and `shardserve save PATH`: DCP checkpoints with a rich progress bar."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_checkpoint_commands(sub: Any) -> None:
    """Add the `load` and `save` subcommands to the CLI's subparsers."""
    load = sub.add_parser(
        "load",
        help="load tensors of a DCP checkpoint (each rank reads its own shards)",
        description="Load tensors of a torch.distributed.checkpoint directory into the cluster: "
        "every rank reads its own shards straight from PATH (a filesystem the ranks "
        "see). All tensors appear at once, or none after a failure.",
    )
    load.add_argument("path", help="checkpoint directory")
    load.add_argument(
        "--names", nargs="+", help="tensors to load (default: every tensor of the checkpoint)"
    )
    load.add_argument(
        "--dim",
        type=int,
        default=0,
        help="dim to chunk each tensor along over every live rank (default 0: row-wise)",
    )
    load.add_argument(
        "--dtype", help="cast to this dtype on load, e.g. bfloat16 (default: as saved)"
    )
    load.add_argument("--overwrite", action="store_true", help="replace tensors of the same names")
    add_replicas_flag(load)
    save = sub.add_parser(
        "save",
        help="save tensors as a DCP checkpoint (each rank writes its own shards)",
        description="Write READY tensors as one torch.distributed.checkpoint directory at PATH; "
        "torch.distributed.checkpoint.load reads it into tensors of any layout.",
    )
    save.add_argument("path", help="checkpoint directory (created)")
    save.add_argument("--names", nargs="+", help="tensors to save (default: every READY tensor)")


def add_replicas_flag(parser: argparse.ArgumentParser) -> None:
    """--replicas R: every box of the layout on R live ranks, on distinct hosts where there are several."""
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="R",
        help="copies of every box, each on another live rank (another host where the cluster has "
        "several); reads fail over between them (default 1)",
    )


def run_checkpoint_command(cluster: Any, args: argparse.Namespace) -> bool:
    """Run `load` or `save` if that is the command; False for any other command."""
    if args.command not in ("load", "save"):
        return False
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, transient=not sys.stdout.isatty()) as bar:
        task = bar.add_task(f"{args.command} {args.path}", total=None)

        def show(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total or None)

        if args.command == "load":
            spec = _row_spec(cluster, args.dim)
            loaded = cluster.load_checkpoint(
                args.path,
                names=args.names,
                spec=spec,
                dtype=args.dtype,
                overwrite=args.overwrite,
                progress=show,
                replicas=args.replicas,
            )
        else:
            saved = cluster.save_checkpoint(args.path, names=args.names, progress=show)
    if args.command == "load":
        for name, remote in sorted(loaded.items()):
            print(f"loaded {name} version {remote.version}: {tuple(remote.shape)} {remote.dtype}")
    else:
        print(f"saved {', '.join(saved)} to {args.path}")
    return True


def _row_spec(cluster: Any, dim: int) -> Any:
    from shardserve.core.specs import ChunkShardingSpec

    live = [r for r in cluster.ranks() if r.alive]
    placements = tuple(f"rank:{r.rank}/{r.device}" for r in live)
    return ChunkShardingSpec(dim, placements) if live else None  # type: ignore[arg-type]
