"""CRC32C of stored chunks, and a per-tensor checksum that does not depend on how the tensor was sharded.

The tensor checksum is the CRC32C of the tensor's whole row-major byte string. A CRC is linear, so
``crc(A || B) = shift(crc(A), len(B)) ^ crc(B)`` (zlib's ``crc32_combine``). Unrolled over pieces
``P_1 .. P_k`` that tile the tensor, ``crc(tensor) = XOR_i shift(crc(P_i), bytes after P_i)``: each
piece contributes a term on its own, in any order, so ranks combine their terms with a plain XOR.
"""
from __future__ import annotations

import functools
from typing import Iterable, Iterator

import crc32c as _crc32c

_POLY = 0x82F63B78  # CRC32C (Castagnoli), reflected


# crc32c(data, value=0): the CRC32C of a bytes-like object, optionally continuing from ``value`` (hardware-
# accelerated); the C function itself, not a wrapper: it is called once per small chunk read or written.
crc32c = _crc32c.crc32c


def _multmodp(a: int, b: int) -> int:
    """Multiply two polynomials modulo the CRC polynomial (reflected bit order)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


def crc32c_shift(crc: int, nbytes: int) -> int:
    """``crc`` as if ``nbytes`` more bytes followed, minus their own contribution (x^(8n) mod P)."""
    if not crc or not nbytes:  # zero stays zero; no shift is the identity (many small chunks take this path)
        return crc
    table = _hot_tables.get(nbytes)
    if table is not None and 0 <= crc <= 0xFFFFFFFF:  # (a CRC is 32 bits: anything wider is a caller's bug, not an index)
        return shift_by_table(crc, table)
    _count_use(nbytes)
    return _multmodp(_x8n(nbytes), crc)


# A shift used this often gets a table (four lookups, not a 32-step product): a conversion of many alike tensors
# shifts every chunk by one of a few lengths. Both maps are bounded; a race between threads only costs a count.
_HOT_AFTER = 32
_hot_tables: dict[int, list[list[int]]] = {}
_uses: dict[int, int] = {}


def _count_use(nbytes: int) -> None:
    uses = _uses[nbytes] = _uses.get(nbytes, 0) + 1
    if uses == _HOT_AFTER:
        if len(_hot_tables) >= 256:
            _hot_tables.clear()
        _hot_tables[nbytes] = shift_table(nbytes)
    if len(_uses) >= 4096:
        _uses.clear()


@functools.lru_cache(maxsize=4096)  # a tensor's chunks (and a model's many alike tensors) repeat their shifts
def _x8n(nbytes: int) -> int:
    """x^(8 * nbytes) mod P."""
    k, p = 3, 1 << 31  # x^0; bytes are 2^3 bits
    while nbytes:
        if nbytes & 1:
            p = _multmodp(_X2N[k & 31], p)
        nbytes >>= 1
        k += 1
    return p


def shift_table(nbytes: int) -> list[list[int]]:
    """Tables that shift a CRC by a fixed ``nbytes`` in four lookups: the shift is linear in the CRC's bits, so each
    entry is one XOR of an entry before it and one of the 32 one-bit products."""
    factor, tables = _x8n(nbytes), []
    for k in range(4):
        basis = [_multmodp(factor, 1 << (8 * k + bit)) for bit in range(8)]
        table = [0] * 256
        for b in range(1, 256):
            low = b & -b
            table[b] = table[b ^ low] ^ basis[low.bit_length() - 1]
        tables.append(table)
    return tables


def shift_by_table(crc: int, table: list[list[int]]) -> int:
    return table[0][crc & 255] ^ table[1][(crc >> 8) & 255] ^ table[2][(crc >> 16) & 255] ^ table[3][crc >> 24]


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of ``A || B`` from the CRCs of ``A`` and ``B`` and the length of ``B``."""
    return crc32c_shift(crc_a, len_b) ^ crc_b


def tensor_crc_term(piece_crc: int, bytes_after: int) -> int:
    """One contiguous byte run's term in its tensor's checksum: XOR all terms of a tiling to get the CRC."""
    return crc32c_shift(piece_crc, bytes_after) if bytes_after else piece_crc  # (a tensor's last run: no shift)


def runs_crc_term(runs: list[tuple[int, int, int]], run_crcs: list[int], itemsize: int, numel: int) -> int:
    """A chunk's term of its tensor's checksum from its runs ``(global start, local start, elements)``
    (``regions.contiguous_runs``) and the CRC32C of each run's bytes."""
    total, term = numel * itemsize, 0
    for (start, _, n), run_crc in zip(runs, run_crcs):
        term ^= tensor_crc_term(run_crc, total - (start + n) * itemsize)
    return term


def xor_terms(terms: list[dict[str, int]]) -> dict[str, int]:
    """By tensor name, the XOR of the terms of several parts (a rank's files, a checkpoint's ranks): what each part
    adds to a tensor's checksum combined (the one part's own dict when there is one)."""
    if len(terms) == 1:
        return terms[0]
    out: dict[str, int] = {}
    for part in terms:
        for name, term in part.items():
            out[name] = out.get(name, 0) ^ term
    return out


class SegmentedCRC:
    """CRC32C of consecutive segments of a byte stream fed piece by piece (segment lengths given in order),
    e.g. the checksum blocks of a chunk read into several buffers."""

    def __init__(self, lengths: Iterable[int]):
        self._lengths: Iterator[int] = iter(lengths)
        self._left = next(self._lengths, 0)
        self._crc = 0
        self.crcs: list[int] = []

    def feed(self, data) -> None:
        data = memoryview(data).cast("B")
        pos = 0
        while pos < len(data) and self._left:
            take = min(self._left, len(data) - pos)
            self._crc = crc32c(data[pos:pos + take], self._crc)
            pos, self._left = pos + take, self._left - take
            if not self._left:
                self.crcs.append(self._crc)
                self._crc, self._left = 0, next(self._lengths, 0)


@functools.lru_cache(maxsize=4)
def _block_shift(block_size: int) -> list[list[int]]:
    return shift_table(block_size)


def combine_block_crcs(blocks: list[int] | tuple[int, ...], length: int, block_size: int) -> int:
    """The CRC32C of ``length`` bytes from those of its ``block_size`` blocks (all full but the last)."""
    if len(blocks) == 1:  # a chunk of one block (every small tensor): its CRC, no table
        return blocks[0]
    crc, table = 0, _block_shift(block_size)
    for block_crc in blocks[:-1]:
        crc = shift_by_table(crc, table) ^ block_crc
    return crc32c_combine(crc, blocks[-1], length - (len(blocks) - 1) * block_size) if blocks else 0


@functools.lru_cache(maxsize=64)
def _shift_factor(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial: ``crc32c_shift(c, nbytes) == _multmodp(factor, c)``."""
    return crc32c_shift(1 << 31, nbytes)  # 1 << 31 is x^0 in the reflected order


def combine_equal_pieces(crcs: list[int] | tuple[int, ...], piece: int, length: int) -> int:
    """The CRC32C of ``length`` bytes from those of its consecutive pieces of ``piece`` bytes each (the last may
    be shorter): one polynomial product per piece, with no table to build (``combine_block_crcs`` builds one)."""
    if len(crcs) <= 1:
        return crcs[0] if crcs else 0
    crc, factor = 0, _shift_factor(piece)
    for piece_crc in crcs[:-1]:
        crc = _multmodp(factor, crc) ^ piece_crc
    last = length - (len(crcs) - 1) * piece
    return (_multmodp(factor, crc) if last == piece else crc32c_shift(crc, last)) ^ crcs[-1]
