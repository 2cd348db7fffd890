"""mkdocs hooks: the repository's FORMAT.md is a page of the manual (docs/format.md does not exist: the file
stays where README and GitHub link it), and links out of docs/ to it point at that page."""
from __future__ import annotations

import os

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES_FROM_ROOT = {"FORMAT.md": "format.md"}  # a file at the repository root -> its page in the manual


def on_files(files, config):
    for name, uri in PAGES_FROM_ROOT.items():
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            files.append(File.generated(config, uri, content=f.read()))
    return files


def on_page_markdown(markdown, page, config, files):
    for name, uri in PAGES_FROM_ROOT.items():
        markdown = markdown.replace(f"](../{name}", f"]({uri}")
    if page.file.src_uri in PAGES_FROM_ROOT.values():
        markdown = markdown.replace("](docs/", "](")
    return markdown
