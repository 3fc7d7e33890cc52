"""The coordinators a client or rank is given and the one it calls: parsing "A,B" (errors name the field),
following a named leader, moving on when none is named or one cannot be reached, and going back to the
addresses given when a named leader is gone."""

from __future__ import annotations

import pytest

from shardserve.core.coordinator_addresses import CoordinatorAddresses, parse_addresses


def test_parse_keeps_the_order_drops_repeats_and_names_the_field():
    assert parse_addresses("a:1, b:2,a:1") == ("a:1", "b:2")
    assert parse_addresses(["a:1"]) == ("a:1",)
    for bad in ("", "a", "a:0", "a:x", ",", "a:1,b"):
        with pytest.raises(ValueError, match="--coordinator"):
            parse_addresses(bad, "--coordinator")
    with pytest.raises(TypeError, match="address must be"):
        parse_addresses(7, "address")  # type: ignore[arg-type]


def test_a_named_leader_is_called_then_the_next_when_none_is_known():
    addresses = CoordinatorAddresses(("a:1", "b:2"))
    assert addresses.after_failure("a:1", leader="b:2", unreachable=False) == "b:2"
    assert addresses.current == "b:2"
    assert addresses.after_failure("b:2", leader="", unreachable=False) == "a:1"  # knows none
    assert addresses.after_failure("a:1", leader=None, unreachable=True) == "b:2"  # gone: next
    assert addresses.after_failure("b:2", leader=None, unreachable=False) is None  # its answer


def test_another_calls_move_is_not_undone():
    addresses = CoordinatorAddresses(("a:1", "b:2", "c:3"))
    assert addresses.after_failure("a:1", leader="c:3", unreachable=False) == "c:3"
    assert addresses.after_failure("a:1", leader=None, unreachable=True) == "c:3"  # a late failure


def test_one_address_given_fails_at_once_and_a_gone_leader_leads_back_to_it():
    addresses = CoordinatorAddresses(("a:1",))
    assert not addresses.several
    assert addresses.after_failure("a:1", leader=None, unreachable=True) is None
    assert addresses.after_failure("a:1", leader="z:9", unreachable=False) == "z:9"  # not listed
    assert addresses.after_failure("z:9", leader=None, unreachable=True) is None
    assert addresses.current == "a:1"
