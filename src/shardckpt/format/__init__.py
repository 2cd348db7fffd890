"""shardckpt's on-disk contract (FORMAT.md), pure: no I/O. The manifest, chunk tables, chunk indexes, codecs,
strict field validation, the tree of plain values, dtypes and checksums."""
