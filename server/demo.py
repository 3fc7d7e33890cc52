"""The demo table of `shardserve up --demo`: a DCP checkpoint written once under the state dir, then loaded.

On first run the launcher writes a float32 1,000,000 x 64 table (standard
normal, torch.Generator seed 0) as a torch.distributed.checkpoint directory
at STATE_DIR/demo-checkpoint (single process, no process group), exactly as a
trainer would; every start then loads it into the cluster as "demo", row-wise
over all ranks, through the same collective checkpoint load as
`shardserve load` (each rank reads its own rows from the files).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from shardserve.protos import shardserve_pb2 as pb

if TYPE_CHECKING:
    import torch

    from shardserve.server.coordinator.server import CoordinatorServer

log = logging.getLogger(__name__)

DEMO_NAME = "demo"
DEMO_ROWS, DEMO_DIM, DEMO_SEED = 1_000_000, 64, 0


def demo_table() -> torch.Tensor:
    """The demo table itself (the same numbers every time), for writing it and for checking lookups."""
    import torch

    return torch.randn(DEMO_ROWS, DEMO_DIM, generator=torch.Generator().manual_seed(DEMO_SEED))


def ensure_demo_checkpoint(state_dir: str | Path) -> str:
    """The demo checkpoint's directory, written first if it is not there yet (written aside, then renamed)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    path = Path(state_dir).resolve() / "demo-checkpoint"
    if (path / ".metadata").is_file():
        return str(path)
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    log.info("writing the demo checkpoint (%d x %d float32) to %s", DEMO_ROWS, DEMO_DIM, path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.save({DEMO_NAME: demo_table()}, checkpoint_id=str(partial), no_dist=True)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(partial, path)
    return str(path)


def load_demo(coordinator: CoordinatorServer, state_dir: str | Path) -> pb.TensorInfo:
    """Write the demo checkpoint if needed and load it as "demo", row-wise over every rank."""
    import torch

    from shardserve.core.metadata import RemoteDevice, TensorProperties
    from shardserve.core.specs import ChunkShardingSpec
    from shardserve.server.coordinator.drivers.orders import LoadOrder

    path = ensure_demo_checkpoint(state_dir)
    ranks = coordinator.registry.ranks()
    spec = ChunkShardingSpec(0, tuple(RemoteDevice((r.rank, r.device)) for r in ranks))
    meta = spec.build_metadata((DEMO_ROWS, DEMO_DIM), TensorProperties(dtype=torch.float32))
    order = LoadOrder(path, {DEMO_NAME: meta}, overwrite=True)
    final = None
    for message in coordinator.checkpoints.load(order):
        final = message
    assert final is not None and final.done
    info = coordinator.answers.tensor(final.tensors[0])
    log.info("demo tensor %r version %d loaded from %s", DEMO_NAME, info.version, path)
    return info
