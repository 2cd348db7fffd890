"""Between DCP's flat keys and shardckpt's nested tree, both ways.

DCP flattens a state dict (``torch/distributed/checkpoint/_nested_dict.py``): every mapping is walked, its
keys made ``str``; a list is walked only if it holds tensors or mappings; each leaf's key is its path
joined by ``.``, which is also the name shardckpt gives a tensor at that path. ``Metadata.planner_data``
keeps each key's path, from which the writer rebuilds the nesting; the reader flattens a saved tree the
same way DCP flattens the state dict it loads into, so the keys meet.
"""
from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint._traverse import traverse_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from shardckpt.format.tree import TensorRef, depth_exceeds, holds

__all__ = ["TensorLeaf", "nested_tree", "flat_leaves"]


class TensorLeaf:
    """A tensor's place in the rebuilt tree (encoded as ``{"$tensor": name}``, named by its path)."""


def _paths(metadata: Metadata) -> dict[str, tuple]:
    """Each key's path: from DCP's flattening where the planner kept it, else the key itself."""
    keys = metadata.state_dict_metadata
    mappings = metadata.planner_data
    if isinstance(mappings, dict) and all(isinstance(mappings.get(k), tuple) and mappings[k] and
                                          ".".join(map(str, mappings[k])) == k for k in keys):
        return {k: tuple(mappings[k]) for k in keys}
    return {k: (k,) for k in keys}


def nested_tree(metadata: Metadata, values: dict[str, Any]) -> dict:
    """The saved state dict's nesting, tensors as ``TensorLeaf``, other leaves from ``values`` (by key)."""
    root: dict = {}
    for key, path in _paths(metadata).items():
        leaf = TensorLeaf() if isinstance(metadata.state_dict_metadata[key], TensorStorageMetadata) else values.get(key)
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = leaf
    return _lists(root)


def _lists(node: Any) -> Any:
    """Dicts whose keys are the ints 0..n-1 (DCP's list indices) back into lists."""
    if not isinstance(node, dict):
        return node
    out = {k: _lists(v) for k, v in node.items()}
    if out and all(isinstance(k, int) for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    return out


def _plain(node: Any) -> Any:
    """Per-rank values, and tuples that hold tensors, as lists (DCP walks lists, not tuples); a tuple of plain
    values stays one value, as DCP saves it."""
    if isinstance(node, dict):
        return {k: _plain(v) for k, v in node.items()}
    if isinstance(node, list) or isinstance(node, tuple) and holds(node, lambda v: isinstance(v, TensorRef)):
        return [_plain(v) for v in node]
    return node


def flat_leaves(tree: Any) -> dict[str, Any]:
    """DCP's keys for a decoded shardckpt tree: ``TensorRef`` and plain-value leaves by flat key."""
    if not isinstance(tree, dict) or depth_exceeds(tree):
        return {}
    found: dict[str, Any] = {}

    def visit(path: tuple, value: Any) -> None:
        found[".".join(map(str, path))] = value

    traverse_state_dict(_plain(tree), visit, lambda v: isinstance(v, TensorRef))
    return found
