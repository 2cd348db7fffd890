"""The manual cannot rot: every ``python`` block of every page in docs/ runs (a page's blocks in order, in one
process and one empty directory, as a reader would), docs/cli.md is what docs/gen_cli_reference.py makes of
the parser, every public name has a reference page, and ``mkdocs build --strict`` passes (broken links,
missing pages, docstrings mkdocstrings cannot resolve)."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
RUN_BLOCKS = """
import json, sys
page, blocks = json.load(sys.stdin)
scope = {"__name__": "__main__"}
for i, code in enumerate(blocks, 1):
    exec(compile(code, f"docs/{page} (python block {i})", "exec"), scope)
"""


def _pages() -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), DOCS) for d, _, files in os.walk(DOCS) for f in files
                  if f.endswith(".md"))


def _python_blocks(page: str) -> list[str]:
    with open(os.path.join(DOCS, page), encoding="utf-8") as f:
        return [code for lang, code in FENCE.findall(f.read()) if lang == "python"]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_cli_reference", os.path.join(DOCS, "gen_cli_reference.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_page(page: str, folder: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    return subprocess.run([sys.executable, "-c", RUN_BLOCKS], input=json.dumps([page, _python_blocks(page)]),
                          cwd=folder, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def page_runs(tmp_path_factory):
    """Every page's blocks, two pages at a time (each process spends most of its time importing torch)."""
    pages = [p for p in _pages() if _python_blocks(p)]
    with ThreadPoolExecutor(2) as pool:
        runs = {p: pool.submit(_run_page, p, str(tmp_path_factory.mktemp(p.replace("/", "-")))) for p in pages}
        yield runs


@pytest.mark.parametrize("page", [p for p in _pages() if _python_blocks(p)])
def test_python_blocks_of_the_page_run(page, page_runs):
    run = page_runs[page].result()
    assert run.returncode == 0, run.stderr[-3000:]


def test_the_guide_pages_have_examples_that_run():
    assert {"getting-started.md", "async-save.md", "storage.md", "run-directories.md", "formats.md",
            "state-dicts.md"} <= \
        {p for p in _pages() if _python_blocks(p)}


def test_cli_reference_is_what_the_parser_says():
    with open(os.path.join(DOCS, "cli.md"), encoding="utf-8") as f:
        written = f.read()
    assert written == _generator().render(), "docs/cli.md is out of date: run python docs/gen_cli_reference.py"


def test_cli_reference_has_every_verb_and_option():
    from shardckpt.api.spec import VERBS, params

    text = _generator().render()
    for verb in VERBS:
        assert f"## shardckpt {verb.name}\n" in text
        section = text.split(f"## shardckpt {verb.name}\n")[1].split("\n## ")[0]
        for param in params(verb.load()):
            name = param.name.upper() if param.positional else param.flags[0]
            assert f"`{name}" in section, (verb.name, name)


def test_every_public_name_has_a_reference_page():
    import shardckpt
    import shardckpt.api

    text = "\n".join(open(os.path.join(DOCS, p), encoding="utf-8").read() for p in _pages() if p.startswith("api"))
    documented = set(re.findall(r"^::: (\S+)$", text, re.MULTILINE))
    missing = [n for n in shardckpt.__all__ if f"shardckpt.{n}" not in documented]
    missing += [n for n in shardckpt.api.__all__ if f"shardckpt.{n}" not in documented
                and f"shardckpt.api.{n}" not in documented]
    assert not missing, f"no ::: directive in docs/api/ for {sorted(set(missing))}"


def test_every_page_is_in_the_nav():
    yaml = pytest.importorskip("yaml")
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        nav = json.dumps(yaml.safe_load(f)["nav"])
    assert [p for p in _pages() if f'"{p}"' not in nav] == []


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    assert os.path.exists(tmp_path / "site" / "api" / "convert" / "index.html")
