"""PyTorch's structured trace (``TORCH_TRACE`` / ``tlparse``): artifacts next to the graphs."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from . import private

__all__ = ["trace_artifact"]


def trace_artifact(name: str, payload_fn: Callable[[], Any]) -> None:
    """Emit a JSON artifact ``name`` into the structured trace of the compile in progress
    (``torch._logging.trace_structured("artifact", ...)``, what PyTorch's own
    ``trace_structured_artifact`` does). ``payload_fn`` runs only when a trace is being
    written (``TORCH_TRACE`` set), so it costs nothing otherwise."""
    trace_structured = private("torch._logging", "trace_structured")
    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "json"},
        payload_fn=lambda: json.dumps(payload_fn(), sort_keys=True),
    )
