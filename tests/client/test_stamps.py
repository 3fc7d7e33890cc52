"""Stamps (client/stamps.py): a tensor torch saw no write to matches the stamp taken before, any counted write,
another storage or a freed one does not; the writes torch does not count are not seen (why a delta put trusts
stamps only when asked). And the hashing of delta puts: a trusted source is not read again."""

from __future__ import annotations

import gc

import pytest
import torch

from shardserve.client import metrics as client_metrics
from shardserve.client.delta_writes import Hashes, Source, hash_all
from shardserve.client.errors import InvalidArgumentError
from shardserve.client.stamps import Stamp, delta_mode
from shardserve.core.delta import block_hashes


def _stamp(tensor: torch.Tensor) -> Stamp:
    stamp = Stamp.of(tensor)
    assert stamp is not None
    return stamp


def test_no_write_matches_and_a_detached_view_is_the_same_tensor() -> None:
    weight = torch.nn.Parameter(torch.randn(8, 4))
    before = _stamp(
        weight.detach()
    )  # what model.state_dict() hands out: a new detached tensor each time
    assert before.matches(Stamp.of(weight.detach()))
    assert before.matches(Stamp.of(weight))


@pytest.mark.parametrize(
    "write",
    [
        lambda t: t.add_(1.0),
        lambda t: t[3].fill_(0.0),  # through a view of it
        lambda t: t.detach().copy_(torch.ones(8, 4)),
        lambda t: t.mul_(2.0),
    ],
    ids=["add_", "view", "detached copy_", "mul_"],
)
def test_a_counted_write_does_not_match(write) -> None:  # type: ignore[no-untyped-def]
    tensor = torch.randn(8, 4)
    before = _stamp(tensor)
    with torch.no_grad():
        write(tensor)
    assert not before.matches(Stamp.of(tensor))


def test_an_optimizer_step_does_not_match() -> None:
    layer = torch.nn.Linear(4, 4)
    before = _stamp(layer.weight.detach())
    layer(torch.ones(2, 4)).sum().backward()
    torch.optim.AdamW(layer.parameters()).step()
    assert not before.matches(Stamp.of(layer.weight.detach()))


def test_another_storage_or_place_does_not_match() -> None:
    tensor = torch.randn(8, 4)
    before = _stamp(tensor)
    assert not before.matches(Stamp.of(tensor.clone()))  # same bytes, another storage
    assert not before.matches(Stamp.of(tensor[1:]))  # another place in the same storage
    assert not before.matches(Stamp.of(tensor.t()))  # other strides
    assert not before.matches(None)


def test_a_freed_storage_does_not_match_whatever_takes_its_place() -> None:
    tensor = torch.randn(1024)
    before = _stamp(tensor)
    del tensor
    gc.collect()
    again = torch.randn(1024)  # may well take the same address, with a counter at 0 again
    assert not before.matches(Stamp.of(again))


def test_writes_torch_does_not_count_are_not_seen() -> None:
    """The documented limit: `.data` has a counter of its own, numpy writes past torch."""
    weight = torch.nn.Parameter(torch.randn(8, 4))
    before = _stamp(weight.detach())
    weight.data.add_(1.0)
    weight.detach().numpy()[0, 0] = 7.0
    assert before.matches(Stamp.of(weight.detach()))


def test_a_write_counted_by_the_wrapper_a_piece_was_cut_from_does_not_match() -> None:
    """A DTensor's in-place ops count in its own counter, not its local tensor's: a piece's stamp keeps both."""
    wrapper, piece = (
        torch.zeros(8),
        torch.zeros(4),
    )  # stand-ins: the counter is all that is read of the wrapper
    before = _stamp_with(piece, wrapper)
    assert before.matches(Stamp.of(piece, wrapper))
    wrapper.add_(1.0)
    assert not before.matches(Stamp.of(piece, wrapper))
    assert not _stamp_with(piece, wrapper).matches(
        Stamp.of(piece)
    )  # with and without a counter differ


def _stamp_with(tensor: torch.Tensor, counter: torch.Tensor) -> Stamp:
    stamp = Stamp.of(tensor, counter)
    assert stamp is not None
    return stamp


def test_an_inference_tensor_has_no_stamp() -> None:
    with torch.inference_mode():
        tensor = torch.zeros(4)
    assert Stamp.of(tensor) is None


@pytest.mark.parametrize(
    "value, expected",
    [(False, (False, False)), (True, (True, False)), ("version_counters", (True, True))],
)
def test_delta_modes(value: object, expected: tuple[bool, bool]) -> None:
    assert delta_mode(value) == expected


@pytest.mark.parametrize("value", ["yes", 1, None, "versions"])
def test_other_delta_values_are_refused_naming_the_field(value: object) -> None:
    with pytest.raises(InvalidArgumentError, match="delta must be") as caught:
        delta_mode(value)
    assert caught.value.metadata.get("field") == "delta"


def _hashed_bytes() -> int:
    return int(client_metrics()["delta_hashed_bytes"])


def test_trusted_hashing_reads_only_the_sources_written_since() -> None:
    a, b = torch.randn(4096, 64), torch.randn(4096, 64)  # 1 MiB each
    sources = {"a": Source(a, torch.float32), "b": Source(b, torch.float32)}
    before = _hashed_bytes()
    first = hash_all(sources)
    assert _hashed_bytes() - before == 2 << 20
    b[5] = 0.0
    before = _hashed_bytes()
    trusted = hash_all(sources, trusted=first)
    assert _hashed_bytes() - before == 1 << 20  # only "b" was read
    assert trusted.blocks == {"a": block_hashes(a), "b": block_hashes(b)}
    before = _hashed_bytes()
    untrusted = hash_all(sources)
    assert _hashed_bytes() - before == 2 << 20 and untrusted.blocks == trusted.blocks


def test_a_cast_source_is_hashed_as_stored_and_trusted_by_its_own_stamp() -> None:
    weight = torch.randn(256, 32)
    first = hash_all({"w": Source(weight, torch.bfloat16)})
    assert first.blocks["w"] == block_hashes(weight.to(torch.bfloat16))
    before = _hashed_bytes()
    again = hash_all({"w": Source(weight, torch.bfloat16)}, trusted=first)
    assert _hashed_bytes() == before and again.blocks == first.blocks


def test_hashes_unchanged_needs_a_kept_stamp() -> None:
    tensor = torch.randn(16)
    hashes = Hashes({"t": (1, 2)}, {"t": None})
    assert hashes.unchanged("t", Stamp.of(tensor)) is None
    assert hashes.unchanged("other", Stamp.of(tensor)) is None
