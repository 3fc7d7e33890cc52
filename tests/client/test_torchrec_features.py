"""shardserve.client.torchrec.features: a KJT's ids, offsets and weights checked once and cut per table."""

from __future__ import annotations

import pytest
import torch

from shardserve import InvalidArgumentError

torchrec = pytest.importorskip("torchrec")

from torchrec import KeyedJaggedTensor  # noqa: E402 - after the skip

from shardserve.client.torchrec.features import FeatureBatch  # noqa: E402


def _kjt(id_dtype: torch.dtype = torch.int64, weighted: bool = False) -> KeyedJaggedTensor:
    """Keys a, b, c over a batch of 2: a = [1, 2], [3]; b = [], [4, 5]; c = [6], [7, 8, 9]."""
    values = torch.arange(1, 10, dtype=id_dtype)
    return KeyedJaggedTensor(
        keys=["a", "b", "c"],
        values=values,
        lengths=torch.tensor([2, 1, 0, 2, 1, 3], dtype=id_dtype),
        weights=values.float() / 10 if weighted else None,
    )


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32], ids=str)
def test_neighbouring_features_are_one_slice(id_dtype: torch.dtype) -> None:
    batch = FeatureBatch(_kjt(id_dtype), weighted=False)
    assert batch.bounds == [0, 3, 5, 9] and batch.stride == 2
    ids = batch.table(["b", "c"])
    assert ids.ids.dtype == torch.int64 and ids.ids.tolist() == [4, 5, 6, 7, 8, 9]
    assert ids.offsets.tolist() == [0, 0, 2, 3] and ids.weights is None
    assert ids.positions == [1, 2]


def test_features_out_of_key_order_are_joined_with_their_weights() -> None:
    batch = FeatureBatch(_kjt(weighted=True), weighted=True)
    ids = batch.table(["c", "a"])
    assert ids.ids.tolist() == [6, 7, 8, 9, 1, 2, 3]
    assert ids.offsets.tolist() == [0, 1, 4, 6]
    assert ids.weights is not None
    torch.testing.assert_close(ids.weights, ids.ids.float() / 10)
    assert batch.lengths(2).tolist() == [1, 3]


def test_a_missing_key_is_named() -> None:
    with pytest.raises(InvalidArgumentError, match="no key 'z'"):
        FeatureBatch(_kjt(), weighted=False).table(["a", "z"])


def test_inconsistent_offsets_and_weights_are_refused() -> None:
    kjt = KeyedJaggedTensor(keys=["a"], values=torch.arange(3), offsets=torch.tensor([0, 2, 1, 3]))
    with pytest.raises(InvalidArgumentError, match="non-decreasing"):
        FeatureBatch(kjt, weighted=False)
    kjt = KeyedJaggedTensor(
        keys=["a"], values=torch.arange(3), lengths=torch.tensor([1, 2]), weights=torch.ones(2)
    )
    with pytest.raises(InvalidArgumentError, match="one weight per id"):
        FeatureBatch(kjt, weighted=True)


def test_an_empty_batch() -> None:
    kjt = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.empty(0, dtype=torch.int64),
        lengths=torch.zeros(6, dtype=torch.int64),
    )
    ids = FeatureBatch(kjt, weighted=False).table(["b", "a"])
    assert ids.ids.numel() == 0 and ids.offsets.tolist() == [0] * 6
