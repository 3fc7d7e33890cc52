"""Which of a tensor's pages this process's page tables map now: what a test of "not faulted in" reads."""

from __future__ import annotations

import torch


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of `tensor`'s address range that this process's page tables map now (/proc/self/smaps Rss)."""
    start = tensor.data_ptr()
    stop = start + tensor.numel() * tensor.element_size()
    resident, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low < stop and high > start
            elif head == "Rss:" and inside:
                resident += int(line.split()[1]) * 1024
    return resident
