"""``declare_regions``: mark regions by module path, without touching the model's code.

``declare_regions(model, {"model.layers.*.self_attn": "attn"})`` runs every
matched module's call inside ``region("attn")``: a forward pre-hook emits the
enter marker and a forward hook emits the exit (not ``always_call``: Dynamo guards
that dict by hook id, which would make one compiled graph per layer; a module that
raises closes no region, and the eager engine's pass ends what is open). Hooks are traced by Dynamo like the rest of the
module call, so this works eagerly, under ``torch.compile`` (``fullgraph=True``
included) and inside ``apply_selective_checkpointing`` (whose checkpoint runs
the module's hooks inside it).

Patterns are matched against the full dotted path from the root, as
``model.named_modules()`` reports it; ``*`` stands for exactly one path
component (``"layers.*.mlp"`` matches ``layers.0.mlp``, not ``layers.0.x.mlp``).
The root module itself is the empty path ``""``. A model wrapped by
``torch.compile`` (an ``OptimizedModule``) is matched through the module it wraps.

A pattern that names no module may name a *method*: module components, then attributes down to
an object and one of its methods (``"layers.*.mlp.dispatcher.dispatch"``: the ``dispatch``
method of the plain object in each MoE block's ``dispatcher`` attribute, an MoE dispatcher's
stage). That object's method is then run inside ``region(name)``, as ``@region(name)`` would
run it, without editing its class: an instance attribute shadows the class's method (removed
again by ``remove()`` / :func:`undeclare_regions`; the object pickles and deep-copies with it).
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from ._compat.dynamo import guard_module_hooks, skip_frame, unwrap_compiled
from .arguments import check_pattern
from .keep import validate_region_name
from .markers import DECLARED_ATTR as _ATTR
from .markers import declared_names, exporting, ops
from .markers.regions import wrap_in_region
from .records import generic_path

__all__ = ["RegionDeclarations", "declare_regions", "declared_names", "undeclare_regions"]


@dataclass
class RegionDeclarations:
    """What one :func:`declare_regions` call installed; ``remove()`` takes it out again."""

    model: nn.Module
    # module path -> region names this call declared on it (in the order given)
    modules: dict[str, tuple[str, ...]] = field(default_factory=dict)
    _handles: list[tuple[nn.Module, str]] = field(default_factory=list, repr=False)
    _methods: list[tuple[nn.Module, str]] = field(default_factory=list, repr=False)

    def remove(self) -> None:
        """Remove the hooks this call installed (declarations made by other calls stay)."""
        for module, path in self._methods:
            _undeclare_method(module, path)
        self._methods.clear()
        for module, name in self._handles:
            declared = module.__dict__.get(_ATTR, {})
            handles = declared.pop(name, None)
            if handles is not None:
                for h in handles:
                    h.remove()
            if not declared:
                module.__dict__.pop(_SCRIPT_HOOK, None)
        self._handles.clear()
        self.modules.clear()

    def __enter__(self) -> RegionDeclarations:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def declare_regions(model: nn.Module, declarations: Mapping[str, str]) -> RegionDeclarations:
    """Run each module matching a pattern inside ``region(name)``.

    Args:
        model: the root module; paths are relative to it.
        declarations: ``{pattern: region name}``. A pattern is a dotted module
            path where ``*`` matches one component.

    Returns:
        A :class:`RegionDeclarations` handle (``.modules`` lists what matched,
        ``.remove()`` undoes it; also a context manager).

    Raises:
        TypeError: ``model`` is not a module, or ``declarations`` is not a
            mapping of strings to strings.
        ValueError: a pattern matches no module (the message lists the closest
            module paths), a pattern is malformed, or a region name is invalid.

    Declaring the same name on the same module twice is a no-op, so calling this
    again with the same arguments changes nothing.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"declare_regions takes an nn.Module, got {type(model).__name__}")
    if not isinstance(declarations, Mapping):
        raise TypeError(
            "declare_regions takes a mapping {module path pattern: region name}, "
            f"got {type(declarations).__name__} {declarations!r}"
        )
    root = unwrap_compiled(model)  # torch.compile(model)
    paths = {path: module for path, module in root.named_modules()}
    plan: list[tuple[str, str, nn.Module]] = []
    methods: list[tuple[str, str, nn.Module, object, str]] = []
    for pattern, name in declarations.items():
        check_pattern(pattern)
        validate_region_name(name)
        matched = [p for p in paths if match_path(pattern, p)]
        if matched:
            plan.extend((p, name, paths[p]) for p in matched)
            continue
        found = _match_methods(pattern, paths)
        if not found:
            raise ValueError(no_match_message(pattern, list(paths)))
        methods.extend((path, name, module, obj, attr) for path, module, obj, attr in found)

    handle = RegionDeclarations(model)
    for path, name, module in plan:
        declared = module.__dict__.setdefault(_ATTR, {})
        if name not in declared:
            declared[name] = _install(module, name)
            handle._handles.append((module, name))
        handle.modules[path] = handle.modules.get(path, ()) + (name,)
    for path, name, module, obj, attr in methods:
        if _declare_method(module, path, obj, attr, name):
            handle._methods.append((module, path))
        handle.modules[path] = handle.modules.get(path, ()) + (name,)
    return handle


