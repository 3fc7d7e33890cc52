"""Packs (shardcore.packs): small tensors planned into byte tensors, listed in a skeleton and read back checked."""

from __future__ import annotations

import json

import pytest
import torch

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
