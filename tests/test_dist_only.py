"""shardckpt.dist is the only package that talks to torch.distributed: every collective, process-group creation
and rank/world query elsewhere goes through it. Outside dist/, only the type imports listed below may name
torch.distributed (DTensor and placement types, for detection and layout arithmetic; no communication). The
command line (cli/, installed as shardckpt.cli) is held to the same rule."""
from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(REPO, "src", "shardckpt")
CLI = os.path.join(REPO, "cli")
DIST = os.path.join(SRC, "dist")

# (module, name) pairs a `from torch.distributed... import name` outside dist/ may take.
TYPE_IMPORTS = {
    ("torch.distributed.tensor", "DTensor"),
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"),
    ("torch.distributed.tensor.placement_types", "Partial"),
    ("torch.distributed.tensor.placement_types", "Replicate"),
    # DCP's metadata records, which offline.dcp_output pickles into a DCP checkpoint's .metadata
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "BytesStorageMetadata", "ChunkStorageMetadata", "Metadata", "MetadataIndex", "StorageMeta",
        "TensorProperties", "TensorStorageMetadata")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
}
TD = "torch.distributed"

# shardckpt.dcp (the storage backend DCP's own save/load call) implements DCP's interface classes, so it
# imports them, and DCP's flattening walk, from these modules; DCP makes the collectives, dcp/ makes none.
# Only dcp/ may, and only these modules.
DCP_INTERFACE_MODULES = {
    "torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.storage", "torch.distributed.checkpoint._traverse",
}
DCP_PACKAGE = os.path.join(SRC, "dcp")


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _is_td(module: str) -> bool:
    return module == TD or module.startswith(TD + ".")


def uses_of_torch_distributed(path: str, interface_modules: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """Every place the module reaches torch.distributed other than an allowed type import (or a name from one of
    ``interface_modules``), as 'line: what'."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    found: list[str] = []
    aliases: set[str] = set()  # names bound to torch.distributed or one of its submodules
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _is_td(a.name):
                    found.append(f"{node.lineno}: import {a.name}" + (f" as {a.asname}" if a.asname else ""))
                    if a.asname:
                        aliases.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if (node.module == "torch" and a.name == "distributed") or \
                        (_is_td(node.module) and (node.module, a.name) not in TYPE_IMPORTS
                         and node.module not in interface_modules):
                    found.append(f"{node.lineno}: from {node.module} import {a.name}")
                    if node.module == "torch" or _is_td(full):
                        aliases.add(a.asname or a.name)
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:  # only the whole chain: a.b.c, not a.b
            continue
        name = _dotted(node)
        if name is None:
            continue
        head = name.split(".")[0]
        if name.startswith(TD + ".") or head in aliases and "." in name:
            found.append(f"{node.lineno}: {name}")
    return sorted(set(found), key=lambda s: (int(s.split(":")[0]), s))


def _scan(include_dist: bool) -> dict[str, list[str]]:
    out = {}
    for folder, _, files in (*os.walk(SRC), *os.walk(CLI)):
        if not include_dist and (folder == DIST or folder.startswith(DIST + os.sep)):
            continue
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                in_dcp = folder == DCP_PACKAGE or folder.startswith(DCP_PACKAGE + os.sep)
                uses = uses_of_torch_distributed(path, DCP_INTERFACE_MODULES if in_dcp else frozenset())
                if uses:
                    out[os.path.relpath(path, REPO)] = uses
    return out


def test_only_dist_calls_torch_distributed():
    wrong = _scan(include_dist=False)
    assert not wrong, f"torch.distributed used outside shardckpt.dist (go through shardckpt.dist): {wrong}"


def test_the_scan_is_not_vacuous():
    found = _scan(include_dist=True)
    dist_uses = [use for path, uses in found.items() if path.startswith(os.path.join("src", "shardckpt", "dist", ""))
                 for use in uses]
    assert any(use.endswith("dist.all_gather_object") for use in dist_uses), dist_uses
    assert any("import torch.distributed as dist" in use for use in dist_uses), dist_uses


def test_the_scan_catches_each_way_in(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import torch\n"
        "import torch.distributed as d\n"
        "from torch import distributed\n"
        "from torch.distributed import all_reduce\n"
        "from torch.distributed.tensor import DTensor\n"
        "def f(x):\n"
        "    torch.distributed.barrier()\n"
        "    d.get_rank()\n"
        "    distributed.new_group([0])\n"
        "    return isinstance(x, DTensor)\n")
    uses = uses_of_torch_distributed(str(src))
    assert uses == ["2: import torch.distributed as d", "3: from torch import distributed",
                    "4: from torch.distributed import all_reduce", "7: torch.distributed.barrier",
                    "8: d.get_rank", "9: distributed.new_group"], uses


def test_the_dcp_package_takes_dcp_interface_classes_and_nothing_else(tmp_path):
    """dcp/'s allowance is DCP's interface modules by name: a collective from torch.distributed is still caught."""
    src = tmp_path / "m.py"
    src.write_text(
        "from torch.distributed.checkpoint.storage import StorageWriter\n"
        "from torch.distributed.checkpoint.state_dict_saver import save\n"
        "from torch.distributed import barrier\n")
    uses = uses_of_torch_distributed(str(src), DCP_INTERFACE_MODULES)
    assert uses == ["2: from torch.distributed.checkpoint.state_dict_saver import save",
                    "3: from torch.distributed import barrier"], uses
    assert len(uses_of_torch_distributed(str(src))) == 3


def test_the_scan_covers_the_command_line():
    scanned = {os.path.relpath(os.path.join(f, n), REPO) for root in (SRC, CLI) for f, _, names in os.walk(root)
               for n in names if n.endswith(".py")}
    assert os.path.join("cli", "convert_cmd.py") in scanned and os.path.join("cli", "main.py") in scanned
