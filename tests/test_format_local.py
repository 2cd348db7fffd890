"""FORMAT.md is enough to read a LOCAL checkpoint: a reader written from its rules alone (no shardckpt code below the
line that says so) reads the golden ``fixtures/local*/`` as ``load_full`` does, and by parameter as shardckpt's own
load does (names, shapes, aliases, optimizer state by ID or by name, per flat group or saved with
``use_orig_params``, param-group order), padding never showing."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import shardckpt
from tests.test_fixtures import _assert_bit_equal

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
FIXTURE = os.path.join(ROOT, "local")
# fixtures/make_local_fixture.py's VARIANTS, and the keys of their optimizer state by parameter
FIXTURES = {"local": [1, 2, 3, 4, 5, 6, 7], "local-orig": [1, 2, 3, 4, 5, 6, 7],
            "local-names": ["emb.weight", "blocks.0.gate", "blocks.0.fc.weight", "blocks.0.fc.bias", "blocks.1.gate",
                            "blocks.1.fc.weight", "blocks.1.fc.bias"]}

# ------------------------------------------------------------------ the reader: FORMAT.md's rules, nothing else

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}
SEAL = 21


def _crc_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # 0x1EDC6F41, reflected
        table.append(c)
    return table


TABLE = _crc_table()


def crc(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c = TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _strict_json(data: bytes):
    def pairs(items):
        assert len({k for k, _ in items}) == len(items), "duplicate key"
        return dict(items)  # keeps the keys' order: the layouts' order matters
    return json.loads(data.decode("utf-8"), object_pairs_hook=pairs, parse_constant=lambda c: 1 / 0)


def _decode(node):
    if isinstance(node, list):
        return [_decode(v) for v in node]
    if not isinstance(node, dict):
        return node
    if len(node) == 1:
        (tag, body), = node.items()
        if tag == "$tensor":
            return ("tensor", body)
        if tag == "$tuple":
            return tuple(_decode(v) for v in body)
        if tag == "$dict":
            return {_decode(k): _decode(v) for k, v in body}
        if tag == "$float":
            return float(body)
    return {k: _decode(v) for k, v in node.items()}


class Reader:
    def __init__(self, root: str):
        self.root = root
        data = open(os.path.join(root, "manifest.json"), "rb").read()
        assert data[:11] == b'{"crc32c":"' and int(data[11:19], 16) == crc(data[SEAL:]), "manifest checksum"
        self.doc = _strict_json(data)
        self.tree = _decode(self.doc["tree"])
        self._rows: dict[int, dict] = {}

    def _index(self, f: int) -> dict:
        if f not in self._rows:
            entry = self.doc["files"][f]
            assert os.path.getsize(os.path.join(self.root, entry["path"])) == entry["size"]
            raw = open(os.path.join(self.root, entry["index"]["path"]), "rb").read()
            assert len(raw) == entry["index"]["size"] and crc(raw) == entry["index"]["crc32c"]
            self._rows[f] = {(r[0], r[1]): r for r in _strict_json(raw)["chunks"]}
        return self._rows[f]

    def tensor(self, name: str) -> torch.Tensor:
        t = self.doc["tensors"][name]
        dtype, shape = DTYPES[t["dtype"]], t["shape"]
        numel = math.prod(shape)
        size = torch.empty((), dtype=dtype).element_size()
        out = bytearray(numel * size)
        chunks = t["chunks"]
        assert isinstance(chunks, dict), "this fixture has regular chunks only"
        s, files = chunks["size"], chunks["files"]
        assert chunks["count"] == -(-numel // s)
        for i in range(chunks["count"]):
            f = files[i] if isinstance(files, list) else files["first"] + i * files["step"]
            _, _, offset, length, row_crc, codec, _ = self._index(f)[(name, i)]
            assert codec == "raw" and length == (min((i + 1) * s, numel) - i * s) * size
            with open(os.path.join(self.root, self.doc["files"][f]["path"]), "rb") as fh:
                fh.seek(offset)
                data = fh.read(length)
            assert crc(data) == row_crc, f"{name} chunk {i}"
            out[i * s * size:i * s * size + length] = data
        assert crc(bytes(out)) == t["crc32c"], f"{name}: whole-tensor checksum"
        return torch.frombuffer(out, dtype=dtype).reshape(shape) if numel else torch.empty(shape, dtype=dtype)

    def full(self) -> dict:
        """The tree with every tensor read (what ``load_full`` gives)."""
        return self._full(self.tree)

    def _full(self, node):
        if isinstance(node, tuple) and len(node) == 2 and node[0] == "tensor":
            return self.tensor(node[1])
        if isinstance(node, dict):
            return {k: self._full(v) for k, v in node.items()}
        if isinstance(node, list):
            return [self._full(v) for v in node]
        if isinstance(node, tuple):
            return tuple(self._full(v) for v in node)
        return node


def by_parameter(full: dict, metadata: dict) -> tuple[dict, dict, list[str]]:
    """A LOCAL checkpoint's model and optimizer state by parameter name (FORMAT.md, "LOCAL checkpoints"); and the
    padding of every flat tensor (model and optimizer), which must be zeros... for the model's."""
    model, layouts = full["model"], full["model"]["_flat_layouts"]
    order = metadata.get("param_names")
    if order is None:
        placed = {p: n for lay in layouts.values() for n, p in zip(lay["names"], lay["positions"])}
        order = [placed[i] for i in range(len(placed))]
    position = {name: i for i, name in enumerate(order)}
    by_id = metadata["optim_key"] == "PARAM_ID"
    flat_keys = list(layouts)  # an ID is a flat key's place here

    def members(flat_key: str, flat: torch.Tensor):
        lay = layouts[flat_key]
        assert list(flat.shape) == [lay["padded_numel"]] and lay["padded_numel"] == lay["world_size"] * lay["shard_numel"]
        for name, shape, offset, aliases in zip(lay["names"], lay["shapes"], lay["offsets"], lay["aliases"]):
            yield name, aliases, flat[offset:offset + math.prod(shape)].reshape(shape)

    params, padding = {}, []
    for key, lay in layouts.items():
        used = torch.zeros(lay["padded_numel"], dtype=torch.bool)
        for name, aliases, value in members(key, model[key]):
            for fqn in [name] + aliases:
                params[fqn] = value
        for shape, offset in zip(lay["shapes"], lay["offsets"]):
            used[offset:offset + math.prod(shape)] = True
        padding.append(model[key][~used])
    buffers = {k: v for k, v in model.items() if k != "_flat_layouts" and k not in layouts}

    optim, state = full["optim"], {}
    member_names = {n for lay in layouts.values() for n in lay["names"]}
    keys = list(optim["state"]) + [p for pg in optim["param_groups"] for p in pg["params"]]
    id_names = {p: n for pg in optim["param_groups"] for p, n in zip(pg["params"], pg.get("param_names", []))}
    if all(id_names.get(k, k) in member_names for k in keys):  # saved with use_orig_params: by parameter already
        return {"model": {**params, **buffers}, "optim": optim}, padding
    for key, entry in optim["state"].items():
        flat_key = flat_keys[key] if by_id else key
        for name, _, _ in members(flat_key, model[flat_key]):
            mine = {}
            for k, v in entry.items():
                if isinstance(v, torch.Tensor) and list(v.shape) == list(model[flat_key].shape):
                    mine[k] = dict((n, t) for n, _, t in members(flat_key, v))[name]
                else:
                    mine[k] = v
            state[position[name] if by_id else name] = mine
    groups = []
    for pg in optim["param_groups"]:
        names = sorted((n for p in pg["params"] for n in layouts[flat_keys[p] if by_id else p]["names"]),
                       key=position.__getitem__)
        group = {k: v for k, v in pg.items() if k not in ("params", "param_names")}
        group["params"] = [position[n] for n in names] if by_id else names
        if by_id:
            group["param_names"] = names
        groups.append(group)
    state = {k: state[k] for k in sorted(state, key=lambda k: k if by_id else position[k])}
    return {"model": {**params, **buffers}, "optim": {"state": state, "param_groups": groups}}, padding

