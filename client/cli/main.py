"""The `shardserve` command: start a cluster (up, coordinator) and inspect or use one.

`up`, `coordinator`, `node` and `catalog` hand over to `python -m shardserve.server` (os.execv), so the
client never imports the server. Every other subcommand talks to a running
coordinator given by --coordinator or SHARDSERVE_COORDINATOR. Expected errors
print one line on stderr and exit non-zero, without a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shardserve.client.cli.checkpoints import (
    add_checkpoint_commands,
    add_replicas_flag,
    run_checkpoint_command,
)
from shardserve.client.cli.status import show_snapshots, show_status
from shardserve.client.cli.verify import add_verify_command, run_verify

if TYPE_CHECKING:
    pass

EXIT_ERROR = 1
EXIT_USAGE = 2
_INTERRUPTED = {  # what an interrupted command leaves behind
    "reshard": "; the coordinator aborts the reshard and the old version stays served",
}
_SERVER_COMMANDS = {
    "up": "run a coordinator and N shard servers on this host (foreground; Ctrl-C stops all). "
    "Options go to `python -m shardserve.server up`; see `shardserve up --help`.",
    "coordinator": "run only the coordinator (ranks join it with `shardserve node` or "
    "`torchrun ... -m shardserve.server "
    "--coordinator HOST:PORT`). See `shardserve coordinator --help`.",
    "catalog": "work on a coordinator's catalog without a coordinator: `shardserve catalog copy SRC DST` "
    "copies it between an SQLite file and a postgresql:// database. See `shardserve catalog --help`.",
    "node": "run and supervise some ranks of a cluster whose coordinator runs elsewhere, restarting each that "
    "exits (foreground; Ctrl-C stops them). See `shardserve node --help`.",
}


def _ints(text: str) -> tuple[int, ...]:
    """Parse "4,5" into (4, 5) for argparse."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip() != "")
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 4,5, got {text!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardserve",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve sharded PyTorch tensors over gRPC: start a cluster, inspect it, create, fetch "
        "and delete tensors.",
        epilog="example:\n  shardserve up --ranks 2 --demo          # prints: coordinator: HOST:PORT\n"
        "  export SHARDSERVE_COORDINATOR=HOST:PORT  # in another shell\n"
        "  shardserve status\n  shardserve fetch demo --offsets 0,0 --sizes 2,4",
    )
    parser.add_argument(
        "--coordinator",
        default=os.environ.get("SHARDSERVE_COORDINATOR"),
        metavar="HOST:PORT[,HOST:PORT...]",
        help="coordinator address; several that share one catalog, comma-separated: calls go to the one "
        "that leads (default: $SHARDSERVE_COORDINATOR)",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("SHARDSERVE_TOKEN"),
        help="bearer token of the cluster (default: $SHARDSERVE_TOKEN)",
    )
    parser.add_argument(
        "--timeout", type=float, default=30.0, help="deadline of each call in seconds (default 30)"
    )
    parser.add_argument(
        "--tls-ca", help="CA certificate (PEM) to verify the servers with; enables TLS"
    )
    parser.add_argument("--tls-cert", help="client certificate (PEM) for mutual TLS")
    parser.add_argument("--tls-key", help="client private key (PEM) for mutual TLS")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, text in _SERVER_COMMANDS.items():
        sub.add_parser(name, help=text, description=text, add_help=False)
    sub.add_parser(
        "status",
        help="table of ranks (address, device, pid, restarts, alive, memory, metrics) and tensors",
        description="Show every rank (address, device, pid, restarts, alive, memory, metrics "
        "address) and every tensor (version, health, replicas, shape, dtype, layout, bytes), and the "
        "coordinator's metrics address.",
    )
    top = sub.add_parser(
        "top",
        help="live view of ranks, tensors, request rates, p50/p99 and jobs (metrics)",
        description="A refreshing view, from the processes' Prometheus metrics (start the "
        "cluster with --metrics-port): ranks, tensors, requests per second, p50/p99 "
        "latency per method, bytes per data path and collective jobs in flight. "
        "Ctrl-C quits.",
    )
    top.add_argument(
        "--interval", type=float, default=2.0, help="seconds between refreshes (default 2)"
    )
    top.add_argument(
        "--iterations",
        type=int,
        default=0,
        help="stop after this many refreshes (0 = until Ctrl-C)",
    )
    sub.add_parser(
        "list",
        help="print the READY tensors, one per line",
        description="Print the READY tensors, one per line: name, version, shape, dtype, replicas "
        "(copies of each box), health.",
    )
    create = sub.add_parser(
        "create",
        help="create a tensor filled on the ranks",
        description="Create a tensor chunked along --dim over every live rank, "
        "filled on the ranks by --init.",
    )
    create.add_argument("name", help="tensor name")
    create.add_argument("--shape", type=_ints, required=True, help="global shape, e.g. 1000,64")
    create.add_argument(
        "--dtype",
        default="float32",
        help="dtype name, e.g. float32, bfloat16, int64 (default float32)",
    )
    create.add_argument(
        "--dim", type=int, default=0, help="dim to chunk over the ranks (default 0)"
    )
    create.add_argument(
        "--init",
        default="zeros",
        choices=["zeros", "ones", "normal", "arange"],
        help="fill (default zeros; normal uses --seed)",
    )
    create.add_argument("--seed", type=int, default=0, help="seed of --init normal (default 0)")
    create.add_argument(
        "--overwrite", action="store_true", help="replace an existing tensor of that name"
    )
    add_replicas_flag(create)
    fetch = sub.add_parser(
        "fetch",
        help="read a box of a tensor; print it or save it with torch.save",
        description="Read the box at --offsets of --sizes (default: the whole tensor). "
        "Prints it, or saves it with torch.save when -o is given.",
    )
    fetch.add_argument("name", help="tensor name")
    fetch.add_argument(
        "--offsets", type=_ints, help="global offsets of the box, e.g. 0,0 (default: zeros)"
    )
    fetch.add_argument(
        "--sizes", type=_ints, help="sizes of the box, e.g. 2,3 (default: to the end)"
    )
    fetch.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="save the tensor to FILE (torch.save) instead of printing",
    )
    reshard = sub.add_parser(
        "reshard",
        help="move a tensor into another layout (new version), with a progress bar",
        description="Move a tensor into another layout with the ranks' collectives; reads keep the old version "
        "until the new one is committed. Layout: --dim D (chunks along D, the default 0), --grid RxC "
        "(2-D mesh, tensor dims --grid-dims, default 0,1) or --replicate, over --ranks (default: "
        "every live rank).",
    )
    reshard.add_argument("name", help="tensor name")
    reshard.add_argument("--dim", type=int, help="chunk along this dim (ChunkShardingSpec)")
    reshard.add_argument("--grid", help="2-D mesh of ranks, e.g. 2x2 (Shard, Shard)")
    reshard.add_argument(
        "--grid-dims", type=_ints, help="tensor dims the grid's two mesh dims split (default 0,1)"
    )
    reshard.add_argument(
        "--replicate", action="store_true", help="a whole copy on every rank of --ranks"
    )
    reshard.add_argument(
        "--ranks", type=_ints, help="ranks of the new layout, e.g. 0,2 (default: all live)"
    )
    reshard.add_argument(
        "--bucket-bytes", type=int, help="largest bucket one collective moves (default 64 MiB)"
    )
    reshard.add_argument(
        "--reshard-timeout",
        type=float,
        help="bound on the data movement in seconds "
        "(default 300); a dead or hung rank fails the reshard within it",
    )
    add_replicas_flag(reshard)
    delete = sub.add_parser(
        "delete",
        help="delete a tensor and free its shards",
        description="Delete a tensor from the catalog and free its shards on every rank.",
    )
    delete.add_argument("name", help="tensor name")
    snapshots = sub.add_parser(
        "snapshots",
        help="list the kept snapshots of a prefix (state dicts of SPMD jobs)",
        description="List the kept snapshots of PREFIX, oldest first: number, tensors, bytes "
        "and age; with --tensors, each tensor's key, shape and dtype too.",
    )
    snapshots.add_argument("prefix", help="the prefix the snapshots were put under")
    snapshots.add_argument(
        "--tensors", action="store_true", help="also list each snapshot's tensors"
    )
    add_checkpoint_commands(sub)
    add_verify_command(sub)
    return parser


