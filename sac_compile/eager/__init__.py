"""The eager engine: region-level selective checkpointing without compile (:mod:`.engine`)."""

from __future__ import annotations

from .engine import EagerSession, EngineStats, checkpoint_with_regions, engine_contexts

__all__ = ["EagerSession", "EngineStats", "checkpoint_with_regions", "engine_contexts"]
