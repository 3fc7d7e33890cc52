"""Which pages of an address range this process's page tables map now: what a test of "not faulted in" reads."""

from __future__ import annotations

import torch


def resident_bytes_at(address: int, nbytes: int) -> int:
    """The bytes of this process's mappings within [address, address + nbytes) that have pages mapped now
    (/proc/self/smaps Rss of the mappings there)."""
    resident, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, stop = (int(part, 16) for part in head.split("-"))
                inside = start < address + nbytes and address < stop
            elif inside and head == "Rss:":
                resident += int(line.split()[1]) * 1024
    return resident


def resident_bytes(tensor: torch.Tensor) -> int:
    """resident_bytes_at over `tensor`'s bytes."""
    return resident_bytes_at(tensor.data_ptr(), tensor.numel() * tensor.element_size())
