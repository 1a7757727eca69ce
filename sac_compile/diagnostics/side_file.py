"""The warm-cache side file: a compiled graph's diagnoses and regions, kept next to
Inductor's caches.

On a warm FX-graph / AOTAutograd cache hit the tagging pass does not run, so a graph
served from the cache has no records. When the pass runs with the caches on, the
backend writes what it found (diagnoses, regions, keep names) to a small JSON file
under Inductor's cache directory, keyed by the Dynamo graph's code, its input
metadata and the pass's ``uuid()``; a warm start reads it back and reports the same
as a cold one. A missing file is an INFO record: the graph was not checked.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

import torch

from .._compat import inductor
from .core import Diagnosis

__all__ = ["SideRecord", "read", "side_key", "side_path", "write"]

log = logging.getLogger("sac_compile")

_VERSION = 1

SideRecord = tuple[list[Diagnosis], list[str], list[str]]  # diagnoses, regions, keep names


def side_key(graph_code: str, example_inputs: list[Any], pass_uuid: bytes) -> str:
    metas = [
        (
            tuple(getattr(x, "shape", ())),
            str(getattr(x, "dtype", type(x).__name__)),
            getattr(x, "requires_grad", None),
        )
        for x in example_inputs
    ]
    text = f"{_VERSION}|{graph_code}|{pass_uuid.hex()}|{metas}|{torch.is_grad_enabled()}"
    return hashlib.sha256(text.encode()).hexdigest()


def side_path(key: str) -> str:
    return os.path.join(inductor.cache_dir(), "sac_compile", key[:2], f"{key}.json")


def write(key: str, found: list[Diagnosis], regions: list[str], keep_names: list[str]) -> None:
    path = side_path(key)
    data = {"diagnoses": [d.to_json() for d in found], "regions": list(regions), "keep": list(keep_names)}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache dir must not break compiling
        log.info("sac_compile: could not write %s: %s", path, e)


def read(key: str) -> SideRecord | None:
    try:
        with open(side_path(key)) as f:
            data = json.load(f)
        found = [Diagnosis.from_json(d) for d in data["diagnoses"]]
        return found, data["regions"], data["keep"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
