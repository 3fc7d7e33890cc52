"""Group naming per (epoch, participants): every participant derives the same prefix and its own index."""

import pytest

from shardserve.core.epochs import group_prefix, group_rank, participants_of


def test_prefix_is_the_same_whatever_the_order_of_ranks():
    assert group_prefix(7, [3, 0, 2, 3]) == group_prefix(7, (0, 2, 3)) == "epoch/7/0,2,3"


def test_epochs_and_participant_sets_give_distinct_prefixes():
    prefixes = {
        group_prefix(e, r) for e in (1, 2) for r in ([0, 1], [0, 1, 2], [1, 2], [0, 12], [0, 1, 2])
    }
    assert len(prefixes) == 8
    assert not group_prefix(1, [0, 1]).startswith(group_prefix(1, [0]) + "/")


def test_group_rank_is_the_index_in_the_sorted_participants():
    assert [group_rank([5, 1, 3], r) for r in (1, 3, 5)] == [0, 1, 2]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: group_rank([0, 1], 2), "rank 2 is not a participant"),
        (lambda: participants_of([]), "at least one participant"),
        (lambda: participants_of([-1, 0]), "ranks must be >= 0"),
        (lambda: group_prefix(0, [0]), "epoch must be >= 1"),
    ],
)
def test_bad_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_non_integers_are_refused():
    with pytest.raises(TypeError):
        participants_of([0.5])
