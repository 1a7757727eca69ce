"""Inspection: partition reports (:mod:`.report`), ``capture_partition`` (:mod:`.capture`)
and independent measurements (:mod:`.measure`)."""

from __future__ import annotations

from .capture import capture_partition
from .measure import autograd_saved_bytes, collectives_run
from .report import INPUT, GraphPartition, PartitionReport, SavedValue

__all__ = [
    "INPUT",
    "GraphPartition",
    "PartitionReport",
    "SavedValue",
    "autograd_saved_bytes",
    "capture_partition",
    "collectives_run",
]