def _server_options(
    parser: argparse.ArgumentParser, args: argparse.Namespace, given: Sequence[str]
) -> list[str]:
    """The global options given before `up`/`coordinator`/`node` as the server's: --token carries over (the
    cluster's token either way), and --coordinator for `node`; the others mean something else there
    (--tls-cert is the client's certificate here, the server's there), so they are an error saying where
    they go."""
    options = []
    for word in (w.split("=", 1)[0] for w in given if w.startswith("--")):
        if word == "--token":
            options += ["--token", args.token]
        elif word == "--coordinator" and args.command == "node":  # the node's ranks dial it
            options += ["--coordinator", args.coordinator]
        else:
            parser.error(
                f"{word} before `{args.command}` is a client option; give the server's options after "
                f"it (`shardserve {args.command} --help`)"
            )
    return options


def exec_server_command(command: str, args: Sequence[str]) -> None:
    """Replace this process with `python -m shardserve.server COMMAND ARGS...` (same interpreter)."""
    argv = [sys.executable, "-m", "shardserve.server", command, *args]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)


def _fetch(cluster, args: argparse.Namespace) -> None:
    import torch

    remote = cluster.tensor(args.name)
    offsets = args.offsets if args.offsets is not None else (0,) * remote.ndim
    sizes = (
        args.sizes
        if args.sizes is not None
        else tuple(max(n - o, 0) for n, o in zip(remote.shape, offsets))
    )
    result = remote.fetch(offsets, sizes)
    if args.output:
        try:
            torch.save(result, args.output)
        except (
            RuntimeError,
            OSError,
        ) as err:  # torch reports a missing directory as a RuntimeError
            raise OSError(f"-o {args.output}: {err}") from None
        print(
            f"saved {args.name}[offsets={tuple(offsets)}, sizes={tuple(result.shape)}] "
            f"({result.dtype}, version {remote.version}) to {args.output}"
        )
    else:
        torch.set_printoptions(threshold=1000)
        print(result)


