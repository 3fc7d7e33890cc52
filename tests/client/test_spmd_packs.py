"""Packing on the client (client.spmd_packs), without a cluster: which tensors a put packs, the bytes it packs,
the buffers it keeps for the next put, and how a get's pieces are cut from the packs it reads."""

from __future__ import annotations

import pytest
import torch

from shardserve.client.errors import InvalidArgumentError
from shardserve.client.spmd_packs import PACK_ITEM_BYTES, pack_state, packed_read
from shardserve.core.metadata import Box
from shardserve.core.packs import packs_of
from shardserve.core.state_tree import split_state_dict


class FakeSession:
    """What the packing keeps its buffers by: any object a weak reference can name."""


def split(state: dict):
    return split_state_dict(state, is_tensor=lambda v: isinstance(v, torch.Tensor))


def small_state() -> dict:
    return {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.tensor([7, 8], dtype=torch.int64),
        "c": torch.tensor(True),
        "big": torch.zeros(PACK_ITEM_BYTES // 4 + 1),  # one element too many
        "view": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous: packed as its values
    }


def test_a_put_packs_the_small_plain_tensors_and_copies_their_values_cast():
    session, parts = FakeSession(), split(small_state())
    packed = pack_state(
        session, "p", parts.tensors, parts.skeleton, cast=torch.bfloat16, writer=True
    )
    (pack,) = packs_of(packed.skeleton)
    assert set(packed.tensors) == {"big", pack.key}
    assert [(i.key, i.dtype) for i in pack.items] == [
        ("a", torch.bfloat16),
        ("b", torch.int64),
        ("c", torch.bool),
        ("view", torch.bfloat16),
    ]
    memory = packed.tensors[pack.key]
    for item in pack.items:
        got = memory[item.offset : item.offset + item.nbytes].view(item.dtype).view(item.shape)
        want = small_state()[item.key]
        assert torch.equal(got, want.to(item.dtype)), item.key


def test_a_put_of_fewer_than_two_small_tensors_packs_nothing():
    parts = split({"a": torch.zeros(3), "big": torch.zeros(1 << 20)})
    packed = pack_state(FakeSession(), "p", parts.tensors, parts.skeleton, cast=None, writer=True)
    assert packed.tensors == parts.tensors and packed.skeleton == parts.skeleton


def test_a_job_rank_that_does_not_write_plans_the_same_packs_without_filling_them():
    parts = split(small_state())
    writer = pack_state(FakeSession(), "p", parts.tensors, parts.skeleton, cast=None, writer=True)
    other = pack_state(FakeSession(), "p", parts.tensors, parts.skeleton, cast=None, writer=False)
    assert other.skeleton == writer.skeleton
    assert {k: v.shape for k, v in other.tensors.items()} == {
        k: v.shape for k, v in writer.tensors.items()
    }


def test_the_next_put_of_a_prefix_fills_the_same_buffers_once_the_last_one_gave_them_back():
    session, parts = FakeSession(), split(small_state())
    first = pack_state(session, "p", parts.tensors, parts.skeleton, cast=None, writer=True)
    (key,) = [k for k in first.tensors if k != "big"]
    during = pack_state(session, "p", parts.tensors, parts.skeleton, cast=None, writer=True)
    assert (
        during.tensors[key] is not first.tensors[key]
    )  # taken: a put at the same time gets its own
    first.done()
    again = pack_state(session, "p", parts.tensors, parts.skeleton, cast=None, writer=True)
    assert again.tensors[key] is first.tensors[key]
    again.done()
    changed = split({**small_state(), "d": torch.zeros(4)})
    other = pack_state(session, "p", changed.tensors, changed.skeleton, cast=None, writer=True)
    assert other.tensors[key] is not first.tensors[key]  # another plan: new buffers


def test_a_get_reads_each_needed_pack_whole_and_cuts_every_piece_from_it():
    session, parts = FakeSession(), split(small_state())
    packed = pack_state(session, "p", parts.tensors, parts.skeleton, cast=None, writer=True)
    (pack_key,) = [k for k in packed.tensors if k != "big"]
    a_rows = torch.zeros(1, 3, dtype=torch.float64)  # a box of "a" (a DTensor's local piece), cast
    targets = {
        "a": [(Box((1, 0), (1, 3)), a_rows)],
        "b": [(Box((0,), (2,)), torch.zeros(2, dtype=torch.int64))],
        "big": [(Box((0,), (PACK_ITEM_BYTES // 4 + 1,)), torch.zeros(PACK_ITEM_BYTES // 4 + 1))],
    }
    read = packed_read(session, "p", packed.skeleton, targets)
    assert set(read.plain) == {"big", pack_key}
    ((box, memory),) = read.plain[pack_key]
    assert box == Box((0,), (memory.numel(),))
    memory.copy_(packed.tensors[pack_key])  # what read_pieces would land
    read.unpack()
    read.done()
    assert torch.equal(a_rows, small_state()["a"][1:2].to(torch.float64))
    assert torch.equal(targets["b"][0][1], small_state()["b"])


def test_a_get_piece_that_does_not_fit_its_packed_tensor_is_refused_naming_the_key():
    session, parts = FakeSession(), split(small_state())
    packed = pack_state(session, "p", parts.tensors, parts.skeleton, cast=None, writer=True)
    with pytest.raises(InvalidArgumentError, match=r"'a': .*the stored tensor has shape \(2, 3\)"):
        packed_read(
            session, "p", packed.skeleton, {"a": [(Box((0, 0), (3, 3)), torch.zeros(3, 3))]}
        )
    with pytest.raises(InvalidArgumentError, match="'b'"):
        packed_read(session, "p", packed.skeleton, {"b": [(Box((0,), (2,)), torch.zeros(2))]})
