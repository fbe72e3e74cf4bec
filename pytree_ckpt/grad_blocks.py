"""Whether a function's whole body runs inside a ``with torch.no_grad():`` block.

NOTE [a body under its own no-grad]: the rules for reused calls (NOTE [differentiable results
are refused where grad is on] in frozen.py) let a function decorated with ``@torch.no_grad()``
return floats whatever it reaches, as eager computes them without grad. Neither the static
look nor the grad probe can see a ``with torch.no_grad():`` block inside the body (the
original pass runs under no-grad already), so a router written

    def route(self, x):
        with torch.no_grad():
            scores = self.gate(x).softmax(-1)
            return scores.topk(2)

was refused where eager runs it. Its source tells: where everything the body does is inside
one block that switches grad off (its first context manager is ``torch.no_grad()``,
``torch.inference_mode()`` or ``torch.set_grad_enabled(False)``, named as globals the function
reads), and at most a ``return`` of names follows the block, every float the function computes
has no graph in eager, as under the decorator. Anything else (a statement before the block, a
computation after it, a block that names ``enable_grad``, ``set_grad_enabled`` or
``inference_mode`` again inside (as a name, an attribute or a string), or a global bound to
one under another name, a context manager beside the switch other than autocast or another
switch, a local or closure variable named as the switch, source that cannot be read: a lambda,
exec'd code) keeps the refusal, which the decorator lifts. As with the decorator, a helper the body
calls that enables grad itself is not seen. Judged once per code object and globals, at its first
use.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
from typing import Any, NamedTuple

import torch

from .function_reach import globals_of
from .tree import dunder

__all__ = ["body_without_grad"]


class _Block(NamedTuple):
    """What the source says of a body held by one block: its context managers, and the dotted
    names read inside it (resolved among the globals when the function is judged)."""

    managers: tuple[ast.Call, ...]
    names: tuple[ast.expr, ...]


# id(code) -> (code, kept alive so the id stays its own; its block, or None where the body is
# not all in one block); (id(code), id(globals)) -> (code, the verdict)
_SHAPES: dict[int, tuple[types.CodeType, _Block | None]] = {}
_VERDICTS: dict[tuple[int, int], tuple[types.CodeType, bool]] = {}
# Inside the block, a name that may turn grad back on (inference_mode(False) does: helper HL),
# by its last part whatever it is bound to.
_SWITCHES_ON = frozenset({"enable_grad", "set_grad_enabled", "inference_mode",
                          "_set_grad_enabled"})


def body_without_grad(fn: Any, /) -> bool:
    """``fn`` (a plain function or a method bound to one, not wrapped by a decorator) runs all
    its body inside a block that switches grad off (NOTE above)."""
    function = dunder(fn, "__func__", fn)
    code = dunder(function, "__code__")
    if not isinstance(function, types.FunctionType) or not isinstance(code, types.CodeType) \
            or dunder(function, "__wrapped__") is not None:
        return False
    space = globals_of(function)
    # Judged per code and globals: one code object may run with other globals (a function
    # made from another's code).
    key = (id(code), id(space))
    verdict = _VERDICTS.get(key)
    if verdict is None or verdict[0] is not code:
        entry = _SHAPES.get(id(code))
        if entry is None or entry[0] is not code:
            entry = _SHAPES[id(code)] = (code, _block_around_body(function))
        block = entry[1]
        verdict = _VERDICTS[key] = (code, block is not None and _judged(block, space))
    return verdict[1]


def _judged(block: _Block, space: dict[str, Any], /) -> bool:
    """The block's first context manager switches grad off, the others switch it off too or
    are autocast, and no name read inside is bound to a switch that turns it back on (an
    alias: `from torch import enable_grad as eg`)."""
    first, *others = block.managers
    return _switches_off(first, space) and all(
        _switches_off(other, space) or _is_autocast(_resolved(other.func, space))
        for other in others) and not any(
        _is_one_of(_resolved(name, space), _TURNING_ON) for name in block.names)


def _is_one_of(value: Any, options: tuple[Any, ...], /) -> bool:
    return any(value is option for option in options)  # by identity: a tensor's == is not


def _block_around_body(function: types.FunctionType, /) -> _Block | None:
    """The one ``with`` block holding all of the function's body (but a docstring, and a
    ``return`` of names after it), if it has that shape, its context managers are calls of
    global names, and nothing inside names a switch turning grad back on."""
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return None  # no source (exec'd code, a REPL)
    try:
        statements = ast.parse(textwrap.dedent(source)).body
    except SyntaxError:  # IndentationError too
        # A line at column 0 inside a method (a docstring's or a string's continuation, a
        # backslash continuation) leaves dedent nothing to take off: parsed as the body of an
        # `if` (helper HW: refused, the parse error swallowed).
        try:
            wrapped = ast.parse("if 1:\n" + source).body
        except SyntaxError:
            return None  # a lambda's line that is no statement
        statements = wrapped[0].body if wrapped and isinstance(wrapped[0], ast.If) else []
    defined = statements[0] if statements else None
    if not isinstance(defined, (ast.FunctionDef, ast.AsyncFunctionDef)) or \
            defined.name != function.__code__.co_name:
        return None  # a lambda, or a function made some other way
    body = list(defined.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]  # the docstring
    if not body or not isinstance(body[0], ast.With) or len(body) > 2 or len(body) == 2 and \
            not (isinstance(body[1], ast.Return) and _names_only(body[1].value)):
        return None
    block = body[0]
    managers = [item.context_expr for item in block.items]
    code = function.__code__
    local = {*code.co_varnames, *code.co_cellvars, *code.co_freevars}
    for manager in managers:
        head = manager.func if isinstance(manager, ast.Call) else None
        while isinstance(head, ast.Attribute):
            head = head.value
        if not isinstance(head, ast.Name) or head.id in local:
            return None  # resolved among the globals only: a local may be anything
    inside = [*managers[1:], *block.body]
    if any(isinstance(node, ast.Attribute) and node.attr in _SWITCHES_ON or
           isinstance(node, ast.Name) and node.id in _SWITCHES_ON or
           # getattr(torch, "enable_grad"): the name as a string (helper HW)
           isinstance(node, ast.Constant) and node.value in _SWITCHES_ON
           for part in inside for node in ast.walk(part)):
        return None
    names = tuple(node for part in block.body for node in ast.walk(part)
                  if isinstance(node, (ast.Name, ast.Attribute)))
    return _Block(tuple(m for m in managers if isinstance(m, ast.Call)), names) \
        if all(isinstance(m, ast.Call) for m in managers) else None


def _names_only(value: ast.expr | None, /) -> bool:
    """A returned value that computes nothing: names, constants, and containers of them."""
    if value is None or isinstance(value, (ast.Name, ast.Constant)):
        return True
    if isinstance(value, (ast.Tuple, ast.List)):
        return all(_names_only(v) for v in value.elts)
    if isinstance(value, ast.Dict):
        return all(k is None or _names_only(k) for k in value.keys) and \
            all(_names_only(v) for v in value.values)
    return False


def _switches_off(expression: ast.Call, space: dict[str, Any], /) -> bool:
    """``expression`` is a call of ``torch.no_grad()``, ``torch.inference_mode()`` (or with
    ``True``) or ``torch.set_grad_enabled(False)``, its callee named as the function's globals
    hold it (``torch.no_grad`` or ``no_grad`` imported from torch)."""
    if expression.keywords:
        return False
    callee = _resolved(expression.func, space)
    given = [a.value if isinstance(a, ast.Constant) else a for a in expression.args]
    if callee is torch.no_grad:
        return not given
    if callee is torch.inference_mode:
        return not given or given == [True]
    return callee is torch.set_grad_enabled and given == [False]


# What a name inside the block may be bound to that turns grad back on.
_TURNING_ON = (torch.enable_grad, torch.set_grad_enabled, torch.inference_mode,
               torch._C._set_grad_enabled)


def _is_autocast(value: Any, /) -> bool:
    """torch's autocast under any of its names (``torch.cpu.amp.autocast`` is a subclass:
    helper HX), allowed beside the switch: it changes no grad mode."""
    return isinstance(value, type) and issubclass(value, torch.autocast)


def _resolved(expression: ast.expr, space: dict[str, Any], /) -> Any:
    """What a dotted name (``torch.no_grad``) names among the globals, read through modules
    only (nothing a user object's attribute lookup could run); ``None`` if not that."""
    if isinstance(expression, ast.Name):
        return space.get(expression.id)
    if isinstance(expression, ast.Attribute):
        owner = _resolved(expression.value, space)
        if isinstance(owner, types.ModuleType):
            return owner.__dict__.get(expression.attr)
    return None
