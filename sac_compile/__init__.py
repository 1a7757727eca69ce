"""sac-compile: region-level selective activation checkpointing that works under torch.compile.

Importing the package registers the ``sac_compile::*`` marker ops and nothing heavier:
Dynamo, AOTAutograd and Inductor load on the first compile (``tests/test_architecture.py``
checks it). The package is layered, imports pointing down: the layers and what each holds
are ``docs/architecture.md``'s table, which ``tests/test_architecture.py`` checks against the
layering it enforces. ``sac_compile.testing`` (demo and test models, the rank runner, parity
reports) is not imported by ``import sac_compile``.
"""

from . import compiler as compiler
from . import declare as declare
from . import inspection as inspection
from . import policy as policy
from . import seam as seam
from .compiler import make_sac_backend, sac_backend
from .compiler import session as _session
from .config import SacConfig
from .context_fn import region_context_fn
from .declare import declare_regions
from .diagnostics import SacDiagnosticError, set_strict, strict
from .keep import ALL_REGIONS
from .markers import region
from .planning import advice as _advice
from .planning import plan
from .policy import SAVE_ALL, SAVE_COSTLY
from .seam import apply_selective_checkpointing, remove_selective_checkpointing

# What a user types in training code; inspection, testing and advanced names live in their
# submodules (tests/test_architecture.py holds this to 16 names).
__all__ = [
    # Marking regions
    "region",  # context manager and decorator: with region("attn"): ...
    "declare_regions",  # {module path pattern: region name}, no code change
    # Keep sets and region policies: (op, open regions, keep) -> CheckpointPolicy, both modes
    "ALL_REGIONS",  # keep every marked region
    "SAVE_COSTLY",  # default: a kept region's costly values saved, its cheap ops recomputed
    "SAVE_ALL",  # every op of a kept region saved (eagerly, kept modules run once)
    # Checkpointing layers (eager, per-layer compile, whole-model compile)
    "SacConfig",  # one frozen config applied to a whole model
    "apply_selective_checkpointing",  # one call per wrap site; see its decision table
    "remove_selective_checkpointing",  # undo it (and declare_regions) on a module tree
    "region_context_fn",  # context_fn for a torch.utils.checkpoint you call (transformers' switch)
    "plan",  # the least recompute within a memory target, measured (sac_compile.planning)
    # Compiling
    "sac_backend",  # Inductor backend keeping every marked region
    "make_sac_backend",  # memoised backend for a keep set
    # Diagnostics (logger "sac_compile", WARNING)
    "SacDiagnosticError",
    "set_strict",
    "strict",
]

# The composition root wires the planner's advice into the compile session, which sits below
# the planner (sac_compile.planning.advice: one INFO line when a plan dominates a keep set).
_session.set_advisor(_advice.advise)

__version__ = "0.16.1"
