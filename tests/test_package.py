"""``import shardckpt`` is lazy (PEP 562): it imports no layer (no torch) until a name is used, and what
type checkers see (the TYPE_CHECKING imports) is what ``__getattr__`` gives."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import shardckpt

INIT = os.path.join(os.path.dirname(shardckpt.__file__), "__init__.py")


def test_type_checkers_see_what_getattr_gives():
    tree = ast.parse(open(INIT, encoding="utf-8").read())
    checked = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                checked.update({a.name: imp.module for a in imp.names})
    assert checked == shardckpt._WHERE
    assert set(shardckpt.__all__) == set(checked) | {n for n in shardckpt.__all__ if n.endswith("Error")}
    for name in shardckpt.__all__:
        assert getattr(shardckpt, name) is not None, name


def test_import_is_lazy_and_the_runtime_alone_finds_its_state_dict_handlers():
    code = ("import sys, shardckpt; assert 'torch' not in sys.modules, 'import shardckpt imported torch'\n"
            "from shardckpt.runtime.api import _module_state_handlers\n"
            "assert 'shardckpt.state_dict' not in sys.modules\n"
            "assert _module_state_handlers() is not None and 'shardckpt.state_dict' in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
