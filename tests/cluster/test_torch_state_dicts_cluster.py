"""torch's own state dicts through a cluster: a 2-process FSDP2 trainer (fully_shard, CPU, gloo) takes AdamW steps
and puts `get_model_state_dict` and `get_optimizer_state_dict` (param_groups with tuples, floats, bools and
FQN lists; steps); a 1-process job and a 2-process tensor-parallel job (parallelize_module) get them into their
own layouts, `set_model_state_dict` / `set_optimizer_state_dict` take them, and the next optimizer step on each
reader equals the trainer's next step bit for bit.

The model is linear in its parameters with integer inputs, so every gradient is exact whatever the layout sums
it in: a difference can only come from the stored state.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from gloo_world import World
from torch import nn

from shardserve import connect, spmd
from shardserve.server.launcher import LocalCluster

IN, WIDE, NARROW, BATCH = 8, 16, 4, 8
BETAS = (0.9, 0.95)


class TwoHeads(nn.Module):
    """Two linear heads on one input; the loss is linear in every parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(IN, WIDE)
        self.narrow = nn.Linear(IN, NARROW)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wide(x).sum(dim=-1) + self.narrow(x).sum(dim=-1)


def batch(step: int) -> torch.Tensor:
    """Integer inputs, the same on every process (each FSDP rank takes its half)."""
    return torch.randint(-3, 4, (BATCH, IN), generator=torch.Generator().manual_seed(step)).float()


def fresh_model() -> TwoHeads:
    torch.manual_seed(0)
    return TwoHeads()


def optimizer(model: nn.Module, lr: float = 0.01) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, weight_decay=0.1)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optim.zero_grad()
    model(x).mean().backward()
    optim.step()


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def job_train_and_publish(rank: int, address: str) -> dict[str, Any]:
    """FSDP2 over the 2-process world: two steps, publish model and optimizer, then the next step."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    model = fresh_model()
    fully_shard(model.wide, mesh=mesh)
    fully_shard(model.narrow, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = optimizer(model)
    half = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    for step in (1, 2):
        train_step(model, optim, batch(step)[half])
    model_sd = get_model_state_dict(model)
    optim_sd = get_optimizer_state_dict(model, optim)
    with connect(address) as cluster:
        spmd.put_state_dict(cluster, model_sd, "fsdp-model")
        spmd.put_state_dict(cluster, optim_sd, "fsdp-optim")
    train_step(model, optim, batch(3)[half])
    return {"after": full_parameters(model), "groups": optim_sd["param_groups"]}


def _load(
    model: nn.Module, optim: torch.optim.Optimizer, address: str, group: Any
) -> dict[str, Any]:
    """Warm the optimizer's state up (so its tensors exist in this layout), get both snapshots into torch's
    own state dicts, hand them to torch, and take the next step."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optim.step()
    model_sd = get_model_state_dict(model)
    optim_sd = get_optimizer_state_dict(model, optim)
    with connect(address) as cluster:
        spmd.get_state_dict(cluster, "fsdp-model", into=model_sd, group=group)
        spmd.get_state_dict(cluster, "fsdp-optim", into=optim_sd, group=group)
    set_model_state_dict(model, model_sd)
    set_optimizer_state_dict(model, optim, optim_sd)
    groups = optim_sd["param_groups"]
    train_step(model, optim, batch(3))
    return {"after": full_parameters(model), "groups": groups}


def job_read_in_one_process(rank: int, address: str) -> dict[str, Any] | None:
    single = dist.new_group([0])  # every rank makes the group; only rank 0 is in it
    if rank != 0:
        return None
    model = fresh_model()
    return _load(model, optimizer(model, lr=0.5), address, single)  # lr comes from the snapshot


def job_read_tensor_parallel(rank: int, address: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2,))
    model = parallelize_module(
        fresh_model(), mesh, {"wide": ColwiseParallel(), "narrow": ColwiseParallel()}
    )
    return _load(model, optimizer(model, lr=0.5), address, None)


@pytest.fixture(scope="module")
def cluster(cluster2: LocalCluster) -> LocalCluster:
    """The shared 2-rank cluster (conftest)."""
    return cluster2


@pytest.fixture(scope="module")
def trainer(cluster: LocalCluster, world2: World) -> dict[str, Any]:
    return world2.run(job_train_and_publish, cluster.address, timeout=240)[0]


@pytest.mark.parametrize("job", [job_read_in_one_process, job_read_tensor_parallel])
def test_the_next_step_after_a_get_equals_the_trainers_bit_for_bit(
    cluster: LocalCluster, world2: World, trainer: dict[str, Any], job: Any
) -> None:
    reader = world2.run(job, cluster.address, timeout=240)[0]
    groups = reader["groups"]
    assert groups == trainer["groups"]  # lr 0.01, not the reader's 0.5; betas, weight decay, FQNs
    assert type(groups[0]["betas"]) is tuple and type(groups[0]["lr"]) is float
    assert type(groups[0]["amsgrad"]) is bool and groups[0]["params"][0] == "wide.weight"
    assert sorted(reader["after"]) == sorted(trainer["after"])
    for name, expected in trainer["after"].items():
        assert torch.equal(reader["after"][name], expected), name


def job_publish_trusting_version_counters(rank: int, address: str) -> dict[str, Any]:
    """FSDP2 with the narrow head frozen (a LoRA run's base weights): three AdamW steps, each published with
    delta="version_counters" and read back by the same job into zeroed DTensors of its layout. Per put: the
    bytes this rank hashed; per step: whether the snapshot read back equals the model bit for bit."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardserve.client import metrics as client_metrics

    mesh = init_device_mesh("cpu", (2,))
    model = fresh_model()
    model.narrow.requires_grad_(False)
    fully_shard(model.wide, mesh=mesh)
    fully_shard(model.narrow, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    half = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    hashed, same = [], []
    with connect(address) as cluster:
        for step in (1, 2, 3):
            train_step(model, optim, batch(step)[half])
            model_sd = get_model_state_dict(model)
            before = client_metrics()["delta_hashed_bytes"]
            spmd.put_state_dict(cluster, model_sd, "fsdp-trusted", delta="version_counters")
            hashed.append(client_metrics()["delta_hashed_bytes"] - before)
            into = {key: torch.zeros_like(value) for key, value in model_sd.items()}
            spmd.get_state_dict(cluster, "fsdp-trusted", into=into)
            same.append(
                all(
                    torch.equal(into[k].full_tensor(), v.full_tensor()) for k, v in model_sd.items()
                )
            )
    trained = sum(
        v.to_local().numel() * v.element_size() for k, v in model_sd.items() if k.startswith("wide")
    )
    everything = sum(v.to_local().numel() * v.element_size() for v in model_sd.values())
    return {"hashed": hashed, "same": same, "trained": trained, "everything": everything}


def test_an_fsdp2_trainer_trusting_version_counters_reads_only_what_its_optimizer_wrote(
    cluster: LocalCluster, world2: World
) -> None:
    """The optimizer's in-place steps on FSDP2's sharded parameters count in the version counters of the
    DTensors get_model_state_dict hands out, every step's new ones included: after the first put (in full, every
    byte hashed), each rank reads only its shards of the trained head, and every snapshot reads back bit for
    bit."""
    results = world2.run(job_publish_trusting_version_counters, cluster.address, timeout=240)
    for out in results.values():
        assert out["same"] == [True, True, True]
        assert out["hashed"] == [out["everything"], out["trained"], out["trained"]]
        assert 0 < out["trained"] < out["everything"]
