"""A wrapped layer whose ``forward`` the user compiled: compiled again as the layer's checkpoint scope.

Note [a compiled forward is the layer's scope]
Trainers compile a checkpointed layer's whole ``forward``: on its class (xtuner's
``_compile_overwrite``: ``setattr(cls, "forward", torch.compile(cls.forward, fullgraph=True))``)
or on the instance, before or after wrapping it (``layer.forward = torch.compile(layer.forward)``).
Run inside the seam's eager checkpoint, that compiled call keeps nothing: the checkpoint discards
what its graph saved (full recompute), or, routed as a kept body because it holds a kept region,
its whole graph is held (no checkpoint at all). So the seam compiles the same function again,
with the user's ``torch.compile`` options (``fullgraph``, ``dynamic``, Inductor's mode and
options) and ``make_sac_backend(<the layer's keep set, policy, budget, offload>, inner=<the
user's backend>)``, and runs it with no eager checkpoint around it: the compiled graph is the
layer's checkpoint scope, as with ``compile=`` (kept regions saved, the rest recomputed in its
backward). The copy has a code object of its own (Dynamo's cache and recompile limit are per
code object: the user's compile of the same function, still run by unwrapped layers of the
class, keeps its own entries) and is shared by every layer of the class and configuration (one
graph for N layers). A backend the seam cannot wrap (one without AOTAutograd) is refused when it
is found, with the fix.
"""

from __future__ import annotations

import types

import torch.nn as nn

from .arguments import SeamConfig
from .compiler.adopt import (
    is_adopted,
    scope_compile,
    user_function,
)
from .records import user_class_name

__all__ = ["FORWARD_SCOPE", "USER_FORWARD", "forward_is_scope"]

#: the seam's generated class's attribute: its forward is the seam's compile of the class's compiled forward
FORWARD_SCOPE = "_sac_forward_scope"
#: an instance's compiled forward the seam compiled again (put back by remove_selective_checkpointing)
USER_FORWARD = "_sac_user_forward"


def forward_is_scope(module: nn.Module, config: SeamConfig) -> bool:
    """Whether ``module``'s forward is the seam's compile of a compiled forward (its graph is the
    layer's scope): its class's, or an instance attribute the user compiled, compiled again here
    when first seen (at wrapping, or at the first call after ``layer.forward = torch.compile(...)``)."""
    if config.compile_options is not None:
        return False  # (the seam compiles the layer's whole call: a compiled forward is traced inline)
    forward = module.__dict__.get("forward")
    if forward is None:
        return getattr(type(module), FORWARD_SCOPE, False) is True
    if is_adopted(forward):
        return True
    function, bound = user_function(forward)
    if function is None:
        return False  # (not torch.compile's: another library's forward, left as it is)
    if bound is not None and bound is not module:
        return False  # (another object's method compiled: not this layer's forward)
    where = f"{user_class_name(type(module))}.forward (set on the instance)"
    scoped = scope_compile(forward, config.actions, where)  # (Note [a compiled forward is the layer's scope])
    module.__dict__[USER_FORWARD] = forward
    module.__dict__["forward"] = scoped if bound is None else types.MethodType(scoped, module)
    return True
