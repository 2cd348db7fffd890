"""The package map is a one-way street: each package imports only the layers below it, and no import
cycle exists between packages, lazy (function-level) imports included. docs/architecture.md draws it."""
from __future__ import annotations

import ast
import os

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "shardckpt")
CLI = os.path.join(os.path.dirname(SRC), "..", "cli")

BASE = {"_version", "gc_pause", "records", "errors", "regions", "tensor_views", "sharded_tensor", "sizes", "options", "storage_options"}
# package -> what it may import besides itself (BASE modules import only each other).
ALLOWED = {
    "_version": set(),
    "gc_pause": set(),
    "records": set(),
    "errors": set(),
    "regions": {"records"},
    "sizes": set(),
    "options": {"sizes", "storage_options"},
    "storage_options": {"errors"},
    "tensor_views": {"regions"},
    "sharded_tensor": {"regions"},
    "dist": BASE,
    "io": BASE,
    "format": BASE,
    "formats": BASE | {"io", "format"},
    "checkpoint": BASE | {"dist", "io", "format", "formats"},
    "runtime": BASE | {"dist", "format"},  # format.flat_layout: the LOCAL layout it keeps its flat parameters by
    # The DCP storage backend: DCP's planners call it, it writes and reads through checkpoint/formats.
    "dcp": BASE | {"io", "format", "formats", "checkpoint"},
    "state_dict": BASE | {"dist", "io", "format", "formats", "checkpoint", "runtime"},
    "offline": BASE | {"dist", "io", "format", "formats", "checkpoint", "runtime", "state_dict"},
    # Checkpoint tiers (issue 40): the pure core now; save, replicate and restore through checkpoint and dist later.
    "tiers": BASE | {"dist", "io", "format", "formats", "checkpoint"},
    "api": BASE | {"dist", "io", "format", "formats", "checkpoint", "runtime", "state_dict", "offline"},
    "demo": BASE | {"dist", "io", "format", "checkpoint", "runtime", "state_dict", "tiers"},
    "cli": BASE | {"dist", "io", "format", "formats", "checkpoint", "runtime", "state_dict", "offline", "api", "demo", "tiers", "cli"},
}


def _unit(path: str, root: str) -> str:
    rel = os.path.relpath(path, root).replace(os.sep, "/")
    return rel.split("/")[0].removesuffix(".py")


def _absolute(node: ast.ImportFrom, package: str) -> list[str]:
    """The modules an import-from names, written absolutely (``from ..io import x`` in shardckpt.state_dict is
    shardckpt.io; ``from . import flat`` is shardckpt.state_dict.flat)."""
    if node.level == 0:
        return [node.module] if node.module else []
    parts = package.split(".")
    base = ".".join(parts[:len(parts) - node.level + 1])
    if node.module:
        return [f"{base}.{node.module}"]
    return [f"{base}.{a.name}" for a in node.names]


def _imports(path: str, package: str = "shardckpt") -> set[str]:
    """The shardckpt units a module of ``package`` imports, at any depth of the file (lazy imports count),
    through absolute and relative imports alike."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    out = set()
    for node in ast.walk(tree):
        modules = _absolute(node, package) if isinstance(node, ast.ImportFrom) else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and modules == ["shardckpt"]:
            # The root re-exports every layer: importing a name from it hides a dependency on all of them.
            out.update(a.name if a.name in ALLOWED else "shardckpt (the package root)" for a in node.names)
            continue
        for name in modules:
            parts = name.split(".")
            if parts[0] == "shardckpt" and len(parts) > 1:
                out.add(parts[1])
    return out


def _package(path: str, root: str, top: str) -> str:
    """The dotted package a module file belongs to (a package's __init__.py belongs to that package)."""
    rel = os.path.relpath(os.path.dirname(path), root).replace(os.sep, ".")
    return top if rel == "." else f"{top}.{rel}"


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for root, top, unit_of in ((SRC, "shardckpt", lambda p: _unit(p, SRC)), (CLI, "shardckpt.cli", lambda p: "cli")):
        for folder, _, files in os.walk(root):
            for name in files:
                if name.endswith(".py") and not (root == SRC and folder == SRC and name == "__init__.py"):
                    path = os.path.join(folder, name)
                    unit = unit_of(path)
                    graph.setdefault(unit, set()).update(_imports(path, _package(path, root, top)) - {unit})
    return graph


def test_every_package_imports_only_the_layers_below_it():
    graph = _graph()
    assert set(graph) <= set(ALLOWED), f"a new package needs its place in ALLOWED: {sorted(set(graph) - set(ALLOWED))}"
    wrong = {unit: sorted(deps - ALLOWED[unit]) for unit, deps in graph.items() if deps - ALLOWED[unit]}
    assert not wrong, f"imports against the one-way rule (see docs/architecture.md): {wrong}"


def test_no_import_cycle_between_packages():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(unit: str, path: list[str]) -> None:
        state[unit] = 1
        for dep in sorted(graph.get(unit, ())):
            if state.get(dep) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(path + [unit, dep])}")
            if dep not in state:
                visit(dep, path + [unit])
        state[unit] = 2

    for unit in sorted(graph):
        if unit not in state:
            visit(unit, [])


