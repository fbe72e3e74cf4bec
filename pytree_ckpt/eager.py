"""Code dynamo must not trace, and the reason a compiled caller is told.

NOTE [the boundary stays eager] (module.py) makes the boundary's entry points opaque to dynamo
with ``torch._disable_dynamo``, torch's lazy form of ``torch.compiler.disable`` (dynamo is
imported at the first call, never by ``import pytree_ckpt``). That form takes no reason: a
``torch.compile(model, fullgraph=True)`` that reached a checkpointed layer failed with
"Attempted to inline function marked as skipped", hints to "avoid calling the function" or
"file an issue to PyTorch", and nothing on the cause or the fix. ``runs_eagerly(reason)`` is
the same lazy wrapper, marked as dynamo marks its own disabled functions, so the graph break
and the ``fullgraph`` error quote ``reason``. (The two attributes are dynamo's private names;
under a torch that reads other ones the wrapper still runs eagerly, with torch's message.)
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

import torch

from .tree import dunder

__all__ = ["BACKWARD_REASON", "BOUNDARY_REASON", "DISCARD_REASON", "HOOK_REASON",
           "KEPT_CALLABLE_REASON", "PHASE_REASON", "REUSE_REASON",
           "compile_stance_is_default", "compiled_caller", "compiled_wrapper",
           "in_compiled_module_call",
           "Told", "runs_eagerly", "user_site", "user_stacklevel"]

F = TypeVar("F", bound=Callable[..., Any])

BOUNDARY_REASON = (
    "pytree_ckpt's checkpoint boundary runs eagerly: its replay runs in backward, outside any "
    "graph, so a compiled caller graph-breaks at each checkpointed call. With fullgraph=True, "
    "compile each layer's body instead (layer.forward = torch.compile(layer.forward, "
    "fullgraph=True), then apply_activation_checkpointing(layer); see docs/scaling.md). "
    "Without fullgraph the layers run eagerly, and a forward that calls them in a loop is not "
    "compiled at all (dynamo skips a frame with a graph break in a loop). To export or serve "
    "a trained model (torch.export with strict=True, a fullgraph compile for inference), call "
    "pytree_ckpt.remove_activation_checkpointing on its layers first (docs/boundary.md, "
    "'Shipping a trained model'); a forward that calls pytree_ckpt.checkpoint itself exports "
    "with torch.export's default strict=False, which records the plain call. Inside a branch "
    "or body of torch.cond, while_loop, scan or map (higher-order ops that compile their own "
    "call, even uncompiled), checkpoint the module that calls the op instead of the modules it "
    "calls")
REUSE_REASON = (
    "pytree_ckpt.reuse_during_recompute runs eagerly: it records its result in the boundary's "
    "frame, which traced code would not follow, so a compiled body graph-breaks at the call. "
    "Compile such a body without fullgraph=True (see docs/scaling.md). To export a model that "
    "calls it, use torch.export's default strict=False, where it is a plain call "
    "(docs/boundary.md, 'Shipping a trained model')")
DISCARD_REASON = (
    "pytree_ckpt's output discard (CheckpointWithoutOutput) runs eagerly: it frees outputs in "
    "place and hangs their rebuild on a gradient hook, which traced code would not follow, so "
    "a compiled body graph-breaks at each discarded op. Compile such a body without "
    "fullgraph=True (see docs/scaling.md). To export a model that discards outputs, use "
    "torch.export's default strict=False, where each discard is a plain call (docs/boundary.md, "
    "'Shipping a trained model')")
PHASE_REASON = (
    "pytree_ckpt.current_phase() runs eagerly: it reads which pass of a checkpoint boundary is "
    "running from a ContextVar, which dynamo can neither trace nor guard on, so a compiled body "
    "graph-breaks at the call. Compile such a body without fullgraph=True (see "
    "docs/scaling.md)")
HOOK_REASON = (
    "pytree_ckpt's module registration hooks run eagerly: torch calls them for every module "
    "built anywhere, and they only count that the module structure changed. Under "
    "fullgraph=True, register a submodule or a buffer under a new name outside the compiled "
    "code (in __init__, or before the compiled call), or compile without fullgraph; a buffer "
    "reassigned under its name (self.count += 1) compiles")
BACKWARD_REASON = (
    "pytree_ckpt's checkpoint boundary replays its layer in backward eagerly: the replay runs "
    "the layer's forward again with grad enabled and takes its gradients, outside any graph")
KEPT_CALLABLE_REASON = (
    "a method kept by a pytree_ckpt save unit (KeptCallables) runs eagerly: the region that "
    "keeps its outputs must see every op it runs. Save units need eager layer bodies (see "
    "docs/save_units.md)")


def runs_eagerly(reason: str, /) -> Callable[[F], F]:
    """Decorate ``fn`` so that dynamo never traces it, and says ``reason`` when it stops."""
    def decorate(fn: F) -> F:
        wrapper = torch._disable_dynamo(fn)
        # Read by dynamo where it meets the function in a compiled caller (the check comes
        # before its skip-file rule, which gave the reasonless message above).
        wrapper._torchdynamo_disable = True  # type: ignore[attr-defined]
        wrapper._torchdynamo_disable_msg = reason  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]
    return decorate


# torch's and this package's folders, and contextlib's file (an ExitStack's exit runs a
# dispatch mode's, which may warn).
_INNER_PATHS = tuple(os.path.dirname(path) + os.sep
                     for path in (torch.__file__, __file__)) + (contextlib.__file__,)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning name the user's line: the first frame outside
    torch, this package and contextlib. The dynamo wrapper of ``runs_eagerly`` (two frames in
    torch, their number a torch detail) and ``nn.Module``'s call sit between the user and the
    boundary."""
    level = 1  # the frame that calls warnings.warn
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_INNER_PATHS):
        level += 1
        frame = frame.f_back
    return level


