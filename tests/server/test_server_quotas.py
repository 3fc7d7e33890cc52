"""Per-principal byte quotas (max_bytes in the tokens file), against one real 2-rank cluster.

Two writers with a 64 KiB quota each and two admins, one with a quota: puts up to the quota pass, the put that
would go over is RESOURCE_EXHAUSTED naming the quota, replicas count each, an overwrite or an update counts the
tensor once, a delete frees its bytes, one principal's quota never limits another's, and a checkpoint load over
the loading principal's quota is refused with nothing loaded.
"""

from __future__ import annotations

import pytest
import torch

from shardserve import ResourceExhaustedError, connect
from shardserve.core.metadata import ShardMetadata
from shardserve.core.specs import ChunkShardingSpec, EnumerableShardingSpec
from shardserve.server.common.auth import Security
from shardserve.server.common.principals import PrincipalBook, parse_tokens_file, token_sha256

pytestmark = pytest.mark.timeout(300)
QUOTA = 64 << 10
TOKENS = {
    "capped": "capped-token-1",
    "neighbour": "neighbour-token-1",
    "admin": "admin-token-1",
    "capped-admin": "capped-admin-token",
}
ROW_WISE = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"])


def tokens_toml() -> str:
    tables = []
    for name, role, quota in (
        ("capped", "write", QUOTA),
        ("neighbour", "write", QUOTA),
        ("admin", "admin", None),
        ("capped-admin", "admin", QUOTA),
    ):
        limit = f"\nmax_bytes = {quota}" if quota is not None else ""
        tables.append(
            f'[[principal]]\nname = "{name}"\ntoken_sha256 = "{token_sha256(TOKENS[name])}"\n'
            f'role = "{role}"{limit}\n'
        )
    return "\n".join(tables)


@pytest.fixture(scope="module")
def cluster(make_cluster, tmp_path_factory):
    path = tmp_path_factory.mktemp("tokens") / "tokens.toml"
    path.write_text(tokens_toml())
    return make_cluster(ranks=2, security=Security(principals=PrincipalBook(str(path))))


def client(cluster, name: str):
    return connect(cluster.address, token=TOKENS[name], timeout=30)


def kib(n: int) -> torch.Tensor:
    """A float32 tensor of n KiB (rows of 1 KiB)."""
    return torch.randn(n, 256)


def test_puts_fill_the_quota_and_the_next_one_is_refused_naming_it(cluster):
    with client(cluster, "capped") as capped:
        first = kib(40)
        capped.put("capped_a", first, ROW_WISE)
        with pytest.raises(
            ResourceExhaustedError,
            match=r"'capped' would hold 81920 bytes, over its quota "
            r"max_bytes = 65536",
        ):
            capped.put("capped_b", kib(40), ROW_WISE)
        assert "capped_b" not in {t.name for t in capped.list(include_pending=True)}
        capped.put("capped_b", kib(24), ROW_WISE)  # exactly up to the quota
        capped.put(
            "capped_a", kib(40), ROW_WISE, overwrite=True
        )  # an overwrite counts the tensor once
        capped.update_rows(
            "capped_a", torch.tensor([0, 39]), torch.ones(2, 256)
        )  # an update adds nothing
        assert torch.equal(capped.tensor("capped_a")[39], torch.ones(256))
        capped.delete("capped_a")  # frees its bytes
        capped.put("capped_c", kib(40), ROW_WISE)
        capped.delete("capped_b")
        capped.delete("capped_c")


def test_replicas_count_each(cluster):
    half = 20
    mirrored = EnumerableShardingSpec(
        [
            ShardMetadata((0, 0), (half, 256), "rank:0/cpu"),
            ShardMetadata((0, 0), (half, 256), "rank:1/cpu"),
            ShardMetadata((half, 0), (half, 256), "rank:1/cpu"),
            ShardMetadata((half, 0), (half, 256), "rank:0/cpu"),
        ]
    )
    with client(cluster, "capped") as capped:
        with pytest.raises(
            ResourceExhaustedError, match="would hold 81920 bytes"
        ):  # 40 KiB held twice
            capped.put("capped_mirrored", kib(40), mirrored)
        source = kib(30)
        capped.put("capped_mirrored", source, ROW_WISE)
        assert torch.equal(capped.tensor("capped_mirrored").full_tensor(), source)
        capped.delete("capped_mirrored")


def test_one_principal_quota_never_limits_another(cluster):
    with (
        client(cluster, "capped") as capped,
        client(cluster, "neighbour") as neighbour,
        client(cluster, "admin") as admin,
    ):
        capped.put("capped_full", kib(64), ROW_WISE)
        neighbour.put("neighbour_full", kib(64), ROW_WISE)
        admin.put("admin_large", kib(512), ROW_WISE)  # no max_bytes: no quota
        with pytest.raises(ResourceExhaustedError, match="'neighbour'"):
            neighbour.put("neighbour_more", kib(1), ROW_WISE)
        for name, owner in (
            ("capped_full", capped),
            ("neighbour_full", neighbour),
            ("admin_large", admin),
        ):
            owner.delete(name)


def test_a_load_over_the_quota_is_refused_and_loads_nothing(cluster, tmp_path):
    with client(cluster, "admin") as admin, client(cluster, "capped-admin") as capped_admin:
        admin.put("ckpt_small", kib(16), ROW_WISE)
        admin.put("ckpt_large", kib(60), ROW_WISE)
        admin.save_checkpoint(str(tmp_path / "ckpt"), ["ckpt_small", "ckpt_large"])
        admin.delete("ckpt_small")
        admin.delete("ckpt_large")
        with pytest.raises(
            ResourceExhaustedError,
            match=r"'capped-admin' would hold 77824 bytes.*max_bytes = 65536",
        ):
            capped_admin.load_checkpoint(str(tmp_path / "ckpt"), ["ckpt_small", "ckpt_large"])
        assert not {"ckpt_small", "ckpt_large"} & {
            t.name for t in capped_admin.list(include_pending=True)
        }
        loaded = capped_admin.load_checkpoint(str(tmp_path / "ckpt"), ["ckpt_large"])
        assert loaded["ckpt_large"].shape == (60, 256)
        capped_admin.delete("ckpt_large")


@pytest.mark.parametrize("value", ["-1", "1.5", "true", '"1GiB"'])
def test_max_bytes_must_be_a_non_negative_integer(value):
    text = f'[[principal]]\nname = "p"\ntoken_sha256 = "{"0" * 64}"\nrole = "write"\nmax_bytes = {value}\n'
    with pytest.raises(
        ValueError, match=r"principal #1 \('p'\): max_bytes must be an integer >= 0"
    ):
        parse_tokens_file(text)
