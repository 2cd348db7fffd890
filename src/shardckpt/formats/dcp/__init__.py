"""torch.distributed.checkpoint (DCP) directories behind the one read interface: FSDP1 (ShardedTensor),
FSDP2 (DTensor) and torchtitan-style checkpoints written by DCP's ``FileSystemWriter`` (or its fsspec
subclass), on local disk or any fsspec URL.

The layout, as torch 2.13 writes it: ``.metadata``, a pickled ``Metadata`` (each flattened key's tensor
chunks or bytes entry, and where each item lies), and ``__<rank>_<n>.distcp`` data files, items back to
back. A tensor chunk is a whole ``torch.save`` archive of that chunk (a zip, stored uncompressed); a bytes
entry is ``torch.save(value)``.

- ``metadata``: ``.metadata`` unpickled through a closed allow-list of inert stand-ins (no DCP, pathlib or
  ``torch.distributed`` code runs), then validated into ``DcpLayout`` (``parse_metadata``);
- ``archive``: one item's ``torch.save`` archive: where a chunk's elements are (ranged reads of the zip
  directory, a closed unpickler for ``data.pkl``, the record's header), reading them (CRC-32 checked), and
  ``torch.load(weights_only=True)`` of what is not a plain dense tensor;
- ``reader``: ``DcpReader`` (``tensors``, ``tree``, ``read``: requests to chunks, on a thread pool) and
  ``is_dcp_dir``.

Not supported (refused with a clear error): stream transforms (``transform_descriptors``: DCP's experimental
compression/extension streams), DCP's safetensors serialization (``SerializationFormat.SAFETENSORS``) and
other storage writers' ``storage_data``, big-endian archives, non-strided (sparse) tensors, dtypes outside
``format.dtypes``.
"""
from __future__ import annotations

from shardckpt.formats.dcp.metadata import ADMITTED_GLOBALS, METADATA_NAME, DcpLayout, parse_metadata
from shardckpt.formats.dcp.reader import DcpReader, is_dcp_dir

__all__ = ["ADMITTED_GLOBALS", "METADATA_NAME", "DcpLayout", "DcpReader", "is_dcp_dir", "parse_metadata"]
