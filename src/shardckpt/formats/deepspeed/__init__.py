"""DeepSpeed ZeRO checkpoints (stages 1-3) read by parameter name (``reader``), from their per-rank partitions
(``partitions``), unpickled with DeepSpeed's few classes admitted as inert stand-ins (``unpickle``)."""
from shardckpt.formats.deepspeed.reader import DeepSpeedReader, tag_dir

__all__ = ["DeepSpeedReader", "tag_dir"]
