"""The late-bound variables a function's code uses as a subscript's index (``layers[i]``,
``t[:, i]``), read from its bytecode once per code object (NOTE [an index rebound before the
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
# An index expression longer than this is not read (one that long is no loop index).
_LONGEST_INDEX = 48
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


def _read(code: types.CodeType, /) -> tuple[tuple[int, ...], tuple[str, ...]]:
    instructions = list(dis.get_instructions(code))
    free = code.co_freevars
    cells: dict[int, None] = {}
    names: dict[str, None] = {}
    for at, instruction in enumerate(instructions):
        need = _index_takes(instruction)
        # Walk back over the instructions that pushed the index: each pushes its effect's net
        # count, so the index is complete when the values still needed reach none. A jump in
        # or into that stretch (a conditional index) ends the walk with nothing found.
        found: list[dis.Instruction] = []
        back = at - 1
        while need > 0 and back >= 0 and at - back <= _LONGEST_INDEX:
            before = instructions[back]
            effect = _stack_effect(before)
            if effect is None or before.is_jump_target or before.opcode in dis.hasjrel or \
                    before.opcode in dis.hasjabs:
                found = []
                break
            found.append(before)
            need -= effect
            back -= 1
        if need > 0:
            continue
        for load in found:
            if load.opname in _CELL_LOADS and load.argval in free:
                cells[free.index(load.argval)] = None
            elif load.opname in _GLOBAL_LOADS:
                names[load.argval] = None
    return tuple(sorted(cells)), tuple(names)


def index_places(code: Any, /) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The closure cells (by index into ``__closure__``) and global names that ``code`` reads
    into a subscript's index, once per code object; none for what is not a code object."""
    entry = _INDEX_PLACES.get(id(code))
    if entry is None:
        places = _read(code) if isinstance(code, types.CodeType) else ((), ())
        entry = _INDEX_PLACES[id(code)] = (code, places)
    return entry[1]
