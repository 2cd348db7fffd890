from __future__ import annotations

import os
import random

from shardckpt.format.checksum import crc32c, crc32c_combine, tensor_crc_term


def test_combine_matches_crc_of_concatenation():
    rng = random.Random(0)
    for _ in range(50):
        a, b = os.urandom(rng.randint(0, 300)), os.urandom(rng.randint(0, 3000))
        assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)


def test_terms_xor_to_whole_crc_in_any_order():
    data = os.urandom(10_000)
    cuts = sorted(random.Random(1).sample(range(1, len(data)), 7))
    bounds = list(zip([0] + cuts, cuts + [len(data)]))
    terms = [tensor_crc_term(crc32c(data[a:b]), len(data) - b) for a, b in bounds]
    random.Random(2).shuffle(terms)
    acc = 0
    for t in terms:
        acc ^= t
    assert acc == crc32c(data)


def test_equal_pieces_combine_to_the_crc_of_the_whole():
    from shardckpt.format.checksum import combine_equal_pieces

    data = bytes((i * 7919 + 13) % 251 for i in range(10007))
    for n in (0, 1, 16, 10000, 10007):
        whole = data[:n]
        for piece in (1, 7, 16, 1000, 5000, 10000, 10007, 20000):
            crcs = [crc32c(whole[i:i + piece]) for i in range(0, n, piece)]
            assert combine_equal_pieces(crcs, piece, n) == crc32c(whole), (n, piece)


def test_a_shift_used_often_is_looked_up_in_a_table_and_gives_the_same_crc(monkeypatch):
    from shardckpt.format import checksum

    monkeypatch.setattr(checksum, "_hot_tables", {})
    monkeypatch.setattr(checksum, "_uses", {})
    rng = random.Random(3)
    tail_lengths = (1, 7, 256, 4097, 1 << 20)
    for round_ in range(3 * checksum._HOT_AFTER):
        for n in tail_lengths:
            a, crc_b = os.urandom(rng.randint(1, 64)), rng.getrandbits(32)
            want = checksum._multmodp(checksum._x8n(n), crc32c(a))  # the 32-step product, by definition
            assert checksum.crc32c_shift(crc32c(a), n) == want, (round_, n)
            assert crc32c_combine(crc32c(a), crc_b, n) == want ^ crc_b
    assert set(checksum._hot_tables) == set(tail_lengths)  # each became hot and was then used ~2x as often
    for wide in (-1, -(1 << 33), 1 << 32):  # not a CRC: the product path (the table would wrap or raise IndexError)
        assert checksum.crc32c_shift(wide, 256) == checksum._multmodp(checksum._x8n(256), wide)
    b = os.urandom(4097)
    a = os.urandom(33)
    assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)  # the hot path against real bytes
