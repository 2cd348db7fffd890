"""Fuzzing every parser and reader with hypothesis (issue 16, hostile inputs), in a child process whose
address space is capped (``test_fuzz.py`` runs it and checks its report).

Each target starts from a real checkpoint and mutates one artifact, structure-aware where a checksum
would otherwise refuse every mutation at the first step (a mutated manifest is re-sealed; a mutated chunk
index gets its size and CRC updated in a re-sealed manifest; a mutated safetensors header gets a matching
length prefix), byte-level where the format has no checksum (DCP ``.metadata``, ``torch.save`` archives):

- ``manifest``: a JSON value anywhere in manifest.json replaced, removed or duplicated, then re-sealed;
- ``manifest-bytes``: bytes of manifest.json flipped, cut or inserted (re-sealed half the time);
- ``index``: a JSON value anywhere in a chunk index replaced or removed;
- ``safetensors``: a JSON value anywhere in a safetensors header replaced or removed;
- ``dcp-metadata``: bytes of a torch DCP ``.metadata`` pickle flipped, cut or inserted;
- ``torch-save``: bytes of a ``torch.save`` zip archive flipped, cut or inserted.

Every example is read with ``load_full`` (and, for shardckpt's own format, ``verify``). Allowed outcomes:
a ``CheckpointError`` (the documented refusal), or a load whose tensors hold exactly the original bytes
under their original names (a mutation that changes no value, e.g. in ``metadata``). Anything else (another
exception type, a MemoryError under the cap, wrong bytes, ``verify`` and ``load_full`` disagreeing) is
reported; so is a checkpoint ``verify`` passes and ``load_full`` refuses. Prints one JSON line: per target, examples, refused, loaded, and the failures.

    python tests/storage/_fuzz.py WORKDIR EXAMPLES_PER_TARGET [TARGET...]
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import traceback
from collections import Counter

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import shardckpt  # noqa: E402
from shardckpt.checkpoint.verify import verify  # noqa: E402
from shardckpt.errors import CheckpointError  # noqa: E402
from shardckpt.format.checksum import crc32c  # noqa: E402
from shardckpt.format.manifest import seal  # noqa: E402
from shardckpt.tensor_views import as_bytes  # noqa: E402

MEMORY_CAP = 2 << 30  # address space allowed above what the process holds once everything is imported
TARGETS = ("manifest", "manifest-bytes", "index", "safetensors", "dcp-metadata", "torch-save")

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.sampled_from([0, -1, 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, 10**30])
    | st.floats(allow_nan=True) | st.text(max_size=12)
    | st.sampled_from(["../x", "/etc/passwd", "data-0/../../x", "float32", "bfloat16", "int64", "zstd", "raw"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(64, 33, generator=g), "b": torch.randn(33, generator=g).to(torch.bfloat16),
                      "i": torch.arange(10, dtype=torch.int64), "z": torch.tensor(3.5), "e": torch.empty(0, 4)},
            "step": 7, "note": "x"}


def _flat(tree, prefix="") -> dict[str, torch.Tensor]:
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
    elif isinstance(tree, torch.Tensor):
        out[prefix[:-1]] = tree
    return out


ORIGINAL = _flat(_state())


def _paths(doc, here=()) -> list[tuple]:
    """Every place in a JSON document (as key/index paths)."""
    out = [here]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, here + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, here + (i,))
    return out


MUTATION = [""]  # the last mutation, for failure reports


def _mutate_json(doc, data) -> object:
    """``doc`` with one place replaced by hostile JSON, removed, or duplicated (lists), chosen by ``data``."""
    where = data.draw(st.sampled_from(_paths(doc)[1:] or [()]))
    how = data.draw(st.sampled_from(["replace", "remove", "duplicate"]))
    MUTATION[0] = f"{how} at {list(where)}"
    if not where:
        return data.draw(JSON)
    parent = doc
    for k in where[:-1]:
        parent = parent[k]
    last = where[-1]
    if how == "replace" or (how == "duplicate" and not isinstance(parent, list)):
        parent[last] = data.draw(JSON)
        MUTATION[0] += f" with {json.dumps(parent[last])[:200]}"
    elif how == "remove":
        del parent[last]
    else:
        parent.insert(last, parent[last])
    return doc


def _mutate_bytes(raw: bytes, data) -> bytes:
    b = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        how = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = data.draw(st.integers(0, max(len(b) - 1, 0)))
        if how == "flip" and b:
            b[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif how == "cut":
            del b[pos:pos + data.draw(st.integers(1, 64))]
        else:
            b[pos:pos] = data.draw(st.binary(min_size=1, max_size=16))
    return bytes(b)


def _unsealed(manifest: bytes) -> dict:
    doc = json.loads(manifest)
    doc.pop("crc32c", None)
    return doc


def _sealed(doc) -> bytes:
    body = json.dumps(doc).encode() if isinstance(doc, dict) else b"{}"
    return seal(body if body.startswith(b"{") and body != b"{}" else b'{"x": 1}')


class Fuzzer:
    def __init__(self, work: str):
        self.work = work
        self.counts: dict[str, Counter] = {t: Counter() for t in TARGETS}
        self.failures: dict[str, list[str]] = {t: [] for t in TARGETS}
        self.native = os.path.join(work, "native")
        shardckpt.save(_state(), self.native)
        self.manifest = open(os.path.join(self.native, "manifest.json"), "rb").read()
        files = _unsealed(self.manifest)["files"]
        self.index_name = files[0]["index"]["path"]
        self.index = open(os.path.join(self.native, self.index_name), "rb").read()
        self.st_path = os.path.join(work, "model.safetensors")
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in ORIGINAL.items()}, self.st_path)
        raw = open(self.st_path, "rb").read()
        n = int.from_bytes(raw[:8], "little")
        self.st_header, self.st_data = json.loads(raw[8:8 + n]), raw[8 + n:]
        import torch.distributed.checkpoint as dcp

        self.dcp_path = os.path.join(work, "dcp")
        dcp.save({k: v.clone() for k, v in ORIGINAL.items()}, checkpoint_id=self.dcp_path, no_dist=True)
        self.dcp_metadata = open(os.path.join(self.dcp_path, ".metadata"), "rb").read()
        self.pt_path = os.path.join(work, "model.pt")
        torch.save(ORIGINAL, self.pt_path)
        self.pt = open(self.pt_path, "rb").read()

    # -- one example ---------------------------------------------------------------------------------
    def check(self, target: str, path: str, native: bool) -> None:
        c, fail = self.counts[target], self.failures[target]
        c["examples"] += 1
        try:
            loaded = _flat(shardckpt.load_full(path))
        except CheckpointError:
            loaded = None
        except MemoryError:
            fail.append("MemoryError under the cap")
            return
        except Exception as e:  # noqa: BLE001 - what the suite looks for
            fail.append(f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)[-600:]}")
            return
        if loaded is not None:
            for name, t in loaded.items():
                if name in ORIGINAL and bytes(as_bytes(t).numpy()) != bytes(as_bytes(ORIGINAL[name]).numpy()):
                    fail.append(f"wrong bytes for {name!r} (dtype {t.dtype}, shape {tuple(t.shape)})")
        if native:
            try:
                ok = verify(path).ok
            except CheckpointError:
                ok = False
            except Exception as e:  # noqa: BLE001
                fail.append(f"verify raised {type(e).__name__}: {e}")
                return
            if ok and loaded is None:
                fail.append(f"verify says ok but load_full refused; mutation: {MUTATION[0]}")
            if loaded is not None and not ok:
                # load_full read exactly the original bytes (checked above) and verify, which also
                # checks whole-tensor checksums and every file, found a hand-made inconsistency: fine.
                c["loaded, verify damaged"] += 1
        c["loaded" if loaded is not None else "refused"] += 1

    def _write(self, path: str, data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)

    # -- the targets ---------------------------------------------------------------------------------
    def manifest_json(self, data) -> None:
        self._write(os.path.join(self.native, "manifest.json"), _sealed(_mutate_json(_unsealed(self.manifest), data)))
        self.check("manifest", self.native, True)

    def manifest_bytes(self, data) -> None:
        raw = _mutate_bytes(self.manifest, data)
        if data.draw(st.booleans()):
            try:
                raw = _sealed(_unsealed(raw))
            except ValueError:
                pass
        self._write(os.path.join(self.native, "manifest.json"), raw)
        self.check("manifest-bytes", self.native, True)

    def index_json(self, data) -> None:
        index = json.dumps(_mutate_json(json.loads(self.index), data)).encode()
        doc = _unsealed(self.manifest)
        doc["files"][0]["index"].update(size=len(index), crc32c=crc32c(index))
        self._write(os.path.join(self.native, self.index_name), index)
        self._write(os.path.join(self.native, "manifest.json"), _sealed(doc))
        self.check("index", self.native, True)

    def safetensors_header(self, data) -> None:
        header = json.dumps(_mutate_json(json.loads(json.dumps(self.st_header)), data)).encode()
        self._write(self.st_path, len(header).to_bytes(8, "little") + header + self.st_data)
        self.check("safetensors", self.st_path, False)

    def dcp_bytes(self, data) -> None:
        self._write(os.path.join(self.dcp_path, ".metadata"), _mutate_bytes(self.dcp_metadata, data))
        self.check("dcp-metadata", self.dcp_path, False)

    def torch_save_bytes(self, data) -> None:
        self._write(self.pt_path, _mutate_bytes(self.pt, data))
        self.check("torch-save", self.pt_path, False)

    def run(self, target: str, examples: int) -> None:
        fn = {"manifest": self.manifest_json, "manifest-bytes": self.manifest_bytes, "index": self.index_json,
              "safetensors": self.safetensors_header, "dcp-metadata": self.dcp_bytes,
              "torch-save": self.torch_save_bytes}[target]
        test = settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                        suppress_health_check=list(HealthCheck))(given(st.data())(fn))
        test()


def _cap_memory() -> None:
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as f:
        held = int(f.read().split()[0]) * page
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (held + MEMORY_CAP, hard))


def main() -> None:
    work, examples = sys.argv[1], int(sys.argv[2])
    targets = sys.argv[3:] or list(TARGETS)
    torch.set_num_threads(1)
    fuzzer = Fuzzer(work)
    _cap_memory()
    for target in targets:
        fuzzer.run(target, examples)
    print(json.dumps({t: {**fuzzer.counts[t], "failures": fuzzer.failures[t][:10],
                          "failure_count": len(fuzzer.failures[t])} for t in targets}))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
