"""A state dict as a tree: its tensors under flat keys, and everything else in a typed JSON document.

torch's state dicts are nested containers whose leaves are tensors and plain values: an optimizer state dict
holds `param_groups` (floats, tuples such as `betas`, bools, lists of parameter names or ids) and int or float
`step`s, under str or int keys. `split_state_dict` cuts one into its tensors, each under the dotted path of
keys that leads to it ("state.layer.weight.exp_avg", the names DCP uses), and a skeleton: the same tree with
every tensor replaced by a reference to its key, encoded as JSON in which each value keeps its Python type
(a tuple stays a tuple, an int an int, nan a float). Nothing in it is executable and nothing is unpickled.
`join_state_dict` rebuilds the tree from the skeleton and the tensors; `fill_state_dict` writes a stored
tree's plain values into a caller's state dict, whose tensors the caller fills in place.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

FORMAT = 1  # the skeleton's format version, stored with it
PACKED_FORMAT = 2  # the same tree, with packs listed beside it (shardcore.packs)
READABLE_FORMATS = (FORMAT, PACKED_FORMAT)
Key = str | int | bool | float | None | tuple[Any, ...]
_PLAIN_KEYS = (str, int, bool, float, type(None), tuple)


class StateTreeError(ValueError):
    """A state dict entry that cannot be stored or restored; the message names its key path and type."""


@dataclass(frozen=True)
class SplitStateDict:
    """A state dict cut in two: `tensors` by flat key, in the tree's order, and `skeleton`, the typed JSON
    document of the rest (tensors as references to their keys)."""

    tensors: dict[str, Any]
    skeleton: str


def split_state_dict(
    state_dict: Mapping[Any, Any], *, is_tensor: Callable[[Any], bool]
) -> SplitStateDict:
    """Cut `state_dict` into its tensors (`is_tensor(value)` true: tensors, DTensors, ShardedTensors) and the
    typed document of everything else. StateTreeError names the path of a value of another type (an object,
    a callable), and of two tensors whose paths flatten to the same key."""
    if not isinstance(state_dict, Mapping):
        raise StateTreeError(f"a state dict must be a dict, got {type(state_dict).__name__}")
    splitter = _Splitter(is_tensor)
    document = {"format": FORMAT, "tree": splitter.encode(state_dict, ())}
    return SplitStateDict(
        splitter.tensors, json.dumps(document, separators=(",", ":"), allow_nan=False)
    )


@dataclass
class _Splitter:
    """The tensors met so far and their paths, while a tree is encoded (an object rather than a recursive
    closure, which would be a reference cycle left for the cyclic collector at every put)."""

    is_tensor: Callable[[Any], bool]
    tensors: dict[str, Any] = field(default_factory=dict)
    paths: dict[str, tuple[Key, ...]] = field(default_factory=dict)

    def encode(self, value: Any, path: tuple[Key, ...]) -> Any:
        if self.is_tensor(value):
            key = flat_key(path)
            if key in self.tensors:
                raise StateTreeError(
                    f"state dict entries {_shown(self.paths[key])} and {_shown(path)} both flatten to the "
                    f"key {key!r}; rename one"
                )
            self.tensors[key], self.paths[key] = value, path
            return {"tensor": key}
        if isinstance(value, Mapping):
            return {
                "dict": [
                    [_encode_key(k, path), self.encode(v, (*path, k))] for k, v in value.items()
                ]
            }
        if type(value) is list:
            return [self.encode(v, (*path, i)) for i, v in enumerate(value)]
        if type(value) is tuple:
            return {"tuple": [self.encode(v, (*path, i)) for i, v in enumerate(value)]}
        return _encode_plain(value, path)


def join_state_dict(skeleton: str, tensors: Mapping[str, Any]) -> dict[Any, Any]:
    """The tree `skeleton` describes, with each tensor reference replaced by `tensors[key]`."""
    tree = _decode(_parse(skeleton), tensors)
    if not isinstance(tree, dict):
        raise StateTreeError("the stored state dict is not a dict")
    return tree


def tensor_keys(skeleton: str) -> list[str]:
    """The flat keys of the tensors `skeleton` refers to, in its order."""
    keys: list[str] = []
    _decode(_parse(skeleton), _Recorder(keys))
    return keys


def fill_state_dict(into: MutableMapping[Any, Any], skeleton: str) -> None:
    """Set every plain value of `into` (not its tensors, which the caller fills in place) to the value the
    stored tree holds at the same path: the optimizer's param_groups and steps of a get_state_dict. A path the
    stored tree lacks is left as it is; a container the stored tree holds where `into` has none is added.
    A steady get reads the same skeleton every step: its tree is decoded once, and a tree with nothing to set
    (tensors only) is not walked."""
    stored, sets = _stored_tree(skeleton)
    if sets:
        _fill(into, stored)


@functools.lru_cache(maxsize=8)
def _stored_tree(skeleton: str) -> tuple[dict[Any, Any], bool]:
    """The stored tree (its tensors as references) and whether filling a state dict from it could set anything.
    It is shared between calls: `_fill` sets copies of its containers, never the containers themselves."""
    stored = join_state_dict(skeleton, _Recorder([]))
    return stored, _sets_something(stored)


def _sets_something(node: Any) -> bool:
    """Whether `_fill` could set a value from `node` (a child of a container it walks): a plain value, an empty
    container, or a container with such a node in it; never a tensor or a tuple holding one."""
    if isinstance(node, _TensorRef):
        return False
    if isinstance(node, tuple):
        return not _holds_tensor(node)
    if isinstance(node, (dict, list)):
        children = node.values() if isinstance(node, dict) else node
        return not node or any(_sets_something(child) for child in children)
    return True


def flat_key(path: tuple[Key, ...]) -> str:
    """The dotted key of a tensor's path of dict keys and list indexes ("state.0.exp_avg")."""
    return ".".join(str(part) for part in path)


