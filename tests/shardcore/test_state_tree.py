"""shardcore.state_tree: any state dict torch produces splits into tensors and a typed JSON skeleton and joins
back equal, every value of the same Python type; other values are refused naming their key and type."""

from __future__ import annotations

import json
import math
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.core.state_tree import (
    StateTreeError,
    fill_state_dict,
    join_state_dict,
    split_state_dict,
    tensor_keys,
)


def is_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor)


def same(a: object, b: object) -> bool:
    """Equal and of the same types all the way down (nan equals nan; tensors compared bit for bit)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b  # type: ignore[arg-type]
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))  # type: ignore[arg-type]
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)  # type: ignore[index]
    return a == b


def round_trip(state_dict: dict) -> dict:
    split = split_state_dict(state_dict, is_tensor=is_tensor)
    wire = json.loads(split.skeleton)  # what is stored is plain JSON
    assert wire["format"] == 1
    return join_state_dict(split.skeleton, split.tensors)


def adamw_state_dict() -> dict:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optim.step()
    return optim.state_dict()


def test_an_optimizer_state_dict_round_trips_with_its_types() -> None:
    state = adamw_state_dict()
    assert isinstance(state["param_groups"][0]["betas"], tuple)
    back = round_trip(state)
    assert same(back, state)
    assert type(next(iter(back["state"]))) is int  # torch.optim keys parameters by int
    assert type(back["param_groups"][0]["betas"]) is tuple
    assert type(back["param_groups"][0]["lr"]) is float


def test_tensors_get_dotted_keys_in_order() -> None:
    state = adamw_state_dict()
    split = split_state_dict(state, is_tensor=is_tensor)
    assert list(split.tensors)[:3] == ["state.0.step", "state.0.exp_avg", "state.0.exp_avg_sq"]
    assert tensor_keys(split.skeleton) == list(split.tensors)


plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(st.text(max_size=6) | st.integers(-5, 5), inner, max_size=4)
    ),
    max_leaves=25,
)


@settings(max_examples=80, deadline=None)
@given(tree=st.dictionaries(st.text(min_size=1, max_size=6), plain, max_size=5))
def test_any_tree_of_plain_values_round_trips_with_its_types(tree: dict) -> None:
    assert same(round_trip(tree), tree)


def test_nan_inf_and_big_ints_keep_their_values_and_types() -> None:
    tree = {
        "nan": math.nan,
        "inf": math.inf,
        "-inf": -math.inf,
        "tiny": 5e-324,
        "big": 2**100,
        "neg0": -0.0,
        "one": 1,
        "true": True,
        "none": None,
        "nested": [(1.0, (2, [3.5]))],
    }
    back = round_trip(tree)
    assert same(back, tree) and math.copysign(1.0, back["neg0"]) == -1.0


def test_keys_with_dots_are_kept_and_colliding_paths_are_refused() -> None:
    tensor = torch.arange(3.0)
    back = round_trip({"layer.weight": tensor, "layer.bias": tensor + 1})
    assert list(back) == ["layer.weight", "layer.bias"] and torch.equal(
        back["layer.bias"], tensor + 1
    )
    with pytest.raises(StateTreeError, match=r"'a\.b'.*'a\.b'.*flatten to the key 'a\.b'"):
        split_state_dict({"a.b": tensor, "a": {"b": tensor}}, is_tensor=is_tensor)


@pytest.mark.parametrize(
    "value, kind",
    [
        (object(), "builtins.object"),
        (lambda: 1, "function"),
        (torch.Size([2]), "torch.Size"),
        ({1, 2}, "builtins.set"),
        (b"raw", "builtins.bytes"),
        (torch.float32, "torch.dtype"),
    ],
)
def test_other_values_are_refused_naming_the_key_and_the_type(value: object, kind: str) -> None:
    with pytest.raises(StateTreeError, match=rf"entry 'param_groups\.0\.odd' is a .*{kind}"):
        split_state_dict({"param_groups": [{"odd": value}]}, is_tensor=is_tensor)


def test_keys_of_other_types_are_refused() -> None:
    with pytest.raises(StateTreeError, match="key .* under 'state' is a object"):
        split_state_dict({"state": {object(): 1}}, is_tensor=is_tensor)


def test_mappings_come_back_as_dicts() -> None:
    back = round_trip({"model": OrderedDict(w=torch.ones(2))})
    assert type(back["model"]) is dict and torch.equal(back["model"]["w"], torch.ones(2))


def test_fill_sets_plain_values_and_leaves_tensors_to_the_caller() -> None:
    trainer = adamw_state_dict()
    split = split_state_dict(trainer, is_tensor=is_tensor)
    reader = adamw_state_dict()
    reader["param_groups"][0]["lr"] = 0.5
    reader["param_groups"][0]["betas"] = (0.1, 0.2)
    exp_avg = reader["state"][0]["exp_avg"]
    fill_state_dict(reader, split.skeleton)
    assert reader["param_groups"] == trainer["param_groups"]
    assert reader["state"][0]["exp_avg"] is exp_avg  # tensors stay the caller's, to fill in place


def test_fills_from_one_skeleton_set_containers_of_their_own() -> None:
    """The stored tree is decoded once per skeleton and kept: what a fill sets is a copy, so a caller that
    changes it changes nothing the next fill sets."""
    trainer = adamw_state_dict()
    split = split_state_dict(trainer, is_tensor=is_tensor)
    first, second = {"state": {}}, {"state": {}}
    fill_state_dict(first, split.skeleton)
    first["param_groups"][0]["params"].append("changed")
    first["param_groups"][0]["lr"] = -1.0
    fill_state_dict(second, split.skeleton)
    assert second["param_groups"] == trainer["param_groups"]
    assert second["param_groups"] is not first["param_groups"]


def test_a_tree_of_tensors_only_sets_nothing_and_an_empty_container_is_still_added() -> None:
    tensors_only = split_state_dict(
        {"a": torch.ones(1), "b": {"c": torch.ones(1)}, "t": (torch.ones(1), 1)},
        is_tensor=is_tensor,
    )
    into: dict = {"a": "kept"}
    fill_state_dict(into, tensors_only.skeleton)
    assert into == {"a": "kept"}  # no "b" (it holds tensors), no "t" (a tuple holding one)
    with_empty = split_state_dict({"a": torch.ones(1), "state": {}}, is_tensor=is_tensor)
    into = {}
    fill_state_dict(into, with_empty.skeleton)
    assert into == {"state": {}}


def test_a_tampered_skeleton_is_refused_not_evaluated() -> None:
    for skeleton in (
        '{"format":1,"tree":{"pickle":"x"}}',
        '{"format":2,"tree":{}}',
        "not json",
        '{"format":1,"tree":{"float":"0xzz"}}',
    ):
        with pytest.raises(StateTreeError):
            join_state_dict(skeleton, {})
    with pytest.raises(StateTreeError, match="missing"):
        join_state_dict('{"format":1,"tree":{"dict":[["w",{"tensor":"w"}]]}}', {})


def test_splitting_leaves_no_reference_cycle():
    """Everything a split makes is freed by reference counting as soon as it returns, its test of tensors
    included (a recursive closure would be a cycle that only the cyclic collector frees, at every put)."""
    import gc
    import weakref

    class IsTensor:
        def __call__(self, value: object) -> bool:
            return isinstance(value, torch.Tensor)

    is_tensor = IsTensor()
    gone = weakref.ref(is_tensor)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        split = split_state_dict(
            {"a": {"b": torch.ones(2), "c": [1, (2.0, "x")]}}, is_tensor=is_tensor
        )
        del is_tensor
        assert gone() is None
    finally:
        if was_enabled:
            gc.enable()
    assert list(split.tensors) == ["a.b"]
