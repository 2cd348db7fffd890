"""A chunk pool's ``pool.json`` (FORMAT.md, "Pooled checkpoints"): created once, never changed.

    {"format": "shardckpt-pool", "version": 1, "id": "<32 hex>", "hash": "blake3-128-keyed", "secret": "<64 hex>"}

The ``id`` ties a v5 manifest to its pool (a reader refuses a pool of another id); the ``secret`` keys the chunk
digests (``format.content_hash``). Strict JSON, exactly these fields; everything read here is untrusted.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from shardckpt.errors import CorruptCheckpointError
from shardckpt.format.validate import check_fields, parse_json

POOL_FORMAT = "shardckpt-pool"
POOL_JSON = "pool.json"
POOL_HASH = "blake3-128-keyed"  # format.content_hash.ALGORITHM (not imported: that module is for writers)
_ID = re.compile(r"^[0-9a-f]{32}$")
_SECRET = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class PoolInfo:
    id: str
    secret: bytes

    def to_bytes(self) -> bytes:
        return json.dumps({"format": POOL_FORMAT, "version": 1, "id": self.id, "hash": POOL_HASH,
                           "secret": self.secret.hex()}, separators=(",", ":")).encode()


def new_pool_info() -> PoolInfo:
    return PoolInfo(secrets.token_hex(16), secrets.token_bytes(32))


def parse_pool_info(data: bytes, where: str) -> PoolInfo:
    doc = parse_json(data, where)
    check_fields(doc, ("format", "version", "id", "hash", "secret"), (), where)
    if doc["format"] != POOL_FORMAT or doc["version"] != 1 or doc["hash"] != POOL_HASH:
        raise CorruptCheckpointError(f"{where}: not a version 1 {POOL_FORMAT} of {POOL_HASH} chunks")
    if not isinstance(doc["id"], str) or not _ID.match(doc["id"]):
        raise CorruptCheckpointError(f"{where}: 'id' must be 32 lowercase hex digits")
    if not isinstance(doc["secret"], str) or not _SECRET.match(doc["secret"]):
        raise CorruptCheckpointError(f"{where}: 'secret' must be 64 lowercase hex digits")
    return PoolInfo(doc["id"], bytes.fromhex(doc["secret"]))