def user_site() -> tuple[str, int, dict[str, Any]]:
    """The user's line, as ``user_stacklevel`` finds it: its file, line number and module
    globals, for a warning given later (``warnings.warn_explicit``) that names it."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_back is not None and \
            frame.f_code.co_filename.startswith(_INNER_PATHS):
        frame = frame.f_back
    assert frame is not None
    return frame.f_code.co_filename, frame.f_lineno, frame.f_globals


class Told:
    """What a module was warned about, held in its ``__dict__`` (``Told(what)``, truthy):
    a copy of the module (``copy.deepcopy``, pickle) carries ``None`` there instead, and is
    warned anew, as the compile warnings are (held by the installed forward:
    ``compiled_layers._tell_once``). Each warning is about one module (its forward, its
    hooks, its state), and a copy is a module of its own: one made from a template layer
    after a first step (``[copy.deepcopy(layer) for _ in range(n)]``) was never told."""

    __slots__ = ("what",)

    def __init__(self, what: Any = True, /) -> None:
        self.what = what

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _not_told, ()

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None


def _not_told() -> None:
    return None


# Frames looked at: the layer's own wrapper's call is the 10th on torch 2.11 and 2.13; a
# compiled model's that calls it in a loop the 13th, more where models nest (a causal-LM head
# around a decoder), looked for until it is found once.
_WRAPPER_DEPTH = 16
_AROUND_DEPTH = 64

_eval_frame: Any = None  # torch._dynamo.eval_frame, kept once dynamo is imported
_wrapper_call: Any = None  # the code of OptimizedModule.__call__ (False: none of its own)
_compile_call: Any = None  # the code of torch.compile's wrapper of a function (False: none)


def _dynamo_eval_frame() -> Any:
    """torch._dynamo.eval_frame once imported (by a first layer call), else None: the lookup
    is made until then, not after."""
    global _eval_frame
    if _eval_frame is None:
        _eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return _eval_frame


def in_compiled_module_call() -> bool:
    """Whether the call of a ``torch.compile(module)`` wrapper (dynamo's OptimizedModule) is
    running: dynamo's flag, set by that call for its whole length (process-wide, so a wrapper
    running in another thread sets it too; False on a torch without it). Read at every layer
    call: one attribute of a module kept once dynamo is imported."""
    eval_frame = _eval_frame if _eval_frame is not None else _dynamo_eval_frame()
    return eval_frame is not None and getattr(eval_frame, "_in_optimized_module", False) is True


def compile_stance_is_default() -> bool:
    """Whether torch.compiler's stance is the default one: the only one under which torch
    fails a fullgraph=True call that compiled no frame (``set_stance("force_eager")``, a
    debugging switch, runs it eagerly; True on a torch without stances)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(getattr(eval_frame, "_stance", None), "stance", "default") == "default"


