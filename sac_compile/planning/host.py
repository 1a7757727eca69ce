"""A GPU's link to its host's memory (:data:`HOST_LINKS`, the figures' sources beside them),
the fraction of it a copy reaches, and a target's offload fields checked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["HOST_EFFICIENCY", "HOST_LINKS", "HostLink", "check_target"]


@dataclass(frozen=True)
class HostLink:
    """A GPU's link to its host's memory: bytes/s one way, and the source of the figure."""

    name: str
    bandwidth: float
    source: str


#: The host links a :class:`~sac_compile.planning.devices.Target` may name (``host_link``).
HOST_LINKS: dict[str, HostLink] = {
    link.name: link
    for link in (
        HostLink(
            "pcie4",
            31.5e9,
            "PCI Express Base Specification 4.0 (PCI-SIG, 2017): 16 GT/s a lane, 128b/130b encoding, x16: "
            "31.5 GB/s each way (A100's host link)",
        ),
        HostLink(
            "pcie5",
            63e9,
            "PCI Express Base Specification 5.0 (PCI-SIG, 2019): 32 GT/s a lane, 128b/130b encoding, x16: "
            "63 GB/s each way (H100 / H200 SXM, B200, MI300X host links)",
        ),
        HostLink(
            "c2c",
            450e9,
            "NVIDIA GH200 Grace Hopper Superchip datasheet: NVLink-C2C 900 GB/s between Grace and Hopper, "
            "450 GB/s each way (GH200, GB200)",
        ),
    )
}

#: The fraction of a host link's bandwidth a large pinned-memory copy reaches (CUDA's
#: bandwidthTest reports about 25 GB/s on PCIe 4.0 x16 and about 50 GB/s on PCIe 5.0 x16: ~0.8)
HOST_EFFICIENCY = 0.8


def check_target(target: Any, cuda: bool, name: str) -> None:
    """A ``Target``'s offload fields checked (``cuda``: its device's kernels are a GPU's,
    ``name`` the device's): each names a value it takes; host memory and a link only with
    ``offload``; only on a GPU."""
    if target.host_link is not None and target.host_link not in HOST_LINKS:
        raise ValueError(f"Target(host_link={target.host_link!r}): one of {', '.join(HOST_LINKS)}")
    if not isinstance(target.offload, bool):
        raise ValueError(f"Target(offload={target.offload!r}): True or False")
    for field in ("host_memory", "host_link"):
        if getattr(target, field) is not None and not target.offload:
            raise ValueError(
                f"Target({field}={getattr(target, field)!r}) without offload=True does nothing: "
                f"pass offload=True to let the plan offload regions, or drop {field}"
            )
    if target.offload and (target.host_memory is None or not cuda):
        raise ValueError(
            f"Target(offload=True) on {name}: "
            + (
                "needs host_memory, the host memory per GPU for offloaded values (e.g. '256GB')"
                if cuda
                else "its host is the device (offloaded values would stay in the same memory)"
            )
        )
