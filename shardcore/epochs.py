"""Naming of the process groups that collective jobs run on: one per (epoch, participant set).

The coordinator numbers epochs; a failed job ends its epoch. Every participant
of a job derives the same store prefix and its own index in the group from
(epoch, participants) alone, so the ranks of a job meet in one group and ranks
outside it never see its keys.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

GROUP_KEY_ROOT = "epoch"


def participants_of(ranks: Iterable[int]) -> tuple[int, ...]:
    """The participant set as a sorted tuple of distinct ranks; ValueError for none or a negative rank."""
    out = tuple(sorted({operator.index(r) for r in ranks}))
    if not out:
        raise ValueError("a process group needs at least one participant")
    if out[0] < 0:
        raise ValueError(f"ranks must be >= 0, got {out[0]}")
    return out


def group_prefix(epoch: int, ranks: Iterable[int]) -> str:
    """The store prefix of the group of `ranks` in `epoch`, e.g. "epoch/7/0,2,3"."""
    epoch = operator.index(epoch)
    if epoch < 1:
        raise ValueError(f"epoch must be >= 1, got {epoch}")
    return f"{GROUP_KEY_ROOT}/{epoch}/{','.join(map(str, participants_of(ranks)))}"


def group_rank(ranks: Iterable[int], rank: int) -> int:
    """`rank`'s index in the sorted participant list: its rank inside the group."""
    members = participants_of(ranks)
    try:
        return members.index(operator.index(rank))
    except ValueError:
        raise ValueError(f"rank {rank} is not a participant of {list(members)}") from None
