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
step, on the root or any submodule, is found at the next call. Not found: a generator that
takes the place of another attribute of the same name holding no generator (``self.gen =
None`` in ``__init__``, a generator later), until some dict of the tree changes size or the
tree changes (``pytree_ckpt.module_state.drop_caches(module)`` forgets the cache); nor one
inside a container attribute (a list of generators), nor one a closure holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from . import module_state
from .module_state import GENERATORS_CACHE, ModuleDicts

__all__ = ["held_generators"]

_Generator = torch.Generator


def _dropped() -> None:
    return None


class _Held:
    """What the last search found on one module tree (see the module's NOTE). Holds the
    submodules' dicts, not the root's own (which holds this: no reference cycle); a copy or a
    pickle of the module carries none (found again at its next call), as for the tree's shape
    in module_state.py."""

    __slots__ = ("generation", "own_size", "sizes", "own_names", "names")

    def __init__(self, generation: int, sizes: tuple[tuple[dict[str, Any], int], ...],
                 own_names: tuple[str, ...], names: tuple[tuple[dict[str, Any], str], ...]
                 ) -> None:
        self.generation = generation
        self.own_size = -1  # set once this is in the root's dict
        self.sizes = sizes
        self.own_names = own_names
        self.names = names

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _dropped, ()

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None


def _names(d: dict[str, Any], /) -> tuple[str, ...]:
    return tuple(name for name, value in d.items() if isinstance(value, _Generator))


def _search(module: nn.Module, tree: ModuleDicts, /) -> _Held:
    own = module.__dict__
    held = _Held(module_state.structure_generation(),
                 tuple((d, len(d)) for d in tree.submodules), _names(own),
                 tuple((d, name) for d in tree.submodules for name in _names(d)))
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
