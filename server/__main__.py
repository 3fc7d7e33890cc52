"""`python -m shardserve.server up ...` (local cluster), `... coordinator ...`, `... node ...`
(a node's ranks, supervised), `... catalog ...` (a catalog without a coordinator), else one rank
(torchrun-compatible)."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    """Run the process `argv` names: `up`, `coordinator`, `node`, `catalog`, else one rank."""
    if argv and argv[0] == "up":
        from shardserve.server.up import main_up

        return main_up(argv[1:])
    if argv and argv[0] == "coordinator":
        from shardserve.server.coordinator_process import main_coordinator

        return main_coordinator(argv[1:])
    if argv and argv[0] == "node":
        from shardserve.server.node import main_node

        return main_node(argv[1:])
    if argv and argv[0] == "catalog":
        from shardserve.server.catalog_command import main_catalog

        return main_catalog(argv[1:])
    from shardserve.server.rank.main import main as rank_main

    return rank_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
