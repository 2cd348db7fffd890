"""What of a data file a killed ``convert`` wrote can be kept: the longest prefix of what its journal claims
(``offline.resume.Claim``) that is what this plan puts there, in order, and whose every block is in the file and
matches its CRC32C (read back a buffer at a time, frames decoded). Nothing else is trusted: not the journal's
word that bytes were written (a kill or a crash can lose or tear them), not the index's."""
from __future__ import annotations

import math

import torch

from shardckpt.checkpoint.save_plan import SavePlan, WriteTask
from shardckpt.checkpoint.writer import ALIGN, FileProgress
from shardckpt.offline.resume import Claim
from shardckpt.errors import CheckpointError
from shardckpt.format.checksum import combine_block_crcs, crc32c, runs_crc_term
from shardckpt.format.codecs import RAW, FrameError, decode_frame
from shardckpt.format.dtypes import DTYPES
from shardckpt.checkpoint import writer as _writer  # its BLOCK_SIZE, read when used (tests shrink it)
from shardckpt.format.index import ChunkRecord
from shardckpt.io import Storage
from shardckpt.regions import contiguous_runs

Chunk = tuple[tuple[str, int], ChunkRecord, bool]  # (key, record, whole: False for the chunk in progress)


def kept_progress(storage: Storage, data_path: str, claim: Claim, tasks: list[WriteTask], plan: SavePlan,
                  buffer: torch.Tensor) -> FileProgress:
    """The progress to go on from: the checked prefix of ``claim`` (empty if nothing checks)."""
    out = FileProgress()
    try:
        size = storage.file_size(data_path)
    except CheckpointError:
        return out
    view = memoryview(buffer.numpy()).cast("B")
    for key, record, whole in _planned(claim, tasks, plan):
        planned = _codec(plan, key[0])
        good = _good_blocks(storage, data_path, size, record, record.codec if whole else planned,
                            DTYPES[plan.tensors[key[0]].dtype].itemsize, view)
        if whole and good == len(record.blocks):
            out.done[key], out.size = record, record.offset + record.stored_length
            continue
        # gone on with as the planned codec writes it: a frame per block (a raw chunk's blocks are frames as they are)
        frames = [] if planned == RAW else list(record.frames[:good]) if record.frames else [record.block_size] * good
        out.current, out.offset, out.blocks, out.frames = key, record.offset, list(record.blocks[:good]), frames
        out.size = record.offset + (sum(frames) if frames else good * record.block_size)
        break
    return out


def kept_bytes(progress: FileProgress) -> int:
    """The logical (decoded) bytes ``progress`` keeps."""
    return sum(r.length for r in progress.done.values()) + len(progress.blocks) * _writer.BLOCK_SIZE


def _codec(plan: SavePlan, name: str) -> str:
    return RAW if plan.compression is None else plan.compression.codec_for(DTYPES[plan.tensors[name].dtype])


def _planned(claim: Claim, tasks: list[WriteTask], plan: SavePlan) -> list[Chunk]:
    """The claimed chunks that are the plan's first tasks of this file, in order, where the plan places them
    (aligned one after another), of the planned lengths and codec; the chunk in progress made whole if it has
    all its blocks. Stops at the first that is not."""
    out: list[Chunk] = []
    pos = 0
    claimed = list(claim.done.items()) + ([claim.current] if claim.current is not None else [])
    for i, (key, record) in enumerate(claimed):
        if i >= len(tasks) or key != (tasks[i].name, tasks[i].chunk):
            break
        tensor = plan.tensors[key[0]]
        length = tensor.regions[key[1]].numel * DTYPES[tensor.dtype].itemsize
        codec, whole = _codec(plan, key[0]), i < len(claim.done)
        blocks = -(-length // _writer.BLOCK_SIZE)
        if record.offset != pos + (-pos % ALIGN) or record.block_size != _writer.BLOCK_SIZE:
            break
        if whole and (record.length != length or record.codec not in (RAW, codec) or len(record.blocks) != blocks
                      or record.crc32c != combine_block_crcs(record.blocks, length, record.block_size)):
            break  # the chunk's checksum is the blocks' (which are read back), never the journal's word alone
        if not whole:
            if len(record.blocks) > blocks or (codec != RAW and len(record.frames) != len(record.blocks)) or \
                    (codec == RAW and record.frames):
                break
            if len(record.blocks) == blocks:  # every block written: finished but for its record
                record, whole = _finished(record, length, codec), True
        out.append((key, record, whole))
        pos = record.offset + record.stored_length if whole else 0
    return out


def _finished(record: ChunkRecord, length: int, codec: str) -> ChunkRecord:
    """The record of a chunk whose every block was written, as the writer makes it (``raw`` if no frame shrank)."""
    raw = codec == RAW or sum(record.frames) >= length
    crc = combine_block_crcs(record.blocks, length, record.block_size)
    return ChunkRecord(record.offset, length, crc, RAW if raw else codec, record.block_size, record.blocks,
                       () if raw else record.frames)


def _good_blocks(storage: Storage, path: str, size: int, record: ChunkRecord, codec: str, itemsize: int,
                 buffer: memoryview) -> int:
    """How many of the record's blocks, from the first, are in the file (of ``size`` bytes) and check."""
    bs, n = record.block_size, len(record.blocks)
    stored = (lambda k: record.frames[k]) if record.frames else (lambda k: min(bs, record.length - k * bs))
    scratch = memoryview(bytearray(bs)) if record.frames else None
    k, at = 0, record.offset  # block k's stored bytes start at ``at``
    while k < n:
        j, end = k, at
        while j < n and (j == k or end + stored(j) - at <= len(buffer)):
            end += stored(j)
            j += 1
        if end > size:  # cut short: the blocks that are there
            j, end = _within(k, n, at, size, stored)
            if j == k:
                return k
        run = buffer[:end - at] if end - at <= len(buffer) else memoryview(bytearray(end - at))
        try:
            storage.read_into(path, at, run)
        except (CheckpointError, OSError):
            return k
        lo = 0
        for b in range(k, j):
            frame, logical = run[lo:lo + stored(b)], min(bs, record.length - b * bs) if record.frames else stored(b)
            if scratch is not None and len(frame) != logical:
                try:
                    decode_frame(codec, frame, itemsize, scratch[:logical])
                except FrameError:
                    return b
                frame = scratch[:logical]
            if crc32c(frame) != record.blocks[b]:
                return b
            lo += stored(b)
        k, at = j, end
    return n


def _within(k: int, n: int, at: int, size: int, stored) -> tuple[int, int]:
    """From block ``k`` (stored from ``at``): the end block and end byte of the blocks wholly before ``size``."""
    j, end = k, at
    while j < n and end + stored(j) <= size:
        end += stored(j)
        j += 1
    return j, end


def kept_chunk_terms(progress: FileProgress, plan: SavePlan) -> dict[str, int]:
    """Each tensor's checksum term from the chunks ``progress`` keeps whole (a convert chunk is one run)."""
    terms: dict[str, int] = {}
    for (name, chunk), record in progress.done.items():
        tensor = plan.tensors[name]
        runs = list(contiguous_runs(tensor.regions[chunk], tensor.shape))
        term = runs_crc_term(runs, [record.crc32c], DTYPES[tensor.dtype].itemsize, math.prod(tensor.shape))
        terms[name] = terms.get(name, 0) ^ term
    return terms
