"""Adapters: a model family's names and layouts mapped onto Hugging Face's and back (``base`` is the interface,
``reader`` applies one to a checkpoint; one file per family, whose ``FAMILIES`` maps names to its two adapters,
listed in ``_BUILTIN``). ``register`` adds a family at run time; ``resolve`` turns
``"NAME[:key=value,...]"`` (``--adapter``) into the adapter of the asked direction and its options."""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

from shardckpt.errors import BadArgumentError
from shardckpt.formats.api import CheckpointReader
from shardckpt.offline.adapters.base import Adapter

_FAMILIES: dict[str, tuple[Adapter, Adapter]] = {}  # name -> (to HF, from HF)
_BUILTIN = ("hf", "torchtitan_llama", "phi3_fused")
_LOADED: list[bool] = []


def register(name: str, to_hf: Adapter, from_hf: Adapter) -> None:
    """Make family ``name`` usable as ``adapter=name`` / ``--adapter name``: ``to_hf`` and its declared inverse."""
    if not isinstance(to_hf, Adapter) or not isinstance(from_hf, Adapter):
        raise BadArgumentError(f"adapter {name!r}: register it with two Adapter objects (to HF, from HF)")
    _FAMILIES[name] = (to_hf, from_hf)


def names() -> list[str]:
    _load_builtin()
    return sorted(_FAMILIES)


def resolve(spec: str, reverse: bool = False,
            config: Mapping[str, Any] | None = None) -> tuple[Adapter, dict[str, Any]]:
    """The adapter named by ``spec`` (``NAME`` or ``NAME:key=value,...``; ``config=PATH`` reads the options the
    adapter needs from a Hugging Face ``config.json``, a file or its directory), from HF when ``reverse``.
    An option given that disagrees with ``config=PATH``'s or ``config``'s (the export's ``--config``) is refused."""
    _load_builtin()
    name, _, rest = str(spec).partition(":")
    if name not in _FAMILIES:
        raise BadArgumentError(f"adapter {name!r}: unknown; known: {', '.join(sorted(_FAMILIES))}")
    adapter = _FAMILIES[name][1 if reverse else 0]
    opts: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise BadArgumentError(f"adapter {spec!r}: {item!r} is not key=value")
        opts[key.strip()] = _value(value.strip())
    if "config" in opts:
        path = str(opts.pop("config"))
        opts = {**_agreeing(_from_config(path, adapter), opts, adapter, path), **opts}
    if config is not None:
        _agreeing(config_options(config, adapter), opts, adapter, "--config")
    return adapter, opts


def _agreeing(known: dict[str, Any], given: Mapping[str, Any], adapter: Adapter, where: str) -> dict[str, Any]:
    """``known`` (a config's options), after refusing a head option ``given`` otherwise (wrong data, silently)."""
    for name in adapter.options:
        if name in known and name in given and known[name] != given[name]:
            raise BadArgumentError(f"adapter {adapter.name!r}: {name}={given[name]!r}, but the config ({where}) has "
                                   f"{adapter.options[name]}={known[name]!r}; leave the option out or fix it")
    return known


def _value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(text)
    except ValueError:
        return text


def _from_config(path: str, adapter: Adapter) -> dict[str, Any]:
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise BadArgumentError(f"adapter config {file}: cannot read it as JSON: {e}") from None
    if not isinstance(config, dict):
        raise BadArgumentError(f"adapter config {file}: not a JSON object")
    return config_options(config, adapter)


def config_options(config: Mapping[str, Any], adapter: Adapter) -> dict[str, Any]:
    """The options ``adapter`` needs, as a Hugging Face ``config.json``'s ``config`` gives them."""
    keys = {**adapter.options, "tie_word_embeddings": "tie_word_embeddings"}
    opts = {option: config[key] for option, key in keys.items() if key in config}
    if "n_kv_heads" in adapter.options and "n_kv_heads" not in opts and "n_heads" in opts:
        opts["n_kv_heads"] = opts["n_heads"]  # HF: num_key_value_heads defaults to num_attention_heads
    return opts


def _load_builtin() -> None:
    import importlib

    if _LOADED:
        return
    for module in _BUILTIN:
        for name, (to_hf, from_hf) in importlib.import_module(f"shardckpt.offline.adapters.{module}").FAMILIES.items():
            _FAMILIES.setdefault(name, (to_hf, from_hf))
    _LOADED.append(True)


def apply(reader: CheckpointReader, spec: str | None, reverse: bool = False,
          config: Mapping[str, Any] | None = None) -> CheckpointReader:
    """``reader`` seen through the adapter ``spec`` names (``resolve``, ``config`` checking its options); as it
    is when ``spec`` is None."""
    if spec is None:
        if reverse:
            raise BadArgumentError("reverse: name the adapter to reverse (adapter=NAME)")
        return reader
    from shardckpt.offline.adapters.reader import adapted

    adapter, opts = resolve(spec, reverse, config)
    return adapted(reader, adapter, opts)
