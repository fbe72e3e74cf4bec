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
``inference_mode`` again inside, a local or closure variable named as the switch,
source that cannot be read: a lambda, exec'd code) keeps the refusal, which the decorator
lifts. As with the decorator, a helper the body calls that enables grad itself is not seen.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
from typing import Any

import torch

from .function_reach import globals_of
from .tree import dunder

__all__ = ["body_without_grad"]

# id(code) -> (code, kept alive so the id stays its own; the block's first context manager,
# or None where the body is not all in one block)
_SHAPES: dict[int, tuple[types.CodeType, ast.Call | None]] = {}
# Inside the block, a name that may turn grad back on (inference_mode(False) does: helper HL).
_SWITCHES_ON = frozenset({"enable_grad", "set_grad_enabled", "inference_mode"})


def body_without_grad(fn: Any, /) -> bool:
    """``fn`` (a plain function or a method bound to one, not wrapped by a decorator) runs all
    its body inside a block that switches grad off (NOTE above)."""
    function = dunder(fn, "__func__", fn)
    code = dunder(function, "__code__")
    if not isinstance(function, types.FunctionType) or not isinstance(code, types.CodeType) \
            or dunder(function, "__wrapped__") is not None:
        return False
    entry = _SHAPES.get(id(code))
    if entry is None or entry[0] is not code:
        entry = _SHAPES[id(code)] = (code, _block_around_body(function))
    # Resolved at each call, not kept with the code: one code object may run with other
    # globals (a function made from another's code).
    return entry[1] is not None and _switches_off(entry[1], globals_of(function))


def _block_around_body(function: types.FunctionType, /) -> ast.Call | None:
    """The first context manager of the one ``with`` block holding all of the function's
    body (but a docstring, and a ``return`` of names after it), if it has that shape and
    nothing inside names a switch turning grad back on."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None  # no source (exec'd code, a REPL), or a lambda's line that is no module
    defined = tree.body[0] if tree.body else None
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
    first = block.items[0].context_expr
    inside = [item.context_expr for item in block.items[1:]] + list(block.body)
    head = first.func if isinstance(first, ast.Call) else None
    while isinstance(head, ast.Attribute):
        head = head.value
    code = function.__code__
    if not isinstance(head, ast.Name) or head.id in code.co_varnames or \
            head.id in code.co_cellvars or head.id in code.co_freevars:
        return None  # resolved among the globals only: a local of that name may be anything
    if not isinstance(first, ast.Call) or any(
            isinstance(node, ast.Attribute) and node.attr in _SWITCHES_ON or
            isinstance(node, ast.Name) and node.id in _SWITCHES_ON
            for part in inside for node in ast.walk(part)):
        return None
    return first


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
