"""``checkpoint.device_slices``: a device tensor's bytes handed to the writer a slice at a time (the slicing is the
same on any device: checked here on CPU tensors; tests/checkpoint/test_cuda.py runs it on a GPU)."""
from __future__ import annotations

import pytest
import torch

from shardckpt.checkpoint import device_slices as ds
from shardckpt.regions import Box, FlatRange


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64])
@pytest.mark.parametrize("numel,first", [(1, 0), (1000, 0), (1000, 256), (4096, 4095), (5000, 1024), (64, 64)])
def test_slices_reassemble_the_tensor_from_first_on_in_whole_blocks(monkeypatch, dtype, numel, first):
    monkeypatch.setattr(ds, "SLICE_BYTES", 1024)  # many slices from a small tensor
    block = 256
    data = torch.arange(numel).to(dtype)
    got, kept = [], []
    for piece in ds.device_slices(data)(block, first):
        kept.append(piece)  # each slice must be taken (written) before the next is asked for
        got.append(piece.clone())
    whole = torch.cat(got) if got else torch.empty(0, dtype=dtype)
    assert torch.equal(whole, data[first:])
    assert all(p.nbytes % block == 0 for p in got[:-1])
    assert all(p.nbytes <= max(1024 // block, 1) * block for p in got)


def test_only_contiguous_single_run_cuda_pieces_stay_on_the_device():
    # On CPU nothing stays on a device; the region rule is checked with a CPU tensor standing in.
    t = torch.zeros(4, 6)
    assert not ds.keeps_on_device(t, Box((0, 0), (4, 6)), (8, 6))

    class FakeCuda:
        def __init__(self, t):
            self.t, self.device = t, torch.device("cuda")

        def __getattr__(self, name):
            return getattr(self.t, name)

    assert ds.keeps_on_device(FakeCuda(t), Box((4, 0), (4, 6)), (8, 6))  # rows 4..7, whole: one run
    assert not ds.keeps_on_device(FakeCuda(t), Box((0, 0), (4, 6)), (4, 12))  # columns 0..5 of each row: 4 runs
    assert ds.keeps_on_device(FakeCuda(t.reshape(-1)), FlatRange(3, 24), (100,))
    assert not ds.keeps_on_device(FakeCuda(t.t()), Box((0, 0), (6, 4)), (6, 4))  # not contiguous
    assert not ds.keeps_on_device(FakeCuda(torch.zeros(0)), FlatRange(0, 0), (0,))