def _fill(into: Any, stored: dict[Any, Any] | list[Any]) -> None:
    """Write `stored`'s plain values into `into`, the caller's container of the same kind (a mutable mapping,
    or a list of the same length), going down into the containers both hold."""
    pairs = stored.items() if isinstance(stored, dict) else enumerate(stored)
    for key, value in pairs:
        current = into.get(key) if isinstance(into, MutableMapping) else into[key]
        if _same_container(current, value):
            _fill(current, value)
        elif not _holds_tensor(value):
            into[key] = copy.deepcopy(value)  # the stored tree is kept for the next fill


def _same_container(current: Any, value: Any) -> bool:
    if isinstance(value, dict):
        return isinstance(current, MutableMapping)
    return isinstance(value, list) and isinstance(current, list) and len(current) == len(value)


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, _TensorRef):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


class _TensorRef(str):
    """A tensor's key where a tree is rebuilt without its tensors."""


class _Recorder(dict[str, Any]):
    """A mapping that answers every key with a _TensorRef and remembers the keys asked for."""

    def __init__(self, keys: list[str]) -> None:
        super().__init__()
        self.keys_asked = keys

    def __missing__(self, key: str) -> _TensorRef:
        self.keys_asked.append(key)
        return _TensorRef(key)


def _encode_key(key: Any, path: tuple[Key, ...]) -> Any:
    if type(key) not in _PLAIN_KEYS:
        raise StateTreeError(
            f"state dict key {key!r} under {_shown(path)} is a {type(key).__name__}; keys must be "
            f"str, int, bool, float, None or tuples of these"
        )
    return (
        _encode_plain(key, path)
        if type(key) is not tuple
        else {"tuple": [_encode_key(k, path) for k in key]}
    )


def _encode_plain(value: Any, path: tuple[Key, ...]) -> Any:
    if value is None or type(value) in (bool, int, str):
        return value
    if type(value) is float:
        return {"float": value.hex() if math.isfinite(value) else repr(value)}
    raise StateTreeError(
        f"state dict entry {_shown(path)} is a {type(value).__module__}.{type(value).__qualname__}; "
        f"only tensors, None, bool, int, float, str and lists, tuples and dicts of these can be stored"
    )


def _parse(skeleton: str) -> Any:
    try:
        document = json.loads(skeleton)
    except json.JSONDecodeError as err:
        raise StateTreeError(f"the stored state dict skeleton is not JSON: {err}") from None
    if (
        not isinstance(document, dict)
        or document.get("format") not in READABLE_FORMATS
        or "tree" not in document
    ):
        raise StateTreeError(
            f"the stored state dict skeleton is not of a format this client reads {READABLE_FORMATS}"
        )
    return document["tree"]


def _decode(node: Any, tensors: Mapping[str, Any]) -> Any:
    if node is None or type(node) in (bool, int, str):
        return node
    if type(node) is list:
        return [_decode(v, tensors) for v in node]
    if type(node) is dict and len(node) == 1:
        ((tag, body),) = node.items()
        if tag == "tensor" and type(body) is str:
            if body not in tensors and not isinstance(tensors, _Recorder):
                raise StateTreeError(
                    f"the stored state dict refers to tensor {body!r}, which is missing"
                )
            return tensors[body]
        if tag == "float" and type(body) is str:
            return _float(body)
        if tag == "tuple" and type(body) is list:
            return tuple(_decode(v, tensors) for v in body)
        if (
            tag == "dict"
            and type(body) is list
            and all(type(p) is list and len(p) == 2 for p in body)
        ):
            return {_decode(k, tensors): _decode(v, tensors) for k, v in body}
    raise StateTreeError(f"the stored state dict skeleton holds an unknown node {str(node)[:80]!r}")


def _float(text: str) -> float:
    if text in ("nan", "inf", "-inf"):
        return float(text)
    try:
        return float.fromhex(text)
    except ValueError:
        raise StateTreeError(
            f"the stored state dict skeleton holds a bad float {text[:40]!r}"
        ) from None


def _shown(path: tuple[Key, ...]) -> str:
    return repr(flat_key(path)) if path else "the top"
