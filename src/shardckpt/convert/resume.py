"""What lets ``convert`` and ``export`` resume after a kill: a source's identity, a deterministic name for a
conversion's output, and the check that a killed run's output files are whole.

A conversion's data directory is named by a hash of the source's identity and every option that shapes the
output (``conversion_generation``), so a rerun of the same command finds what the killed run wrote. An
output rank is kept when each of its data files has its index, the index lists exactly the planned chunks
with their planned lengths, and the data file ends where the records end (``finished_rank``): an index is
written only once its data file is durable (``checkpoint.writer``), so a kill cannot leave a whole-looking
rank with missing bytes. The values are not read back: the commit's manifest checksums are computed from
the indexes' CRCs, which were taken from the bytes as they were written.
"""
from __future__ import annotations

import hashlib
import json
import math
import uuid

from shardckpt.checkpoint.gc import committed_dir
from shardckpt.checkpoint.save import data_dir
from shardckpt.checkpoint.save_plan import SavePlan
from shardckpt.checkpoint.writer import RankResult
from shardckpt.errors import CheckpointError
from shardckpt.format.checksum import crc32c, runs_crc_term
from shardckpt.format.dtypes import DTYPES
from shardckpt.format.index import parse_index
from shardckpt.format.manifest import FileEntry, version_for
from shardckpt.formats.api import CheckpointReader
from shardckpt.io import Storage
from shardckpt.regions import contiguous_runs


def source_identity(reader: CheckpointReader) -> str | None:
    """What changes whenever the source's values may: a shardckpt checkpoint's generation (new at every save
    and convert). None for other formats: nothing in their files changes with every write, so their
    conversions and exports are never resumed, always redone."""
    manifest = getattr(reader, "manifest", None)
    return f"shardckpt-generation:{manifest.generation}" if manifest is not None else None


def conversion_generation(source: CheckpointReader, storage: Storage, options: dict) -> str:
    """The data directory's generation: a hash of the source's identity and ``options`` (what shapes the
    output), or a random one when the source has no identity or the committed checkpoint at ``storage``
    already has that generation (its files must not be written over)."""
    identity = source_identity(source)
    if identity is None:
        return uuid.uuid4().hex[:16]
    key = json.dumps([identity, options], sort_keys=True, default=str)
    generation = hashlib.sha256(key.encode()).hexdigest()[:16]
    try:
        taken = committed_dir(storage) == data_dir(generation)
    except CheckpointError:
        taken = True  # unreadable: take no chance with its files
    return uuid.uuid4().hex[:16] if taken else generation


def finished_rank(storage: Storage, plan: SavePlan, rank: int) -> RankResult | None:
    """Output rank ``rank``'s write result as a killed run of the same plan left it, if whole (see the module's
    docstring); None if anything is missing or differs: the rank is then written again."""
    base = f"{data_dir(plan.generation)}/rank-{rank:05d}"
    version = version_for(plan.compression is not None)
    files, terms = [], {}
    for slot in range(plan.files_per_rank):
        data_path, index_path = f"{base}-{slot}.bin", f"{base}-{slot}.index.json"
        try:
            if not (storage.exists(index_path) and storage.exists(data_path)):
                return None
            size = storage.file_size(data_path)
            index = storage.read_bytes(index_path)
            records = parse_index(index, version, size, storage.url(index_path))
        except CheckpointError:
            return None
        if set(records) != {(t.name, t.chunk) for t in plan.tasks[rank] if t.slot == slot}:
            return None
        end = 0
        for (name, chunk), record in records.items():
            tensor = plan.tensors[name]
            region, itemsize = tensor.regions[chunk], DTYPES[tensor.dtype].itemsize
            runs = list(contiguous_runs(region, tensor.shape))
            if record.length != region.numel * itemsize or len(runs) != 1:
                return None
            terms[name] = terms.get(name, 0) ^ runs_crc_term(runs, [record.crc32c], itemsize, math.prod(tensor.shape))
            end = max(end, record.offset + record.stored_length)
        if size != end:
            return None
        files.append(FileEntry(data_path, size, index_path, len(index), crc32c(index)))
    return RankResult(files, terms)
