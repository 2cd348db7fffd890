"""What ``diff`` compares of each side: ``only`` (dotted-name prefixes) and ``strip_prefix``, so that a training
checkpoint (``model.w``, ``optim...``, ``step``) can be compared with its export (``w``): ``only=["model"],
strip_prefix="model."``. Both apply to each side where they find something: a side that holds nothing under
``only`` (the export, in that example) is compared whole, and said so in a note; names without the prefix keep
theirs. And the hint for a comparison in which no tensor name was common to both sides."""
from __future__ import annotations

from collections import Counter
from typing import Any, Mapping, Sequence

from shardckpt.checkpoint.load_any import wanted_keys
from shardckpt.errors import IncompatibleCheckpointError
from shardckpt.format.tree import TensorRef, leaves, path_name
from shardckpt.formats.api import CheckpointReader, Facts, ReadRequest, TensorInfo
from shardckpt.formats.safetensors_header import METADATA_KEY


class Selected:
    """``reader`` with its tensors and plain values renamed (and filtered) by ``names``: old -> new name. Its
    tree is flat: ``{new name: TensorRef(new name) or the plain value}``."""

    def __init__(self, reader: CheckpointReader, names: Mapping[str, str], plain: Mapping[str, Any]):
        self.reader = reader
        infos = reader.tensors()
        self._old = {new: old for old, new in names.items()}
        self._infos = {new: TensorInfo(new, infos[old].dtype, infos[old].shape, infos[old].crc32c)
                       for old, new in names.items()}
        self._plain = dict(plain)

    def tensors(self) -> Mapping[str, TensorInfo]:
        return dict(self._infos)

    def facts(self) -> Facts:
        return self.reader.facts()

    def tree(self) -> Any:
        return {**self._plain, **{name: TensorRef(name) for name in self._infos}}

    def read(self, requests: Sequence[ReadRequest]) -> None:
        self.reader.read([ReadRequest(self._old[r.tensor], r.region, r.dest) for r in requests])


def select(reader: CheckpointReader, side: str, only: Sequence[str] | None,
           strip_prefix: str | None) -> tuple[CheckpointReader, list[str]]:
    """``reader`` as compared (see the module's docstring), and notes for the report (``side``: "A" or "B")."""
    refs, plain = {}, {}
    for path, leaf in leaves(reader.tree(), lambda v: isinstance(v, TensorRef)):
        if isinstance(leaf, TensorRef):
            refs[path_name(path)] = leaf.name
        else:
            plain[path_name(path)] = leaf
    notes = []
    if only:
        keep = wanted_keys(only)
        if any(keep(n) for n in [*refs, *plain] if n != METADATA_KEY):
            refs = {n: t for n, t in refs.items() if keep(n)}
            plain = {n: v for n, v in plain.items() if keep(n) or n == METADATA_KEY}
        else:
            notes.append(f"only={list(only)} selects nothing in {side}: {side} is compared whole")
    renamed: dict[str, str] = {}  # new name -> old name, tensors and plain values alike
    for name in [*refs, *plain]:
        new = name.removeprefix(strip_prefix) if strip_prefix else name
        if new in renamed or not new:
            raise IncompatibleCheckpointError(f"{side}: {renamed.get(new, name)!r} and {name!r} both become {new!r} "
                                              f"once strip_prefix={strip_prefix!r} is removed; narrow them with only=")
        renamed[new] = name
    names = {refs[old]: new for new, old in renamed.items() if old in refs}
    values = {new: plain[old] for new, old in renamed.items() if old in plain}
    return Selected(reader, names, values), notes


def nothing_compared_hint(names_a: Sequence[str], names_b: Sequence[str]) -> str:
    """What to do when no tensor name is in both sides: the prefix to remove if one side's names are the
    other's under a prefix (a training checkpoint's ``model.``), and ``verify --against`` for an export."""
    hint = "no tensor name is in both A and B: nothing was compared."
    for side, mine, theirs in (("A", names_a, names_b), ("B", names_b, names_a)):
        tops = Counter(n.split(".", 1)[0] for n in mine if "." in n)
        for top, _ in tops.most_common(3):
            if {n.removeprefix(f"{top}.") for n in mine if n.startswith(f"{top}.")} & set(theirs):
                hint += (f" {side}'s names are the other's under {top!r}: compare those with only=['{top}'], "
                         f"strip_prefix='{top}.' (--only {top} --strip-prefix {top}.).")
                break
        else:
            continue
        break
    return hint + (" To check an export against the checkpoint it was made from: "
                   "`shardckpt verify EXPORT --against CHECKPOINT` (verify_export(export, against=checkpoint)).")
