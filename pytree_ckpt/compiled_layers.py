"""What a checkpointed layer tells of ``torch.compile`` put around or over its boundary, where
it compiles nothing (NOTE [compiled around the layer], NOTE [compiled over the boundary]).

The installed forward (``_CheckpointedForward`` in module.py) calls these at each call; what
was checked and told is held by it, so a copy of the layer is checked and told anew.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from torch import nn

from .eager import compile_stance_is_default, compiled_caller, compiled_wrapper, user_stacklevel
from .errors import CheckpointConfigError
from .tree import dunder

if TYPE_CHECKING:  # module.py imports this module
    from .module import _CheckpointedForward

__all__ = ["check_compiled_wrapper", "compiled_over", "recompile_limit_note",
           "recompile_limit_noted", "warn_compiled_over", "warn_module_compiled"]


def warn_compiled_over(module: nn.Module, installed: _CheckpointedForward) -> None:
    forward = module.__dict__.get("forward")
    if "compiled over" in installed.told or not compiled_over(forward, installed) or \
            dunder(forward, "_torchdynamo_disable", False):
        # torch.compiler.disable over the boundary keeps the layer out of a compile: what the
        # user meant, and nothing to tell (helper JU: told it "was compiled").
        return
    if installed.options.keep is not None:
        # Compiling the body first is no way out here: save units refuse a compiled body.
        fix = ("This layer keeps ops through save units, which need an eager body "
               "(docs/save_units.md): leave its forward eager, or drop its save units "
               "and compile the body first")
    else:
        fix = ("Compile the body first: remove_activation_checkpointing(layer), then "
               "layer.forward = torch.compile(layer.forward), then "
               "apply_activation_checkpointing(layer) (docs/scaling.md, 'Wrapping order')")
    _tell_once(
        installed, "compiled over",
        f"pytree_ckpt: the forward of this {type(module).__name__} was compiled after "
        "checkpointing, which compiles nothing (the boundary is opaque to dynamo, and so is the "
        f"body it runs). {fix}")


def warn_module_compiled(module: nn.Module, installed: _CheckpointedForward) -> None:
    if "module.compile()" in installed.told:  # called at every call: no message built then
        return
    if _fullgraph(module.__dict__["_compiled_call_impl"]) and compile_stance_is_default():
        # As torch.compile(layer, fullgraph=True) is (check_compiled_wrapper): torch would
        # fail after the whole forward had run, "found no compiled frames". Not marked told:
        # every call is refused.
        name = type(module).__name__
        raise CheckpointConfigError(
            f"this {name} is checkpointed and compiled with {name}.compile(fullgraph=True), "
            "which compiles its call up to the boundary: the boundary runs eagerly (its replay "
            "runs in backward, outside any graph), so no graph can be compiled",
            expected="the layer's body compiled, inside the boundary",
            got=f"module.compile(fullgraph=True) of the checkpointed {name}",
            tip="compile the body inside the boundary: remove_activation_checkpointing(layer), "
                "then layer.forward = torch.compile(layer.forward, fullgraph=True), then "
                "apply_activation_checkpointing(layer) (docs/scaling.md, 'Wrapping order')")
    _tell_once(
        installed, "module.compile()",
        f"pytree_ckpt: this {type(module).__name__} was compiled with module.compile(), which "
        "compiles its call up to the boundary and nothing inside it (the boundary is opaque to "
        "dynamo, and so is the body it runs). Compile the body instead: "
        "layer.forward = torch.compile(layer.forward) before apply_activation_checkpointing("
        "layer) (docs/scaling.md, 'Wrapping order')")


def _fullgraph(compiled: Any, /) -> bool:
    """Whether the function ``torch.compile`` returned was made with ``fullgraph=True``: read
    from the compile context its closure holds (dynamo's private layout; False where it
    differs, and the layer is then told, not refused)."""
    for cell in dunder(compiled, "__closure__") or ():
        try:
            held = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if callable(held) and isinstance(getattr(held, "fullgraph", None), bool):
            return bool(held.fullgraph)
    return False


def _tell_once(installed: _CheckpointedForward, what: str, message: str, /) -> None:
    """Warn ``message`` unless the layer was already told ``what`` (held by its installed
    forward: a copy is told anew)."""
    if what in installed.told:
        return
    installed.told.add(what)
    warnings.warn(message, stacklevel=user_stacklevel())


# NOTE [compiled around the layer]: torch.compile(layer) after checkpointing (torchtitan
# compiles each block after applying activation checkpointing) wraps the layer in dynamo's
# OptimizedModule. Dynamo skips nn.Module's call frames and reaches the boundary only through
# its eager entry, so nothing compiles, silently; with fullgraph=True torch failed after the
# whole forward had run, with "found no compiled frames" and a list of torch's own frames.
# The layer is not told it was wrapped, so the wrapper's call is looked for on the call stack
# (eager.compiled_wrapper), at the layer's first call and then only at calls made while some
# wrapper's call runs: dynamo sets a flag for the length of every OptimizedModule call, read
# here at each call (one attribute). So a layer called eagerly first and wrapped later is found
# at its first wrapped call, and an eager step pays no frame walk. Calls inside
# torch.compile(model) run under the flag too and pay the walk at each: about 20,000
# instructions, 1% of what the boundary adds to a layer call. A torch without the flag
# checks first calls only. What was checked and told is held by the installed
# forward, not the module's __dict__: a copy (deepcopy, pickle) gets its own, and is checked
# and told anew; each warning is given once per layer. A body compiled inside the boundary
# (the order docs/scaling.md gives) makes a wrapper put around it as well harmless: its graphs
# are compiled frames, so torch runs it, fullgraph=True included, and nothing is said (nor
# looked for again).
def check_compiled_wrapper(module: nn.Module, installed: _CheckpointedForward) -> None:
    if dunder(installed.bare, "_torchdynamo_orig_callable") is not None:  # a compiled body
        installed.check_wrapper = False
        return
    wrapper = compiled_wrapper(module)
    name = type(module).__name__
    if wrapper is None:
        installed.check_wrapper = True
        # Not told under another stance (force_eager compiles nothing at all), until later.
        outer = None if "compiled model" in installed.told or \
            not compile_stance_is_default() else compiled_caller(module, forward=installed)
        if outer is not None:  # NOTE [compiled around the model]
            _tell_once(
                installed, "compiled model",
                f"pytree_ckpt: this {name} is checkpointed and called inside "
                f"torch.compile({_compiled_name(outer)}), which compiles only the code around "
                "it: the boundary is opaque to dynamo, so the layer's body runs eagerly (and a "
                "function that calls such layers in a loop is not compiled at all: dynamo does "
                "not resume inside a loop). Compile each layer's body first: "
                "layer.forward = torch.compile(layer.forward), then "
                "apply_activation_checkpointing(layer) (docs/scaling.md, 'Wrapping order')")
        return
    fix = ("compile the body inside the boundary: remove_activation_checkpointing(layer), "
           "then either layer.forward = torch.compile(layer.forward{}) and "
           "apply_activation_checkpointing(layer), or checkpoint the compiled module, "
           "apply_activation_checkpointing(torch.compile(layer{})) (docs/scaling.md, "
           "'Wrapping order')")
    if getattr(getattr(wrapper, "dynamo_ctx", None), "fullgraph", False) and \
            compile_stance_is_default():
        # Left as it was: every call is checked again and refused, rather than torch's
        # message after it (also on a torch without dynamo's flag). Only where torch fails
        # too: under another stance (force_eager) it runs the call.
        raise CheckpointConfigError(
            f"this {name} is checkpointed and called through torch.compile(layer, "
            "fullgraph=True): the compiled wrapper reaches only the boundary, "
            "which runs eagerly (its replay runs in backward, outside any graph), so no graph "
            "can be compiled", expected="the layer's body compiled, inside the boundary",
            got=f"torch.compile around the checkpointed {name}",
            tip=fix.format(", fullgraph=True", ", fullgraph=True"))
    installed.check_wrapper = True
    _tell_once(  # checked again at each wrapped call: told once
        installed, "compiled around",
        f"pytree_ckpt: this {name} is checkpointed and called through torch.compile(layer), "
        "which compiles nothing: the compiled wrapper reaches only the boundary, "
        f"which is opaque to dynamo, and so is the body it runs. To compile it, "
        f"{fix.format('', '')}")


# NOTE [compiled around the model]: torch.compile(model) over checkpointed layers (torch's
# checkpoint is traced by dynamo, so a user coming from it expects the whole model compiled)
# compiles only the code around the layers, and nothing of the function that calls them in a
# loop: dynamo does not resume after a graph break inside a loop. Found by the same walk, at the
# layer's first call and at calls under dynamo's flag: a wrapper's call whose module is not
# this layer, or the call of a compiled function (torch.compile(train_step), a lambda over the
# model). A function compiled around a layer whose first call was eager is not found: no flag
# marks a compiled function's call, so later calls are not walked. Told once per layer, not
# under a compile stance other than the default (force_eager compiles nothing), and not for a
# layer whose body is compiled (returned above), where compiling the model too is harmless.


def _compiled_name(outer: Any, /) -> str:
    """How the message names what was compiled: the model's class, or the function's name."""
    # torch.compile of a torch.nn container (a Sequential) calls dynamo's inline wrapper of it,
    # whose __wrapped__ is the module (helper JU: named "wrap_inline.<locals>.inner").
    inner = dunder(outer, "__wrapped__")
    for target in (getattr(outer, "_orig_mod", None), dunder(outer, "__self__"), inner, outer):
        if isinstance(target, nn.Module):  # torch.compile(model): its call, or the wrapper's
            return type(target).__name__
    name = dunder(outer, "__qualname__")  # train_step, Trainer.step, <lambda>
    return name if isinstance(name, str) else type(outer).__name__


# NOTE [compiled over the boundary]: ``layer.forward = torch.compile(layer.forward)`` after
# checkpointing wraps the boundary, which dynamo never traces: nothing is compiled, and the
# layer is still checkpointed. is_checkpointed says so, applying again does not nest a second
# boundary, removing drops the wrapper with the boundary, the first call warns, and a deep
# copy is refused (it would share the wrapper, and so the original's boundary).
def compiled_over(forward: Any, installed: _CheckpointedForward) -> bool:
    """Whether ``forward`` is torch.compile's wrapper of ``installed`` (not any other wrapper:
    a ``functools.wraps`` one of the user's stays theirs). ``torch.compiler.disable``'s counts:
    its wrapper is dynamo's too, and a copy would share it all the same."""
    forward = dunder(forward, "_torchdynamo_orig_callable")  # dynamo's wrapper
    for _ in range(3):  # then its inline wrapper of a callable object
        if forward is None or forward is installed:
            return forward is installed
        forward = dunder(forward, "_torchdynamo_orig_callable") or \
            dunder(forward, "__wrapped__")
    return False


