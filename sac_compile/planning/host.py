"""A GPU's link to its host's memory (:data:`HOST_LINKS`, the figures' sources beside them),
the fraction of it a copy reaches, and a target's offload fields checked."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["HOST_EFFICIENCY", "HOST_LINKS", "WORLD", "WORLD_FILE", "HostLink", "check_target"]

#: The data file the planner's world is read from: devices, links, kernel rates, fitted
#: step-time figures (each with its source)
WORLD_FILE = os.path.join(os.path.dirname(__file__), "world.json")
with open(WORLD_FILE) as _f:
    WORLD: dict[str, Any] = json.load(_f)


@dataclass(frozen=True)
class HostLink:
    """A GPU's link to its host's memory: bytes/s one way, and the source of the figure."""

    name: str
    bandwidth: float
    source: str


#: The host links a :class:`~sac_compile.planning.devices.Target` may name (``host_link``),
#: from the planner's data file (``world.json``, each with its source)
HOST_LINKS: dict[str, HostLink] = {
    e["name"]: HostLink(e["name"], e["bandwidth"], e["source"]) for e in WORLD["host_links"]
}

#: The fraction of a host link's bandwidth a large pinned-memory copy reaches (``world.json``)
HOST_EFFICIENCY: float = WORLD["links"]["host_copy_efficiency"]["value"]


def check_target(machine: Any, cuda: bool, name: str) -> None:
    """A ``Target``'s ``Machine``'s offload fields checked (``cuda``: its device's kernels are a GPU's,
    ``name`` the device's): each names a value it takes; host memory and a link only with
    ``offload``; only on a GPU."""
    if machine.host_link is not None and machine.host_link not in HOST_LINKS:
        raise ValueError(f"Target(host_link={machine.host_link!r}): one of {', '.join(HOST_LINKS)}")
    if not isinstance(machine.offload, bool):
        raise ValueError(f"Target(offload={machine.offload!r}): True or False")
    for field in ("host_memory", "host_link"):
        if getattr(machine, field) is not None and not machine.offload:
            raise ValueError(
                f"Target({field}={getattr(machine, field)!r}) without offload=True does nothing: "
                f"pass offload=True to let the plan offload regions, or drop {field}"
            )
    if machine.offload and (machine.host_memory is None or not cuda):
        raise ValueError(
            f"Target(offload=True) on {name}: "
            + (
                "needs host_memory, the host memory per GPU for offloaded values (e.g. '256GB')"
                if cuda
                else "its host is the device (offloaded values would stay in the same memory)"
            )
        )
