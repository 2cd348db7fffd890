"""``leaf_groups`` and the grouped ``check_tree`` against the leaf-at-a-time walk they replaced, on random trees:
the same leaves under the same names, and the same verdict (pass, or the same kind of error) on trees with colliding
names, misnamed and repeated references, and tensor tables that disagree."""
from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from shardckpt.errors import CorruptCheckpointError
from shardckpt.format.manifest import check_tree
from shardckpt.format.tree import PerRankValues, TensorRef, leaf_groups, leaf_path, leaves, path_name


def _is_ref(v) -> bool:
    return type(v) is TensorRef


def _reference_check_tree(tree, tensors, strict: bool) -> None:
    """The walk ``check_tree`` made before it checked a container's leaves at once (the oracle)."""
    seen: set[str] = set()
    refs: set[str] = set()
    for at, leaf in leaves(tree, _is_ref):
        name = path_name(at)
        if name in seen:
            raise CorruptCheckpointError("both named")
        seen.add(name)
        if type(leaf) is not TensorRef:
            continue
        if strict and leaf.name != name:
            raise CorruptCheckpointError("is named")
        if leaf.name in refs:
            raise CorruptCheckpointError("referenced twice")
        refs.add(leaf.name)
    if len(refs) != len(tensors) or not refs.issuperset(tensors):
        raise CorruptCheckpointError("disagree")


_KINDS = ("both named", "is named", "referenced twice", "disagree")


def _verdict(fn) -> str:
    try:
        fn()
    except CorruptCheckpointError as e:
        return next(k for k in _KINDS if k in str(e))
    return "ok"


def _key(rng: random.Random):
    return rng.choice(["a", "b", "a.b", "b.a", "0", "1", "x", 0, 1, 1.5, True, None, "", "c"])


def _tree(rng: random.Random, path: tuple, depth: int, misname: float):
    kind = rng.random()
    if depth > 3 or kind < 0.35:
        if rng.random() < 0.7:
            name = path_name(path)
            if rng.random() < misname:
                name = rng.choice(["a", "a.b", "0", name + "x"])
            return TensorRef(name)
        return rng.choice([1, "s", None, 2.5, [], {}, [1, 2], {"k": 3}])
    if kind < 0.75:
        container = rng.choice([dict, OrderedDict])()
        for _ in range(rng.randint(0, 5)):
            k = _key(rng)
            container[k] = _tree(rng, path + (k,), depth + 1, misname)
        return container
    items = [_tree(rng, path + (i,), depth + 1, misname) for i in range(rng.randint(0, 4))]
    return rng.choice([list, tuple, PerRankValues])(items)


def _ref_names(tree) -> list[str]:
    return [v.name for _, v in leaves(tree, _is_ref) if type(v) is TensorRef]


def test_leaf_groups_are_the_leaves_under_their_names() -> None:
    for seed in range(300):
        _same_leaves(random.Random(seed))


def _same_leaves(rng: random.Random) -> None:
    tree = {"root": _tree(rng, ("root",), 0, 0.0), **{f"t{i}": TensorRef(f"t{i}") for i in range(rng.randint(0, 3))}}
    expected = [(path_name(p), id(v)) for p, v in leaves(tree, _is_ref)]
    got = [(name, id(v)) for _, _, names, values in leaf_groups(tree, _is_ref) for name, v in zip(names, values)]
    paths = [leaf_path(parent, keys, i) for parent, keys, names, _ in leaf_groups(tree, _is_ref)
             for i in range(len(names))]
    assert paths == [p for p, _ in leaves(tree, _is_ref)]
    assert got == expected


@pytest.mark.parametrize("strict", [True, False])
def test_check_tree_gives_the_verdict_of_the_leaf_walk(strict: bool) -> None:
    verdicts = [_same_verdict(random.Random(seed), strict) for seed in range(600)]
    # the random trees reach every verdict, each many times (strict: a reference made twice is misnamed once first)
    reached = ("ok", "both named", "disagree", "is named" if strict else "referenced twice")
    assert all(verdicts.count(kind) >= 20 for kind in reached), {k: verdicts.count(k) for k in reached}


