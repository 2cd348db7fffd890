"""``HeldPiece``: a small chunk whose bytes are in memory only until the next piece of its file is asked for
(``convert``'s small chunks, read in runs). The writer writes one before it asks for the next, and writes the bytes,
records and checksum terms a staged piece of the same values gets, on every path (the small-chunk loop, the general
one when blocks are smaller than the chunk, compressed)."""
from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch

from shardckpt.checkpoint import writer
from shardckpt.checkpoint.collect import LocalPiece
from shardckpt.checkpoint.save_plan import WriteTask
from shardckpt.checkpoint.writer import HeldPiece, write_data_file
from shardckpt.format.codecs import Compression
from shardckpt.format.index import parse_index
from shardckpt.io import LocalStorage
from shardckpt.regions import FlatRange
from shardckpt.tensor_views import as_bytes, host_memory


def _values() -> dict[str, tuple[torch.Tensor, tuple[int, ...], FlatRange]]:
    """Each piece's values, its tensor's shape and its region: whole tensors of several dtypes, a flat part not at
    the tensor's start (its checksum term is shifted), a one-element part, and one past ``SMALL_WRITE``."""
    g = torch.Generator().manual_seed(11)
    whole = {"f32": torch.randn(3, 5, generator=g), "f64": torch.tensor([2.5], dtype=torch.float64),
             "bool": torch.rand(7, generator=g) > 0.5, "bf16": torch.randn(2, 3, generator=g).bfloat16(),
             "c64": torch.randn(4, dtype=torch.complex64, generator=g), "i8": torch.arange(11, dtype=torch.int8),
             "big": torch.randn(40_000, generator=g)}
    out = {n: (t, tuple(t.shape), FlatRange(0, t.numel())) for n, t in whole.items()}
    out["part"] = (torch.randn(6, generator=g), (4, 5), FlatRange(7, 13))
    out["one"] = (torch.randn(1, generator=g), (4, 5), FlatRange(19, 20))
    return out


class _Reused(Mapping):
    """Held pieces whose bytes are all in one buffer that the next piece asked for overwrites (as a run's buffer is
    given back and taken again): a held piece not written before the next is asked for is written wrong."""

    def __init__(self, values: dict):
        self.values, self.buffer = values, torch.empty(1 << 20, dtype=torch.uint8)

    def __getitem__(self, name: str) -> HeldPiece:
        data, shape, region = self.values[name]
        raw = as_bytes(data.reshape(-1))
        self.buffer.fill_(0xA5)  # what the previous piece held is gone
        self.buffer[:raw.numel()].copy_(raw)
        return HeldPiece(name, data.dtype, shape, region, host_memory(self.buffer)[:raw.numel()])

    def __contains__(self, name: object) -> bool:
        return name in self.values

    def __iter__(self):
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)


def _staged(values: dict) -> dict[str, LocalPiece]:
    return {n: LocalPiece(n, t.reshape(-1).clone(), shape, region, False) for n, (t, shape, region) in values.items()}


@pytest.mark.parametrize("path", ["small loop", "general (blocks smaller than a chunk)", "compressed"])
def test_held_pieces_are_written_as_staged_pieces_of_their_values_are(tmp_path, monkeypatch, path):
    if path.startswith("general"):
        monkeypatch.setattr(writer, "BLOCK_SIZE", 16)  # every chunk of several blocks: the general path
    compression = Compression.parse("zstd") if path == "compressed" else None
    values = _values()
    storage = LocalStorage(str(tmp_path))
    tasks = [WriteTask(name, 0) for name in values]
    held = write_data_file(storage, "h.bin", "h.index.json", tasks, _Reused(values), compression)
    staged = write_data_file(storage, "s.bin", "s.index.json", tasks, _staged(values), compression)
    assert held[1] == staged[1]  # every tensor's checksum term
    assert (tmp_path / "h.bin").read_bytes() == (tmp_path / "s.bin").read_bytes()
    assert (tmp_path / "h.index.json").read_bytes() == (tmp_path / "s.index.json").read_bytes()
    version = 3 if compression else 2
    records = parse_index((tmp_path / "h.index.json").read_bytes(), version, held[0].size, "h")
    assert list(records) == [(name, 0) for name in values]


def test_the_writer_tells_the_index_it_wrote(tmp_path):
    """``Followed.indexed`` hears the index's bytes once written: a finished journal carries them as they are."""
    values = _values()
    storage = LocalStorage(str(tmp_path))
    told = []
    write_data_file(storage, "h.bin", "h.index.json", [WriteTask(n, 0) for n in values], _Reused(values),
                    followed=writer.Followed(indexed=told.append))
    assert told == [(tmp_path / "h.index.json").read_bytes()]


def test_a_resumed_convert_reads_only_the_chunks_it_did_not_keep_and_counts_each_once(tmp_path, monkeypatch):
    """A rerun after a kill reads from the source only the small chunks the killed run's files do not keep, and its
    progress counts every byte once: it never passes the total, and ends on it."""
    import shardckpt
    from shardckpt.checkpoint.verify import verify
    from shardckpt.offline import resume
    from tests.convert._kill import killed_after
    from tests.convert._spy import spy_reads

    monkeypatch.setattr(writer, "COALESCE_BYTES", 16 << 10)
    monkeypatch.setattr(resume, "JOURNAL_BYTES", 0)  # a journal after every write the file holds
    sd = {f"layers.{i}.w": torch.randn(4, 33, generator=torch.Generator().manual_seed(i)) for i in range(400)}
    src, dst = tmp_path / "src", tmp_path / "dst"
    shardckpt.save(sd, src)
    options = {"world_size": 2, "files_per_rank": 1}
    killed_after(3, writer._Coalesced, "_flush", lambda: shardckpt.convert(src, dst, **options))
    requested = []
    spy_reads(monkeypatch, lambda reads: requested.extend(name for name, _ in reads))
    told = []
    report = shardckpt.convert(src, dst, progress=lambda done, total: told.append((done, total)), **options)
    chunk = 2 * 33 * 4  # every chunk: two rows of one tensor
    assert report.kept_bytes > 0 and report.kept_bytes % chunk == 0
    assert len(requested) == 2 * len(sd) - report.kept_bytes // chunk
    total = told[-1][1]
    assert total == 2 * len(sd) * chunk and told[-1][0] == total
    assert all(a[0] <= b[0] <= total for a, b in zip(told, told[1:]))
    assert verify(dst).ok and shardckpt.diff(src, dst).equal
