"""``diff``: are two checkpoints, of any formats ``open_reader`` reads, the same? Tensor by tensor, plain values too.

Tensors are compared by checksum where both sides store one for the same dtype and shape (no data is
read then; a CRC32C collides by chance once in 2**32 tensors, and can be made to: ``read_all`` reads every
tensor), otherwise by value, in slices of at most ``slice_bytes`` per side, so that memory stays bounded
whatever the checkpoint's size. With ``atol = rtol = 0`` (the default) values must be equal bit for bit
(NaN payloads and -0.0 count); with a tolerance, ``torch.isclose`` decides for floating-point (and complex)
values (NaN equals NaN). Integer and bool values are compared exactly, always: a tolerance applies to
floating-point values only, and an integer's error is exact (a Python int, computed without overflow or a
round trip through float). Tensors of different dtypes are compared by value: floating-point ones in
float64 / complex128, integers exactly (uint64 against int64 too), an integer against a float exactly (equal
only where the float is that very integer), and the dtype difference is reported: as a difference when comparing exactly, apart (in
``dtype_differences``) when a tolerance is given and both are floating-point (an fp32 checkpoint against its
bf16 export, within the tolerance).

The ``__metadata__`` strings of two safetensors files (an export's records its source's path) are compared
apart too (``metadata_differences``): bit-identical tensors under other metadata are equal. ``only`` and
``strip_prefix`` pick and rename what is compared on each side (``convert/diff_select.py``): a training
checkpoint against its export is ``only=["model"], strip_prefix="model."``. When no tensor name is common to
both sides, ``notes`` says what to try. ``progress(done, total)`` is told the bytes read as they are.

LOCAL checkpoints (flat groups plus their layouts) are compared as stored when both sides have the same
layouts; otherwise (another world size or wrapping, or a LOCAL and a FULL/SHARDED/foreign checkpoint) both
sides are compared by parameter, through ``formats.local_view.logical_view``: the same model state at 2 and
3 ranks is equal, as it should be, and padding never counts.
"""
from __future__ import annotations

import fractions
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy
import torch

from shardckpt.offline.diff_select import nothing_compared_hint, select
from shardckpt.format.dtypes import itemsize
from shardckpt.format.flat_layout import LAYOUTS_KEY, is_local
from shardckpt.format.tree import TensorRef, leaves, path_name
from shardckpt.formats.api import CheckpointReader, ReadRequest, TensorInfo
from shardckpt.formats.detect import open_reader
from shardckpt.io import Storage
from shardckpt.formats.local_view import logical_view
from shardckpt.formats.safetensors import SafetensorsReader
from shardckpt.formats.safetensors_header import METADATA_KEY
from shardckpt.regions import FlatRange
from shardckpt.tensor_views import as_bytes

SLICE_BYTES = 64 << 20  # per side and per read: the memory a comparison holds
# hi - lo of two integers of n bytes wraps in their own type, but is exact read as unsigned: it is < 2**(8n)
_UNSIGNED = {1: numpy.uint8, 2: numpy.uint16, 4: numpy.uint32, 8: numpy.uint64}


@dataclass(frozen=True)
class Difference:
    name: str
    kind: str  # "only in A", "only in B", "shape", "dtype", "values", "plain value", "metadata"
    detail: str
    max_abs_error: float | int | None = None  # an int for integer values (exact), else a float


@dataclass
class DiffReport:
    tensors: int = 0  # compared, in both
    by_checksum: int = 0  # of them, settled by equal checksums without reading
    bytes_read: int = 0  # tensor bytes read, both sides
    plain_values: int = 0
    differences: list[Difference] = field(default_factory=list)  # what makes them unequal
    dtype_differences: list[Difference] = field(default_factory=list)  # floats compared within a tolerance
    metadata_differences: list[Difference] = field(default_factory=list)  # safetensors __metadata__, not data
    notes: list[str] = field(default_factory=list)  # what was not compared, and why

    @property
    def equal(self) -> bool:
        """The tensors and plain values are equal (dtype and metadata differences apart)."""
        return not self.differences


@dataclass(frozen=True)
class Comparison:
    """What ``diff`` compares, and how strictly: tolerances for floating-point values (``atol = rtol = 0``: bit for
    bit), ``only`` / ``strip_prefix`` on each side (``diff_select``), and ``read_all``: every tensor by value, also
    where both sides store equal checksums (a CRC32C can be made to collide)."""

    atol: float = 0.0
    rtol: float = 0.0
    only: Sequence[str] | None = None
    strip_prefix: str | None = None
    read_all: bool = False

    def __post_init__(self) -> None:
        if self.atol < 0 or self.rtol < 0 or not (math.isfinite(self.atol) and math.isfinite(self.rtol)):
            raise ValueError("atol and rtol must be finite and >= 0")

    @property
    def exact(self) -> bool:
        return self.atol == self.rtol == 0

    @property
    def checksums(self) -> bool:
        """Equal stored checksums settle a tensor without reading it."""
        return not self.read_all


