"""A data file's chunk index (``<data file>.index.json``): where each chunk sits, and its checksums.

From format v2 every chunk also carries one CRC32C per ``block_size`` bytes of its stored bytes, so that
a read of part of a chunk checks whole blocks around the wanted bytes instead of trusting them. Format v3
adds compressed codecs: a chunk's ``length``, CRC and block CRCs are then of its logical (decoded) bytes,
and a frame table gives the stored length of each block's frame (``format.codecs``).
"""
from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field

from shardckpt.errors import CorruptCheckpointError
from shardckpt.format.codecs import MAX_RATIO, RAW, codec_named
from shardckpt.format.validate import (
    MAX_BYTES,
    MAX_NUMEL,
    check_fields,
    get_field,
    get_int,
    get_list,
    int_field,
    parse_json,
)

INDEX_FORMAT_NAME = "shardckpt-index"
# 1 MiB: a partial read checks at most two extra partial blocks per chunk (2% more bytes in the ws 2 -> 3
# load of benchmarks/bench_reshard_load.py, where 256 KiB and 1 MiB load in the same time and 4 MiB is
# slower), and the index grows by ~13 bytes per MiB of data (46 at 256 KiB).
BLOCK_SIZE = 1 << 20
MAX_BLOCK_SIZE = 1 << 31
MIN_ROW_BYTES = 16  # no row is shorter: ["",0,0,1,0,"raw"] is 18 bytes, and v2 adds its block CRCs
ROW_WIDTH = {1: 6, 2: 7, 3: 8, 4: 8, 5: 9, 6: 9}  # v2 adds block CRCs, v3 the frame table, v5 the chunk digest
_DIGEST = re.compile(r"^[0-9a-f]{32}$")


@dataclass(slots=True, unsafe_hash=True)
class ChunkRecord:
    """Where one chunk sits in a data file, with the CRC32C of all of its bytes and of each block.

    ``length`` and the CRCs are of the chunk's logical bytes (for ``raw``, the stored bytes). A format v1
    record has no block CRCs: it is treated as one block, the whole chunk.

    Made for every chunk of every index read and every chunk written (one per small tensor), so it is a slotted
    dataclass with plain assignments in its ``__init__``: 0.3 us against a frozen one's 0.85 (a frozen ``__init__``
    goes through ``object.__setattr__`` per field). Nothing assigns to a record once it is made.
    """

    offset: int
    length: int
    crc32c: int
    codec: str
    block_size: int
    blocks: tuple[int, ...]  # CRC32C of logical bytes [k*block_size, (k+1)*block_size), clipped to length
    frames: tuple[int, ...] = ()  # stored bytes of block k's frame; empty for raw
    digest: bytes | None = None  # v5: the keyed BLAKE3-128 of the logical bytes (format.content_hash), if hashed
    _starts: tuple[int, ...] | None = field(default=None, init=False, repr=False, compare=False, hash=False)

    def block_bounds(self, lo: int, hi: int) -> tuple[int, int]:
        """The smallest run of whole blocks holding logical bytes ``[lo, hi)``, as byte bounds in the chunk."""
        b = self.block_size
        return lo // b * b, min(-(-hi // b) * b, self.length)

    @property
    def stored_length(self) -> int:
        return self.frame_starts[-1] if self.frames else self.length

    @property
    def frame_starts(self) -> tuple[int, ...]:
        """Where each frame starts in the chunk's stored bytes, and (last) where the last one ends (found once:
        readers index it in loops over the frames)."""
        if self._starts is None:
            self._starts = (0, *itertools.accumulate(self.frames))
        return self._starts


def index_to_bytes(records: dict[tuple[str, int], ChunkRecord], version: int, block_size: int) -> bytes:
    """The index of one data file; every record's blocks are ``block_size`` bytes (the last may be shorter)."""
    if version < 3 and any(r.frames for r in records.values()):
        raise ValueError("compressed chunks need format version 3")
    width = ROW_WIDTH[version]  # a row's fields, cut to the version's (tuples are JSON arrays)
    rows = [(name, i, r.offset, r.length, r.crc32c, r.codec, r.blocks, r.frames,
             r.digest.hex() if r.digest is not None else None)[:width] for (name, i), r in records.items()]
    return json.dumps({"format": INDEX_FORMAT_NAME, "version": version, "block_size": block_size, "chunks": rows},
                      separators=(",", ":")).encode()


def _record(row, version: int, block_size: int, file_size: int, where: str) -> tuple[str, int, ChunkRecord]:
    width = ROW_WIDTH.get(version, 8)
    if not (isinstance(row, list) and len(row) == width and isinstance(row[0], str)):
        raise CorruptCheckpointError(f"{where}: malformed chunk row {str(row)[:80]} (a row has {width} fields)")
    rec = _plain_record(row, version, block_size) if version >= 2 else None
    if rec is None:
        rec = _checked_record(row, version, block_size, where)
    name, i, offset = row[0], row[1], row[2]
    if offset + rec.stored_length > file_size:
        raise CorruptCheckpointError(f"{where}: tensor {name!r} chunk {i} runs past the end of the data file "
                                     f"({offset}+{rec.stored_length} > {file_size} bytes)")
    return name, i, rec


