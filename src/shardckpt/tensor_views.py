"""The torch side of region math: byte views of tensors and strided views of region pieces."""
from __future__ import annotations

import ctypes

import torch

from shardckpt.regions import StridedView


def view_of(buf: torch.Tensor, view: StridedView) -> torch.Tensor:
    """Apply ``view`` to the 1-D tensor ``buf`` (whose element 0 is the view's base)."""
    return buf.as_strided(view.size, view.stride, buf.storage_offset() + view.offset)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as a flat uint8 tensor, sharing memory (the tensor must be contiguous)."""
    if t.dtype == torch.uint8 and t.dim() == 1 and t.is_contiguous():  # already flat bytes (a staged piece's)
        return t if t.numel() != 1 or t.stride(0) == 1 else t.as_strided((1,), (1,))
    flat = t if t.dim() == 1 else t.reshape(-1)  # (a reshape costs a microsecond; 1-D is already flat)
    if flat.numel() == 1 and flat.stride(0) != 1:  # torch calls it contiguous; view(uint8) needs stride 1
        flat = flat.as_strided((1,), (1,))
    if flat.dtype == torch.uint8:
        return flat
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.view(torch.uint8)


def copy_into(dest: torch.Tensor, src: torch.Tensor) -> None:
    """``dest.copy_(src)``. A destination made under ``torch.inference_mode`` is written inside that mode, the only
    place torch lets an inference tensor change in place (the mode is per thread: readers copy in their workers)."""
    if dest.is_inference():
        with torch.inference_mode():
            dest.copy_(src)
    else:
        dest.copy_(src)


def from_bytes(raw: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Reinterpret a flat uint8 tensor as ``dtype`` with ``shape`` (no copy)."""
    if raw.numel() == 0:
        return torch.empty(shape, dtype=dtype, device=raw.device)
    return raw.view(dtype).reshape(shape)


# CPython's own constructor of a memoryview over an address: one call (~1 us), where a ctypes array type of the
# length, its instance and a cast cost up to 5 us (a save of 20k small tensors takes a view of each). A prototype of our
# own: ``ctypes.pythonapi.PyMemoryView_FromMemory`` is one object per process, whose argument types other packages
# set too (often with a 32-bit length, which would cut a view of 2 GiB or more).
_memory_view = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)(
    ("PyMemoryView_FromMemory", ctypes.pythonapi))
_WRITABLE = 0x200  # PyBUF_WRITE


def host_memory(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes (a writable, flat memoryview of format "B"), read in place through its
    address: unlike ``.numpy()``, this does not mark the caller's storage as not resizable (code that frees storage
    with ``resize_(0)`` keeps working). Like any view of an address, it must not outlive the tensor's storage."""
    return _memory_view(t.data_ptr(), t.nbytes, _WRITABLE)