def diff(a: str | os.PathLike | Storage | CheckpointReader, b: str | os.PathLike | Storage | CheckpointReader, *,
         slice_bytes: int = SLICE_BYTES,
         progress: Callable[[int, int], None] | None = None, **comparison: Any) -> DiffReport:
    """Compare checkpoints ``a`` and ``b`` (local paths, opened places or readers); differences are collected, not raised.
    ``comparison``: ``Comparison``'s fields (see the module's docstring for ``only``, ``strip_prefix``, tolerances
    and metadata).

    Unreadable input raises a ``CheckpointError`` subclass naming the file."""
    rules = Comparison(**comparison)
    ra, rb = (r if isinstance(r, CheckpointReader) else open_reader(r) for r in (a, b))
    metadata = (_file_metadata(ra), _file_metadata(rb))
    ra, rb = _comparable(ra, rb)
    report = DiffReport()
    if rules.only or rules.strip_prefix:
        (ra, notes_a), (rb, notes_b) = (select(r, side, rules.only, rules.strip_prefix)
                                        for r, side in ((ra, "A"), (rb, "B")))
        report.notes += notes_a + notes_b
    _diff_plain(ra.tree(), rb.tree(), report, [m is not None for m in metadata])
    _diff_metadata(*metadata, report)
    ta, tb = ra.tensors(), rb.tensors()
    report.differences += [Difference(n, "only in A", _describe(ta[n])) for n in sorted(set(ta) - set(tb))]
    report.differences += [Difference(n, "only in B", _describe(tb[n])) for n in sorted(set(tb) - set(ta))]
    common = sorted(set(ta) & set(tb))
    if ta and tb and not common:
        report.notes.append(nothing_compared_hint(list(ta), list(tb)))
    total = sum(_bytes_to_read(ta[n], tb[n], rules) for n in common)
    tick = (lambda: progress(report.bytes_read, total)) if progress is not None and total else (lambda: None)
    tick()
    for name in common:
        _diff_tensor(ra, rb, ta[name], tb[name], rules, slice_bytes, report, tick)
    return report


def _bytes_to_read(ia: TensorInfo, ib: TensorInfo, rules: Comparison) -> int:
    """What comparing two tensors reads, both sides (0: settled without reading, or not comparable)."""
    if tuple(ia.shape) != tuple(ib.shape) or (rules.checksums and _same_checksum(ia, ib)):
        return 0
    return math.prod(ia.shape) * (itemsize(ia.dtype) + itemsize(ib.dtype))


def _file_metadata(reader: CheckpointReader) -> dict | None:
    """A safetensors checkpoint's ``__metadata__`` (where its files agree), else None: no file metadata."""
    if not isinstance(reader, SafetensorsReader):
        return None
    tree = reader.tree()
    return dict(tree.get(METADATA_KEY, {})) if isinstance(tree, dict) else {}


def _diff_metadata(meta_a: dict | None, meta_b: dict | None, report: DiffReport) -> None:
    if meta_a is None or meta_b is None:
        return  # one side has no file metadata: nothing to set against the other's
    for key in sorted(set(meta_a) | set(meta_b)):
        if meta_a.get(key) != meta_b.get(key):
            shown = [repr(m[key]) if key in m else "(none)" for m in (meta_a, meta_b)]
            report.metadata_differences.append(Difference(f"{METADATA_KEY}.{key}", "metadata", " != ".join(shown)))


def _comparable(ra: CheckpointReader, rb: CheckpointReader) -> tuple[CheckpointReader, CheckpointReader]:
    """The readers as stored, or both by parameter when their storage forms differ (see the module doc)."""
    ta, tb = ra.tree(), rb.tree()
    if not (is_local(ta) or is_local(tb)):
        return ra, rb
    if is_local(ta) and is_local(tb) and ta["model"][LAYOUTS_KEY] == tb["model"][LAYOUTS_KEY]:
        return ra, rb
    return logical_view(ra), logical_view(rb)


def _describe(info: TensorInfo) -> str:
    return f"{_dtype(info.dtype)} {list(info.shape)}"


