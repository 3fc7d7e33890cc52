"""CUDA tensors end to end (on a GPU; skipped without one): Cluster.put / fetch and spmd.put_state_dict /
get_state_dict of CUDA tensors, every floating and integer dtype, contiguous, strided and transposed sources,
into CPU ranks (`up --ranks 2`: registered segments) and CUDA ranks (`--device cuda:0`: CUDA IPC), first and
steady puts, over the automatic path and forced same-host; and a real FSDP2 trainer on the GPU (NCCL, a world
of one) whose model and optimizer state a GPU reader in another process takes with set_*_state_dict, bit for
bit. Values are compared as bits (random bytes make NaNs of every float)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from shardserve import connect, spmd
from shardserve.client import metrics as client_metrics
from shardserve.core.specs import ChunkShardingSpec
from shardserve.server.common.rank_options import RankOptions
from shardserve.server.launcher import LocalCluster

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
]
SPECS = {
    "cpu": ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"]),
    "cuda": ChunkShardingSpec(0, ["rank:0/cuda:0", "rank:0/cuda:0"]),
}
PROCESS_S = 300


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def ranks(request, make_cluster) -> tuple[str, LocalCluster]:
    if request.param == "cpu":
        return "cpu", make_cluster(ranks=2)
    return "cuda", make_cluster(ranks=1, rank_options=RankOptions(device="cuda"))


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes as a CPU tensor of `dtype` (every bit pattern, NaNs included)."""
    count = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(
        0, 256, (count,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )
    return raw.view(dtype).view(shape)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().contiguous().view(-1).view(torch.uint8)


def sources(dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """CUDA tensors of one dtype: contiguous, a strided column slice and a transpose."""
    base = random_bits((24, 10), dtype, seed).cuda()
    return {"whole": base, "strided": base[:, ::3], "transposed": base.t()}


@pytest.mark.parametrize("transport", ["auto", "shm"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_tensors_put_and_fetched_into_cuda_out(ranks, transport, dtype) -> None:
    kind, cluster = ranks
    with connect(cluster.address, transport=transport) as client:
        for label, source in sources(dtype, seed=DTYPES.index(dtype)).items():
            name = f"put-{kind}-{transport}-{label}-{str(dtype).split('.')[-1]}"
            remote = client.put(name, source, SPECS[kind], durable=False)
            out = torch.full_like(source, 0).contiguous()
            remote.fetch((0,) * source.dim(), tuple(source.shape), out=out)
            assert torch.equal(bits(out), bits(source)), name
            strided_out = torch.zeros(
                source.shape[1], source.shape[0], dtype=dtype, device="cuda"
            ).t()
            remote.fetch((0,) * source.dim(), tuple(source.shape), out=strided_out)
            assert torch.equal(bits(strided_out), bits(source)), name
            assert torch.equal(bits(remote.full_tensor()), bits(source)), name
            if transport == "shm":
                assert remote.last_transport == "shm"
            client.delete(name)


@pytest.mark.parametrize("transport", ["auto", "shm"])
def test_cuda_state_dicts_first_and_steady_puts_and_gets(ranks, transport) -> None:
    kind, cluster = ranks
    prefix = f"sd-{kind}-{transport}"
    with connect(cluster.address, transport=transport) as client:
        for step in range(3):  # the first put creates the snapshot, the next ones fill reservations
            state = {
                f"{str(dtype).split('.')[-1]}_{label}": tensor
                for dtype in DTYPES
                for label, tensor in sources(dtype, seed=100 * step + DTYPES.index(dtype)).items()
            }
            state["step"] = step
            spmd.put_state_dict(client, state, prefix, SPECS[kind], durable=False)
            into = {key: torch.zeros_like(t) for key, t in state.items() if key != "step"}
            into["step"] = -1
            spmd.get_state_dict(client, prefix, into=into)
            assert into["step"] == step
            for key, tensor in state.items():
                if key != "step":
                    assert into[key].device.type == "cuda"
                    assert torch.equal(bits(into[key]), bits(tensor)), (step, key)


@pytest.mark.parametrize("transport", ["auto", "shm"])
def test_packed_cuda_state_dicts_are_packed_on_the_gpu_and_cut_there_on_read(
    ranks, transport
) -> None:
    """pack=True with CUDA tensors: the pack is filled on the GPU, stored as one tensor, and read back whole into
    the reader's GPU, where every tensor is cut from it (strided and transposed sources, every dtype)."""
    from shardserve.protos import shardserve_pb2 as pb

    kind, cluster = ranks
    prefix = f"packed-{kind}-{transport}"
    with connect(cluster.address, transport=transport) as client:
        for step in range(3):
            state = {
                f"{str(dtype).split('.')[-1]}_{label}": tensor
                for dtype in DTYPES
                for label, tensor in sources(dtype, seed=100 * step + DTYPES.index(dtype)).items()
            }
            spmd.put_state_dict(client, state, prefix, durable=False, pack=True)
            into = {key: torch.zeros_like(t) for key, t in state.items()}
            spmd.get_state_dict(client, prefix, into=into)
            for key, tensor in state.items():
                assert into[key].device.type == "cuda"
                assert torch.equal(bits(into[key]), bits(tensor)), (step, key)
        stored = client.session.call("GetSnapshot", pb.GetSnapshotRequest(prefix=prefix))
        assert [entry.key for entry in stored.entries] == ["_packed.0"]


def test_steady_puts_into_a_cuda_rank_reuse_the_memory_writer_and_reader_opened(make_cluster):
    """A weight sync into a CUDA rank alternates between two buffers the rank keeps: once the writer and the
    reader opened each (the first puts and gets), later steps open no CUDA IPC handle, and read bit for bit."""
    cluster = make_cluster(ranks=1, rank_options=RankOptions(device="cuda"))
    spec = ChunkShardingSpec(0, ["rank:0/cuda:0"])
    with connect(cluster.address, transport="shm") as client:
        opened = []
        for step in range(6):
            state = {f"w{i}": sources(torch.float32, seed=10 * step + i)["whole"] for i in range(4)}
            spmd.put_state_dict(client, state, "reused-cuda", spec, keep=1, durable=False)
            into = {key: torch.zeros_like(t) for key, t in state.items()}
            spmd.get_state_dict(client, "reused-cuda", into=into)
            assert all(torch.equal(bits(into[k]), bits(t)) for k, t in state.items()), step
            opened.append(client_metrics()["cuda_ipc_opens"])
        assert opened[-1] == opened[2] > 0, opened


FSDP_JOB = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from shardserve import connect, spmd

    role, address, store_path, out = sys.argv[1:5]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, 1), rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,))
    torch.manual_seed(0 if role == "train" else 1)  # the reader starts from other weights
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).cuda()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01 if role == "train" else 0.5)

    def step(seed):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed)).cuda()
        optim.zero_grad()
        model(x).square().mean().backward()
        optim.step()

    with connect(address) as cluster:
        if role == "train":
            for seed in (1, 2):
                step(seed)
                spmd.put_state_dict(cluster, get_model_state_dict(model), "fsdp-gpu-model", durable=False)
                spmd.put_state_dict(
                    cluster, get_optimizer_state_dict(model, optim), "fsdp-gpu-optim", durable=False
                )
        else:
            step(9)  # the optimizer's state exists in this layout before it is filled
            model_sd, optim_sd = get_model_state_dict(model), get_optimizer_state_dict(model, optim)
            spmd.get_state_dict(cluster, "fsdp-gpu-model", into=model_sd)
            spmd.get_state_dict(cluster, "fsdp-gpu-optim", into=optim_sd)
            set_model_state_dict(model, model_sd)
            set_optimizer_state_dict(model, optim, optim_sd)
    step(3)
    torch.save({k: v.full_tensor().cpu() for k, v in model.state_dict().items()}, out)
    dist.destroy_process_group()
    """
)


def _run_fsdp(role: str, address: str, tmp_path: Path) -> dict[str, torch.Tensor]:
    out = tmp_path / f"{role}.pt"
    done = subprocess.run(
        [sys.executable, "-c", FSDP_JOB, role, address, str(tmp_path / f"{role}.store"), str(out)],
        capture_output=True,
        timeout=PROCESS_S,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return torch.load(out, weights_only=True)


def test_an_fsdp2_gpu_trainers_state_reaches_a_gpu_reader_bit_for_bit(
    ranks, tmp_path: Path
) -> None:
    """After the get, the reader's next step equals the trainer's next step bit for bit (same weights, same
    AdamW moments and step counts, same lr from the snapshot)."""
    _, cluster = ranks
    trained = _run_fsdp("train", cluster.address, tmp_path)
    read = _run_fsdp("read", cluster.address, tmp_path)
    assert sorted(read) == sorted(trained)
    for key, expected in trained.items():
        assert torch.equal(bits(read[key]), bits(expected)), key
