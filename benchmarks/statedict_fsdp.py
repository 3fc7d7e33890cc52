"""A small model's weight sync from a 2-process FSDP2 job: `get_model_state_dict` of a fully_shard'ed model (28
tensors, 0.9 MB) put to the cluster and got back into the model's own DTensors, against dcp.save / dcp.load of the
same state dict to /dev/shm. Medians of steady rounds, timed on job rank 0 between barriers.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any

from benchmarks.harness import Row
from shardserve.server.rank_start import forkserver_context

LAYERS, WIDTH = 14, 128  # 14 x (weight, bias): 28 tensors, 0.9 MB of float32
ROUNDS, QUICK_ROUNDS = 7, 3
SHM = "/dev/shm"


def _model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))


def _job(rank: int, port: int, address: str, folder: str, rounds: int, results: Any) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from shardserve import connect, spmd

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=300),
    )
    model = _model()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    state = get_model_state_dict(model)
    expected = {key: value.full_tensor().clone() for key, value in state.items()}
    steps = {
        "put": lambda: spmd.put_state_dict(cluster, state, "fsdp", keep=1, durable=False),
        "get": lambda: spmd.get_state_dict(cluster, "fsdp", into=state),
        "dcp.save": lambda: dcp.save(state, checkpoint_id=folder),
        "dcp.load": lambda: dcp.load(state, checkpoint_id=folder),
    }
    with connect(address) as cluster:
        seconds = {name: _median_s(step, rounds) for name, step in steps.items()}
        ok = all(torch.equal(state[key].full_tensor(), expected[key]) for key in state)
    if rank == 0:
        results.put(
            (seconds, ok, len(state), sum(v.numel() * v.element_size() for v in expected.values()))
        )
    dist.destroy_process_group()


def _median_s(step: Any, rounds: int) -> float:
    import torch.distributed as dist

    step()  # the first round of each: connections, pages, files
    times = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fsdp_rows(address: str, *, quick: bool, peaks: dict[str, int]) -> list[Row]:
    """The FSDP2 small-model case, two processes (forked from the preloaded forkserver) against the cluster
    at `address`."""
    from shardserve.server.launcher import free_port

    ctx = forkserver_context()
    results = ctx.Queue()
    rounds = QUICK_ROUNDS if quick else ROUNDS
    with tempfile.TemporaryDirectory(prefix="shardserve-bench-fsdp-", dir=SHM) as folder:
        port = free_port()
        procs = [
            ctx.Process(target=_job, args=(r, port, address, folder, rounds, results))
            for r in range(2)
        ]
        for proc in procs:
            proc.start()
        seconds, ok, count, nbytes = results.get(timeout=600)
        for proc in procs:
            proc.join(timeout=60)
    case = f"FSDP2 model, 2 processes, {count} tensors"
    subject = {"path": "shm", "ok": ok, "peak_rss": peaks, "nbytes": nbytes}
    return [
        Row(
            "statedict-fsdp",
            case,
            "put_state_dict",
            seconds["put"],
            baseline="dcp.save",
            note="get_model_state_dict, durable=False",
            **subject,
        ),
        Row(
            "statedict-fsdp",
            case,
            "get_state_dict",
            seconds["get"],
            baseline="dcp.load",
            note="into the model's DTensors",
            **subject,
        ),
        Row(
            "statedict-fsdp",
            case,
            "dcp.save",
            seconds["dcp.save"],
            role="baseline",
            path=SHM,
            nbytes=nbytes,
        ),
        Row(
            "statedict-fsdp",
            case,
            "dcp.load",
            seconds["dcp.load"],
            role="baseline",
            path=SHM,
            nbytes=nbytes,
        ),
    ]
