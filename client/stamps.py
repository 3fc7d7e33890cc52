"""Stamps: what tells, without reading a tensor's bytes, that they are the bytes read before.

torch counts every in-place write it dispatches to a tensor, or to any view sharing its storage and counter, in
the tensor's version counter (`Tensor._version`, the counter autograd checks its saved tensors against: an
optimizer's step, `copy_`, `load_state_dict` all count). A stamp keeps that count with the tensor's storage, by
weak reference (a storage freed and another one made at the same address is not the same), and where the view
lies in it. A tensor whose stamp matches the one taken when its bytes were last read has, as far as torch knows,
the same bytes. A DTensor's in-place ops (an optimizer's step on FSDP2's or tensor parallelism's parameters)
count in the DTensor's own counter, not in its local tensor's (the local op runs below autograd's dispatch), so
the stamp of a local piece keeps the counts of both: the piece's and its `counter`, the tensor of the state dict
it was cut from.

Writes torch does not dispatch are not counted: through `.data` (another counter), numpy or DLPack views of the
memory, torch.distributed collectives into the tensor (all_reduce and broadcast leave the counter as it was),
kernels writing through a pointer. This is why a delta put trusts stamps only when asked
(`delta="version_counters"`); a tensor without a counter (made under `torch.inference_mode`) has no stamp.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from shardserve.client import arguments

TRUSTING = "version_counters"  # the delta mode that trusts stamps


@dataclass(frozen=True, eq=False)
class Stamp:
    """One tensor's storage (weakly), the place of its view in it, and its version counter's count."""

    storage: weakref.ref[torch.UntypedStorage]
    place: tuple[Any, ...]  # data pointer, storage offset, shape, strides, dtype, device
    version: tuple[int, int]  # the tensor's count and its counter's

    @classmethod
    def of(cls, tensor: torch.Tensor, counter: torch.Tensor | None = None) -> Stamp | None:
        """The stamp of `tensor` now, with the count of `counter` too (the DTensor or other wrapper `tensor` is a
        local piece of; None: `tensor` alone); None for one without a counter or whose storage cannot be
        referenced."""
        try:
            version = (tensor._version, counter._version if counter is not None else 0)
            storage = weakref.ref(tensor.untyped_storage())
        except (RuntimeError, TypeError, NotImplementedError):
            return None
        place = (
            tensor.data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
            tensor.dtype,
            tensor.device,
        )
        return cls(storage, place, version)

    def matches(self, other: Stamp | None) -> bool:
        """Whether `other` is of the same live storage and place with no write counted since this one."""
        if other is None:
            return False
        storage = self.storage()
        return (
            storage is not None
            and storage is other.storage()
            and self.place == other.place
            and self.version == other.version
        )


def delta_mode(value: Any) -> tuple[bool, bool]:
    """(whether a put is a delta put, whether it trusts version counters) of a `delta` argument: True, False or
    "version_counters"; INVALID_ARGUMENT for any other value."""
    mode = arguments.flag_or_word(value, "delta", TRUSTING)
    return mode is not False, mode == TRUSTING
