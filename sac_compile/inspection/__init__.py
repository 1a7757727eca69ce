"""Inspection: partition reports (:mod:`.report`), ``capture_partition`` (:mod:`.capture`),
independent measurements (:mod:`.measure`) and the tagging pass's records
(:mod:`sac_compile.records`)."""

from __future__ import annotations

from ..records import collect_records, recent_records
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
    "collect_records",
    "collectives_run",
    "recent_records",
]
