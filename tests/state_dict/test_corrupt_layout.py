"""A LOCAL checkpoint whose saved flat layout is broken (re-sealed, so the manifest checksum passes) is a
corrupt checkpoint, on every rank, not a ShardingError from deep inside the runtime."""
from __future__ import annotations

import os

import pytest

from shardckpt import CorruptCheckpointError
from tests._dist import run_ranks
from tests.state_dict._train import load_state_refused, save_local_state
from tests.storage._util import manifest_doc, sealed


@pytest.mark.parametrize("damage", ["offsets not ints", "layout not an object"])
def test_a_broken_saved_layout_is_a_corrupt_checkpoint(tmp_path, damage):
    path = str(tmp_path / "ckpt")
    run_ranks(2, save_local_state, path)
    manifest = os.path.join(path, "manifest.json")
    doc = manifest_doc(open(manifest, "rb").read())
    layouts = doc["tree"]["model"]["_flat_layouts"]
    key = sorted(layouts)[0]
    if damage == "offsets not ints":
        layouts[key]["offsets"] = ["x"] * len(layouts[key]["offsets"])
    else:
        layouts[key] = [1, 2, 3]
    with open(manifest, "wb") as f:
        f.write(sealed(doc))
    run_ranks(2, load_state_refused, path, CorruptCheckpointError, "_flat_layouts")
