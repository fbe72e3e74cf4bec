"""Which results ``reuse_during_recompute`` may replay: frozen ones, never a gradient's path.

NOTE [differentiable results are refused where grad is on]: the replay hands back the recorded
result instead of calling fn, so a float leaf that eager computes with grad (router gate
weights or probabilities) would silently lose its gradient under checkpointing. Whether eager
computes a leaf with grad depends on three things, each checked where it can be seen:

1. What fn reaches that requires grad in the original pass (parameters, the boundary's
   inputs): fn runs with grad enabled there, as in eager (the boundary's own no-grad would hide
   it), and the key paths of the leaves that come out requiring grad are recorded; their
   detached values are what is recorded and returned. fn's own no_grad blocks still apply.
2. The grad mode where reuse_during_recompute is called: the original pass cannot see it (it
   runs under the boundary's no-grad, whatever the caller's code set); the replay can (it runs
   with grad, under the caller's own no_grad blocks). The replay refuses the leaves of 1 where
   grad is enabled.
3. The inputs that require grad in eager: in the original pass the layer's tensors computed
   before the call do not (no-grad), so 1 cannot see that fn's float result depends on them
   (logits computed by the layer, passed to a top-k). The replay's arguments do, as eager's.
   Whether fn blocks that path itself (a no_grad inside it) cannot be known without calling
   it, so a float leaf returned for an input that requires grad is refused where grad is
   enabled: pass such inputs detached when fn's float results are frozen.

A leaf that requires grad whatever the grad mode (a parameter or an input returned as it is)
is refused when recorded. Outside any boundary the result and the arguments are checked at
once by the same rules, so a model that checkpoints only some layers fails alike in every one.

fn's graph in the original pass is built only to tell 1: its saved tensors are hidden from
ambient hooks (offload would copy them, a census count them), and a backward that reaches it
after fn returned (a tensor fn or a hook stored, with that graph) is refused: the replay does
not call fn, so nothing it computed can carry a gradient there. torch.func transforms refuse
saved-tensor hooks, so they cannot run inside a reused fn in a boundary.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .errors import ReuseError
from .saved import Unchanged
from .tree import flatten, flatten_call, leaf_paths, unflatten

__all__ = ["as_recorded", "probed", "refuse_in_plain_call", "refuse_in_replay"]

_SPLIT_TIP = ("return only the frozen part (the top-k ids) from the reused call and compute "
              "the differentiable part outside it, from those ids (MoE gate weights: gather "
              "the softmax of the router's scores at the replayed ids, as "
              "examples/glm_dsa/mlp.py does)")
_DETACH_TIP = (_SPLIT_TIP + "; if no gradient is wanted, compute it under torch.no_grad() "
               "from inputs passed detached")


@contextmanager
def probed(name: str, /) -> Iterator[None]:
    """fn's call in a boundary's original pass: grad enabled, its graph kept from others."""
    running = [True]

    def unpack(saved: Unchanged) -> torch.Tensor:
        if not running[0]:
            raise ReuseError(
                f"a backward reached the graph of reuse_during_recompute({name}) made in a "
                "boundary's original pass",
                expected="gradients through the layer's recomputed work only",
                got=f"a tensor computed by {name} kept with its graph (stored on a module, by "
                    "a hook, or returned inside an object)",
                tip="the replay does not call fn, so nothing it computes can carry a gradient: "
                    "compute what needs one (a router's logits for a load-balancing loss) "
                    "outside the reused call")
        return saved.get()

    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(Unchanged, unpack):
            yield
    except RuntimeError as error:
        if "saved tensor hooks" in str(error) and hasattr(error, "add_note"):
            error.add_note(
                f"pytree_ckpt: reuse_during_recompute({name}) runs fn with grad enabled under "
                "saved-tensor hooks in a boundary's original pass (docs/replay.md, 'What may "
                "be replayed'); torch.func transforms refuse them: compute that result outside "
                "the checkpointed layer and pass it in")
        raise
    finally:
        running[0] = False


def as_recorded(name: str, result: Any, args: tuple[Any, ...], kwargs: dict[str, Any], /
             ) -> tuple[Any, tuple[str, ...]]:
    """``result`` as recorded (leaves that require grad detached) and those leaves' paths."""
    flat = flatten(result)
    positions = [i for i in flat.tensor_index if flat.leaves[i].requires_grad]
    if not positions:
        return result, ()
    paths = leaf_paths(flat.spec, root="result")
    call = flatten_call(args, kwargs)
    given = {id(call.leaves[i]) for i in call.tensor_index}
    leaves = list(flat.leaves)
    for i in positions:
        if leaves[i].is_leaf or id(leaves[i]) in given:
            _refuse_outside(name, paths[i])
        leaves[i] = leaves[i].detach()
    return unflatten(flat.spec, leaves), tuple(paths[i] for i in positions)


