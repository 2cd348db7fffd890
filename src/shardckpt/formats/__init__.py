"""Readers of checkpoint formats behind one interface (``api.CheckpointReader``); shardckpt's own first."""
