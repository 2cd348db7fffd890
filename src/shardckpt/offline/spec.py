"""What ``convert`` and ``export`` are asked to do: one frozen spec per verb, checked whole in ``__post_init__``.

The spec is the verb's one description. ``shardckpt.convert(...)`` / ``export(...)`` build it from their keywords
(``api.transform``), the ``shardckpt convert`` / ``export`` command lines from their options (each field's ``Opt``:
``cli/verbs.py`` builds the parser from the verb's signature, which is this spec's), and the offline engines take
it. Each field's check is one function used twice: as the ``Opt``'s parser of the command-line text and by
``__post_init__``, so that a value the command line refuses is refused by the Python API with the same words (a
``BadArgumentError`` naming the argument as ``name=value``; the CLI says ``--flag value``). Values come out
normalised (sequences as tuples, sizes as bytes, names in lower case, a destination's storage options defaulting
to the source's). Light: torch is imported only to check a dtype or a codec, never to build the parser."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Sequence

from shardckpt.errors import BadArgumentError
from shardckpt.offline.rename import Renames, read_rename_map
from shardckpt.options import STORAGE, Opt, integer, prefixes
from shardckpt.sizes import parse_size

PathLike = str | os.PathLike
TYPES = ("full", "sharded", "local")  # convert's output types
FORMATS = ("shardckpt", "dcp")  # convert's output formats
OPTIM_KEYS = ("name", "id")
MAX_FILES_PER_RANK = 64
DEFAULT_FILES_PER_RANK = 2  # as ``checkpoint.save``'s default (light here: the CLI builds its parser from this module)
CASTS = {"keep": "keep", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
         "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}  # export's --dtype


Check = Callable[[str, Any], Any]  # (field name, value) -> the value normalised, or BadArgumentError


def _bad(name: str, value: Any, why: str) -> BadArgumentError:
    return BadArgumentError(f"{name} {value!r}: {why}")


def positive(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _bad(name, value, "must be a positive int")
    return value


def world_size(name: str, value: Any) -> int | None:
    """A positive int up to the format's cap (a plan for more ranks would run for minutes and fill the memory
    before any manifest could refuse it)."""
    from shardckpt.format.manifest import MAX_WORLD_SIZE

    if value is not None and positive(name, value) > MAX_WORLD_SIZE:
        raise _bad(name, value, f"above the format's cap of {MAX_WORLD_SIZE} ranks")
    return value


def files_per_rank(name: str, value: Any) -> int:
    if value is None:
        return DEFAULT_FILES_PER_RANK
    if positive(name, value) > MAX_FILES_PER_RANK:
        raise _bad(name, value, f"at most {MAX_FILES_PER_RANK}")
    return value


def one_of(choices: tuple[str, ...]) -> Check:
    """A name among ``choices`` (any case; lower case out), or None."""
    def check(name: str, value: Any) -> str | None:
        value = {"PARAM_NAME": "name", "PARAM_ID": "id"}.get(getattr(value, "name", None), value)  # OptimStateKeyType
        if value is not None and (not isinstance(value, str) or value.lower() not in choices):
            named = ", ".join(map(repr, choices[:-1])) + f" or {choices[-1]!r}"
            raise BadArgumentError(f"{name} must be {named}, got {value!r}")
        return None if value is None else value.lower()
    return check


def float_dtype(name: str, value: Any) -> Any:
    """A floating-point torch dtype, from one or from its name (``"bfloat16"``, ``"torch.float16"``)."""
    import torch

    if value is None:
        return None
    dtype = getattr(torch, value.removeprefix("torch."), None) if isinstance(value, str) else value
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise _bad(name, value, "expected a floating-point torch dtype, e.g. bfloat16")
    return dtype


def cast_name(name: str, value: Any) -> str:
    """Export's cast: ``"keep"`` or the name of bfloat16 / float16 / float32 (from a name, an alias or a dtype)."""
    cast = str(value).removeprefix("torch.").lower()
    if cast not in CASTS:
        raise _bad(name, value, "expected one of keep, bfloat16, float16, float32 (or bf16, fp16, fp32)")
    return CASTS[cast]


def compression(name: str, value: Any) -> str | None:
    """A codec ``checkpoint.save`` takes (``"zstd"``, ``"zstd:LEVEL"``), kept as given (the resume identity)."""
    from shardckpt.format.codecs import Compression

    try:
        Compression.parse(value)
    except ValueError as e:
        raise BadArgumentError(str(e)) from None
    return value


def size(name: str, value: Any) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as e:
        raise BadArgumentError(f"{name}: {e}") from None