# ------------------------------------------------------------------ the checks, against shardckpt's own reading


def _make_fixture():
    spec = importlib.util.spec_from_file_location("make_local_fixture", os.path.join(ROOT, "make_local_fixture.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("fixture", FIXTURES)
def test_the_reader_reads_the_fixture_as_load_full_does(fixture):
    reader = Reader(os.path.join(ROOT, fixture))
    mine, theirs = reader.full(), shardckpt.load_full(os.path.join(ROOT, fixture))
    _assert_bit_equal(mine, theirs)
    assert mine["model"]["_flat_layouts"] == theirs["model"]["_flat_layouts"]
    assert mine["optim"]["param_groups"] == theirs["optim"]["param_groups"] and mine["step"] == theirs["step"] == 1


@pytest.mark.parametrize("fixture", FIXTURES)
def test_by_parameter_the_reader_gets_what_shardckpt_loads(fixture):
    reader = Reader(os.path.join(ROOT, fixture))
    metadata = reader.doc["metadata"]
    assert metadata["state_dict_type"] == "LOCAL_STATE_DICT"
    assert metadata["optim_key"] == ("PARAM_NAME" if fixture == "local-names" else "PARAM_ID")
    mine, padding = by_parameter(reader.full(), metadata)
    # shardckpt loads a LOCAL checkpoint into an unsharded (FULL-shaped) target by parameter: strict, so its names
    # and shapes must be the reader's exactly; then the values and the param groups must be too.
    target = {"model": {k: torch.zeros_like(v) for k, v in mine["model"].items()},
              "optim": {"state": {k: {n: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
                                      for n, v in s.items()} for k, s in mine["optim"]["state"].items()},
                        "param_groups": []}, "step": 0}
    shardckpt.load(target, os.path.join(ROOT, fixture))
    _assert_bit_equal(target, mine)
    assert target["optim"]["param_groups"] == mine["optim"]["param_groups"]
    assert list(target["optim"]["state"]) == list(mine["optim"]["state"]) == FIXTURES[fixture]  # no ID 0: frozen
    assert all(not p.any() for p in padding)


def test_the_fixture_covers_what_a_reader_must_get_right():
    reader = Reader(FIXTURE)
    full = reader.full()
    layouts = full["model"]["_flat_layouts"]
    mine, _ = by_parameter(full, reader.doc["metadata"])
    model = _make_fixture().make_model()
    assert torch.equal(mine["model"]["pos"], model.pos) and torch.equal(mine["model"]["blocks.1.mask"], model.blocks[1].mask)
    assert mine["model"]["head.weight"] is mine["model"]["emb.weight"]  # an alias: one parameter, two names
    assert not layouts["_frozen_flat_param"]["requires_grad"] and "_frozen_flat_param" not in (
        reader.doc["tree"]["optim"]["param_groups"][0].get("param_names", []))
    block = layouts["blocks.0._flat_param"]
    assert block["offsets"][2] > block["offsets"][1] + math.prod(block["shapes"][1])  # a gap between members
    assert block["padded_numel"] > block["numel"]  # padding at the end
    weight_at, cols = block["offsets"][1], block["shapes"][1][1]
    assert (block["shard_numel"] - weight_at) % cols  # the shards split fc.weight mid-row
    groups = mine["optim"]["param_groups"]
    stored = reader.doc["tree"]["optim"]["param_groups"]
    assert stored[0]["param_names"] == ["blocks.1._flat_param", "_flat_param"]  # not the layouts' order ...
    assert groups[0]["param_names"] == ["emb.weight", "blocks.1.gate", "blocks.1.fc.weight", "blocks.1.fc.bias"]
    assert groups[1]["params"] == [2, 3, 4] and groups[1]["lr"] == 0.02  # ... by parameter: sorted by param_names


def test_loading_by_parameter_does_not_depend_on_what_was_imported():
    """``load`` reads LOCAL by parameter whatever else was imported, and reading LOCAL (load, inspect by parameter)
    imports neither the training runtime nor the state-dict layer: LOCAL's layout is the format's."""
    reader = Reader(FIXTURE)
    mine, _ = by_parameter(reader.full(), reader.doc["metadata"])
    shapes = {k: list(v.shape) for k, v in mine["model"].items()}
    code = ("import json, sys, torch, shardckpt\n"
            "target = {'model': {k: torch.zeros(s) for k, s in json.loads(sys.argv[2]).items()}}\n"
            "shardckpt.load(target, sys.argv[1], strict=False)\n"
            "assert shardckpt.inspect(sys.argv[1]).details['parameters']\n"
            "assert not {'shardckpt.runtime', 'shardckpt.state_dict'} & set(sys.modules), 'imported to read'\n"
            "print(json.dumps({k: v.tolist() for k, v in target['model'].items()}))\n")
    done = subprocess.run([sys.executable, "-c", code, FIXTURE, json.dumps(shapes)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-500:]
    got = json.loads(done.stdout)
    assert all(torch.equal(torch.tensor(got[k], dtype=v.dtype).reshape(v.shape), v) for k, v in mine["model"].items())