def _same_verdict(rng: random.Random, strict: bool) -> str:
    tree = {k: _tree(rng, (k,), 1, 0.15) for k in rng.sample(["a", "b", "a.b", "c", "0"], rng.randint(1, 4))}
    tensors = dict.fromkeys(_ref_names(tree))
    if rng.random() < 0.2:
        tensors[rng.choice(["a", "zz"])] = None
    if tensors and rng.random() < 0.1:
        tensors.pop(next(iter(tensors)))
    got = _verdict(lambda: check_tree(tree, tensors, strict, "m"))
    expected = _verdict(lambda: _reference_check_tree(tree, tensors, strict))
    # A tree with faults of two kinds may report either first (the walks visit leaves in another order); a tree whose
    # only fault is its table's disagreement reports that, and a sound one passes.
    assert (got == "ok") == (expected == "ok")
    assert (got == "disagree") == (expected == "disagree") or "disagree" not in (got, expected) or \
        _faults_in_walk(tree, strict)
    return expected


def _faults_in_walk(tree, strict: bool) -> bool:
    return _verdict(lambda: _reference_check_tree(tree, _ref_names(tree), strict)) != "ok"


def test_a_flat_dict_of_many_tensors_is_one_group() -> None:
    tree = {f"layer{i}.w": TensorRef(f"layer{i}.w") for i in range(1000)}
    groups = list(leaf_groups(tree, _is_ref))
    assert len(groups) == 1 and groups[0][2] == list(tree)
    check_tree(tree, dict.fromkeys(tree), True, "m")


@pytest.mark.parametrize("tree, message", [
    ({"a.b": TensorRef("a.b"), "a": {"b": TensorRef("a.b")}}, "both named 'a.b'"),
    ({"l": [TensorRef("l.0")], "l.0": 3}, "both named 'l.0'"),
    ({1: TensorRef("1"), "1": TensorRef("1")}, "both named '1'"),
    ({"a": TensorRef("b"), "b": 1}, "the tensor at 'a' is named 'b'"),
    ({"m": {"x": TensorRef("m.x"), "y": TensorRef("m.y")}, "k": 2}, "disagree on \\['m.z'"),
])
def test_errors_name_the_entry(tree, message: str) -> None:
    names = set(_ref_names(tree)) | ({"m.z"} if "m.z" in message else set())
    with pytest.raises(CorruptCheckpointError, match=message):
        check_tree(tree, names, True, "m")


@pytest.mark.parametrize("root", [TensorRef(""), 3, PerRankValues([TensorRef("0")]), []])
def test_a_root_that_is_a_leaf_is_one_run_at_the_empty_path(root) -> None:
    runs = list(leaf_groups(root, _is_ref if not isinstance(root, PerRankValues) else lambda v: True))
    expected = list(leaves(root, _is_ref if not isinstance(root, PerRankValues) else lambda v: True))
    assert [(leaf_path(p, k, i), v) for p, k, names, values in runs for i, v in enumerate(values)] == expected


class _SortedKeys(dict):
    """A dict subclass whose iteration (keys) is sorted but whose values() is in insertion order."""

    def __iter__(self):
        return iter(sorted(super().keys()))

    def keys(self):
        return sorted(super().keys())

    def items(self):
        return [(k, self[k]) for k in sorted(super().keys())]


class _ReversedValues(dict):
    def values(self):
        return list(reversed(list(super().values())))


@pytest.mark.parametrize("kind", [_SortedKeys, _ReversedValues])
def test_a_dict_subclass_whose_iteration_orders_differ_keeps_each_tensor_under_its_key(tmp_path, kind) -> None:
    import torch

    import shardckpt

    inner = kind()
    inner["b"], inner["a"] = torch.tensor([1.0, 2.0]), torch.tensor([7.0, 8.0])
    runs = list(leaf_groups({"m": inner}, lambda v: isinstance(v, torch.Tensor)))
    assert [(n, v.tolist()) for _, _, names, values in runs for n, v in zip(names, values)] == \
        [(f"m.{k}", v.tolist()) for k, v in inner.items()]
    shardckpt.save({"m": inner}, str(tmp_path / "c"))
    back = shardckpt.load_full(str(tmp_path / "c"))
    assert back["m"]["a"].tolist() == [7.0, 8.0] and back["m"]["b"].tolist() == [1.0, 2.0]
    target = {"m": {"a": torch.zeros(2), "b": torch.zeros(2)}}
    shardckpt.load(target, str(tmp_path / "c"))
    assert target["m"]["a"].tolist() == [7.0, 8.0] and target["m"]["b"].tolist() == [1.0, 2.0]
