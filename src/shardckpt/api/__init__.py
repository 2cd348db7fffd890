"""Every ``shardckpt`` verb as a Python function (also on the package: ``shardckpt.convert(...)``), whose
signature is the command's spec (``spec.py``), and the results they return (``results.py``)."""
from __future__ import annotations

from shardckpt.api.check import diff, inspect, verify
from shardckpt.api.results import (
    ConvertResult,
    DiffResult,
    Difference,
    ExportResult,
    GcResult,
    InspectResult,
    LatestResult,
    LsResult,
    Problem,
    RmResult,
    VerifyResult,
)
from shardckpt.api.runs import ls
from shardckpt.api.tidy import gc, latest, rm
from shardckpt.api.transform import convert, export

__all__ = ["convert", "export", "verify", "diff", "inspect", "gc", "rm", "latest", "ls", "ConvertResult",
           "ExportResult", "VerifyResult", "DiffResult", "InspectResult", "GcResult", "RmResult", "LatestResult",
           "LsResult", "Problem",
           "Difference"]
