"""shardckpt as a storage backend for ``torch.distributed.checkpoint`` (DCP).

    import torch.distributed.checkpoint as dcp
    from shardckpt.dcp import StorageReader, StorageWriter

    dcp.save(state_dict, storage_writer=StorageWriter("s3://bucket/run/step-100", compress="zstd"))
    dcp.load(state_dict, storage_reader=StorageReader("s3://bucket/run/step-100"))

DCP keeps its planners and collectives; what lands is a shardckpt checkpoint (block checksums, sealed
manifest, atomic commit), and the reader reads every format shardckpt reads (a DeepSpeed ZeRO checkpoint
straight into an FSDP2 model). This package implements DCP's interface classes, so it imports them from
``torch.distributed.checkpoint``; it makes no collective call of its own (DCP makes them).
"""
from __future__ import annotations

from shardckpt.dcp.reader import StorageReader
from shardckpt.dcp.writer import StorageWriter

__all__ = ["StorageReader", "StorageWriter"]
