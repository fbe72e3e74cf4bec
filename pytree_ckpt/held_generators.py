"""The ``torch.Generator``s a call's modules hold as attributes (``self.gen =
torch.Generator()`` on the module a boundary wraps or on any of its submodules), found per call
from a cache on the module.

NOTE [generators held as attributes]: an MoE router drawing its noise from a generator of its
own (``torch.randn(..., generator=self.gen)``) drew other numbers in the replay, since the
boundary restored only the default generators and those passed in: the replay routed tokens to
other experts, every shape the same, and the gradients were silently other than eager's. The
generators in the ``__dict__`` of the call's modules (the owner, modules passed as arguments,
and their submodules) are therefore restored and jumped exactly as generators passed in (NOTE
[generators passed in] in rng.py, NOTE [skipped work keeps the RNG in step] in frames.py).

Walking every submodule's ``__dict__`` at every call would cost each layer, with or without a
generator, a look at every attribute it has. What was found is cached on the root instead: the
names that held a generator, in which dict, read live at each call (a generator replaced by
another under its name is the new one), and the size of each dict then. The cache is found
again when the module tree changes (the structure generation of module_state.py) or any dict's
size changes, which a new attribute does: ``self.gen = torch.Generator()`` set after the first
step, on the root or any submodule, is found at the next call. Names holding None in modules
of the user's classes are read at each call too (not nn.Module's own, nor this library's
markers): ``self.gen = None`` in ``__init__``, a generator later, is the usual way to make one
on the input's device, and changes no dict's size. Not found: a generator that takes the
place of another attribute of the same name holding neither (until some dict of the tree
changes size or the tree changes;
``pytree_ckpt.module_state.drop_caches(module)`` forgets the cache); nor one inside a
container attribute (a list of generators), nor one a closure holds.

A generator made during the checkpointed call itself (``if self.gen is None: self.gen =
torch.Generator(x.device)`` in the forward) cannot be restored for that call's replay: its
state before the call was never seen. The replay finds the name as the forward did (None),
makes another, and draws other numbers than the forward did unless the forward seeds it the
same way each time (a fixed seed: exact, helper NK); the boundary warns once per module
(``warn_made_during``, which cannot tell), naming the fix: make it before the first call. One
made as a new attribute of a submodule (not of the call's module) in that call is warned of
only where the call's trees already hold a generator or a None-valued name (the after-check
reads the submodules' dict sizes only then, to keep the usual layer at one ``len``); it is
restored from the next call on either way.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from . import module_state
from .eager import Told, user_stacklevel
from .module_state import GENERATORS_CACHE, DroppedOnCopy, ModuleDicts

__all__ = ["held_generators", "warn_made_during"]

_Generator = torch.Generator


class _Held(DroppedOnCopy):
    """What the last search found on one module tree (see the module's NOTE): the names that
    held a generator or None, read at each call. Holds the submodules' dicts, not the root's
    own (which holds this: no reference cycle); a copy or a pickle of the module carries none
    (found again at its next call)."""

    __slots__ = ("generation", "own_size", "sizes", "own_names", "names")

    def __init__(self, generation: int, sizes: tuple[tuple[dict[str, Any], int], ...],
                 own_names: tuple[str, ...], names: tuple[tuple[dict[str, Any], str], ...]
                 ) -> None:
        self.generation = generation
        self.own_size = -1  # set once this is in the root's dict
        self.sizes = sizes
        self.own_names = own_names
        self.names = names


# nn.Module's own attributes (``_is_full_backward_hook`` holds None in every module): never a
# generator's place.
_MODULE_OWN = frozenset(nn.Module().__dict__)
_MARKERS = "_pytree_ckpt_"  # this library's (a copy's Told markers are None)


def _names(d: dict[str, Any], user: bool, /) -> tuple[str, ...]:
    """The names in ``d`` that hold a generator, or None in a module of the user's class (one
    may be put there later; torch.nn's own layers, whose None options such as an RMSNorm's
    ``eps`` would be read at every call for nothing, make no generator)."""
    return tuple(name for name, value in tuple(d.items())
                 if isinstance(value, _Generator) or
                 (user and value is None and name not in _MODULE_OWN and
                  not name.startswith(_MARKERS)))


def _users(module: nn.Module, /) -> dict[int, bool]:
    """By id of each module's ``__dict__`` in ``module``'s tree: whether its class is the
    user's rather than torch's own."""
    return {id(m.__dict__): not type(m).__module__.startswith("torch.")
            for m in module.modules()}


def _search(module: nn.Module, tree: ModuleDicts, /) -> _Held:
    own = module.__dict__
    users = _users(module)
    held = _Held(module_state.structure_generation(),
                 tuple((d, len(d)) for d in tree.submodules), _names(own, users[id(own)]),
                 tuple((d, name) for d in tree.submodules
                       for name in _names(d, users.get(id(d), True))))
    own[GENERATORS_CACHE] = held
    held.own_size = len(own)
    return held


def _held(module: nn.Module, tree: ModuleDicts, /) -> tuple[torch.Generator, ...]:
    own = module.__dict__
    held = own.get(GENERATORS_CACHE)
    if held is None or held.generation != module_state.structure_generation() or \
            held.own_size != len(own):
        held = _search(module, tree)
    else:
        # NOTE [loops on the per-call path] in boundary.py: one len per submodule, no walk of
        # their attributes.
        for d, size in held.sizes:
            if len(d) != size:
                held = _search(module, tree)
                break
    if not held.own_names and not held.names:
        return ()  # the usual layer
    found = []
    for name in held.own_names:
        value = own.get(name)
        if isinstance(value, _Generator):
            found.append(value)
    for d, name in held.names:
        value = d.get(name)
        if isinstance(value, _Generator):
            found.append(value)
    return tuple(found)


def held_generators(modules: Sequence[nn.Module], trees: Sequence[ModuleDicts], /
                    ) -> tuple[torch.Generator, ...]:
    """The generators ``modules`` and their submodules hold as attributes now (``trees``: their
    current ``module_dicts``); duplicates are left for the caller to drop."""
    if len(modules) == 1:
        return _held(modules[0], trees[0])
    found: tuple[torch.Generator, ...] = ()
    for module, tree in zip(modules, trees):
        found += _held(module, tree)
    return found


_WARNED_MADE = "_pytree_ckpt_warned_generator_made"


def warn_made_during(modules: Sequence[nn.Module], trees: Sequence[ModuleDicts],
                     restored: tuple[tuple[torch.Generator, torch.Tensor], ...], /) -> None:
    """After a call's original pass: warn once per module of a generator its modules hold now
    that the call did not hold when it started (``restored``, with their states): made (or
    assigned) during the call, so its replay cannot restore it (see the module's NOTE).
    Looked for where one is made: under a name that held None, or as a new attribute of a
    call's module (its dict grew); per call, the usual layer pays one ``len``."""
    for module in modules:
        own = module.__dict__
        held = own.get(GENERATORS_CACHE)
        if held is None or held.own_names or held.names or held.own_size != len(own):
            break
    else:
        return
    now = held_generators(modules, trees)
    if not now:
        return
    before = {id(g) for g, _ in restored}
    if all(id(g) in before for g in now):
        return
    owner = modules[0]
    if owner.__dict__.get(_WARNED_MADE):
        return
    owner.__dict__[_WARNED_MADE] = Told()  # a copy is told anew
    warnings.warn(
        f"pytree_ckpt: a torch.Generator that {type(owner).__name__} (or a submodule) holds as "
        "an attribute was made or assigned during its checkpointed call: the replay cannot "
        "restore a state it never saw, so, unless the forward makes it the same way at each "
        "call (a fixed seed, `torch.Generator().manual_seed(1234)`, which the replay runs "
        "again), this call's replay draws other numbers than its forward did (its gradients "
        "differ from eager's; verify_replay=True tells). Later calls restore it. Tip: make the "
        "generator before the first checkpointed call (in __init__, or on the device once the "
        "model is moved), not lazily in forward.", stacklevel=user_stacklevel())
