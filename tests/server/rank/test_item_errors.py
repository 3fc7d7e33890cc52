"""A batch entry's errors (server/rank/error_status.item_errors): rank errors become their statuses, named after
the entry; an error no status names passes through as it is; nothing raised, nothing changed."""

from __future__ import annotations

import grpc
import pytest

from shardserve.protos.errors import Reason
from shardserve.server.common.errors import ServiceError
from shardserve.server.rank import errors as rank
from shardserve.server.rank.error_status import item_errors


def test_a_rank_error_becomes_its_status_named_after_the_entry() -> None:
    with pytest.raises(ServiceError) as raised:
        with item_errors("versions[2]"):
            raise rank.InvalidArgument("version 0 is not a version", metadata={"field": "version"})
    err = raised.value
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.reason == Reason.INVALID_ARGUMENT
    assert err.message == "versions[2]: version 0 is not a version"
    assert err.metadata == {"field": "version", "item": "versions[2]"}
    assert err.__cause__ is None


def test_a_value_error_is_an_invalid_entry_and_a_key_error_a_missing_one() -> None:
    with pytest.raises(ServiceError) as invalid:
        with item_errors("shards[0]"):
            raise ValueError("sizes must be positive")
    assert invalid.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert invalid.value.message == "shards[0]: sizes must be positive"
    with pytest.raises(ServiceError) as missing:
        with item_errors("shards[1]"):
            raise KeyError("tensor 't' version 3")
    assert missing.value.code == grpc.StatusCode.NOT_FOUND
    assert missing.value.metadata["item"] == "shards[1]"


def test_other_errors_pass_through_and_a_clean_entry_changes_nothing() -> None:
    with pytest.raises(RuntimeError, match="disk on fire"):
        with item_errors("shards[0]"):
            raise RuntimeError("disk on fire")
    with item_errors("shards[0]"):
        done = True
    assert done
