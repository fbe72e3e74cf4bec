"""Which checkpointed layers keep a method a save unit wrapped: the owners of each wrapper.

NOTE [kept methods of shared submodules]: one submodule may sit inside several checkpointed
layers (shared MTP weights, a shared gate; a layer and a submodule of it checkpointed on its
own), and its kept method is wrapped once for all of them. Removing checkpointing from one
layer must leave the wrapper while another layer still checkpointed keeps that method (its
replay would silently recompute it, its memory no longer kept), and put back exactly what the
module had once the last one goes. A layer keeps a wrapper while its boundary is alive and
installed, its policy keeps the wrapper's ``kept_as``, and the wrapped submodule is among its
submodules (as ``apply_recompute_config`` matched them: a nested boundary's included).

Asking every other keeping layer's tree at each removal made removing all layers of a model
one by one quadratic (examples/bench_removal.py, 61 MoE-like layers of 261 modules: 0.49 s, the
removals without the rule 0.07 s; with owners 0.09 s). Instead each
wrapper holds its owners (a weak set of boundaries), read by one walk of every live keeping
layer, made again only when an owner may have appeared since: a keeping boundary or a wrapper
was made (an apply, a deep copy, an unpickled model: a copy's boundaries and wrappers are its
own, registered here as they are made, and walked lazily, as a copy's submodules may not exist
yet when its boundary is made) or a submodule was registered anywhere (torch's global
registration hook: ``structure_generation``, watched from the first keeping boundary on; a
shared submodule assigned into another layer). An owner counts only if it still keeps the
wrapper as above, which a removal checks of the recorded owners alone: a walk of an owner's
tree is made only for a submodule some other layer also holds. Not seen: a wrapped submodule
put into another keeping layer behind torch's hooks (``ModuleList.insert``, an edit of
``_modules``) after the last walk, until the owners are read again (once a submodule is
registered, or a boundary or wrapper made); that layer's replay then recomputes the method.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from .kept_callables import _KeptMethod
from .module_state import structure_generation, watch_module_structure, watch_tree

if TYPE_CHECKING:
    from .module import _CheckpointedForward

__all__ = ["kept_elsewhere", "kept_wrappers", "keeping_boundary_made"]

# The live boundaries whose policy keeps methods, and how many were made: with the count of
# wrappers made and the structure generation, what the owners were last read at.
_KEEPING: weakref.WeakSet[_CheckpointedForward] = weakref.WeakSet()
_boundaries_made = 0
_read_at: tuple[int, int, int] | None = None


def keeping_boundary_made(forward: _CheckpointedForward, /) -> None:
    """Register a boundary whose policy keeps methods (made by an apply or a copy)."""
    global _boundaries_made
    watch_module_structure()  # from now on, a submodule registered in its layer is seen
    layer = forward.module_ref()
    if layer is not None:  # NOTE [only watched trees move the generation] in module_state.py
        watch_tree(layer)
    _KEEPING.add(forward)
    _boundaries_made += 1


def _read_owners() -> None:
    """Add each live keeping boundary to the owners of the wrappers in its layer that its
    policy keeps: one walk of each layer, only when an owner may have appeared since the last
    (NOTE [kept methods of shared submodules])."""
    global _read_at
    now = (_boundaries_made, _KeptMethod.made, structure_generation())
    if now == _read_at:
        return
    for forward in list(_KEEPING):
        layer = forward.module_ref()
        if layer is None:
            continue
        assert forward.options.keep is not None  # registered with a policy
        callables = forward.options.keep.callables
        # Whether installed or not: one put back later (a compiled wrapper over it) counts.
        # A wrapper sits under its method's name: only those are read ("Class.method").
        names = {kept_as.rpartition(".")[2] for kept_as in callables}
        for sub in _tree(layer):
            for name in names:
                held = sub.__dict__.get(name)
                if type(held) is _KeptMethod and held.kept_as in callables:
                    held.owners.add(forward)
    _read_at = now


def _tree(layer: nn.Module, /) -> list[nn.Module]:
    """``layer`` and its submodules, each once (``modules()`` without a generator per module:
    this runs over whole models)."""
    found: list[nn.Module] = []
    seen: set[int] = set()
    stack = [layer]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        found.append(node)
        for child in node._modules.values():
            if child is not None:
                stack.append(child)
    return found


def kept_wrappers(layer: nn.Module, /) -> list[tuple[nn.Module, str, _KeptMethod]]:
    """(submodule, name, wrapper) for each kept method in ``layer``'s tree, itself included."""
    return [(sub, name, held) for sub in _tree(layer) for name, held in tuple(sub.__dict__.items())
            if type(held) is _KeptMethod]


def kept_elsewhere(layer: nn.Module, wrapped: list[tuple[nn.Module, str, Any]],
                   installed: Callable[[nn.Module], Any], /) -> set[tuple[int, str]]:
    """(id of a submodule, method name) for each of the ``wrapped`` (submodule, name, wrapper)
    that a layer other than ``layer``, still checkpointed (``installed(owner)`` is its
    boundary), keeps (NOTE [kept methods of shared submodules])."""
    _read_owners()
    kept: set[tuple[int, str]] = set()
    trees: dict[int, set[int]] = {}  # an owner's submodules by id, walked once per removal
    for sub, name, held in wrapped:
        for forward in list(held.owners):
            owner = forward.module_ref()
            if owner is None or owner is layer or installed(owner) is not forward:
                continue
            assert forward.options.keep is not None  # registered with a policy
            if held.kept_as not in forward.options.keep.callables:
                continue
            tree = trees.get(id(owner))
            if tree is None:
                tree = trees[id(owner)] = {id(m) for m in _tree(owner)}
            if id(sub) in tree:  # both alive: an id is theirs
                kept.add((id(sub), name))
                break
    return kept
