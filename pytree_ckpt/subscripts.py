"""The late-bound variables a function's code uses as a subscript's index (``layers[i]``,
``t[:, i]``, ``out[:, i] += 1``) or in the name it picks a submodule or attribute by
(``getattr(self, f"layer{i}")``), read from its bytecode (and from the comprehensions and
inner functions it makes) once per code object (NOTE [an index rebound before the
replay] in rebound.py)."""

from __future__ import annotations

import dis
import types
from typing import Any

__all__ = ["index_places"]

# The instructions that read a subscript's index from the stack, and how many values the index
# takes there (a slice's two bounds, for the 3.12+ slice instructions). Python 3.14 reads a
# subscript with BINARY_OP, whose argrepr is then "[]".
_SUBSCRIPTS = {"BINARY_SUBSCR": 1, "STORE_SUBSCR": 1, "DELETE_SUBSCR": 1, "BINARY_SLICE": 2,
               "STORE_SLICE": 2}
_CELL_LOADS = frozenset({"LOAD_DEREF", "LOAD_CLASSDEREF"})
_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
# A module or attribute picked by a name a late variable builds is picked as by an index:
# `getattr(self, f"layer{i}")`, `self.get_submodule(f"layers.{i}")`. By call instruction,
# how many stack values below the arguments the call takes (the callable, and a NULL or self
# slot where the call has one), and the loads that name the callable.
_NAME_PICKERS = frozenset({"getattr", "get_submodule"})
_CALLS = {"CALL": 2, "CALL_METHOD": 2, "CALL_FUNCTION": 1}
_CALLEE_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_METHOD", "LOAD_ATTR"})
# An index expression longer than this is not read (one that long is no loop index).
_LONGEST_INDEX = 48
# How deep the codes a code makes are read (a comprehension in an inner function: 2).
_DEEPEST_CODE = 4
# By id(code): (code, (closure cells by index, global names)); the code object is held so its
# id is not reused (as plain_state.py's tables hold theirs). Static facts of a code object,
# not state of a step.
_INDEX_PLACES: dict[int, tuple[Any, tuple[tuple[int, ...], tuple[str, ...]]]] = {}


def _index_takes(instruction: dis.Instruction, /) -> int:
    if instruction.opname == "BINARY_OP":
        return 1 if instruction.argrepr == "[]" else 0
    return _SUBSCRIPTS.get(instruction.opname, 0)


def _stack_effect(instruction: dis.Instruction, /) -> int | None:
    if instruction.opcode < dis.HAVE_ARGUMENT:
        return dis.stack_effect(instruction.opcode)
    try:
        return dis.stack_effect(instruction.opcode, instruction.arg or 0, jump=False)
    except (ValueError, TypeError):  # an instruction whose effect dis cannot say
        return None


def _walk_back(instructions: list[dis.Instruction], at: int, need: int, /
               ) -> list[dis.Instruction] | None:
    """The instructions before ``at`` that push its last ``need`` stack values, nearest first;
    ``None`` where a jump (a conditional expression), an instruction whose effect dis cannot
    say, or a stretch over _LONGEST_INDEX is in the way."""
    # Each instruction pushes its effect's net count, so the values are complete when the
    # count still needed reaches none.
    found: list[dis.Instruction] = []
    back = at - 1
    while need > 0:
        if back < 0 or at - back > _LONGEST_INDEX:
            return None
        before = instructions[back]
        effect = _stack_effect(before)
        if effect is None or before.is_jump_target or before.opcode in dis.hasjrel or \
                before.opcode in dis.hasjabs:
            return None
        found.append(before)
        need -= effect
        back -= 1
    return found


def _picked_by_name(instructions: list[dis.Instruction], at: int, /
                    ) -> list[dis.Instruction] | None:
    """For a call at ``at`` to getattr or get_submodule (_NAME_PICKERS), the instructions that
    push its arguments; ``None`` for any other call, or one not read."""
    call = instructions[at]
    # A call's stack below its arguments: the callable and a NULL or self slot (3.11+, and
    # 3.10's CALL_METHOD after LOAD_METHOD), the callable alone (3.10's CALL_FUNCTION).
    below = _CALLS.get(call.opname)
    if below is None:
        return None
    start = at - 1 if at and instructions[at - 1].opname == "PRECALL" else at  # 3.11
    arguments = _walk_back(instructions, start, call.arg or 0)
    if arguments is None:
        return None
    callee = _walk_back(instructions, start - len(arguments), below)
    # The callable's last load names it: in `layers.get_submodule(n)(len(t))` the outer call's
    # callee holds get_submodule too, and its arguments pick nothing.
    if not callee or callee[0].opname not in _CALLEE_LOADS or \
            callee[0].argval not in _NAME_PICKERS:
        return None
    return arguments


def _augmented_from(instructions: list[dis.Instruction], at: int, /) -> int:
    """Where to walk back from for the subscript at ``at``: in an augmented store
    (`out[:, i] += 1`) the container and the index are pushed once and copied (3.11+: COPY 2,
    COPY 2; 3.10: DUP_TOP_TWO) for the read, so the index is what precedes the copies."""
    if at >= 1 and instructions[at - 1].opname == "DUP_TOP_TWO":
        return at - 1
    if at >= 2 and all(i.opname == "COPY" and i.arg == 2 for i in instructions[at - 2:at]):
        return at - 2
    return at


def _read_names(code: types.CodeType, depth: int = 0, /
                ) -> tuple[dict[str, None], dict[str, None]]:
    """The free variables and globals ``code`` reads into an index, by name; with those of
    the codes it makes (a comprehension's, a generator expression's, an inner function's:
    Python 3.11 gives each a code of its own) whose free variables are ``code``'s too."""
    instructions = list(dis.get_instructions(code))
    free: dict[str, None] = {}
    names: dict[str, None] = {}
    for at, instruction in enumerate(instructions):
        need = _index_takes(instruction)
        found = _walk_back(instructions, _augmented_from(instructions, at), need) if need \
            else _picked_by_name(instructions, at)
        for load in found or ():
            if load.opname in _CELL_LOADS and load.argval in code.co_freevars:
                free[load.argval] = None
            elif load.opname in _GLOBAL_LOADS:
                names[load.argval] = None
    if depth < _DEEPEST_CODE:
        for inner in code.co_consts:
            if isinstance(inner, types.CodeType):
                inner_free, inner_names = _read_names(inner, depth + 1)
                # One of the inner code's free variables that is a local of this code (a cell
                # it makes at each call) is bound when the call runs: not late.
                free.update((n, None) for n in inner_free if n in code.co_freevars)
                names.update(inner_names)
    return free, names


def _read(code: types.CodeType, /) -> tuple[tuple[int, ...], tuple[str, ...]]:
    free, names = _read_names(code)
    return tuple(sorted(code.co_freevars.index(n) for n in free)), tuple(names)


def index_places(code: Any, /) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The closure cells (by index into ``__closure__``) and global names that ``code`` reads
    into a subscript's index or a getattr's or get_submodule's arguments, once per code
    object; none for what is not a code object."""
    entry = _INDEX_PLACES.get(id(code))
    if entry is None:
        places = _read(code) if isinstance(code, types.CodeType) else ((), ())
        entry = _INDEX_PLACES[id(code)] = (code, places)
    return entry[1]
