"""Train a TorchRec model with DistributedModelParallel, publish it to the cluster, serve its embeddings.

    make run                                                  # or: shardserve up --ranks 2 --demo
    python examples/torchrec_serving.py 127.0.0.1:50051

A 2-process DMP trainer (CPU, gloo) shards the model's EmbeddingBagCollection
table-wise, column-wise and table-column-wise, takes a few training steps,
publishes its state dict (one ShardedTensor per table) with
spmd.put_state_dict, and answers one batch per process with its own sharded
forward. Then an inference process, which holds no weights, serves the same
batches with RemoteEmbeddingBagCollection.from_snapshot and checks every
pooled embedding against the trainer's.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PREFIX = "ranker"
TABLES = [  # (name, rows, dim, features, pooling, how DMP shards it)
    ("t_user", 4000, 64, ["user", "user_recent"], "SUM", "table_wise"),
    ("t_item", 8000, 128, ["item"], "MEAN", "column_wise"),
    ("t_tag", 2000, 128, ["tag"], "SUM", "table_column_wise"),
]
BATCH = 64


def configs() -> list:
    """The model's table configs (trainer and inference both build them)."""
    from torchrec import EmbeddingBagConfig, PoolingType

    return [
        EmbeddingBagConfig(
            name=name,
            num_embeddings=rows,
            embedding_dim=dim,
            feature_names=features,
            pooling=PoolingType[pooling],
        )
        for name, rows, dim, features, pooling, _ in TABLES
    ]


def batch(seed: int) -> dict:
    """A KJT's parts for every feature: lengths 0-8, ids uniform over the feature's table."""
    generator = torch.Generator().manual_seed(seed)
    keys, lengths, values = [], [], []
    for _, rows, _, features, _, _ in TABLES:
        for feature in features:
            length = torch.randint(0, 9, (BATCH,), generator=generator)
            keys.append(feature)
            lengths.append(length)
            values.append(torch.randint(0, rows, (int(length.sum()),), generator=generator))
    return {"keys": keys, "lengths": torch.cat(lengths), "values": torch.cat(values)}


def kjt(parts: dict):
    from torchrec import KeyedJaggedTensor

    return KeyedJaggedTensor(
        keys=parts["keys"],
        values=torch.as_tensor(parts["values"]),
        lengths=torch.as_tensor(parts["lengths"]),
    )


class Model(torch.nn.Module):
    """A tiny ranker: pooled embeddings into one linear layer."""

    def __init__(self) -> None:
        from torchrec import EmbeddingBagCollection

        super().__init__()
        self.sparse = EmbeddingBagCollection(tables=configs(), device=torch.device("meta"))
        self.dense = torch.nn.Linear(sum(dim * len(f) for _, _, dim, f, _, _ in TABLES), 1)

    def forward(self, features) -> torch.Tensor:
        return self.dense(self.sparse(features).values())


def trainer(rank: int, port: int, coordinator: str, steps: int, results: mp.Queue) -> None:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from shardserve import connect, spmd

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=120),
    )
    torch.manual_seed(0)
    model = Model()
    apply_optimizer_in_backward(torch.optim.SGD, model.sparse.parameters(), {"lr": 0.5})
    constraints = {
        name: ParameterConstraints(sharding_types=[sharding], min_partition=32)
        for name, _, _, _, _, sharding in TABLES
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=2, compute_device="cpu"), constraints=constraints
    )
    sharders = [EmbeddingBagCollectionSharder()]
    plan = planner.collective_plan(model, sharders, dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    dense = torch.optim.SGD(dmp.module.dense.parameters(), lr=0.1)
    for step in range(steps):
        loss = dmp(kjt(batch(1000 * step + rank))).square().mean()
        loss.backward()
        dense.step()
        dense.zero_grad()
    with connect(coordinator) as cluster:
        start = time.perf_counter()
        number = spmd.put_state_dict(cluster, dmp.state_dict(), PREFIX)
        seconds = time.perf_counter() - start
    check = batch(10_000 + rank)
    with torch.no_grad():
        pooled = dmp.module.sparse(kjt(check))
        pooled = pooled.wait() if hasattr(pooled, "wait") else pooled
    # numpy arrays through the queue: a tensor would be shared with this process, which ends now
    check = {key: value if key == "keys" else value.numpy() for key, value in check.items()}
    results.put(("trained", rank, number, seconds, check, pooled.values().numpy()))
    dist.destroy_process_group()


def inference(coordinator: str, checks: list, results: mp.Queue) -> None:
    from shardserve import connect
    from shardserve.torchrec import RemoteEmbeddingBagCollection

    with connect(coordinator) as cluster:
        remote = RemoteEmbeddingBagCollection.from_snapshot(
            cluster, PREFIX, configs(), module="sparse"
        )
        answers = []
        for parts, expected in checks:
            start = time.perf_counter()
            got = remote(kjt(parts)).values()
            seconds = time.perf_counter() - start
            expected = torch.from_numpy(expected)
            close = torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
            answers.append((close, float((got - expected).abs().max()), seconds))
        results.put(("served", [t.name for t in remote.tables], answers))


def processes() -> mp.context.BaseContext:
    """Where the trainer and inference processes come from: a forkserver that imported torch and torchrec once
    (each process a fork of it, not a new interpreter importing them again)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torchrec", "shardserve"])
    return ctx


def run_trainers(coordinator: str, steps: int) -> list[tuple]:
    from shardserve.server.launcher import free_port

    ctx = processes()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=trainer, args=(rank, port, coordinator, steps, results))
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    answers = sorted((results.get(timeout=300) for _ in procs), key=lambda a: a[1])
    for proc in procs:
        proc.join(timeout=60)
        if proc.exitcode != 0:
            raise SystemExit(f"a trainer process exited with {proc.exitcode}")
    return answers


def run_inference(coordinator: str, checks: list) -> tuple:
    ctx = processes()
    results = ctx.Queue()
    proc = ctx.Process(target=inference, args=(coordinator, checks, results))
    proc.start()
    answer = results.get(timeout=300)
    proc.join(timeout=60)
    if proc.exitcode != 0:
        raise SystemExit(f"the inference process exited with {proc.exitcode}")
    return answer


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("coordinator", help="HOST:PORT of the cluster's coordinator")
    parser.add_argument("--steps", type=int, default=3, help="training steps before publishing")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    trained = run_trainers(args.coordinator, args.steps)
    number = trained[0][2]
    print(
        f"trainer (2 processes, DMP: {', '.join(f'{t[0]} {t[5]}' for t in TABLES)}) took "
        f"{args.steps} steps and put snapshot {number} of {PREFIX!r} in "
        f"{max(t[3] for t in trained):.2f} s"
    )
    names, answers = run_inference(args.coordinator, [(t[4], t[5]) for t in trained])[1:]
    print(f"inference serves {', '.join(names)}")
    for rank, (close, error, seconds) in enumerate(answers):
        print(
            f"batch of trainer {rank} ({BATCH} samples): "
            + ("equal to the trainer's forward" if close else "MISMATCH")
            + f" (max abs difference {error:.2e}; served in {seconds * 1e3:.1f} ms)"
        )
    if not all(close for close, _, _ in answers) or {t[2] for t in trained} != {number}:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