def prefixes_or_none(name: str, value: Any) -> tuple[str, ...] | None:
    """Dotted-name prefixes as a tuple (one string is one prefix, never its letters), or None."""
    values = (value,) if isinstance(value, str) else value
    if values is not None and not all(isinstance(v, str) for v in values):
        raise _bad(name, value, "expected a sequence of dotted-name prefixes")
    return None if values is None else tuple(values)


def prefixes_of(name: str, value: Any) -> tuple[str, ...]:
    if value is None:
        raise _bad(name, value, "expected a sequence of dotted-name prefixes")
    return prefixes_or_none(name, value)


def rename_rules(name: str, value: Any) -> dict | None:
    """Rename rules (``offline.rename``), compiled once here so that a bad pattern is refused before any work."""
    if value is None:
        return None
    try:
        Renames(value)
    except ValueError as e:
        raise BadArgumentError(f"{name}: {e}") from None
    return dict(value)


def options(name: str, value: Any) -> dict | None:
    if value is not None and not isinstance(value, dict):
        raise _bad(name, value, "expected a dict of fsspec options")
    return value


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad(name, value, "expected True or False")
    return value


def text(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise _bad(name, value, "expected a string")
    return value or None


def from_text(check: Check, name: str, parse: Callable[[str], Any] = str) -> Callable[[str], Any]:
    """A command-line parser: the text made a value (``parse``), then the field's own check."""
    return lambda given: check(name, parse(given))


def _checked(spec: Any, checks: dict[str, Check]) -> None:
    """Each field through its check, the normalised value set on the (frozen) spec; the destination's storage
    options default to the source's."""
    for name, check in checks.items():
        object.__setattr__(spec, name, check(name, getattr(spec, name)))
    if spec.dst_storage_options is None:
        object.__setattr__(spec, "dst_storage_options", spec.storage_options)
    if spec.reverse and spec.adapter is None:
        raise BadArgumentError("reverse: name the adapter to reverse (adapter=NAME)")


SOURCE = Opt("source checkpoint, file or fsspec URL")
DESTINATION = Opt("destination directory or fsspec URL")
MEMORY_LIMIT = Opt("resident memory of this process at most about SIZE, e.g. 2GiB: what the process holds "
                   "already (~265 MiB of Python and torch) is spent first, the rest is the buffers data streams "
                   "through (default: no limit, fixed buffers: convert 256 MiB, export 128 MiB)",
                   parse=from_text(size, "memory_limit"), metavar="SIZE")
ADAPTER = Opt("read the model weights through a model family's adapter: its names and layouts mapped to Hugging "
              "Face's (torchtitan-llama, torchtitan-llama-0.2, phi3-fused, hf: as they are; or one registered with "
              "shardckpt.offline.adapters.register); options after a colon, e.g. torchtitan-llama:config=hf/config.json "
              "or torchtitan-llama:n_heads=32,n_kv_heads=8,tie_word_embeddings=true", metavar="NAME[:K=V,...]")
REVERSE = Opt("apply the adapter's inverse: from Hugging Face's names and layouts to the family's")


@dataclass(frozen=True)
class ConvertSpec:
    """A conversion: ``src`` (any readable checkpoint) written as a shardckpt (or torch DCP) checkpoint at ``dst``.
    The fields are ``shardckpt.convert``'s keywords; ``offline.convert`` documents what each does."""

    src: Annotated[PathLike, SOURCE]
    dst: Annotated[PathLike, DESTINATION]
    world_size: Annotated[int | None, Opt("output world size (default: the source's, 1 for other formats)",
                                          parse=from_text(positive, "world_size", integer))] = None
    type: Annotated[str | None, Opt("output state-dict type (default: the source's)", choices=TYPES)] = None
    optim_key: Annotated[str | None, Opt("key the optimizer state by parameter name or ID (default: as the "
                                         "source does)", choices=OPTIM_KEYS)] = None
    dtype: Annotated[Any, Opt("cast floating-point tensors, e.g. bfloat16 (in Python a name or a torch dtype)",
                              parse=from_text(float_dtype, "dtype"))] = None
    only: Annotated[Sequence[str], prefixes("keep only this dotted-name prefix")] = ()
    exclude: Annotated[Sequence[str], prefixes("leave out this dotted-name prefix")] = ()
    strip_prefix: Annotated[str | None, Opt("remove this prefix from the output names, moving what is under it to "
                                            "the top, e.g. model. for torchtitan's flat DCP keys", metavar="P")] = None
    compress: Annotated[str | None, Opt("store chunks as zstd frames (floats split into byte planes first); "
                                        "default: raw", parse=from_text(compression, "compress"), metavar="zstd[:LEVEL]")] = None
    memory_limit: Annotated[int | str | None, MEMORY_LIMIT] = None
    workers: Annotated[int, Opt("spread the output files over N local processes (each within --memory-limit)",
                                parse=from_text(positive, "workers", integer), metavar="N")] = 1
    format: Annotated[str, Opt("write a shardckpt checkpoint (default) or a torch DCP directory (.metadata, "
                               "__R_0.distcp per output rank) that torch.distributed.checkpoint reads",
                               choices=FORMATS)] = "shardckpt"
    adapter: Annotated[str | None, ADAPTER] = None
    reverse: Annotated[bool, REVERSE] = False
    overwrite: Annotated[bool, Opt("replace a committed checkpoint at DST")] = False
    storage_options: Annotated[dict | None, STORAGE] = None
    dst_storage_options: dict | None = None  # default: storage_options
    files_per_rank: int | None = None  # data files each output rank has, written in parallel (default 2)
    param_names: Sequence[str] | None = None  # a LOCAL source's parameter names in order (formats.local_view)

    def __post_init__(self) -> None:
        _checked(self, {"world_size": world_size, "type": one_of(TYPES), "optim_key": one_of(OPTIM_KEYS),
                        "dtype": float_dtype, "only": prefixes_of, "exclude": prefixes_of, "strip_prefix": text,
                        "compress": compression, "memory_limit": size, "workers": positive, "format": one_of(FORMATS),
                        "adapter": text, "reverse": flag, "overwrite": flag, "storage_options": options,
                        "dst_storage_options": options, "files_per_rank": files_per_rank,
                        "param_names": prefixes_or_none})
        if self.format == "dcp" and (self.type == "local" or self.workers != 1 or self.compress is not None):
            raise BadArgumentError("format='dcp' writes SHARDED or FULL output from one process, uncompressed: "
                                   "leave out type='local', compress= and workers= (and spread_over= in Python)")


@dataclass(frozen=True)
class ExportSpec:
    """An export: the model weights of ``src`` written as Hugging Face style safetensors files in ``dst``. The fields
    are ``shardckpt.export``'s keywords; ``offline.export`` documents what each does."""

    src: Annotated[PathLike, SOURCE]
    dst: Annotated[PathLike, DESTINATION]
    dtype: Annotated[Any, Opt("bfloat16, float16, float32 or keep (default): cast floating-point tensors",
                              parse=from_text(cast_name, "dtype"))] = "keep"
    max_shard_size: Annotated[int | str | None, Opt("tensor bytes per file at most, e.g. 500MiB (default: 5GB; "
                                                    "with --config, the installed transformers' save_pretrained "
                                                    "default)", parse=from_text(size, "max_shard_size"),
                                                    metavar="SIZE")] = None
    config: Annotated[PathLike | None, Opt("write a complete model directory: config.json (dtype and tying made "
                                           "to match the weights, which are checked against it first) and the "
                                           "generation config and tokenizer files beside it, from this "
                                           "config.json, model directory or local Hugging Face cache snapshot",
                                           metavar="FILE_OR_DIR")] = None
    only: Annotated[Sequence[str] | None, prefixes("export this dotted-name prefix instead of the model "
                                                    "weights")] = None
    strip_prefix: Annotated[str | None, Opt("remove this prefix from the exported names", metavar="P")] = None
    rename_map: Annotated[dict | None, Opt("rename the exported tensors: a JSON object of regular expressions -> "
                                           "new names (null: leave out); each name is renamed by the first "
                                           "pattern matching it whole (in Python: the dict)", metavar="FILE",
                                           parse=read_rename_map)] = None
    adapter: Annotated[str | None, ADAPTER] = None
    reverse: Annotated[bool, REVERSE] = False
    memory_limit: Annotated[int | str | None, MEMORY_LIMIT] = None
    latest: Annotated[bool, Opt("SRC is a run directory: use the latest committed checkpoint below it "
                                "(`shardckpt ls` lists them)")] = False
    overwrite: Annotated[bool, Opt("replace an export at DST")] = False
    storage_options: Annotated[dict | None, STORAGE] = None
    dst_storage_options: dict | None = None  # default: storage_options
    verify: bool = True  # check the checksums the source stores as it is read

    def __post_init__(self) -> None:
        _checked(self, {"dtype": cast_name, "max_shard_size": size, "only": prefixes_or_none, "strip_prefix": text,
                        "rename_map": rename_rules, "adapter": text, "reverse": flag, "memory_limit": size,
                        "latest": flag, "overwrite": flag, "storage_options": options, "dst_storage_options": options,
                        "verify": flag})
