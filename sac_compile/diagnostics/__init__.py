"""Diagnostics: a configuration that silently does nothing is reported, once.

Every diagnosis goes to the standard ``logging`` logger ``"sac_compile"`` at
WARNING, names the region and the module, and says what to do. The kinds (the
product spec's numbering):

==========================  ==================================================================
kind                        situation
==========================  ==================================================================
1 ``keep-unused``           a name in a keep set that no marker recorded in this root model (judged when the
                            layer or graph that carries the keep set runs a second time, so
                            that every graph of a step has had its chance to record it)
2 ``kept-nothing``          a kept region that was entered but saved nothing (only views or
                            collectives inside, or the backward needs none of its values)
3 ``no-pass``               markers traced into a graph whose backend does not run the
                            tagging pass (caught while Dynamo traces the marker)
4 ``unbalanced``            an enter without an exit (or the reverse) within one graph or scope
4 ``graph-break``           a graph break split a decorated region across graphs
4 ``eager-fallback``        a graph break inside ``with region(...)``: the frame ran eagerly,
                            neither compiled nor checkpointed
5 ``compiled-in-eager``     a module checkpointed eagerly by the seam contains compiled code
5 ``no-scope``              one graph spans several layers and holds no checkpoint scope
- ``compile-swallowed``     an outer ``torch.compile`` traced a layer wrapped with
                            ``compile=True``: the layer's own backend never runs
- ``compile-fallback``      a layer wrapped with ``compile=True`` runs eagerly (Dynamo did not
                            compile it: recompile limit, skipped frame); the eager engine runs
- ``legacy-keep-ignored``   a layer opted into reentrant checkpointing with a non-empty keep
- ``collective-recomputed`` the eager engine ran a collective inside a kept region: it is
                            recomputed (communicates again) in the backward all the same
- ``graph-reused``          a graph compiled inside some regions runs inside others: a graph
                            break compiled a module's code as a frame of its own, and Dynamo
                            reuses it for another module of the class in other regions
- ``unmarked``              a sac backend compiled a graph with no region marker and no wrapped
                            layer: it was handed to the inner backend untouched (nothing
                            checkpointed; ``make_sac_backend(whole_graph=True)`` checkpoints it)
==========================  ==================================================================

Deduplication is on the whole diagnosis per root model (:mod:`.core`), so a repeated
step, a recompile or N identical layers report once, and a second model reports again.

Modules: :mod:`.core` (the mechanism: diagnoses, owners, strict, regions recorded per
model), :mod:`.messages` (every text, built once), :mod:`.unused_keep` (first call reports,
second call judges keep names), :mod:`.compiled` (rules on the tagging pass's records),
:mod:`.eager` (rules on the eager engine's stats), :mod:`.trace_watch` (markers traced by
a backend without the pass), :mod:`.side_file` (the warm-cache side file). This package
imports only the data modules (``records``, ``keep``) and ``_compat``: the markers, the
backend, the seam and the engine report *into* it.

Compiled graphs: the backend computes a graph's diagnoses when it compiles it,
and the graph reports them when it runs (its first call under each module), so
a graph shared by many layers, or served by Dynamo's cache to a second model,
still reports for each root model. On a warm FX-graph / AOTAutograd cache hit
the tagging pass does not run; the diagnoses and the regions it recorded are
then read back from a side file (:mod:`.side_file`), so a warm start reports the
same as a cold one. If that file is missing, an INFO record says the graph could
not be checked.

``strict``: :func:`set_strict` (process-wide), :func:`strict` (a ``with`` block)
or ``SacConfig(strict=True)`` (one model) turn every diagnosis into a
:class:`SacDiagnosticError`. Errors raised while Dynamo compiles (kinds 3 and
``compile-swallowed``) reach the caller unless Dynamo's
``torch._dynamo.config.suppress_errors`` is set, which swallows them and runs
the frame eagerly; the others are raised when the graph or layer runs.
"""

from __future__ import annotations

from .core import (
    COLLECTIVE_RECOMPUTED,
    COMPILE_FALLBACK,
    COMPILE_SWALLOWED,
    COMPILED_IN_EAGER,
    EAGER_FALLBACK,
    GRAPH_BREAK,
    GRAPH_REUSED,
    KEEP_UNUSED,
    KEPT_NOTHING,
    KINDS,
    LEGACY_KEEP_IGNORED,
    NO_PASS,
    NO_SCOPE,
    UNBALANCED,
    UNMARKED,
    Diagnosis,
    SacDiagnosticError,
    describe_module,
    make_strict,
    report,
    reported,
    set_strict,
    strict,
)

__all__ = [
    "COLLECTIVE_RECOMPUTED",
    "COMPILED_IN_EAGER",
    "COMPILE_FALLBACK",
    "COMPILE_SWALLOWED",
    "EAGER_FALLBACK",
    "GRAPH_BREAK",
    "GRAPH_REUSED",
    "KEEP_UNUSED",
    "KEPT_NOTHING",
    "KINDS",
    "LEGACY_KEEP_IGNORED",
    "NO_PASS",
    "NO_SCOPE",
    "UNBALANCED",
    "UNMARKED",
    "Diagnosis",
    "SacDiagnosticError",
    "describe_module",
    "make_strict",
    "report",
    "reported",
    "set_strict",
    "strict",
]