def _plain_leaves(tree: Any, file_metadata: bool) -> dict[str, Any]:
    """The plain values by dotted name (a safetensors side's ``__metadata__`` left out: ``_diff_metadata``)."""
    named = ((path_name(p), v) for p, v in leaves(tree, lambda v: isinstance(v, TensorRef)) if not isinstance(v, TensorRef))
    return {name: v for name, v in named
            if not (file_metadata and (name == METADATA_KEY or name.startswith(f"{METADATA_KEY}.")))}


def _diff_plain(tree_a: Any, tree_b: Any, report: DiffReport, file_metadata: list[bool]) -> None:
    pa, pb = (_plain_leaves(t, m) for t, m in zip((tree_a, tree_b), file_metadata))
    for name in sorted(set(pa) | set(pb)):
        if name not in pb or name not in pa:
            report.differences.append(Difference(name, "only in A" if name in pa else "only in B",
                                                 f"plain value {_short(pa.get(name, pb.get(name)))}"))
            continue
        report.plain_values += 1
        if not _same_plain(pa[name], pb[name]):
            report.differences.append(Difference(name, "plain value", f"{_short(pa[name])} != {_short(pb[name])}"))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _same_plain(x: Any, y: Any) -> bool:
    """Equality of plain values as formats store them (a tuple may come back as a list, NaN equals NaN), of
    the same types (1 is not True, 0.0 is not -0.0, also as dict keys)."""
    if torch.is_tensor(x) or torch.is_tensor(y):
        return torch.is_tensor(x) and torch.is_tensor(y) and x.dtype == y.dtype and x.shape == y.shape and \
            torch.equal(_bits(x.reshape(-1)), _bits(y.reshape(-1)))
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_same_plain(u, v) for u, v in zip(x, y))
    if isinstance(x, dict) and isinstance(y, dict):  # keys by type too: {1: ...} is not {True: ...}
        kx, ky = ({(type(k), k): k for k in d} for d in (x, y))
        return kx.keys() == ky.keys() and all(_same_plain(x[kx[t]], y[ky[t]]) for t in kx)
    if isinstance(x, float) and isinstance(y, float):  # -0.0 is not 0.0; NaN is NaN
        return (math.isnan(x) and math.isnan(y)) or (x == y and math.copysign(1, x) == math.copysign(1, y))
    return type(x) is type(y) and x == y


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, for a bit-for-bit comparison."""
    return as_bytes(t.detach().cpu().resolve_conj().resolve_neg().contiguous())


def _same_checksum(ia: TensorInfo, ib: TensorInfo) -> bool:
    return ia.dtype == ib.dtype and ia.crc32c is not None and ia.crc32c == ib.crc32c


def _diff_tensor(ra: CheckpointReader, rb: CheckpointReader, ia: TensorInfo, ib: TensorInfo, tol: Comparison,
                 slice_bytes: int, report: DiffReport, tick: Callable[[], None]) -> None:
    if tuple(ia.shape) != tuple(ib.shape):
        report.differences.append(Difference(ia.name, "shape", f"{list(ia.shape)} != {list(ib.shape)}"))
        return
    report.tensors += 1
    same_dtype = ia.dtype == ib.dtype
    if not same_dtype:
        within = not tol.exact and _is_float(ia.dtype) and _is_float(ib.dtype)  # values decide, within tolerance
        (report.dtype_differences if within else report.differences).append(
            Difference(ia.name, "dtype", f"{_dtype(ia.dtype)} != {_dtype(ib.dtype)}"))
    elif tol.checksums and _same_checksum(ia, ib):  # the same bytes (up to a CRC32C collision): equal
        report.by_checksum += 1
        return
    exact, atol, rtol = same_dtype and tol.exact, tol.atol, tol.rtol
    numel = math.prod(ia.shape)
    step = max(1, slice_bytes // max(itemsize(ia.dtype), itemsize(ib.dtype)))
    mismatched, worst, first = 0, None, None
    for lo in range(0, numel, step):
        hi = min(numel, lo + step)
        xa, xb = torch.empty(hi - lo, dtype=ia.dtype), torch.empty(hi - lo, dtype=ib.dtype)
        ra.read([ReadRequest(ia.name, FlatRange(lo, hi), xa)])
        rb.read([ReadRequest(ib.name, FlatRange(lo, hi), xb)])
        report.bytes_read += xa.nbytes + xb.nbytes
        tick()
        bad = _mismatches(xa, xb, exact, atol, rtol)
        if bad.any():
            mismatched += int(bad.sum())
            first = lo + int(bad.nonzero()[0]) if first is None else first
            error = _max_abs_error(xa[bad], xb[bad])
            worst = error if worst is None else max(worst, error)
    if mismatched:
        shown = f"{worst}" if isinstance(worst, int) else f"{worst:.6g}"
        report.differences.append(Difference(
            ia.name, "values", f"{mismatched} of {numel} elements differ (first at flat index {first}); max abs "
                               f"error {shown}", worst))


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _mismatches(x: torch.Tensor, y: torch.Tensor, exact: bool, atol: float, rtol: float) -> torch.Tensor:
    """Which elements differ: bit for bit when ``exact`` (one dtype); else by value: floating-point against
    floating-point within the tolerance (in float64 / complex128: float8 and mixed widths included); wherever
    an integer or bool is involved, exactly, whatever the tolerance (``_integer_mismatches``)."""
    if exact:
        size = x.element_size()
        return (_bits(x).view(-1, size) != _bits(y).view(-1, size)).any(dim=1)
    fx, fy = _is_float(x.dtype), _is_float(y.dtype)
    if fx and fy:
        wx, wy = _wide(x), _wide(y)
        return ~torch.isclose(wx, wy, rtol=rtol, atol=atol, equal_nan=True)
    if fx or fy:
        i, f = (y, x) if fx else (x, y)
        return torch.from_numpy(_int_float_mismatches(i.numpy(), _wide(f).numpy()))
    return torch.from_numpy(_integer_mismatches(x.numpy(), y.numpy()))


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.complex128 if t.is_complex() else torch.float64)


def _integer_mismatches(a: numpy.ndarray, b: numpy.ndarray) -> numpy.ndarray:
    """Exact inequality of two integer (or bool) arrays of any dtypes, uint64 against signed included (numpy
    and torch would compare those in float64, or not at all)."""
    if a.dtype == b.dtype:
        return a != b
    if numpy.uint64 not in (a.dtype, b.dtype):
        return a.astype(numpy.int64) != b.astype(numpy.int64)
    u, s = (a, b) if a.dtype == numpy.uint64 else (b, a)
    s = s.astype(numpy.int64)
    return (s < 0) | (u > numpy.iinfo(numpy.int64).max) | (s.astype(numpy.uint64) != u)


def _int_float_mismatches(i: numpy.ndarray, f: numpy.ndarray) -> numpy.ndarray:
    """Exact inequality of integers and floating-point values: equal only where the float is that very
    integer (2**53 + 1 against 2.0**53 differs, though float64 rounds one onto the other)."""
    imaginary = f.imag != 0 if numpy.iscomplexobj(f) else numpy.zeros(f.shape, dtype=bool)
    f = f.real
    target = numpy.int64 if i.dtype == numpy.bool_ else i.dtype
    with numpy.errstate(invalid="ignore", over="ignore"):
        back = f.astype(target)  # meaningless where f is no such integer: the first test catches those
    return imaginary | (i.astype(numpy.float64) != f) | (back != i.astype(target))


def _max_abs_error(x: torch.Tensor, y: torch.Tensor) -> float | int:
    """Largest |x - y| over differing elements: 0 for two NaNs (bits differ), inf for NaN against a number;
    for integers an exact int (the difference of two int64 values may not fit in an int64)."""
    if x.dtype == torch.bool and y.dtype == torch.bool:
        return 1
    if not (_is_float(x.dtype) or _is_float(y.dtype)):
        if x.dtype == y.dtype:  # max - min in the unsigned type of that width: exact, vectorised
            xn, yn = x.numpy(), y.numpy()
            hi, lo = numpy.maximum(xn, yn), numpy.minimum(xn, yn)
            return int(numpy.subtract(hi, lo, dtype=hi.dtype).view(_UNSIGNED[hi.itemsize]).max()) if hi.size else 0
        return max((abs(int(p) - int(q)) for p, q in zip(x.tolist(), y.tolist())), default=0)
    if _is_float(x.dtype) != _is_float(y.dtype) and not (x.is_complex() or y.is_complex()):
        return max((_exact_gap(p, q) for p, q in zip(x.tolist(), y.tolist())), default=0.0)
    x, y = _wide(x), _wide(y)
    if x.is_complex() != y.is_complex():
        x, y = x.to(torch.complex128), y.to(torch.complex128)
    d = (x - y).abs()
    d[x.isnan() & y.isnan()] = 0
    return float(torch.nan_to_num(d, nan=math.inf).max()) if d.numel() else 0.0


def _exact_gap(p: int | float, q: int | float) -> float:
    """|p - q| of an integer and a float, computed exactly and then rounded (float64 may round the integer
    onto the float: 2**53 + 1 against 2.0**53 is 1, not 0)."""
    if not (math.isfinite(p) and math.isfinite(q)):
        return math.inf
    return float(abs(fractions.Fraction(p) - fractions.Fraction(q)))
