"""Every private PyTorch API sac-compile relies on, behind one door.

One module per PyTorch subsystem; nothing outside ``sac_compile._compat`` touches a
private torch name, a torch frame name or an AOTAutograd naming convention:

==================  ==========================================================================
module              what it wraps
==================  ==========================================================================
``ops``             ``torch._ops`` operator types (overloads, packets, higher-order ops)
``checkpoint``      ``torch.utils.checkpoint``'s SAC internals and early stop, autograd's
                    saved-tensor hooks, Python dispatch modes (pushed by hand, run outside
                    Dynamo), storages' use counts
``dynamo``          what Dynamo is compiling now (translator, compile id, end callbacks,
                    resume functions, frame skipping), ``OptimizedModule`` unwrapping
``aot``             AOTAutograd and the min-cut partitioner: entry points and naming
                    conventions of partitioned graphs
``inductor``        Inductor's entry points, config, custom-pass hook, lowerings, caches
``nn``              ``nn.Module``'s call machinery the seam overrides (``_call_impl``)
``jit``             TorchScript's method modifiers (a method left out of a scripted class)
``logs``            PyTorch's structured trace (``TORCH_TRACE``, read by ``tlparse``)
``pipelining``      ``torch.distributed.pipelining``'s schedules as each rank's actions
``frames``          reading the Python stack: torch's own frames (``nn.Module`` calls,
                    ``torch.compile``'s entry) and ours (decorated regions, seam calls)
``tensors``         tensors' version counters and storages' identities
``transformers``    Hugging Face transformers' checkpointing conventions (duck-typed) and
                    its private model constructor
==================  ==========================================================================

Heavy subsystems (Dynamo, AOTAutograd, Inductor) are imported on first use, so
``import sac_compile`` loads none of them. Each lookup goes through :func:`private`,
which fails with :class:`TorchApiMoved` naming the API and the installed torch
version, instead of an ``AttributeError`` deep inside a compile.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

__all__ = ["SUPPORTED", "TorchApiMoved", "private"]

#: The PyTorch releases this code is tested against.
SUPPORTED = "2.13 to 2.15"


class TorchApiMoved(RuntimeError):
    """A private PyTorch API sac-compile relies on is missing from the installed torch."""


@functools.cache
def private(module: str, name: str) -> Any:
    """``module.name``, imported on first use; :class:`TorchApiMoved` if torch moved it."""
    path = module
    try:
        obj = importlib.import_module(module)
        for part in name.split("."):
            path = f"{path}.{part}"
            if hasattr(obj, part):
                obj = getattr(obj, part)
            else:  # a submodule is not an attribute of its package until it is imported
                obj = importlib.import_module(path)
        return obj
    except ModuleNotFoundError as e:
        # only the module we look up being absent means torch moved it; an import error
        # raised inside an existing module (a broken dependency) propagates as it is
        if e.name is None or not (path.startswith(e.name) or module.startswith(e.name)):
            raise
        raise _moved(module, name, e) from e


def _moved(module: str, name: str, e: Exception) -> TorchApiMoved:
    return TorchApiMoved(
        f"sac_compile relies on {module}.{name}, which torch {torch.__version__} does not provide "
        f"({e}). sac_compile supports torch {SUPPORTED}; please report this with your torch version."
    )