def undeclare_regions(model: nn.Module) -> int:
    """Remove every declared region under ``model``; returns how many were removed."""
    root = unwrap_compiled(model)
    removed = 0
    for module in root.modules():
        for path in list(module.__dict__.get(_METHODS_ATTR, {})):
            removed += _undeclare_method(module, path)
        declared = module.__dict__.get(_ATTR)
        while declared:
            _, handles = declared.popitem()
            for h in handles:
                h.remove()
            removed += 1
        module.__dict__.pop(_SCRIPT_HOOK, None)
    return removed


def declared_regions(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """``{module path: region names}`` currently declared under ``model``."""
    root = unwrap_compiled(model)
    found = {
        path: tuple(module.__dict__[_ATTR])
        for path, module in root.named_modules()
        if module.__dict__.get(_ATTR)
    }
    for module in root.modules():
        for path, (obj, attr) in module.__dict__.get(_METHODS_ATTR, {}).items():
            found[path] = obj.__dict__[attr].names
    return found


def _enter_hook(name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if not exporting():  # See Note [markers export as nothing] in sac_compile/markers/regions.py.
        ops.enter_module_region(name, module, args, kwargs)


def _exit_hook(
    name: str, module: nn.Module, _args: tuple[Any, ...], _kwargs: dict[str, Any], output: object
) -> None:
    if not exporting():
        ops.exit_module_region(name, module, output)


def _output_hook(
    name: str, module: nn.Module, _args: tuple[Any, ...], _kwargs: dict[str, Any], output: object
) -> None:
    # (prepended: the module's own output, before forward hooks registered earlier change it)
    if not exporting():
        ops.module_output(name, module, output)


# Traced inline with the module call, the hooks put their markers in its graph. Run as
# frames of their own (a graph break split the module call, so Dynamo runs _call_impl
# eagerly), they are not compiled: the markers run eagerly (a no-op outside the eager
# engine) and the graphs compiled for the forward find the region on the stack
# (markers.context.enclosing_context) instead of in a marker-only graph of their own.


@functools.cache
def _prepare_dynamo() -> None:
    # on the first declaration, not at import: marking code skipped imports Dynamo
    skip_frame(_enter_hook)
    skip_frame(_exit_hook)
    skip_frame(_output_hook)
    # modules of one class declared differently must not share compiled code
    guard_module_hooks()


def _install(module: nn.Module, name: str) -> tuple[RemovableHandle, ...]:
    _prepare_dynamo()
    # prepend: the region encloses hooks registered earlier (e.g. by fully_shard)
    pre = module.register_forward_pre_hook(
        functools.partial(_enter_hook, name), prepend=True, with_kwargs=True
    )
    post = module.register_forward_hook(functools.partial(_exit_hook, name), with_kwargs=True)
    # the module's own output, first (eager engine: a kept body's output, eager/kept_bodies.py)
    out = module.register_forward_hook(functools.partial(_output_hook, name), prepend=True, with_kwargs=True)
    module.__dict__[_SCRIPT_HOOK] = functools.partial(_refuse_script, type(module).__name__)
    return pre, post, out


# torch.jit.script compiles a module's forward hooks too, and ours (functools.partial
# objects) are not TorchScript: it fails with "'functools.partial' object has no attribute
# '__name__'". TorchScript calls __prepare_scriptable__ on each module before scripting it
# (torch/jit/_script.py, call_prepare_scriptable_func_impl), which is where we say so.
# Returning a copy without the hooks is not an option: TorchScript stores what it returns
# into the parent's _modules, so the user's model would silently lose its regions.
_SCRIPT_HOOK = "__prepare_scriptable__"


def _refuse_script(cls_name: str) -> None:
    raise TypeError(
        f"torch.jit.script cannot compile the forward hooks that sac_compile.declare_regions put on "
        f"{cls_name} (regions mark nothing in TorchScript anyway). Script the model without them: "
        "sac_compile.declare.undeclare_regions(model) before torch.jit.script (declare again afterwards), or use "
        "torch.jit.trace / torch.export, which drop the markers."
    )


# --- methods of plain objects ------------------------------------------------------------

# Module attribute: {declared method path: (object, method name)} of the methods declared on
# objects reached from this module (the first module of the path), for undeclare_regions.
_METHODS_ATTR = "_sac_declared_methods"


class DeclaredMethod:
    """An object's method run inside its declared regions (an instance attribute shadowing the
    class's method). Pickles and deep-copies as ``(object, method name, region names)``."""

    def __init__(self, owner: object, attr: str, names: tuple[str, ...]) -> None:
        self.owner, self.attr, self.names = owner, attr, names
        call: Callable[..., Any] = functools.partial(getattr(type(owner), attr), owner)
        for name in reversed(names):  # (the first name declared is the outermost region)
            call = wrap_in_region(name, call)
        self._call = call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return DeclaredMethod, (self.owner, self.attr, self.names)


def _match_methods(pattern: str, paths: dict[str, nn.Module]) -> list[tuple[str, nn.Module, object, str]]:
    """``(path, module, object, method name)`` for a pattern naming a method: the longest head
    that matches modules, then attributes (no wildcard) down to an object with that method."""
    parts = pattern.split(".")
    for k in range(len(parts) - 1, -1, -1):
        head, rest = ".".join(parts[:k]), parts[k:]
        if "*" in rest:
            continue
        modules = [p for p in paths if match_path(head, p)]
        if not modules:
            continue
        found = []
        for p in modules:
            obj: object = paths[p]
            for a in rest[:-1]:
                obj = getattr(obj, a, None)
            method = getattr(type(obj), rest[-1], None)
            if obj is None or not inspect.isfunction(method) or not hasattr(obj, "__dict__"):
                raise ValueError(
                    f"declare_regions: pattern {pattern!r} matches no module, and "
                    f"{'.'.join(filter(None, [p, *rest]))!r} is not a method of an object with a __dict__ "
                    f"(got {type(obj).__name__}.{rest[-1]}: {type(method).__name__}). Name a module, or a "
                    "method defined on an object's class (e.g. 'layers.*.mlp.dispatcher.dispatch')"
                )
            found.append((".".join(filter(None, [p, *rest])), paths[p], obj, rest[-1]))
        return found
    return []


def _declare_method(module: nn.Module, path: str, obj: object, attr: str, name: str) -> bool:
    """Run ``obj.attr`` inside region ``name`` too; False when it already is."""
    current = obj.__dict__.get(attr)
    names = current.names if isinstance(current, DeclaredMethod) else ()
    if name in names:
        return False
    obj.__dict__[attr] = DeclaredMethod(obj, attr, (*names, name))
    module.__dict__.setdefault(_METHODS_ATTR, {})[path] = (obj, attr)
    return True


def _undeclare_method(module: nn.Module, path: str) -> int:
    obj, attr = module.__dict__.get(_METHODS_ATTR, {}).pop(path, (None, ""))
    return int(obj is not None and isinstance(obj.__dict__.pop(attr, None), DeclaredMethod))


def match_path(pattern: str, path: str) -> bool:
    """``*`` matches exactly one dotted component; everything else literally."""
    if pattern == "":
        return path == ""
    want = pattern.split(".")
    have = path.split(".") if path else []
    return len(want) == len(have) and all(w == "*" or w == h for w, h in zip(want, have))


def no_match_message(pattern: str, paths: list[str]) -> str:
    generic = sorted({generic_path(p) for p in paths if p})
    near = difflib.get_close_matches(pattern, generic, n=5, cutoff=0.5)
    if not near:
        # the same depth, or the same last component
        last = pattern.rsplit(".", 1)[-1]
        near = [g for g in generic if g.rsplit(".", 1)[-1] == last][:5]
    hint = (
        f" Closest module paths: {', '.join(map(repr, near))}."
        if near
        else f" Module paths look like: {', '.join(map(repr, generic[:5]))}."
    )
    return (
        f"declare_regions: pattern {pattern!r} matches no module (patterns match the full dotted path "
        f"from the root, as named_modules() reports it; '*' matches one component).{hint}"
    )
