"""A checked request says once whether its destination takes stored bytes as they are (``CheckedRequest.as_stored``:
CPU memory of the tensor's dtype, neither lazily conjugated nor negated); readers copy bytes straight in only then.
Every other destination is filled through ``copy_``, which casts and resolves the lazy views: each reader is held to
the values here, whole and in part."""
from __future__ import annotations

import pytest
import torch

from tests.formats._save_as import save_as
from shardckpt.formats.api import ReadRequest, TensorInfo
from shardckpt.formats.detect import open_reader
from shardckpt.formats.requests import check_request
from shardckpt.regions import FlatRange

Z = torch.tensor([1 + 2j, 3 - 4j, -5 + 0.5j, 7j], dtype=torch.complex64)
F = torch.tensor([1.5, -2.0, 0.25, 8.0])
STATE = {"z": Z, "f": F}


def _destinations(n: int) -> dict[str, tuple[torch.Tensor, bool, callable]]:
    """name -> (a destination for ``f`` or ``z``'s first ``n`` elements, whether bytes may go in as stored, how to
    read back what it holds)."""
    return {
        "plain": (torch.zeros(n), True, lambda t: t),
        "neg": (torch._neg_view(torch.zeros(n)), False, lambda t: t.resolve_neg()),
        "double": (torch.zeros(n, dtype=torch.float64), False, lambda t: t.float()),
        "conj": (torch.zeros(n, dtype=torch.complex64).conj(), False, lambda t: t.resolve_conj()),
        "zplain": (torch.zeros(n, dtype=torch.complex64), True, lambda t: t),
        "grad": (torch.zeros(n, requires_grad=True), True, lambda t: t.detach()),
    }


def test_check_request_finds_whether_a_destination_takes_stored_bytes():
    infos = {"f": TensorInfo("f", torch.float32, (4,), None), "z": TensorInfo("z", torch.complex64, (4,), None)}
    for kind, (dest, as_stored, _) in _destinations(4).items():
        name = "z" if dest.is_complex() else "f"
        checked = check_request(infos, ReadRequest(name, FlatRange(0, 4), dest), "here")
        assert checked.as_stored is as_stored, kind
    meta = check_request(infos, ReadRequest("f", FlatRange(0, 0), torch.empty(0, device="meta")), "here")
    assert meta.as_stored is False


@pytest.mark.parametrize("fmt", ["shardckpt", "torch", "safetensors", "dcp"])
@pytest.mark.parametrize("region", [FlatRange(0, 4), FlatRange(1, 3)], ids=["whole", "part"])
def test_every_reader_fills_each_kind_of_destination_with_the_stored_values(tmp_path, fmt, region):
    path = str(tmp_path / ("ck.safetensors" if fmt == "safetensors" else "ck.pt" if fmt == "torch" else "ck"))
    save_as(fmt, STATE, path)
    for kind, (dest, _, back) in _destinations(region.numel).items():
        name = "z" if dest.is_complex() else "f"
        open_reader(path).read([ReadRequest(name, region, dest)])
        want = STATE[name][region.start:region.stop]
        assert torch.equal(back(dest).to(want.dtype), want), (fmt, kind)