def refuse_in_plain_call(name: str, result: Any, args: tuple[Any, ...],
                         kwargs: dict[str, Any], /) -> None:
    """The rules of NOTE [differentiable results are refused where grad is on], outside any
    boundary, where the result and the grad mode are eager's own."""
    flat = flatten(result)
    for i in flat.tensor_index:
        if flat.leaves[i].requires_grad:
            _refuse_differentiable(name, leaf_paths(flat.spec, root="result")[i], replay=False)
    if torch.is_grad_enabled():
        _refuse_float_for_grad_input(name, flat, args, kwargs, replay=False)


def refuse_in_replay(name: str, differentiable: tuple[str, ...], result: Any,
                     args: tuple[Any, ...], kwargs: dict[str, Any], /) -> None:
    """Rules 2 and 3 of NOTE [differentiable results are refused where grad is on]."""
    if not torch.is_grad_enabled():
        return
    if differentiable:
        _refuse_differentiable(name, differentiable[0], replay=True)
    _refuse_float_for_grad_input(name, flatten(result), args, kwargs, replay=True)


def _refuse_float_for_grad_input(name: str, flat: Any, args: tuple[Any, ...],
                                 kwargs: dict[str, Any], /, *, replay: bool) -> None:
    floats = [i for i in flat.tensor_index
              if flat.leaves[i].is_floating_point() or flat.leaves[i].is_complex()]
    if not floats:
        return
    call = flatten_call(args, kwargs)
    for j in call.tensor_index:
        if call.leaves[j].requires_grad:
            argument = _argument_path(call, j)
            result = leaf_paths(flat.spec, root="result")[floats[0]]
            raise ReuseError(
                f"reuse_during_recompute({name}) returned the float {result} for {argument}, "
                "which requires grad: "
                + ("the replay hands back the value recorded in the original pass without "
                   "calling fn, so it cannot tell whether eager would compute it with grad"
                   if replay else "under checkpointing the replay would hand back a recorded "
                   "value without calling fn, and could not tell whether it needs a gradient"),
                expected="inputs passed detached when fn returns floats (or int results only)",
                got=f"{argument}.requires_grad=True and a float {result}",
                tip="if fn's float results are frozen (computed under no_grad), pass its "
                    "inputs detached: reuse_during_recompute(fn, logits.detach()), as "
                    "examples/glm_dsa/mlp.py does; otherwise " + _SPLIT_TIP)


def _argument_path(call: Any, index: int, /) -> str:
    path = leaf_paths(call.spec, root="call")[index]  # call[0][i] or call[1]['key']
    if path.startswith("call[0]"):
        return "argument " + path.replace("call[0]", "args", 1)
    return "argument " + path.replace("call[1]", "kwargs", 1)


def _refuse_differentiable(name: str, path: str, /, *, replay: bool) -> None:
    where = ("the replay hands back the value recorded in the original pass, which has no graph"
             if replay else "under checkpointing the replay would hand back a recorded value, "
             "which has no graph")
    raise ReuseError(
        f"reuse_during_recompute({name}) returned {path}, which requires grad where it is "
        f"called: {where}, so its gradient would be lost",
        expected="frozen results only: int ids, or tensors computed under torch.no_grad() from "
                 "detached inputs",
        got=f"{path} computed with grad from parameters or inputs that require grad",
        tip=_DETACH_TIP)


def _refuse_outside(name: str, path: str, /) -> None:
    raise ReuseError(
        f"reuse_during_recompute({name}) returned {path}, a tensor from outside the call that "
        "requires grad (a parameter or an input, returned as it is): eager would take its "
        "gradient whatever the grad mode, and a replayed result carries none",
        expected="frozen results computed by fn", got=f"{path}.requires_grad=True, a leaf or "
        "an argument of the call", tip="use the tensor itself outside the reused call; if no "
        "gradient is wanted, return it .detach()ed")
