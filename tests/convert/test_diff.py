"""``diff``: two checkpoints of any readable formats, tensor by tensor and plain value by plain value."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import shardckpt
from shardckpt.cli.main import main
from shardckpt.offline.diff import diff


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(40, 30, generator=g), "b": torch.randn(30, generator=g).to(torch.bfloat16),
            "s": torch.tensor(1.5), "e": torch.empty(0, 4), "i": torch.arange(7, dtype=torch.int64)}


def test_a_checkpoint_equals_itself_by_checksum_without_reading(tmp_path):
    shardckpt.save({**_state(), "step": 3, "cfg": {"lr": float("nan"), "betas": (0.9, 0.99)}}, tmp_path / "a")
    report = diff(tmp_path / "a", tmp_path / "a")
    assert report.equal and report.tensors == 5 and report.by_checksum == 5 and report.bytes_read == 0
    assert report.plain_values == 2  # step, and cfg as one plain subtree (NaN equals NaN)


def test_the_same_state_in_another_format_is_equal(tmp_path):
    state = _state()
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "m.safetensors")
    torch.save(state, tmp_path / "m.pt")
    shardckpt.save(state, tmp_path / "ck")
    report = diff(tmp_path / "m.safetensors", tmp_path / "ck")
    assert report.equal, report.differences
    assert report.bytes_read == 2 * sum(t.nbytes for t in state.values())  # safetensors has no checksums
    assert diff(tmp_path / "m.pt", tmp_path / "m.safetensors").equal


@pytest.mark.parametrize("change, kind", [
    (lambda s: s["w"].view(-1).__setitem__(17, s["w"].view(-1)[17] + 1e-3), "values"),
    (lambda s: s["w"].view(-1).__setitem__(5, float("nan")), "values"),
    (lambda s: s.__setitem__("s", torch.tensor(-1.5)), "values"),
    (lambda s: s.__setitem__("b", s["b"].float()), "dtype"),
    (lambda s: s.__setitem__("w", s["w"].reshape(30, 40)), "shape"),
    (lambda s: s.pop("i"), "only in A"),
    (lambda s: s.__setitem__("x", torch.zeros(1)), "only in B"),
])
def test_every_kind_of_difference_is_found(tmp_path, change, kind):
    a = _state()
    b = {k: v.clone() for k, v in a.items()}
    change(b)
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    report = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert [d.kind for d in report.differences] == [kind]


def test_bits_count_unless_a_tolerance_is_given(tmp_path):
    a = _state()
    b = {k: v.clone() for k, v in a.items()}
    b["w"][3, 4] += 1e-6
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    exact = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    (d,) = exact.differences
    assert d.name == "w" and "1 of 1200" in d.detail and "flat index 94" in d.detail
    assert d.max_abs_error == pytest.approx(1e-6, rel=0.2)
    assert diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", atol=1e-5).equal
    zero = {"z": torch.zeros(3)}
    save_file(zero, tmp_path / "z.safetensors")
    save_file({"z": -torch.zeros(3)}, tmp_path / "nz.safetensors")
    assert not diff(tmp_path / "z.safetensors", tmp_path / "nz.safetensors").equal  # -0.0 has other bits
    assert diff(tmp_path / "z.safetensors", tmp_path / "nz.safetensors", rtol=1e-9).equal


def test_plain_values_are_compared(tmp_path):
    shardckpt.save({"w": torch.ones(2), "step": 3, "name": "run"}, tmp_path / "a")
    shardckpt.save({"w": torch.ones(2), "step": 4, "name": "run", "extra": None}, tmp_path / "b")
    report = diff(tmp_path / "a", tmp_path / "b")
    assert sorted((d.name, d.kind) for d in report.differences) == [("extra", "only in B"), ("step", "plain value")]


def test_memory_is_bounded_by_the_slice(tmp_path, monkeypatch):
    a = {"w": torch.randn(1000, 100)}
    save_file(a, tmp_path / "a.safetensors")
    save_file({"w": a["w"].clone()}, tmp_path / "b.safetensors")
    from shardckpt.formats.safetensors import SafetensorsReader
    sizes = []
    real = SafetensorsReader.read

    def spy(self, requests):
        sizes.extend(r.dest.nbytes for r in requests)
        return real(self, requests)

    monkeypatch.setattr(SafetensorsReader, "read", spy)
    assert diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", slice_bytes=4096).equal
    assert max(sizes) <= 4096 and sum(sizes) == 2 * a["w"].nbytes


def test_cli_exit_codes_and_json(tmp_path, capsys):
    save_file({"w": torch.ones(3)}, tmp_path / "a.safetensors")
    save_file({"w": torch.tensor([1.0, 2.0, 1.0])}, tmp_path / "b.safetensors")
    assert main(["diff", str(tmp_path / "a.safetensors"), str(tmp_path / "a.safetensors")]) == 0
    assert capsys.readouterr().out.startswith("equal:")
    assert main(["diff", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]) == 1
    assert "w: values: 1 of 3 elements differ" in capsys.readouterr().out
    assert main(["diff", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["equal"] is False and doc["differences"][0]["max_abs_error"] == 1.0
    (tmp_path / "junk").write_text("not a checkpoint")
    assert main(["diff", str(tmp_path / "a.safetensors"), str(tmp_path / "junk")]) == 2
    assert "junk" in capsys.readouterr().err


def test_bad_tolerances_are_refused(tmp_path):
    save_file({"w": torch.ones(3)}, tmp_path / "a.safetensors")
    with pytest.raises(ValueError):
        diff(tmp_path / "a.safetensors", tmp_path / "a.safetensors", atol=-1)


@pytest.mark.parametrize("dtype, value", [(torch.int64, 2**60), (torch.int32, 2**24), (torch.uint64, 2**63),
                                          (torch.int16, 2**14), (torch.uint8, 200)])
@pytest.mark.parametrize("tolerance", [{}, {"atol": 0.5}, {"rtol": 1e-30}, {"atol": 10.0, "rtol": 1.0}])
def test_integers_are_compared_exactly_whatever_the_tolerance(tmp_path, dtype, value, tolerance):
    save_file({"i": torch.tensor([value, 3], dtype=dtype)}, tmp_path / "a.safetensors")
    save_file({"i": torch.tensor([value + 1, 3], dtype=dtype)}, tmp_path / "b.safetensors")
    (d,) = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", **tolerance).differences
    assert d.kind == "values" and "1 of 2 elements differ" in d.detail
    assert d.max_abs_error == 1 and isinstance(d.max_abs_error, int)  # exact, not through a float
    assert d.detail.endswith("max abs error 1")


def test_integer_errors_are_exact_at_the_extremes(tmp_path):
    save_file({"i": torch.tensor([-2**63, 7], dtype=torch.int64)}, tmp_path / "a.safetensors")
    save_file({"i": torch.tensor([2**63 - 1, 7], dtype=torch.int64)}, tmp_path / "b.safetensors")
    (d,) = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors").differences
    assert d.max_abs_error == 2**64 - 1  # overflows int64, and float64 would round it


def test_integers_of_other_widths_are_compared_as_integers(tmp_path):
    save_file({"i": torch.tensor([2**24, 5], dtype=torch.int32)}, tmp_path / "a.safetensors")
    save_file({"i": torch.tensor([2**24 + 1, 5], dtype=torch.int64)}, tmp_path / "b.safetensors")
    report = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", atol=0.5)
    assert sorted(d.kind for d in report.differences) == ["dtype", "values"]
    assert next(d for d in report.differences if d.kind == "values").max_abs_error == 1


def test_an_integer_meeting_a_float_is_compared_in_float64(tmp_path):
    save_file({"i": torch.tensor([2**24 + 1], dtype=torch.int64)}, tmp_path / "a.safetensors")
    save_file({"i": torch.tensor([2**24], dtype=torch.float32)}, tmp_path / "b.safetensors")
    report = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", rtol=1e-12)
    values = next(d for d in report.differences if d.kind == "values")  # float32 would call them equal
    assert values.max_abs_error == 1.0


def test_bool_tensors_ignore_tolerances(tmp_path):
    save_file({"m": torch.tensor([True, False])}, tmp_path / "a.safetensors")
    save_file({"m": torch.tensor([True, True])}, tmp_path / "b.safetensors")
    (d,) = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", atol=5.0, rtol=5.0).differences
    assert d.kind == "values" and d.max_abs_error == 1


def _pair(tmp_path, a: torch.Tensor, b: torch.Tensor) -> tuple:
    shardckpt.save({"t": a}, tmp_path / "a")
    shardckpt.save({"t": b}, tmp_path / "b")
    return tmp_path / "a", tmp_path / "b"


@pytest.mark.parametrize("a, b, tolerance, kinds, error", [
    # dtypes torch cannot promote: they raised (exit 3) before
    (torch.tensor([3, -1], dtype=torch.int64), torch.tensor([3, 2**64 - 1], dtype=torch.uint64), {}, ["dtype", "values"],
     2**64),
    (torch.tensor([3, 2**63], dtype=torch.uint64), torch.tensor([3, 2**63 - 1]), {"atol": 9.0}, ["dtype", "values"], 1),
    (torch.tensor([3, 2**64 - 1], dtype=torch.uint64), torch.tensor([3, 2**64 - 1], dtype=torch.uint64), {}, [], None),
    (torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn), torch.tensor([1.125, 2.0]).to(torch.float8_e4m3fn),
     {"atol": 0.01}, ["values"], 0.125),
    (torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn), torch.tensor([1.125, 2.0]).to(torch.float8_e4m3fn),
     {"atol": 0.2}, [], None),
    (torch.tensor([1.0]).to(torch.float8_e5m2), torch.tensor([1.0]), {}, ["dtype"], None),
    (torch.tensor([1.0]).to(torch.float8_e5m2), torch.tensor([1.5]), {"atol": 0.1}, ["values"], 0.5),
    # an integer meeting a float: equal only where the float is that very integer, whatever float64 rounds
    (torch.tensor([2**53 + 1]), torch.tensor([2.0**53], dtype=torch.float64), {}, ["dtype", "values"], 1.0),
    (torch.tensor([2**53]), torch.tensor([2.0**53], dtype=torch.float64), {}, ["dtype"], None),
    (torch.tensor([7], dtype=torch.uint64), torch.tensor([7.5]), {"atol": 1.0}, ["dtype", "values"], 0.5),
], ids=["int64-uint64", "uint64-int64-atol", "uint64-same", "float8-atol", "float8-within", "float8-float32",
        "float8-float32-atol", "int-float64-rounded", "int-float64-equal", "uint64-float-atol"])
def test_every_pair_of_dtypes_is_compared_by_value_never_an_internal_error(tmp_path, a, b, tolerance, kinds, error):
    report = diff(*_pair(tmp_path, a, b), **tolerance)
    assert sorted(d.kind for d in report.differences) == kinds
    values = [d for d in report.differences if d.kind == "values"]
    assert [d.max_abs_error for d in values] == ([] if error is None else [error])


@pytest.mark.parametrize("a, b", [({1: "x"}, {True: "x"}), (0.0, -0.0), ([1.0, {"k": 0.0}], [1.0, {"k": -0.0}]),
                                  (1, True), (1, 1.0)])
def test_plain_values_of_other_types_or_signs_differ(tmp_path, a, b):
    """Both round-trip exactly through save and load; == calls them equal (1 == True, 0.0 == -0.0)."""
    shardckpt.save({"t": torch.zeros(2), "v": a}, tmp_path / "a")
    shardckpt.save({"t": torch.zeros(2), "v": b}, tmp_path / "b")
    (d,) = diff(tmp_path / "a", tmp_path / "b").differences
    assert d.kind == "plain value" and d.name.startswith("v")
    assert diff(tmp_path / "a", tmp_path / "a").equal and diff(tmp_path / "b", tmp_path / "b").equal


def _crc32c_collision(a: torch.Tensor) -> torch.Tensor:
    """A tensor of a's dtype and shape whose bytes differ from a's but have the same CRC32C: CRC is linear over
    GF(2), so some nonzero combination of single-bit flips in the first 8 bytes changes nothing."""
    from shardckpt.format.checksum import crc32c

    data = a.numpy().tobytes()
    zero = bytes(len(data))
    basis: dict[int, tuple[int, int]] = {}  # pivot bit -> (CRC delta, the flips that make it)
    for i in range(64):
        flip = bytearray(len(data))
        flip[i // 8] = 1 << (i % 8)
        value, combo = crc32c(bytes(flip)) ^ crc32c(zero), 1 << i
        for bit in sorted(basis, reverse=True):
            if value >> bit & 1:
                value, combo = value ^ basis[bit][0], combo ^ basis[bit][1]
        if value == 0:
            break
        basis[value.bit_length() - 1] = (value, combo)
    delta = bytes(sum(1 << j for j in range(8) if combo >> (8 * k + j) & 1) for k in range(len(data)))
    other = bytes(x ^ y for x, y in zip(data, delta))
    assert crc32c(other) == crc32c(data) and other != data
    return torch.frombuffer(bytearray(other), dtype=a.dtype).reshape(a.shape)


def test_read_all_finds_what_a_crc32c_collision_hides(tmp_path, capsys):
    a = torch.tensor([1.0, 2.0, 3.0, 4.0])
    pa, pb = _pair(tmp_path, a, _crc32c_collision(a))
    assert diff(pa, pb).equal  # settled by the equal checksums, as documented
    report = diff(pa, pb, read_all=True)
    assert [d.kind for d in report.differences] == ["values"] and report.by_checksum == 0
    assert main(["diff", str(pa), str(pb), "--read-all"]) == 1 and "values" in capsys.readouterr().out
