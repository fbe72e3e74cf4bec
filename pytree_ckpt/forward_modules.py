"""What the modules of a call were when its original pass ran (their modes, their parameter and
buffer entries, their submodules), put back for the replay if they changed before backward: NOTE
[the replay sees the forward's modules].

What the original pass changes of the modules' state (buffers, frozen parameters) is in
``state_changes.py``; which modules a call uses, in ``module_state.py``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from torch import nn

from .errors import CheckpointError
from .module_state import ModuleDicts, changed_submodule, structure_generation, submodules_now

__all__ = ["Changes", "ForwardModules", "REINSTATED"]

# The ids of the dicts a replay (or an output discard's rebuild) got the forward's entries of
# back, while it runs: NOTE [a key read beside a table given back] in changed_numbers.py reads
# which buffer dicts were bound anew since the forward.
REINSTATED: ContextVar[frozenset[int]] = ContextVar("pytree_ckpt_reinstated",
                                                    default=frozenset())


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

    NOTE [the replay's backward sees the modules as they are]: only the replay's forward (and
    the checks on what it returned) runs on the forward's entries and flags: the boundary puts
    the present ones back before the replay's own backward, where the user's backward hooks
    and tensor hooks run. A hook reading the module (``state_dict()`` saved from a hook, a
    flag) then reads it as in eager, and one setting a buffer (a gradient statistic kept as
    one: ``self.ema = 0.9 * self.ema + ...``) sets the module's own; put back after that
    backward, the hook's update was dropped and its reads were of the forward's tensors (helper
    RF, two micro-batches over a forward that rebinds a buffer). The graph the backward runs
    was made in the replay's forward and needs nothing of the modules; an output discard
    rebuilt there puts back its own module's forward entries (discard.py, NOTE [discard
    lifetimes] 5), as a nested boundary's replay does.

    The forward keeps a list of flags, a shallow copy of each non-empty dict and a list of the
    empty ones (an entry added to one is not the forward's either; about 3 us for a decoder
    layer); when nothing changed (FSDP2 keeps its unsharded parameter objects), backward
    compares and changes nothing. Values are not part of it: what the
    forward changes in place is ``StateWatch``'s. Submodules replaced since are refused (NOTE
    [the replay runs the forward's submodules] in module_state.py).
    """

    __slots__ = ("roots", "submodules", "modes", "entries", "empty", "tree_roots", "generation",
                 "ran")

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
        others = trees[0].flagged_otherwise if len(trees) == 1 else \
            [m for tree in trees for m in tree.flagged_otherwise]
        self.roots = [*roots, *others] if others else roots
        roots = self.roots
        if len(trees) == 1:  # the usual case, without concatenation
            self.submodules = trees[0].submodules
            dicts = trees[0].parameters + trees[0].buffers
        else:
            self.submodules = tuple(d for tree in trees for d in tree.submodules)
            dicts = tuple(d for tree in trees for d in (*tree.parameters, *tree.buffers))
        self.modes = self._modes()
        self.entries = []
        # Empty ones are not copied (most modules have no buffers, activations no parameters),
        # but an entry added to one before backward is not the forward's either.
        self.empty = []
        for d in dicts:  # NOTE [loops on the per-call path] (boundary.py)
            if d:
                self.entries.append((d, d.copy()))
            else:
                self.empty.append(d)

    def _modes(self) -> tuple[list[bool], list[Any]]:
        """The training flags of the roots, and of the submodules (``None`` where the flag is
        not in the ``__dict__``: modules in ``flagged_otherwise``, among the roots)."""
        roots, submodules = [], []
        for m in self.roots:  # NOTE [loops on the per-call path] (boundary.py)
            roots.append(m.training)
        for d in self.submodules:
            submodules.append(d.get("training"))
        return roots, submodules

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
        modes = self._modes()
        # Same objects in the same order: one C-level pass per dict (a reordered dict counts as
        # swapped, harmlessly: its entries are set again).
        swapped = []
        for d, entries in self.entries:  # NOTE [loops on the per-call path] (boundary.py)
            if len(d) != len(entries) or \
                    not all(map(operator.is_, d.values(), entries.values())):
                swapped.append((d, entries, d.copy()))
        if any(self.empty):
            swapped += [(d, {}, d.copy()) for d in self.empty if d]
        if modes == self.modes and not swapped:
            return None
        return modes, swapped

    @contextmanager
    def reinstated(self, changes: Changes, /) -> Iterator[Callable[[], None]]:
        """The forward's modes and entries for the block, ``changes`` (from ``changes()``)
        put back after it, or earlier, when the block calls what it is given (NOTE [the
        replay's backward sees the modules as they are])."""
        modes, swapped = changes
        self._set_modes(self.modes)
        for d, entries, _ in swapped:
            d.clear()
            d.update(entries)
        # NOTE [context variables set inside the try] (keep.py)
        token = None
        back = False

        def put_back() -> None:
            nonlocal token, back
            if back:
                return
            back = True
            if token is not None:
                REINSTATED.reset(token)
                token = None
            self._set_modes(modes)
            for d, _, now in swapped:
                d.clear()
                d.update(now)

        try:
            if swapped:
                token = REINSTATED.set(REINSTATED.get() | {id(d) for d, _, _ in swapped})
            yield put_back
        finally:
            put_back()

    def _set_modes(self, modes: tuple[list[bool], list[Any]]) -> None:
        # Plain attribute writes, not train()/eval(): a module overriding train() (to keep its
        # BatchNorm frozen) already chose these flags.
        for module, flag in zip(self.roots, modes[0]):
            module.training = flag
        for d, flag in zip(self.submodules, modes[1]):
            if flag is not None:
                d["training"] = flag