def test_the_rule_is_not_vacuous():
    graph = _graph()
    assert {"runtime", "checkpoint"} <= graph["state_dict"] and {"io", "format"} <= graph["checkpoint"]


def test_relative_imports_count(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from ..checkpoint import load\nfrom . import flat\nfrom .. import errors, api\n"
                   "import shardckpt.io\n")
    assert _imports(str(src), "shardckpt.state_dict") == {"checkpoint", "state_dict", "errors", "api", "io"}
    assert _imports(str(src), "shardckpt.cli") == {"checkpoint", "cli", "errors", "api", "io"}


def test_every_package_is_installed():
    """A wheel holds only the packages pyproject lists (an editable install hides a missing one)."""
    import tomllib

    with open(os.path.join(os.path.dirname(SRC), "..", "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    folders = [f for f, _, files in os.walk(SRC) if any(n.endswith(".py") for n in files)]
    assert all(os.path.exists(os.path.join(f, "__init__.py")) for f in folders), "a package without __init__.py"
    found = {"shardckpt." + os.path.relpath(f, SRC).replace(os.sep, ".") if f != SRC else "shardckpt" for f in folders}
    assert found | {"shardckpt.cli"} == listed, "every folder of src/shardckpt needs an __init__.py and a line in pyproject"


# Where a ``storage_options`` parameter may appear: the public edges that open a place (the verbs, ``save``,
# ``load``, the DCP backend torch opens by path, ``open_storage`` itself) and the typed specs that carry a
# conversion's two places to the processes that run it. Below them only an opened ``Storage`` travels.
STORAGE_OPTIONS_EDGES = {
    "api/check.py": {"inspect"}, "api/runs.py": {"ls"}, "api/tidy.py": {"gc", "rm", "latest"},
    "checkpoint/save.py": {"save", "plan"}, "checkpoint/load.py": {"load", "load_pieces", "load_full"},
    "checkpoint/lane.py": {"open_checkpoint"}, "checkpoint/latest.py": {"latest_checkpoint"},
    "formats/detect.py": {"open_reader"}, "formats/safetensors.py": {"open_safetensors"},
    "dcp/reader.py": {"__init__"}, "dcp/writer.py": {"__init__"},
    "state_dict/zero_redundancy.py": {"load_zero_partition_state"}, "io/__init__.py": {"open_storage"},
}


def _takes_storage_options() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for folder, _, files in os.walk(SRC):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    args = node.args.args + node.args.kwonlyargs + node.args.posonlyargs
                    if any(a.arg in ("storage_options", "dst_storage_options") for a in args):
                        found.setdefault(os.path.relpath(path, SRC).replace(os.sep, "/"), set()).add(node.name)
    return found


def test_storage_options_are_opened_at_the_edge_and_never_passed_down():
    """Issue 42: ``storage_options`` is not a tramp parameter. A function below the edges that takes it is a
    place that opens a path again instead of walking from the opened place (``io.navigate``)."""
    found = _takes_storage_options()
    extra = {path: names - STORAGE_OPTIONS_EDGES.get(path, set()) for path, names in found.items()}
    assert not {p: n for p, n in extra.items() if n}, "storage_options taken below the edge"
    assert found.get("api/check.py") == {"inspect"}  # the walk sees parameters: not vacuous (verify takes its spec)
