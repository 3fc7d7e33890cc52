"""Packs (shardcore.packs): small tensors planned into byte tensors, listed in a skeleton and read back checked."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shardserve.core.metadata import TensorProperties
from shardserve.core.packs import (
    ALIGN_BYTES,
    Pack,
    Packable,
    PackedItem,
    PackError,
    check_pack_layouts,
    packs_of,
    plan_packs,
    stored_keys,
    with_packs,
)
from shardserve.core.specs import ChunkShardingSpec
from shardserve.core.state_tree import join_state_dict, split_state_dict, tensor_keys


def packable(key: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Packable:
    return Packable(key, dtype, shape)


def test_items_lie_at_aligned_offsets_in_order_and_a_pack_ends_at_its_last_item():
    (pack,) = plan_packs(
        [packable("a", (3,)), packable("b", (2, 2), torch.float64), packable("c", (), torch.bool)],
        taken=["a", "b", "c"],
        max_pack_bytes=1 << 20,
    )
    assert [(i.key, i.offset, i.nbytes) for i in pack.items] == [
        ("a", 0, 12),
        ("b", ALIGN_BYTES, 32),
        ("c", 2 * ALIGN_BYTES, 1),
    ]
    assert pack.key == "_packed.0" and pack.nbytes == 2 * ALIGN_BYTES + 1


def test_packs_are_cut_at_their_size_and_a_larger_tensor_is_alone_in_one():
    packs = plan_packs(
        [
            packable("a", (100,)),
            packable("b", (100,)),
            packable("big", (1000,)),
            packable("c", (1,)),
        ],
        taken=["a", "b", "big", "c"],
        max_pack_bytes=1024,
    )
    assert [[i.key for i in p.items] for p in packs] == [["a", "b"], ["big"], ["c"]]
    assert [p.key for p in packs] == ["_packed.0", "_packed.1", "_packed.2"]
    assert all(p.items[0].offset == 0 for p in packs)
    assert packs[1].nbytes == 4000


def test_a_pack_key_moves_aside_from_the_state_dicts_own_keys():
    (pack,) = plan_packs(
        [packable("a", (1,)), packable("_packed.0", (1,))],
        taken=["a", "_packed.0", "_packed.0_"],
        max_pack_bytes=1024,
    )
    assert pack.key == "_packed.0__"


def test_a_skeleton_lists_its_packs_and_reads_them_back_with_the_tree_unchanged():
    state = {"w": torch.zeros(3), "opt": {"step": torch.tensor(1), "lr": 0.5}}
    split = split_state_dict(state, is_tensor=lambda v: isinstance(v, torch.Tensor))
    packs = plan_packs(
        [Packable("w", torch.bfloat16, (3,)), Packable("opt.step", torch.int64, ())],
        taken=split.tensors,
        max_pack_bytes=1024,
    )
    skeleton = with_packs(split.skeleton, packs)
    assert json.loads(skeleton)["format"] == 2
    assert packs_of(skeleton) == packs
    assert packs_of(split.skeleton) == [] and with_packs(split.skeleton, []) == split.skeleton
    tree = join_state_dict(skeleton, {"w": "W", "opt.step": "S"})
    assert tree == {"w": "W", "opt": {"step": "S", "lr": 0.5}}
    assert stored_keys(tensor_keys(skeleton), packs) == ["_packed.0"]


def test_stored_keys_are_the_unpacked_references_and_the_packs():
    packs = [Pack("_packed.0", 4, (PackedItem("b", 0, torch.float32, ()),))]
    assert stored_keys(["a", "b"], packs) == ["a", "_packed.0"]
    with pytest.raises(PackError, match=r"items \['b'\] are not in the state dict's tree"):
        stored_keys(["a"], packs)


def _skeleton(packs: object) -> str:
    return json.dumps({"format": 2, "tree": {"dict": []}, "packs": packs})


@pytest.mark.parametrize(
    "packs, message",
    [
        ({"key": "p"}, r"packs: not a list"),
        (["p"], r"packs\[0\]: not a pack"),
        ([{"key": "", "nbytes": 4, "items": []}], r"packs\[0\]\.key: not a tensor key"),
        ([{"key": "p", "nbytes": -1, "items": []}], r"packs\[0\]\.nbytes: -1 is not a byte count"),
        ([{"key": "p", "nbytes": 8, "items": [["a", 0, "float32"]]}], r"items\[0\]: not an item"),
        ([{"key": "p", "nbytes": 8, "items": [["a", -4, "float32", []]]}], r"offset -4"),
        ([{"key": "p", "nbytes": 8, "items": [["a", 0, "complex99", []]]}], r"unknown dtype name"),
        ([{"key": "p", "nbytes": 8, "items": [["a", 0, "float32", [-1]]]}], r"shape \[-1\]"),
        (
            [{"key": "p", "nbytes": 8, "items": [["a", 2, "float32", []]]}],
            r"not aligned for float32",
        ),
        (
            [{"key": "p", "nbytes": 8, "items": [["a", 4, "float32", [2]]]}],
            r"ends at byte 12, past",
        ),
        (
            [
                {
                    "key": "p",
                    "nbytes": 16,
                    "items": [["a", 0, "float32", [2]], ["b", 4, "float32", []]],
                }
            ],
            r"item 'b' at byte 4 overlaps",
        ),
        (
            [
                {"key": "p", "nbytes": 4, "items": [["a", 0, "float32", []]]},
                {"key": "q", "nbytes": 4, "items": [["a", 0, "float32", []]]},
            ],
            r"key 'a' is listed twice",
        ),
        (
            [{"key": "a", "nbytes": 4, "items": [["a", 0, "float32", []]]}],
            r"key 'a' is listed twice",
        ),
    ],
)
def test_bad_packs_are_refused_naming_the_pack_or_item(packs: object, message: str):
    with pytest.raises(PackError, match=message):
        packs_of(_skeleton(packs))


def test_a_pack_must_be_stored_as_uint8_bytes_of_its_size():
    packs = [Pack("p", 8, (PackedItem("a", 0, torch.float32, (2,)),))]
    props = TensorProperties(dtype=torch.uint8)
    spec = ChunkShardingSpec(0, ["rank:0/cpu"])
    check_pack_layouts(packs, {"p": spec.build_metadata((8,), props)})
    check_pack_layouts(packs, {})  # a missing pack is the key check's to name
    with pytest.raises(
        PackError, match=r"pack 'p' is stored as uint8 \(9,\); a pack is uint8 \(8,\)"
    ):
        check_pack_layouts(packs, {"p": spec.build_metadata((9,), props)})
    with pytest.raises(PackError, match=r"stored as float32 \(8,\)"):
        check_pack_layouts(packs, {"p": spec.build_metadata((8,), TensorProperties())})


PACKABLE_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.int64,
    torch.bool,
]
packables = st.lists(
    st.tuples(
        st.sampled_from(PACKABLE_DTYPES), st.lists(st.integers(0, 9), min_size=0, max_size=3)
    ),
    min_size=1,
    max_size=40,
)


@given(packables, st.integers(1, 4096))
def test_any_plan_reads_back_from_its_skeleton_with_every_item_aligned_inside_its_pack(
    tensors: list, max_pack_bytes: int
) -> None:
    """Every tensor lies in exactly one pack, aligned, inside it, none overlapping, in order; a pack goes past
    `max_pack_bytes` only when it holds one tensor; the skeleton gives the plan back exactly."""
    wanted = [Packable(f"t{i}", dtype, tuple(shape)) for i, (dtype, shape) in enumerate(tensors)]
    packs = plan_packs(wanted, taken=[t.key for t in wanted], max_pack_bytes=max_pack_bytes)
    items = [item for pack in packs for item in pack.items]
    assert [(i.key, i.dtype, i.shape) for i in items] == [(t.key, t.dtype, t.shape) for t in wanted]
    for pack in packs:
        assert pack.nbytes <= max_pack_bytes or len(pack.items) == 1
        ends = [0]
        for item in pack.items:
            assert item.offset % ALIGN_BYTES == 0 and item.offset >= ends[-1]
            ends.append(item.offset + item.nbytes)
        assert ends[-1] == pack.nbytes
    skeleton = json.dumps(
        {"format": 1, "tree": {"dict": [[t.key, {"tensor": t.key}] for t in wanted]}}
    )
    assert packs_of(with_packs(skeleton, packs)) == packs
    assert stored_keys([t.key for t in wanted], packs) == [p.key for p in packs]
