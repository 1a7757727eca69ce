"""Memory amounts as every entry point takes them: one type, one meaning per kind of value.

* an ``int`` is bytes;
* a ``str`` is a number with a unit: ``"80GiB"``, ``"141 GB"``, ``"512MiB"``, ``"4096B"``
  (GB is 10**9, GiB 2**30; case-insensitive). A number without a unit (``"80"``, as a
  command line or a config file writes it) is an error: is it bytes or GiB?
* a ``float`` is a fraction in [0, 1] of a whole the context names: the scope's
  no-checkpoint bytes for ``plan`` / ``plan_model`` / ``hf.plan_for`` without a device, the
  device's memory for a :class:`~sac_compile.planning.devices.Target`. Where there is no
  whole (host memory), a float is an error.
"""

from __future__ import annotations

import re

__all__ = ["GB", "GiB", "Memory", "parse_memory"]

GB = 10**9
GiB = 2**30

#: What a memory argument takes (see the module docstring): bytes, a number with a unit, or a
#: fraction of a whole.
Memory = int | float | str

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": GB, "tb": 10**12, "kib": 2**10, "mib": 2**20}
_UNITS |= {"gib": GiB, "tib": 2**40}


def parse_memory(
    memory: Memory, whole: int | None = None, *, of: str = "", name: str = "memory", call: str = ""
) -> int:
    """Bytes from ``memory`` (see the module docstring): a ``float`` is that fraction of
    ``whole`` (``of`` says what the whole is, for messages; no ``whole``: a float is refused).
    ``name`` and ``call`` name the argument in messages (``call="plan"``: ``plan(memory=0.5)``).
    A wrong type is a ``TypeError``, a wrong value a ``ValueError``; each names the value and
    the forms taken."""
    said = f"{call}({name}={memory!r})" if call else f"{name}={memory!r}"
    forms = "bytes (an int), a number with a unit ('80GiB', '141GB')"
    if whole is not None:
        forms += f" or a fraction of {of or 'the whole'} (a float in [0, 1])"
    if isinstance(memory, bool) or not isinstance(memory, (int, float, str)):
        raise TypeError(f"{said}: {forms}")
    if isinstance(memory, float):
        if whole is None:
            raise TypeError(f"{said}: a float is a fraction, and there is no whole here: {forms}")
        if not 0.0 <= memory <= 1.0:
            raise ValueError(f"{said}: a float is a fraction in [0, 1]; pass bytes as an int or with a unit")
        return int(memory * whole)
    if isinstance(memory, int):
        if memory < 0:
            raise ValueError(f"{said}: bytes must be >= 0")
        return memory
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", memory)
    if found and not found.group(2):
        number = found.group(1)
        raise ValueError(
            f"{said}: a number with no unit (is it bytes or GiB?): "
            f"'{number}GiB' or '{number}GB' ('{number}B' for bytes)"
        )
    if found and found.group(2).lower() in _UNITS:
        return int(float(found.group(1)) * _UNITS[found.group(2).lower()])
    raise ValueError(f"{said}: {forms}; units: {', '.join(_UNITS)} (case-insensitive)")
