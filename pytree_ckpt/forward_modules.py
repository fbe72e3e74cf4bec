"""What the modules of a call were when its original pass ran (their modes, their parameter and
buffer entries, their submodules), put back for the replay if they changed before backward: NOTE
[the replay sees the forward's modules].

What the original pass changes of the modules' state (buffers, frozen parameters) is in
``state_changes.py``; which modules a call uses, in ``module_state.py``.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn

from .errors import CheckpointError
from .module_state import ModuleDicts, changed_submodule, structure_generation, submodules_now

__all__ = ["Changes", "ForwardModules"]


def _refuse_replaced_in_forward(roots: Sequence[nn.Module], trees: Sequence[ModuleDicts],
                                ran: list[dict[str, Any]], /) -> None:
    now = {id(d) for d in ran}
    if all(id(d) in now for tree in trees for d in tree.submodules):
        return  # only added (a lazily built cache module): those ran, or will in the replay
    raise CheckpointError(
        f"the forward of {type(roots[0]).__name__} replaced or removed one of its submodules: "
        "the replay in backward runs the tree the forward left, so where the old one ran "
        "first (a warm-up activation swapped after use) it would give other gradients than "
        "eager, which backpropagates through the one that ran; which ran cannot be told",
        expected="submodules left in place by the forward (adding new ones is fine)",
        got="a submodule of the tree before the call missing from it after the call",
        tip="make the change outside the checkpointed call (before the next step), or run "
            "that first call without checkpointing")


# The caller's modes, and (dict, the forward's entries, the caller's entries) per swapped dict.
Changes = tuple[tuple[list[bool], list[Any]],
                list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]]


def _dropped() -> None:
    return None


_MISSING = object()


class _Entries:
    """NOTE [the forward's entries, cached]: the entries of a call's ``_parameters`` and
    ``_buffers`` dicts and its submodules' training flags, as a forward found them, as one
    flat tuple of (dict, key, value). ``holds()`` says whether the dicts still hold exactly
    these (each value the same object; each dict as long; the empty ones still empty): one
    loop over the entries, about half of what comparing each dict with a copy of it costs,
    and a snapshot of a module tree costs about as much again. So a tree's snapshot is kept
    on its ``ModuleDicts`` (rebuilt with it when the structure changes) and a forward that
    finds it still holding shares it rather than copying the dicts anew: the usual layer call
    (its modules' own parameters, FSDP2's unsharded ones) checks twice and copies nothing.
    A snapshot holding a tensor with a graph (a fast weight ``torch.func.functional_call``
    swapped in) is not kept past its call, which would keep that graph alive; one holding
    leaf tensors swapped in is kept until the tree's next forward (as the tree's own
    parameters are). Read-only once made."""

    __slots__ = ("flat", "sized", "lens", "empty", "flags", "keep")

    def __init__(self, dicts: tuple[dict[str, Any], ...], submodules: tuple[dict[str, Any], ...],
                 /) -> None:
        self.sized = tuple([d for d in dicts if d])
        self.lens = tuple(map(len, self.sized))
        self.empty = tuple([d for d in dicts if not d])
        self.flags = [d.get("training") for d in submodules]
        entries = [(d, k, v) for d in self.sized for k, v in d.items()]
        self.keep = all(v is None or v.grad_fn is None for _, _, v in entries)
        self.flat = (*entries, *zip(submodules, ("training",) * len(submodules), self.flags))

    def holds(self) -> bool:
        for d, key, value in self.flat:
            if d.get(key, _MISSING) is not value:  # a None entry removed counts too
                return False
        return tuple(map(len, self.sized)) == self.lens and not any(self.empty)

    def by_dict(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """Each dict that had entries, with those entries."""
        found, start = [], 0
        for d, n in zip(self.sized, self.lens):
            found.append((d, {key: value for _, key, value in self.flat[start:start + n]}))
            start += n
        return found

    def __reduce__(self) -> tuple[Any, tuple[()]]:  # a copy of its module carries none
        return _dropped, ()

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None


class ForwardModules:
    """NOTE [the replay sees the forward's modules]: what the modules of a call were when the
    original pass ran, put back for the replay if it changed before backward:

    - each submodule's ``training`` flag: a model switched to ``eval()`` between forward and
      backward (a validation pass) would otherwise replay without dropout, and backpropagate
      through another function than the one that ran;
    - the entries of its ``_parameters`` and ``_buffers`` dicts, as the original pass left
      them: ``torch.func.functional_call`` (and ``torch.nn.utils.stateless``) swap tensors in
      for the call only, so the replay in backward would run on the module's own parameters
      and the tensors passed in would get no gradient.

    The forward keeps the entries and flags (NOTE [the forward's entries, cached]: an entry
    added to a dict that had none is not the forward's either); when nothing changed (FSDP2
    keeps its unsharded parameter objects), backward compares and changes nothing. Values
    are not part of it: what the
    forward changes in place is ``StateWatch``'s. Submodules replaced since are refused (NOTE
    [the replay runs the forward's submodules] in module_state.py).
    """

    __slots__ = ("roots", "submodules", "modes", "entries", "tree_roots", "generation", "ran")

    def __init__(self, roots: Sequence[nn.Module], trees: Sequence[ModuleDicts], /) -> None:
        self.tree_roots = roots
        self.generation = structure_generation()
        # The submodules that ran: as read before the forward, or read again when the forward
        # registered one (NOTE [the replay runs the forward's submodules] in module_state.py).
        # One it replaced or removed is refused now: the replay would run the tree the forward
        # left.
        self.ran = submodules_now(roots, trees)
        if self.ran is not None:
            _refuse_replaced_in_forward(roots, trees, self.ran)
        if len(trees) == 1:  # the usual case, without concatenation
            tree = trees[0]
            others = tree.flagged_otherwise
            self.submodules = tree.submodules
            # NOTE [the forward's entries, cached]
            cache = tree.entries
            entries = cache[0] if cache is not None else None
            if entries is None or not entries.holds():
                entries = _Entries(tree.parameters + tree.buffers, tree.submodules)
                if cache is not None:
                    cache[0] = entries if entries.keep else None
        else:
            others = tuple(m for tree in trees for m in tree.flagged_otherwise)
            self.submodules = tuple(d for tree in trees for d in tree.submodules)
            entries = _Entries(tuple(d for tree in trees for d in (*tree.parameters,
                                                                     *tree.buffers)),
                               self.submodules)
        self.entries = entries
        self.roots = [*roots, *others] if others else roots
        # The roots' flags (and those read as attributes); the submodules' are the entries'.
        self.modes = [m.training for m in self.roots]

    def changes(self) -> Changes | None:
        """What differs now from the forward, or ``None`` (the usual case: nothing); a
        submodule replaced since is refused."""
        changed = changed_submodule(self.tree_roots, self.submodules if self.ran is None else
                                    self.ran, self.generation)
        if changed is not None:
            path, what = changed
            where = f"the submodule {path}" if path else "a submodule"
            raise CheckpointError(
                f"{where} of the checkpointed {type(self.tree_roots[0]).__name__} changed between "
                "its forward and this backward: the replay would run other modules than the "
                "forward ran, and give other gradients than eager, which backpropagates "
                "through the modules that ran", expected="the submodules the forward ran",
                got=f"{path}: {what}" if path else what,
                tip="replace, insert or remove submodules between steps (after backward)")
        self.generation = structure_generation()  # the same trees: a second backward looks less
        roots = [m.training for m in self.roots]
        if roots == self.modes and self.entries.holds():
            return None  # the usual case
        modes = roots, [d.get("training") for d in self.submodules]
        # Same objects in the same order: one C-level pass per dict (a reordered dict counts as
        # swapped, harmlessly: its entries are set again).
        swapped = [(d, entries, d.copy()) for d, entries in self.entries.by_dict()
                   if len(d) != len(entries) or
                   not all(map(operator.is_, d.values(), entries.values()))]
        if any(self.entries.empty):
            swapped += [(d, {}, d.copy()) for d in self.entries.empty if d]
        if modes == (self.modes, self.entries.flags) and not swapped:
            return None
        return modes, swapped

    @contextmanager
    def reinstated(self, changes: Changes, /) -> Iterator[None]:
        """The forward's modes and entries for the block, ``changes`` (from ``changes()``)
        put back after it."""
        modes, swapped = changes
        self._set_modes((self.modes, self.entries.flags))
        for d, entries, _ in swapped:
            d.clear()
            d.update(entries)
        try:
            yield
        finally:
            self._set_modes(modes)
            for d, _, now in swapped:
                d.clear()
                d.update(now)

    def _set_modes(self, modes: tuple[list[bool], list[Any]]) -> None:
        # Plain attribute writes, not train()/eval(): a module overriding train() (to keep its
        # BatchNorm frozen) already chose these flags.
        for module, flag in zip(self.roots, modes[0]):
            module.training = flag
        for d, flag in zip(self.submodules, modes[1]):
            if flag is not None:
                d["training"] = flag