def compiled_wrapper(module: torch.nn.Module, /) -> torch.nn.Module | None:
    """The OptimizedModule (``torch.compile(module)``) whose call is running ``module``, if
    any, found among the frames that led to the boundary (NOTE [compiled around the layer] in
    compiled_layers.py): a frame of OptimizedModule's own ``__call__`` whose wrapper wraps
    ``module``. Frames are told apart by their code object, so the locals of no other frame
    are read (reading them copies them into a dict). None on a torch whose OptimizedModule has
    no ``__call__`` of its own (torch 2.11 and 2.13 have one)."""
    if not _find_codes():
        return None
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_WRAPPER_DEPTH):
        if frame is None:
            return None
        if frame.f_code is _wrapper_call:
            owner = frame.f_locals.get("self")
            if getattr(owner, "_orig_mod", None) is module:
                return owner
        frame = frame.f_back
    return None


def compiled_caller(module: torch.nn.Module, /, *, forward: Any = None) -> Any:
    """What ``torch.compile`` compiled around ``module``'s call, if anything (NOTE [compiled
    around the model] in compiled_layers.py): the nearest OptimizedModule of another module
    (a compiled model), or the callable of the nearest compiled function's call
    (``torch.compile(train_step)``; its wrapper's frame, of dynamo's optimize context), found
    within _AROUND_DEPTH frames. None if neither; not the layer itself, its bound methods or
    its installed ``forward`` (compiled over the boundary: told by warn_compiled_over)."""
    if not _find_codes():
        return None
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_AROUND_DEPTH):
        if frame is None:
            return None
        if frame.f_code is _wrapper_call:
            owner = frame.f_locals.get("self")
            if getattr(owner, "_orig_mod", None) is not module:
                return owner
        elif frame.f_code is _compile_call and \
                type(frame.f_locals.get("self")).__name__ == "OptimizeContext":
            fn = frame.f_locals.get("fn")
            if not _of_layer(fn, module, forward):
                return fn
        frame = frame.f_back
    return None


def _of_layer(fn: Any, module: torch.nn.Module, forward: Any, /) -> bool:
    """Whether a compiled function is the layer, one of its methods or its installed forward,
    seen through dynamo's inline wrapper of a callable object (``__wrapped__``)."""
    for _ in range(3):
        if fn is None:
            return False
        if fn is module or fn is forward or dunder(fn, "__self__") is module:
            return True
        fn = dunder(fn, "__wrapped__")
    return False


def _find_codes() -> bool:
    """Reads, once dynamo is imported, the code objects the walks look for: OptimizedModule's
    ``__call__`` and the wrapper torch.compile puts around a function (``compile_wrapper``,
    made anew per compiled callable from one code object)."""
    global _wrapper_call, _compile_call
    if _wrapper_call is None:
        eval_frame = _dynamo_eval_frame()
        optimized = getattr(eval_frame, "OptimizedModule", None)
        if optimized is None:
            return False  # nothing was compiled in this process yet
        _wrapper_call = getattr(vars(optimized).get("__call__"), "__code__", False)
        context = getattr(getattr(eval_frame, "_TorchDynamoContext", None), "__call__", None)
        _compile_call = next((c for c in getattr(dunder(context, "__code__"),
                                                 "co_consts", ())
                              if getattr(c, "co_name", None) == "compile_wrapper"), False)
    return _wrapper_call is not False
