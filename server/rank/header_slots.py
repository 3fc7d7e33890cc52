"""Header slots: the state words of many composed versions in one memfd, which a same-host reader maps once.

A version made of blocks shared with other versions (a row update's or a delta put's, server/rank/blocks.py)
keeps the header words that tell same-host readers its state (protos/same_host.py) apart from its bytes. A
header-only segment of its own for each such version (a memfd made, sealed and mapped by the rank; opened through
/proc and mapped by each reader) cost as much as the rest of opening the version: for the 64 tensors of a delta
put read right after it, ~40% of the rank's OpenShards and ~45% of the reader's mapping. Here each header is a
SLOT_BYTES slot of a header file of SLOTS_PER_FILE slots, made when no slot is free and kept for the rank's life,
so a reader maps each file once (client/paths/segments.py) and finds a header at its offset.

A slot goes back to the free ones when its version's tensor goes (its state DROPPED by then). Taking it again
first grows its generation word, as taking a recycled segment does: a reader still holding the old version's
place sees (state, generation) differ and reads the version anew. Slot 0 of every file is never handed out and
says DROPPED forever: header offset 0 is where a reader that does not know slots would look.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shardserve.protos.same_host import HEADER_MAGIC, HEADER_WORDS, STATE_DROPPED

SLOT_BYTES = 128  # the HEADER_WORDS int64 words, rounded up to two cache lines
SLOTS_PER_FILE = 512  # 64 KiB a file


@dataclass(frozen=True, eq=False)
class HeaderSlot:
    """One slot: the file it lies in (a Segment of the rank's shared memory), its offset there, its words."""

    file: Any  # the header file's Segment (server/rank/shared_memory.py)
    offset: int
    words: np.ndarray  # int64, the rank's writable view


class HeaderSlots:
    """The header files of one rank and their free slots; thread-safe (and re-entrant: a version's tensor may be
    freed, and its slot given back, by a collection inside take())."""

    def __init__(
        self,
        new_file: Callable[[int], tuple[torch.Tensor, Any]],
        *,
        slots_per_file: int = SLOTS_PER_FILE,
    ) -> None:
        """`new_file(nbytes)`: a new memfd of `nbytes` as (a writable flat uint8 tensor over it, its Segment),
        sealed against new writable mappings (readers map it read-only)."""
        if slots_per_file < 2:
            raise ValueError(
                f"slots_per_file must be >= 2 (slot 0 is never used), got {slots_per_file}"
            )
        self._new_file = new_file
        self._slots_per_file = slots_per_file
        self._free: list[HeaderSlot] = []
        self._files: list[torch.Tensor] = []  # their mappings, kept for the rank's life
        self._lock = threading.RLock()

    @property
    def files(self) -> int:
        """How many header files this rank made."""
        with self._lock:
            return len(self._files)

    def take(self, state: int) -> HeaderSlot:
        """A free slot, its generation grown and its words cleared before `state` is set."""
        with self._lock:
            if not self._free:
                self._grow()
            slot = self._free.pop()
        words = slot.words
        words[2] += 1
        words[3:] = 0
        words[1] = state
        return slot

    def give_back(self, slot: HeaderSlot) -> None:
        """`slot` is free again (its version's tensor is gone): DROPPED until it is taken."""
        slot.words[1] = STATE_DROPPED
        with self._lock:
            self._free.append(slot)

    def _grow(self) -> None:
        """(lock held) One more header file, every slot but the first free."""
        flat, file = self._new_file(SLOT_BYTES * self._slots_per_file)
        self._files.append(flat)
        for index in range(self._slots_per_file):
            words = flat[index * SLOT_BYTES :][: HEADER_WORDS * 8].view(torch.int64).numpy()
            words[:] = 0
            words[0] = HEADER_MAGIC
            words[1] = STATE_DROPPED
            if index:
                self._free.append(HeaderSlot(file, index * SLOT_BYTES, words))
        self._free.reverse()  # the lowest offsets first
