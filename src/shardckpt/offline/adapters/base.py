"""The adapter interface: how one model family's names and layouts map onto Hugging Face's, and back.

A family is one small file declaring two ``Adapter``s (``to_hf`` and its declared inverse ``from_hf``), each
a list of ``Rule``s. A rule matches a source tensor's whole name (``re.fullmatch``, as ``--rename-map``) and
names what it becomes (``\\1``, ``\\g<name>`` refer to its groups; ``None`` leaves it out), through a
``Transform`` of its rows (dim 0):

- ``KEEP``: the tensor as it is, renamed;
- ``RopePermute(heads, inverse)``: the q/k rotary permutation between interleaved (Meta, torchtitan) and
  half-split (HF) layouts: a permutation of whole rows within each head;
- ``Split(sizes)``: one fused tensor cut along dim 0 into the rule's several targets;
- ``Part(index, count)``: this tensor is part ``index`` of ``count`` concatenated along dim 0 into the target
  (a merge: the inverse of ``Split``).

Every transform is a map of output rows to source rows, so a read of any region of an output tensor is a
read of runs of source rows (``offline.adapters.reader``): nothing is materialised; memory is the caller's
buffers and, for a reordering, one group of rows (a head) staged at a time. Sizes that depend on the model (heads, their count per projection) come from the
adapter's options (``opts``), given by the user (``--adapter NAME:n_heads=32,n_kv_heads=8``) or read from a
``config.json``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from shardckpt.errors import BadArgumentError, IncompatibleCheckpointError

Shape = tuple[int, ...]
Opts = Mapping[str, Any]


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, start + rows)`` of source tensor ``source``, in the order ``order`` gives (``order(i)``:
    the source row, relative to ``start``, of the piece's ``i``-th row; None: in order). A reordering keeps rows
    within groups of ``group`` consecutive rows (a head): a read stages one group's source rows, a contiguous
    span, and places its rows from there."""

    source: str
    start: int
    rows: int
    order: Callable[[int], int] | None = None
    group: int = 0


@dataclass(frozen=True)
class Planned:
    """One output tensor: its name, shape and the pieces its rows are, concatenated along dim 0."""

    name: str
    shape: Shape
    pieces: tuple[Piece, ...]


class Transform:
    """How a rule's matched source tensor becomes its target(s): ``pieces`` gives, per target, the piece of it."""

    def targets(self) -> int:
        return 1

    def pieces(self, source: str, shape: Shape, opts: Opts) -> list[Piece]:
        return [Piece(source, 0, shape[0] if shape else 1)]


KEEP = Transform()


@dataclass(frozen=True)
class RopePermute(Transform):
    """The rotary permutation of a q or k projection, ``heads`` naming the option with its head count.

    To HF (``inverse=False``, torchtitan's ``_permute``): within each head of ``2 * half`` rows, HF row
    ``a * half + b`` is source row ``2 * b + a``. From HF (``inverse=True``, ``_reverse_permute``): the other way.
    """

    heads: str
    inverse: bool = False
    width_heads: str | None = None  # the option whose head count divides the columns into heads (head_dim)

    def pieces(self, source: str, shape: Shape, opts: Opts) -> list[Piece]:
        heads = option(opts, self.heads, source)
        if len(shape) != 2 or shape[0] % (2 * heads):
            raise IncompatibleCheckpointError(f"tensor {source!r} of shape {list(shape)}: its rows do not split into "
                                              f"{heads} heads of an even size ({self.heads}={heads}); check the "
                                              "adapter's options")
        if self.width_heads is not None:
            check_head_rows(source, shape, heads, self.heads, option(opts, self.width_heads, source))
        half = shape[0] // heads // 2
        if self.inverse:
            def order(r: int) -> int:
                head, within = divmod(r, 2 * half)
                b, a = divmod(within, 2)
                return head * 2 * half + a * half + b
        else:
            def order(r: int) -> int:
                head, within = divmod(r, 2 * half)
                a, b = divmod(within, half)
                return head * 2 * half + 2 * b + a
        return [Piece(source, 0, shape[0], order, 2 * half)]


@dataclass(frozen=True)
class Split(Transform):
    """A fused tensor cut along dim 0 into the rule's targets: ``sizes(shape, opts)`` gives each one's rows."""

    sizes: Callable[[Shape, Opts], Sequence[int]]
    count: int

    def targets(self) -> int:
        return self.count

    def pieces(self, source: str, shape: Shape, opts: Opts) -> list[Piece]:
        sizes = list(self.sizes(shape, opts))
        if not shape or len(sizes) != self.count or sum(sizes) != shape[0] or min(sizes) < 0:
            raise IncompatibleCheckpointError(f"tensor {source!r} of shape {list(shape)} does not split into rows "
                                              f"{sizes}; check the adapter's options")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [Piece(source, start, rows) for start, rows in zip(starts, sizes)]


@dataclass(frozen=True)
class Part(Transform):
    """This tensor is part ``index`` of ``count`` that concatenate along dim 0 into the rule's target."""

    index: int
    count: int


@dataclass(frozen=True)
class Rule:
    pattern: str
    target: str | Sequence[str] | None  # None: leave the tensor out; several: a Split's targets, in order
    transform: Transform = KEEP

    def compiled(self) -> re.Pattern:
        return re.compile(self.pattern)


@dataclass(frozen=True)
class Adapter:
    """One direction of a family's mapping: ``rules`` in order (the first whose pattern matches renames),
    ``options``: the names of the options it needs (``config_keys``: where a ``config.json`` holds each),
    ``tied``: the (output) names of a tied pair, the second left out when ``opts["tie_word_embeddings"]``;
    ``retied``: such a pair from HF, the second presented as the first again when the source leaves it out and
    ``opts["tie_word_embeddings"]`` (a family that stores both names, e.g. torchtitan)."""

    name: str
    rules: tuple[Rule, ...]
    options: Mapping[str, str] = field(default_factory=dict)  # option -> config.json key
    tied: tuple[str, str] | None = None
    retied: tuple[str, str] | None = None


def check_head_rows(tensor: str, shape: Shape, heads: int, name: str, width_heads: int) -> None:
    """Refuse head options that do not fit ``tensor``: its columns ``width_heads`` heads of ``head_dim`` each, its
    rows ``heads`` of them (a wrong count that still divides the rows would permute the wrong rows silently)."""
    columns = shape[1] if len(shape) == 2 else 0
    if columns % width_heads or shape[0] != heads * (columns // width_heads):
        raise IncompatibleCheckpointError(f"tensor {tensor!r} of shape {list(shape)}: not {heads} heads ({name}) of "
                                          f"{columns} columns / {width_heads} heads; check the adapter's head options")


def option(opts: Opts, name: str, tensor: str) -> int:
    value = opts.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BadArgumentError(f"tensor {tensor!r}: the adapter needs the option {name} (a positive int), got "
                               f"{value!r}: pass it (--adapter NAME:{name}=N) or a config.json (NAME:config=PATH)")
    return value
