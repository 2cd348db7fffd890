"""Checking read requests against a reader's tensors, shared by every reader.

An unknown tensor or a region outside
the tensor is an ``IncompatibleCheckpointError`` (the checkpoint does not hold what was asked for); a
destination that is not contiguous, has the wrong number of elements or a storage too small for them is the
caller's ``ValueError``.
A reader checks every request of a ``read`` call (``check_requests``) before it reads a single byte. The one
checked request, ``CheckedRequest``, is what every reader plans its reads from (shardckpt's own too).
"""
from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Sequence

import torch

from shardckpt.errors import IncompatibleCheckpointError
from shardckpt.formats.api import ReadRequest, TensorInfo
from shardckpt.regions import FlatRange, Region, canonical, check_region


class CheckedRequest(NamedTuple):
    """A request found sound: ``dest`` (contiguous, detached if autograd tracked it) holds ``region`` of ``info``'s
    tensor; ``flat`` is it as a 1-D view. ``region`` is canonical (``regions.canonical``: a box of consecutive elements,
    a dim-0 chunk say, is the flat range it is), once here rather than per chunk read. ``as_stored``: ``dest`` is CPU
    memory of the tensor's dtype, neither lazily conjugated nor negated, so stored bytes may be copied into it as they
    are (found once here, not per chunk read). (A named tuple: made per tensor of a load, in a third of a frozen
    dataclass's time.)"""

    info: TensorInfo
    region: Region
    dest: torch.Tensor
    as_stored: bool = False

    @property
    def flat(self) -> torch.Tensor:
        """``dest`` as a 1-D view, made when asked (a reshape costs ~1 us; a small tensor's copy needs only its
        address)."""
        dest = self.dest
        return dest if dest.dim() == 1 else dest.reshape(-1)


def check_request(infos: Mapping[str, TensorInfo], request: ReadRequest, where: str) -> CheckedRequest:
    """``request`` checked against ``infos`` (``where`` names the checkpoint in errors). An info is anything
    with the tensor's ``shape`` (shardckpt's own reader passes its manifest entries)."""
    info = infos.get(request.tensor)
    if info is None:
        raise IncompatibleCheckpointError(f"{where}: the checkpoint has no tensor {request.tensor!r}")
    region = request.region
    # A flat range inside the tensor (every request of load_full) is checked and canonical as it is: one comparison.
    if type(region) is not FlatRange or region.stop > math.prod(info.shape):
        try:
            check_region(region, info.shape)
        except ValueError as e:
            raise IncompatibleCheckpointError(f"tensor {request.tensor!r}: {e}") from None
        region = canonical(region, info.shape)
    dest = request.dest
    if not isinstance(dest, torch.Tensor):
        raise ValueError(f"destination for {request.tensor!r} must be a torch.Tensor, got {type(dest).__name__}")
    numel = dest.numel()
    if numel != region.numel or not dest.is_contiguous():
        raise ValueError(f"destination for {request.tensor!r} must be contiguous with {region.numel} elements")
    if numel:  # (an empty one has nothing to fill, as before)
        if dest.is_meta:
            raise ValueError(f"destination for {request.tensor!r} is on the meta device: it has no memory to load "
                             "into (materialize it first, e.g. module.to_empty(device=...), or use load_full)")
        # Its storage holds its elements: one resized below them after the tensor was made
        # (``untyped_storage().resize_``) would be written past its end (readers copy into its memory directly).
        need, have = (dest.storage_offset() + numel) * dest.element_size(), dest.untyped_storage().nbytes()
        if have < need:
            raise ValueError(f"destination for {request.tensor!r}: its storage holds {have} bytes, its elements "
                             f"need {need} (resized after the tensor was made?)")
    as_stored = dest.is_cpu and dest.dtype == info.dtype and not dest.is_conj() and not dest.is_neg()
    # Only a destination autograd tracks is detached (a call costs ~1 us, a load of 100k tensors 0.1 s).
    return CheckedRequest(info, region, dest.detach() if dest.requires_grad else dest, as_stored)


def check_requests(infos: Mapping[str, TensorInfo], requests: Sequence[ReadRequest],
                   where: str) -> list[CheckedRequest]:
    """Every request checked, in order; the first bad one raises (nothing has been read by then)."""
    return [check_request(infos, r, where) for r in requests]
