"""``facts()``: every reader says what it knows of its checkpoint as a whole (format, place, world size, state-dict
type, metadata, identity) through the read interface, so that nobody reaches around it for a manifest."""
from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import shardckpt
from shardckpt.format.manifest import FORMAT_NAME
from shardckpt.formats.api import CheckpointReader, Facts
from shardckpt.formats.detect import open_reader
from shardckpt.formats.local_view import logical_view

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fixtures")


def _facts(path) -> Facts:
    reader = open_reader(path)
    assert isinstance(reader, CheckpointReader)
    return reader.facts()


def test_shardckpt_facts_come_from_the_manifest_and_the_identity_changes_with_every_save(tmp_path):
    path = tmp_path / "ck"
    shardckpt.save({"w": torch.ones(3)}, path, metadata={"state_dict_type": "SHARDED_STATE_DICT", "note": 1})
    facts = _facts(path)
    assert (facts.format, facts.world_size, facts.state_dict_type) == (FORMAT_NAME, 1, "SHARDED_STATE_DICT")
    assert facts.metadata == {"state_dict_type": "SHARDED_STATE_DICT", "note": 1}
    assert facts.location.startswith(str(path)) and facts.identity.startswith("shardckpt-generation:")
    shardckpt.save({"w": torch.ones(3)}, path, overwrite=True)
    again = _facts(path)
    assert again.identity != facts.identity and again.state_dict_type is None and again.metadata == {}


def test_the_local_fixture_says_it_is_local_and_its_by_parameter_view_is_the_same_checkpoint():
    reader = open_reader(os.path.join(FIXTURES, "local"))
    facts = reader.facts()
    assert (facts.world_size, facts.state_dict_type, facts.metadata["optim_key"]) == (2, "LOCAL_STATE_DICT", "PARAM_ID")
    assert logical_view(reader).facts() == facts


def test_foreign_readers_say_their_format_and_nothing_they_do_not_know(tmp_path):
    save_file({"w": torch.ones(2)}, str(tmp_path / "w.safetensors"))
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for path, name in ((tmp_path / "w.safetensors", "safetensors"), (tmp_path / "w.pt", "torch.save"),
                       (tmp_path / "dcp", "torch DCP")):
        facts = _facts(path)
        assert (facts.format, facts.world_size, facts.state_dict_type, facts.identity) == (name, None, None, None)
        assert facts.metadata == {} and str(path) in facts.location


def test_a_deepspeed_checkpoint_says_how_many_ranks_saved_it():
    facts = _facts(os.path.join(FIXTURES, "deepspeed", "zero2", "checkpoint"))
    assert (facts.format, facts.state_dict_type, facts.identity) == ("DeepSpeed", None, None)
    assert facts.world_size == 2 and "zero2" in facts.location
