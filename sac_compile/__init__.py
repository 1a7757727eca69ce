"""sac-compile: region-level selective activation checkpointing that works under torch.compile.

Importing the package registers the ``sac_compile::*`` marker ops and nothing heavier:
Dynamo, AOTAutograd and Inductor load on the first compile (``tests/test_architecture.py``
checks it). Layout (imports point down this list; ``tests/test_architecture.py`` checks
that too):

* ``_compat`` - every private PyTorch API, one module per subsystem; what
  we rely on of transformers' checkpointing conventions;
* ``keep``, ``records``, ``policy`` - keep sets, the tagging pass's records, region policies
  and op classification (shared by both engines);
* ``diagnostics`` - reporting; everything below reports into it;
* ``markers`` - the marker ops, ``region``, the stack context of a compile;
* ``declare`` - regions declared by module path;
* ``passes``, ``compiler`` - the tagging pass; the backends and their compile session;
* ``eager`` - the eager engine;
* ``seam``, ``config``, ``contexts`` - wrapping layers, whole-model configs, a
  ``context_fn`` for ``torch.utils.checkpoint``;
* ``inspection`` - partition reports, ``capture_partition``, measurements;
* ``planning`` - the planner: one layer, every kind of layer of a model;
* ``hf`` - transformers models.

``sac_compile.testing`` (demo and test models, the rank runner, parity reports) is not
imported by ``import sac_compile``.
"""

from .compiler import baseline_backend, make_sac_backend, sac_backend
from .compiler import session as _session
from .config import SacConfig
from .contexts import region_context_fn
from .declare import RegionDeclarations, declare_regions, declared_regions, undeclare_regions
from .diagnostics import SacDiagnosticError, set_strict, strict
from .inspection import PartitionReport, autograd_saved_bytes, capture_partition, collectives_run
from .keep import ALL_REGIONS
from .markers import region
from .planning import advice as _advice
from .planning import plan
from .policy import SAVE_ALL, SAVE_COSTLY, is_costly
from .records import collect_records, recent_records
from .seam import LEGACY_ATTR, apply_selective_checkpointing, remove_selective_checkpointing

__all__ = [
    # Marking regions
    "region",  # context manager and decorator: with region("attn"): ...
    "declare_regions",  # {module path pattern: region name}, no code change
    "undeclare_regions",
    "declared_regions",
    "RegionDeclarations",
    # Compiling
    "ALL_REGIONS",  # keep every marked region
    "make_sac_backend",  # memoised backend for a keep set
    "sac_backend",  # Inductor backend keeping every marked region
    "baseline_backend",  # the same compile without the tagging pass (for comparisons)
    # Region policies: (op, open regions, keep) -> CheckpointPolicy, the same in both modes
    "SAVE_COSTLY",  # default: a kept region's costly values saved, its cheap ops recomputed
    "SAVE_ALL",  # every op of a kept region saved
    "is_costly",  # what SAVE_COSTLY calls costly
    # Wrapping layers (eager, per-layer compile, whole-model compile)
    "apply_selective_checkpointing",  # one call per wrap site; see its decision table
    "remove_selective_checkpointing",  # undo it (and declare_regions) on a module tree
    "LEGACY_ATTR",  # module attribute opting into reentrant checkpointing
    "SacConfig",  # one frozen config applied to a whole model
    "plan",  # the least recompute within a memory target, measured (sac_compile.planning)
    "region_context_fn",  # context_fn for a torch.utils.checkpoint you call (transformers' switch)
    # Diagnostics (logger "sac_compile", WARNING)
    "SacDiagnosticError",
    "set_strict",
    "strict",
    # Inspecting
    "capture_partition",  # what a compiled fn saves and recomputes
    "PartitionReport",
    "autograd_saved_bytes",  # what autograd saves while fn runs (an independent check)
    "collectives_run",  # the collectives fn runs (forward, backward, recompute)
    "collect_records",  # what the tagging pass saw, per graph
    "recent_records",
]

# The composition root wires the planner's advice into the compile session, which sits below
# the planner (sac_compile.planning.advice: one INFO line when a plan dominates a keep set).
_session.set_advisor(_advice.advise)

__version__ = "0.1.0"
