"""Weights from a 2-process "trainer" job to a 3-process "inference" job of another layout, through the cluster.

    make run                                                  # or: shardserve up --ranks 2 --demo
    python examples/trainer_to_inference.py 127.0.0.1:50051

Both jobs are torchrun-style gloo worlds on this host (started here with
torch.multiprocessing, each process forked from one forkserver that imported
torch once): the trainer holds every weight as a DTensor sharded by
rows over 2 processes and puts them as one snapshot; the inference job holds
the same names sharded by columns over 3 processes (biases replicated) and
gets them, each process filling exactly its own columns in place. Every
process checks its shards bit for bit against the weights it expects.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardserve import connect, spmd

LAYERS = 4
WIDTH = 1024


def weights(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """The model's full weights at training step `seed` (each process builds them, then keeps its part)."""
    g = torch.Generator().manual_seed(seed)
    return {
        f"layer{i}": {
            "w": torch.randn(WIDTH, WIDTH, generator=g),
            "b": torch.randn(WIDTH, generator=g),
        }
        for i in range(LAYERS)
    }


def trainer(rank: int, port: int, coordinator: str, step: int, results: mp.Queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=120),
    )
    mesh = init_device_mesh("cpu", (2,))
    state = {
        name: {
            "w": distribute_tensor(layer["w"], mesh, [Shard(0)]),
            "b": distribute_tensor(layer["b"], mesh, [Replicate()]),
        }
        for name, layer in weights(step).items()
    }
    with connect(coordinator) as cluster:
        start = time.perf_counter()
        number = spmd.put_state_dict(cluster, state, "policy")
        results.put(("put", rank, number, time.perf_counter() - start))
    dist.destroy_process_group()


def inference(rank: int, port: int, coordinator: str, step: int, results: mp.Queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=3,
        timeout=timedelta(seconds=120),
    )
    mesh = init_device_mesh("cpu", (3,))
    into = {
        f"layer{i}": {
            "w": distribute_tensor(torch.empty(WIDTH, WIDTH), mesh, [Shard(1)]),
            "b": distribute_tensor(torch.empty(WIDTH), mesh, [Replicate()]),
        }
        for i in range(LAYERS)
    }
    with connect(coordinator) as cluster:
        start = time.perf_counter()
        number = spmd.get_state_dict(cluster, "policy", into=into)
        seconds = time.perf_counter() - start
    expected = weights(step)
    wrong = [
        f"{name}.{key}"
        for name, layer in into.items()
        for key, value in layer.items()
        if not torch.equal(
            value.to_local(),
            distribute_tensor(expected[name][key], mesh, value.placements).to_local(),
        )
    ]
    results.put(("get", rank, number, seconds, wrong))
    dist.destroy_process_group()


def run_job(target, size: int, coordinator: str, step: int) -> list[tuple]:
    """Start a `size`-process gloo job running `target` and return each process's answer."""
    from shardserve.server.launcher import free_port

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "shardserve"])
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=target, args=(rank, port, coordinator, step, results))
        for rank in range(size)
    ]
    for proc in procs:
        proc.start()
    answers = [results.get(timeout=300) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
        if proc.exitcode != 0:
            raise SystemExit(f"a {target.__name__} process exited with {proc.exitcode}")
    return answers


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("coordinator", help="HOST:PORT of the cluster's coordinator")
    parser.add_argument(
        "--step", type=int, default=1, help="the training step whose weights the trainer puts"
    )
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    puts = run_job(trainer, 2, args.coordinator, args.step)
    number = puts[0][2]
    nbytes = LAYERS * (WIDTH * WIDTH + WIDTH) * 4
    print(
        f"trainer (2 processes, rows) put snapshot {number} of policy: {2 * LAYERS} tensors, "
        f"{nbytes / 2**20:.0f} MiB in {max(p[3] for p in puts):.2f} s"
    )
    gets = run_job(inference, 3, args.coordinator, args.step)
    wrong = sorted({name for answer in gets for name in answer[4]})
    print(
        f"inference (3 processes, columns) got snapshot {gets[0][2]} in {max(g[3] for g in gets):.2f} s: "
        + ("every shard bit for bit" if not wrong else f"MISMATCH in {wrong}")
    )
    if wrong or {g[2] for g in gets} != {number}:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
