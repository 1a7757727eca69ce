"""The markers: the ``torch.library`` ops (:mod:`.ops`), ``region`` and the seam's scope
markers (:mod:`.region`), and the context a graph starts inside of (:mod:`.context`)."""

from __future__ import annotations

from .context import NO_CONTEXT, Enclosing, enclosing_context, with_block_fallbacks
from .ops import MARKER_OPS, marker_kind
from .regions import (
    DECLARED_ATTR,
    LEGACY_ATTR,
    SEAM_CALL_PREFIX,
    WRAPPER_NAME,
    checkpoint_scope,
    declared_names,
    exporting,
    region,
    seam_scope_args,
)

__all__ = [
    "DECLARED_ATTR",
    "LEGACY_ATTR",
    "MARKER_OPS",
    "NO_CONTEXT",
    "SEAM_CALL_PREFIX",
    "WRAPPER_NAME",
    "Enclosing",
    "checkpoint_scope",
    "declared_names",
    "enclosing_context",
    "exporting",
    "marker_kind",
    "region",
    "seam_scope_args",
    "with_block_fallbacks",
]
