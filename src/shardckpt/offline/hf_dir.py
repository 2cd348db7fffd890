"""``export --config``: the rest of a Hugging Face model directory beside the weights, consistent with them.

**Copied** from the reference (``--config FILE_OR_DIR``: a model directory, a local HF cache snapshot
``.../snapshots/<rev>``, the cache's repository directory ``models--org--name`` (whose ``refs/main`` names the
snapshot), or a file named ``config.json`` in one of those): its ``config.json``, and those of ``COPIED``
present beside it (the generation config, the tokenizer's files, the chat template) byte for byte; a config
file of another name is taken alone. Nothing is fetched from the network.

**Made consistent** with what is written (``plan_directory``): ``dtype`` and ``torch_dtype`` are the exported
dtype (``keep``: the first floating-point tensor's, as ``save_pretrained`` takes the model's);
``architectures``, where the config has none, is the model class transformers builds for it (vLLM and SGLang
pick their model by it); tied weights
are written once when the config ties them (the second one left out, after checking that its values equal the
first's: a checkpoint that untied them in training is refused, not silently re-tied), and
``tie_word_embeddings`` becomes true where the export already left a tied alias out (a LOCAL checkpoint's).

**Checked** before anything is written (``check_weights``, over the names, shapes and dtypes to be written,
so after any rename or adapter): where transformers is installed, against its own model built from the
config on the meta device (no weights allocated): every tensor it expects present, none it does not know,
every shape its shape; ``total_parameters`` (what ``save_pretrained`` puts in the index) is that model's
``num_parameters()``. Without transformers nothing is checked; a model type it does not know is refused, unless
the config has an ``auto_map`` (a model of its own code, ``trust_remote_code``): then nothing is checked (a
warning says so). A config that transformers builds no model from is refused, naming the file; so is a layer
count (``num_hidden_layers``, ``n_layer``, ``num_layers``) above what the weights' names number (checked first,
so a wrong count never makes transformers build a huge model).
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from shardckpt.errors import BadArgumentError, IncompatibleCheckpointError
from shardckpt.formats.api import CheckpointReader, ReadRequest
from shardckpt.regions import FlatRange
from shardckpt.sizes import DEFAULT_MAX_SHARD_SIZE
from shardckpt.tensor_views import as_bytes

log = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "tokenizer.model", "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "spiece.model",
          "chat_template.jinja", "chat_template.json")
OUTPUT_FILES = (CONFIG_NAME,) + COPIED  # what an export with a config may write besides the weights
MAX_CONFIG_BYTES = 64 << 20  # a reference's file larger than this is not a config or tokenizer file

Shapes = Mapping[str, "tuple[tuple[int, ...], torch.dtype]"]


class ConfigMismatchError(IncompatibleCheckpointError):
    """The weights to be written do not fit the model the config describes (a tensor missing, unknown, or
    of another shape; tied weights that differ)."""


@dataclass(frozen=True)
class Reference:
    """A reference directory's files: ``config.json`` parsed, the others as bytes."""

    where: str
    config: dict
    files: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class WeightsCheck:
    tie_pairs: dict[str, str]  # tied name -> the name it is tied to, as the model declares them
    total_parameters: int | None  # the model's num_parameters() (None: transformers is not installed)


@dataclass(frozen=True)
class Directory:
    """What ``plan_directory`` decided: the names left out as tied (-> the name written), the files beside the
    weights (name -> bytes), and the index's ``total_parameters``."""

    left_out: dict[str, str]
    files: dict[str, bytes]
    total_parameters: int | None


# ---------------------------------------------------------------------------------------------------------
# The reference