def _plain_record(row: list, version: int, block_size: int) -> ChunkRecord | None:
    """The common row, a raw chunk of one block with every number in range, read without making the error texts
    of ``_checked_record`` (a microsecond or two per row: an index of 100k small chunks); None for any other
    row, which ``_checked_record`` reads (or refuses). JSON gives ``int`` for every integer, ``bool`` for
    true/false: ``type(x) is int`` admits exactly what ``get_int`` does."""
    i, offset, length, crc, codec, blocks = row[1:7]
    if not (codec == RAW and type(i) is int and type(offset) is int and type(length) is int and type(crc) is int
            and 0 <= i <= MAX_NUMEL and 0 <= offset <= MAX_BYTES and 1 <= length <= block_size
            and length <= MAX_BYTES and 0 <= crc <= 0xFFFFFFFF and type(blocks) is list and len(blocks) == 1):
        return None
    block_crc = blocks[0]
    if type(block_crc) is not int or not 0 <= block_crc <= 0xFFFFFFFF:
        return None
    if (version >= 3 and row[7] != []) or (version >= 5 and row[8] is not None):
        return None
    return ChunkRecord(offset, length, crc, RAW, block_size, (block_crc,))


def _checked_record(row: list, version: int, block_size: int, where: str) -> ChunkRecord:
    """A row's record, every field checked; errors name the field."""
    name = row[0]
    at = f"{where}: tensor {name!r} row"
    i = get_int(row[1], f"{at} chunk number", 0, MAX_NUMEL)
    offset, length = get_int(row[2], f"{at} offset"), get_int(row[3], f"{at} length", 1)
    crc = get_int(row[4], f"{at} crc32c", 0, 0xFFFFFFFF)
    codec = codec_named(row[5], f"{where}: tensor {name!r} chunk {i}")
    if version < 3 and codec != RAW:
        raise CorruptCheckpointError(f"{where}: tensor {name!r} chunk {i}: codec {codec!r} needs format v3")
    if version == 1:
        return ChunkRecord(offset, length, crc, codec, length, (crc,))
    blocks = row[6]
    if not isinstance(blocks, list) or len(blocks) != -(-length // block_size):
        raise CorruptCheckpointError(f"{where}: tensor {name!r} chunk {i}: expected one block CRC per "
                                     f"{block_size} bytes of its {length}")
    crcs = tuple(get_int(c, f"{at} block CRC", 0, 0xFFFFFFFF) for c in blocks)
    frames = _frames(row[7], codec, length, block_size, f"{where}: tensor {name!r} chunk {i}") if version >= 3 else ()
    return ChunkRecord(offset, length, crc, codec, block_size, crcs, frames, _digest(row, version, at))


def _digest(row: list, version: int, where: str) -> bytes | None:
    """A v5 row's 9th value: the chunk's digest, 32 lowercase hex digits, or null (not hashed)."""
    if version < 5 or row[8] is None:
        return None
    if not isinstance(row[8], str) or not _DIGEST.match(row[8]):
        raise CorruptCheckpointError(f"{where} digest: 32 lowercase hex digits or null, got {str(row[8])[:80]!r}")
    return bytes.fromhex(row[8])


def _frames(table, codec: str, length: int, block_size: int, where: str) -> tuple[int, ...]:
    """A v3 frame table: empty for ``raw``; else one stored length per block, from the least a zstd frame
    of that block could take (its length / ``MAX_RATIO``) to the block's length (stored as it is)."""
    if not isinstance(table, list) or len(table) != (0 if codec == RAW else -(-length // block_size)):
        raise CorruptCheckpointError(f"{where}: codec {codec!r} needs " +
                                     ("an empty frame table" if codec == RAW else "one frame length per block"))
    frames = []
    for k, n in enumerate(table):
        block = block_size if k < len(table) - 1 else length - k * block_size
        frames.append(get_int(n, f"{where} frame {k} length", -(-block // MAX_RATIO), block))
    return tuple(frames)


def parse_index(data: bytes, version: int, file_size: int, where: str) -> dict[tuple[str, int], ChunkRecord]:
    """Parse a chunk index written at manifest format ``version`` for a data file of ``file_size`` bytes."""
    doc = parse_json(data, where)
    if version >= 2:
        check_fields(doc, ("format", "version", "block_size", "chunks"), (), where)
    if get_field(doc, "format", where) != INDEX_FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: not a shardckpt chunk index")
    if int_field(doc, "version", where, 1, 1 << 31) != version:
        raise CorruptCheckpointError(f"{where}: index version {doc['version']} differs from the manifest's "
                                     f"format version {version}")
    block_size = int_field(doc, "block_size", where, 1, MAX_BLOCK_SIZE) if version >= 2 else 0
    out: dict[tuple[str, int], ChunkRecord] = {}
    stored = 0
    for row in get_list(doc, "chunks", where):
        name, i, rec = _record(row, version, block_size, file_size, where)
        if (name, i) in out:
            raise CorruptCheckpointError(f"{where}: tensor {name!r} chunk {i} is listed twice")
        out[(name, i)] = rec
        stored += rec.stored_length
    # Chunks do not overlap, so together they fit in the file: what the rows claim is backed by real bytes.
    if stored > file_size:
        raise CorruptCheckpointError(f"{where}: its chunks' stored bytes add up to {stored}, more than the "
                                     f"{file_size} of the data file (chunks overlap)")
    return out