# NOTE [two entries per variant]: dynamo guards on grad mode, so a compiled body behind the
# boundary compiles each variant (a shape, an optional input given or not, a module class)
# twice: once for the original pass (no-grad) and once for the replay (grad). A body whose
# code also runs inside another checkpointed layer (the GLM-DSA decoder body is the MTP
# layer's block) compiles it three times: that layer's no-grad pass hands it an input that
# does not require grad, where a layer's own pass gets one that does, and dynamo guards on
# that too (helper KV). Its recompile_limit (8 by default) counts entries per code object, so
# the boundary halves (or thirds) the variants a body may compile: a body shared by several
# layer kinds, with sequence lengths that change between steps, reached it in a replay, where
# a fullgraph body raised dynamo's "found no compiled frames" in backward (a body without
# fullgraph silently ran eagerly). The boundary does not raise the limit itself (a
# process-wide setting, per context on torch 2.13); the error says why and what to raise.
# Nested boundaries see the error once each: the innermost one's note (naming the body that
# could not compile) is the one kept, so an error carrying it is not noted again.
_LIMIT_SIGNS = ("found no compiled frames", "recompile_limit", "FailOnRecompileLimitHit")
_NOTED = "where a compiled body could not compile"


def recompile_limit_noted(error: BaseException, /) -> bool:
    """Whether a boundary already added ``recompile_limit_note``'s note to ``error``."""
    return any(_NOTED in note for note in getattr(error, "__notes__", ()))


def recompile_limit_note(error: BaseException, where: str, /) -> str | None:
    """The note for dynamo's refusal to compile one more entry of a body, else None (None too
    where an inner boundary added it already)."""
    text = f"{type(error).__name__}: {error}"
    if not any(sign in text for sign in _LIMIT_SIGNS) or recompile_limit_noted(error):
        return None
    return (f"pytree_ckpt: raised in {where}, {_NOTED}: likely "
            "dynamo's recompile_limit, which counts the entries of each code object. Behind "
            "the checkpoint boundary every variant of a body costs two entries, the original "
            "pass's (no-grad) and the replay's (grad), three where its code also runs inside "
            "another checkpointed layer (an input that requires grad or not), so the limit "
            "allows half (or a third of) the variants it allows without checkpointing (the "
            "log says 'hit config.recompile_limit'). Tip: compile the body with twice (or "
            "three times) the limit, torch.compile(layer.forward, "
            "recompile_limit=3 * torch._dynamo.config.recompile_limit) (or raise "
            "torch._dynamo.config.recompile_limit on a torch without that argument), or give "
            "the body fewer variants (docs/scaling.md, 'torch.compile').")