def read_reference(path: str | os.PathLike) -> Reference:
    """The config and the files to copy from ``path`` (see the module's docstring)."""
    where = Path(path)
    if where.is_dir():
        where = _snapshot(where)
        config_path = where / CONFIG_NAME
    else:
        config_path, where = where, where.parent
    if not config_path.is_file():
        raise BadArgumentError(f"config {os.fspath(path)!r}: no {CONFIG_NAME} there; give a config.json, a model "
                               "directory or a local Hugging Face cache snapshot")
    try:
        config = json.loads(_read(config_path))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadArgumentError(f"config {os.fspath(config_path)!r}: not JSON ({e})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str) or not config["model_type"]:
        raise BadArgumentError(f"config {os.fspath(config_path)!r}: not a model config (a JSON object with a "
                               "model_type string)")
    files = {} if config_path.name != CONFIG_NAME else \
        {name: _read(where / name) for name in COPIED if (where / name).is_file()}
    return Reference(os.fspath(config_path), config, files)


def _snapshot(directory: Path) -> Path:
    """A cache repository directory (``models--org--name``, with ``refs/main``) -> the snapshot it names."""
    ref = directory / "refs" / "main"
    if not (directory / CONFIG_NAME).exists() and ref.is_file():
        snapshot = directory / "snapshots" / ref.read_text().strip()
        if snapshot.is_dir():
            return snapshot
    return directory


def _read(path: Path) -> bytes:
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise BadArgumentError(f"{os.fspath(path)}: over {MAX_CONFIG_BYTES >> 20} MiB, not a config file")
        return path.read_bytes()
    except OSError as e:
        raise BadArgumentError(f"{os.fspath(path)}: cannot read it ({e.strerror or e})") from None


# ---------------------------------------------------------------------------------------------------------
# The check, pure over names, shapes and dtypes


def check_weights(tensors: Shapes, config: Mapping[str, Any], where: str = "config") -> WeightsCheck:
    """Check the tensors to be written (name -> (shape, dtype), after renames) against the model ``config``
    describes: with transformers, its meta-device model (``ConfigMismatchError`` naming the first tensor
    missing, unknown or misshapen); without, nothing. The tie pairs are those the model declares (whether or
    not the config ties them). ``where``: the config's file, for errors."""
    check_layer_count(tensors, config, where)
    model = _meta_model(config, where)
    if model is None:
        return WeightsCheck({}, None)
    declared = getattr(model, "_tied_weights_keys", None) or {}
    pairs = dict(declared) if isinstance(declared, dict) else {}
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})  # what this config ties: written once
    what = _config_summary(config)
    for name in expected:
        if name not in tensors and name not in tied:
            raise ConfigMismatchError(f"tensor {name!r} is missing from the weights to be written, which the "
                                      f"config ({what}) needs; export it, or give the model's config")
    for name, (shape, _) in tensors.items():
        if name not in expected or name in tied:
            reason = "is tied to " + repr(pairs.get(name)) + " by the config, so written once" \
                if name in tied else "is not a weight of the model"
            raise ConfigMismatchError(f"tensor {name!r} {reason} ({what}); leave it out (--rename-map) or "
                                      "give the model's config")
        if tuple(shape) != expected[name]:
            raise ConfigMismatchError(f"tensor {name!r} has shape {list(shape)}, the config ({what}) makes it "
                                      f"{list(expected[name])}; give the config of the model trained")
    return WeightsCheck(pairs, model.num_parameters())


def declared_ties(config: Mapping[str, Any], where: str = "config") -> tuple[dict[str, str], bool, str | None]:
    """The tie pairs the model declares (tied name -> the name it is tied to), whether this config ties them
    (its class's default where it does not say), and the model's class name; without transformers no pairs,
    what the config says, and no name."""
    model = _meta_model(config, where)
    if model is None:
        return {}, bool(config.get("tie_word_embeddings", False)), None
    declared = getattr(model, "_tied_weights_keys", None) or {}
    pairs = dict(declared) if isinstance(declared, dict) else {}
    return pairs, bool(model.config.tie_word_embeddings), type(model).__name__


def _config_summary(config: Mapping[str, Any]) -> str:
    keys = ("model_type", "hidden_size", "n_embd", "num_attention_heads", "n_head", "num_key_value_heads",
            "vocab_size", "num_hidden_layers", "n_layer")
    return ", ".join(f"{k}={config[k]}" for k in keys if k in config)


LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")


def check_layer_count(tensors: Iterable[str], config: Mapping[str, Any], where: str = "config") -> None:
    """Refuse a layer count above what the weights' names number (their largest index component + 1): each layer
    has weights named by its index, and a wrong count must not make transformers build a huge model."""
    indices = [int(part) for name in tensors for part in name.split(".") if part.isdigit()]
    present = max(indices) + 1 if indices else 0
    for key in LAYER_FIELDS:
        count = config.get(key)
        if isinstance(count, int) and not isinstance(count, bool) and count > present:
            raise ConfigMismatchError(f"{where}: {key} is {count}, but the weights to be written hold at "
                                      f"most {present} layers (by their names' indices); give the config of the model trained")


