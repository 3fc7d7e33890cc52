"""`python -m benchmarks`' arguments: rank counts and the scale scenario's shards, refused with a message that
names the flag."""

from __future__ import annotations

import pytest

from benchmarks.__main__ import parse_args
from benchmarks.scale import SHARDS_STEP


def test_rank_counts_and_shards_are_parsed() -> None:
    args = parse_args(["--ranks", "10,100,1000", "--shards", "10000"], ["scale"])
    assert args.ranks == (10, 100, 1000) and args.shards == 10_000
    assert parse_args([], ["scale"]).shards is None


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--ranks", "10,x"),
        ("--ranks", "0"),
        ("--shards", "many"),
        ("--shards", "0"),
        ("--shards", str(SHARDS_STEP + 1)),
    ],
)
def test_a_bad_count_is_refused_naming_its_flag(flag: str, value: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args([flag, value], ["scale"])
    assert exit_info.value.code == 2
    assert f"{flag} " in capsys.readouterr().err