def _reshard(cluster, args: argparse.Namespace) -> None:
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )

    from shardserve.client.info import layout_summary
    from shardserve.client.ops.reshard import layout_from_options

    remote = cluster.tensor(args.name)
    devices = {r.rank: r.device for r in cluster.ranks() if r.alive}
    meta = layout_from_options(
        tuple(remote.shape),
        remote.dtype,
        devices,
        dim=args.dim,
        ranks=args.ranks,
        grid=args.grid,
        grid_dims=args.grid_dims,
        replicate=args.replicate,
    )
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, transient=not sys.stdout.isatty()) as bar:
        task = bar.add_task(f"reshard {args.name}", total=None)

        def show(report) -> None:
            bar.update(
                task,
                description=f"reshard {args.name} ({report.phase})",
                completed=report.bytes_done,
                total=report.bytes_total or None,
            )

        new = remote.reshard(
            meta,
            bucket_bytes=args.bucket_bytes,
            timeout=args.reshard_timeout,
            progress=show,
            replicas=args.replicas,
        )
    print(
        f"resharded {args.name}: version {remote.version} -> {new.version}, {layout_summary(new.metadata())}"
    )


def _check_usage(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flag combinations argparse cannot express: usage errors (exit 2) before any call."""
    from shardserve.client.errors import InvalidArgumentError
    from shardserve.client.ops.reshard import check_layout_flags
    from shardserve.core.coordinator_addresses import parse_addresses

    if args.command == "top" and (not args.interval > 0 or args.iterations < 0):
        parser.error("top: --interval must be > 0 seconds and --iterations >= 0")
    if args.coordinator:
        try:
            parse_addresses(args.coordinator, "--coordinator")
        except ValueError:
            parser.error(f"--coordinator must be HOST:PORT, got {args.coordinator!r}")
    if args.command != "reshard":
        return
    try:
        check_layout_flags(args.dim, args.grid, args.grid_dims, args.replicate)
    except InvalidArgumentError as err:
        parser.error(f"reshard: {err}")
    if args.ranks == ():
        parser.error("reshard: --ranks is empty (leave it out for every live rank)")


def _run(args: argparse.Namespace) -> None:
    from shardserve.client.cluster import connect

    if not args.coordinator:
        raise ValueError(
            "no coordinator given: pass --coordinator HOST:PORT or set SHARDSERVE_COORDINATOR"
        )
    with connect(
        args.coordinator,
        token=args.token,
        timeout=args.timeout,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    ) as cluster:
        if args.command == "status":
            show_status(cluster)
        elif args.command == "list":
            from shardserve.client.info import health_summary

            for t in cluster.list():
                print(
                    f"{t.name}\tversion {t.version}\t{tuple(t.shape)}\t{t.dtype}\treplicas {t.replicas}\t"
                    f"{health_summary(t)}"
                )
        elif args.command == "create":
            from shardserve.client.info import layout_summary
            from shardserve.core.specs import ChunkShardingSpec

            live = [r for r in cluster.ranks() if r.alive]
            placements = tuple(f"rank:{r.rank}/{r.device}" for r in live)
            spec = ChunkShardingSpec(args.dim, placements) if live else None  # type: ignore[arg-type]
            created = cluster.create(
                args.name,
                args.shape,
                dtype=args.dtype,
                spec=spec,
                init=args.init,
                seed=args.seed,
                overwrite=args.overwrite,
                replicas=args.replicas,
            )
            print(
                f"created {created.name} version {created.version}: {tuple(created.shape)} {created.dtype}, "
                f"{layout_summary(created.metadata())}"
            )
        elif args.command == "fetch":
            _fetch(cluster, args)
        elif args.command == "top":
            from shardserve.client.cli.top import run_top

            run_top(cluster, args.interval, args.iterations)
        elif args.command == "reshard":
            _reshard(cluster, args)
        elif args.command == "delete":
            cluster.delete(args.name)
            print(f"deleted {args.name}")
        elif args.command == "snapshots":
            show_snapshots(cluster, args.prefix, args.tensors)
        elif args.command == "verify":
            run_verify(cluster, args)
        else:
            run_checkpoint_command(cluster, args)


def run() -> None:
    """The console script: main(), then an exit that skips the interpreter's teardown once every output is
    flushed (the work is done; under load, gRPC's native threads could abort the teardown with SIGABRT after
    a command had succeeded)."""
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `shardserve` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _SERVER_COMMANDS:
        exec_server_command(argv[0], argv[1:])
    parser = build_parser()
    args, unknown = parser.parse_known_args(
        argv
    )  # a server command's own options are the server's to parse
    if unknown and args.command not in _SERVER_COMMANDS:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command in _SERVER_COMMANDS:  # global options came first
        at = argv.index(args.command)
        exec_server_command(args.command, _server_options(parser, args, argv[:at]) + argv[at + 1 :])
    _check_usage(parser, args)
    try:
        from shardserve.client.errors import ShardServeError, TensorExistsError

        _run(args)
    except (ShardServeError, ValueError, TypeError, KeyError, OSError) as err:
        message = str(err.args[0] if isinstance(err, KeyError) and err.args else err)
        if isinstance(err, TensorExistsError):  # the server speaks to Python callers
            message = message.replace("overwrite=True", "--overwrite")
        print(f"shardserve {args.command}: error: {message}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(
            f"shardserve {args.command}: interrupted{_INTERRUPTED.get(args.command, '')}",
            file=sys.stderr,
        )
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