def _meta_model(config: Mapping[str, Any], where: str = "config") -> Any:
    """transformers' model for ``config`` on the meta device (no weights), or None without transformers or
    for a model type it does not know with an ``auto_map`` (a model of its own code: then nothing is checked,
    and a warning says so); any other model type it does not know, or failure to build, is refused."""
    try:
        import transformers
    except ImportError:
        return None
    model_type = config.get("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        if config.get("auto_map"):
            log.warning("config: transformers %s does not know model_type %r (a model of its own code, auto_map): "
                        "the weights are not checked against it", transformers.__version__, model_type)
            return None
        raise BadArgumentError(f"{where}: transformers {transformers.__version__} does not know model_type "
                               f"{model_type!r} (and the config has no auto_map); give the model's own config")
    fields = {k: v for k, v in config.items() if k not in ("torch_dtype", "dtype")}
    try:
        built = transformers.AutoConfig.for_model(**fields)
        arch = (config.get("architectures") or [None])[0]
        cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
        with torch.device("meta"):
            if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
                return cls(built)
            return transformers.AutoModelForCausalLM.from_config(built)
    except Exception as e:  # transformers' own checks raise anything (TypeError for a string size, ...)
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise BadArgumentError(f"{where}: transformers builds no model from it ({reason})") from None


# ---------------------------------------------------------------------------------------------------------
# The plan: what is left out as tied, and the files beside the weights


def plan_directory(reference: Reference, tensors: Sequence, left_out: Mapping[str, str], reader: CheckpointReader,
                   slice_bytes: int) -> Directory:
    """For export's output tensors (``name``, ``source``, ``dtype``, ``shape``) and the names it already left
    out as tied aliases (``left_out``): what else to leave out as tied, checked, and the files to write."""
    config = dict(reference.config)
    written = {t.name: t for t in tensors}
    where = f"config {reference.where!r}"
    check_layer_count(written, config, where)  # before transformers builds the model
    pairs, configured, architecture = declared_ties(config, where)
    if architecture is not None and not config.get("architectures"):
        config["architectures"] = [architecture]  # what vLLM and SGLang pick the model class by
    ties = configured or any(n in pairs for n in left_out)
    dropped: dict[str, str] = {}
    for name, kept in pairs.items() if ties else ():
        if name in written and kept in written:
            if not same_values(reader, written[name], written[kept], slice_bytes):
                raise ConfigMismatchError(f"tensor {name!r} differs from {kept!r}, to which the config ties it "
                                          "(tie_word_embeddings); set \"tie_word_embeddings\": false in the config")
            dropped[name] = kept
    config["tie_word_embeddings"] = ties
    check = check_weights({n: (t.shape, t.dtype) for n, t in written.items() if n not in dropped}, config, where)
    floats = [t.dtype for t in tensors if t.dtype.is_floating_point]
    if floats:
        config["torch_dtype"] = config["dtype"] = str(floats[0]).removeprefix("torch.")
    files = {CONFIG_NAME: (json.dumps(config, indent=2, sort_keys=True) + "\n").encode(), **reference.files}
    return Directory(dropped, files, check.total_parameters)


def same_values(reader: CheckpointReader, a: Any, b: Any, slice_bytes: int) -> bool:
    """Whether export tensors ``a`` and ``b`` hold the same bits in the source, read in slices (by checksum
    where the source keeps one for both)."""
    if a.shape != b.shape or a.source_dtype != b.source_dtype:
        return False
    infos = reader.tensors()
    ia, ib = infos[a.source.name], infos[b.source.name]
    if ia.crc32c is not None and ia.crc32c == ib.crc32c:
        return True
    numel = math.prod(a.shape)
    step = max(1, slice_bytes // max(1, a.source_dtype.itemsize))
    for lo in range(0, numel, step):
        hi = min(numel, lo + step)
        xa, xb = torch.empty(hi - lo, dtype=a.source_dtype), torch.empty(hi - lo, dtype=a.source_dtype)
        reader.read([ReadRequest(a.source.name, FlatRange(lo, hi), xa),
                     ReadRequest(b.source.name, FlatRange(lo, hi), xb)])
        if not torch.equal(as_bytes(xa), as_bytes(xb)):
            return False
    return True


def default_max_shard_size() -> int | str:
    """The installed transformers' ``save_pretrained`` default ("50GB" in 5.x); huggingface_hub's 5GB without."""
    try:
        import inspect

        from transformers import PreTrainedModel
    except ImportError:
        return DEFAULT_MAX_SHARD_SIZE
    default = inspect.signature(PreTrainedModel.save_pretrained).parameters.get("max_shard_size")
    return default.default if default is not None and isinstance(default.default, (int, str)) else \
        DEFAULT_MAX_SHARD_SIZE
