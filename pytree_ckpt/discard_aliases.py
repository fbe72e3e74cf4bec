"""Which outputs of a discarded op must not be freed: those whose storage exists outside the
op (an input's, or state it can reach), found by the address of the tensor each view chain
starts from (discard.py frees the others).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .addresses import data_pointer
from .module_state import module_buffers, owning_module, trainable_parameters
from .tree import dunder

__all__ = ["made_outside", "reachable_objects", "reachable_tensors", "register_rebuild",
           "root_key"]


def reachable_tensors(fn: Callable[..., Any], args: tuple[Any, ...]) -> list[torch.Tensor]:
    """Tensors that exist outside ``fn`` and that it can return a view of: the parameters and
    buffers of the module it belongs to and of modules among its arguments, and tensors and
    modules it closes over, binds as defaults or names as globals (a lambda, a
    ``functools.partial``).

    NOTE [discard frees only fn's own storages]: an output that is a view of one of these (a
    rotary cache sliced to the sequence length, learned positions) is kept, like an output that
    aliases an input: freeing it would destroy the module's state. Globals that ``fn`` names
    count too, and the values of dicts, lists and tuples among all these; a tensor reached any
    other way (through an object's attribute, say) cannot be told from a fresh result. The
    search stops at the first match, else reads every state tensor it can reach: a function
    naming a whole model as a global scans the model each call (about 0.9 ms for 300 layers on
    CPU), so pass the submodule.
    """
    tensors: list[torch.Tensor] = []
    for obj in reachable_objects(fn, args):
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
        elif isinstance(obj, nn.Module):  # read from the boundary's cached dicts: cheap
            frozen: list[torch.Tensor] = []
            tensors += trainable_parameters([obj], set(), frozen=frozen)
            tensors += frozen
            tensors += module_buffers(obj)
    return tensors


def reachable_objects(fn: Callable[..., Any], args: tuple[Any, ...]) -> list[Any]:
    """What ``reachable_tensors`` looks in: ``args``, ``fn``'s module, the objects it closes
    over, binds as defaults or names as globals, and one level into containers among them."""
    found: list[Any] = list(args)
    owner = owning_module(fn)
    if owner is not None:
        found.append(owner)
    target = fn
    if isinstance(target, functools.partial):
        found += [*target.args, *target.keywords.values()]
        target = target.func
    found += [cell.cell_contents for cell in dunder(target, "__closure__") or ()
              if _cell_filled(cell)]
    # Defaults bind a module as a closure does (`lambda t, m=lin: m(t)`): missing them made
    # such a lambda's parameters unreachable, refused in backward as foreign tensors.
    found += [*(dunder(target, "__defaults__") or ()),
              *(dunder(target, "__kwdefaults__") or {}).values()]
    code, names = dunder(target, "__code__"), dunder(target, "__globals__", {})
    if code is not None:  # globals it names (a model defined at module level)
        found += [names[name] for name in code.co_names if name in names]
    for obj in list(found):  # one level into containers (a dict of caches, say)
        if isinstance(obj, dict):
            found += obj.values()
        elif isinstance(obj, (list, tuple)):
            found += obj
    return found


def root_key(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(device, address) of the tensor a view chain starts from: equal for a tensor, its
    views and its ``detach()`` aliases. ``None`` where there is no plain storage, or an empty
    one.

    NOTE [empty storages have no address]: every empty storage has address 0, so by address
    an empty output would alias any empty tensor: the hook tensor of an MoE expert that got
    no tokens this step (``proj(silu(tokens[start:start]))``) was refused as "the discarded
    output itself". An empty storage has nothing to free: ``None`` keeps it, and never
    matches."""
    if tensor.layout is not torch.strided:
        return None
    try:  # the storage's address: a detach() alias of a slice has no _base but the storage
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return None
        # A wrapper subclass (DTensor) gets a storage object, whose address raises: its bytes
        # live in inner tensors (NOTE [a wrapper subclass's bytes are its inner tensors']).
        # One with bytes but no address (the meta device's: every one is at 0) by the storage
        # itself, or every meta output aliased the input and nothing was freed (helper PJ).
        # NOTE [a fake tensor's address]
        return tensor.get_device(), data_pointer(tensor, storage) or storage._cdata
    except RuntimeError:
        return None


def made_outside(outputs: tuple[torch.Tensor, ...], inputs: list[torch.Tensor],
                  fn: Callable[..., Any], args: tuple[Any, ...],
                  reachable: list[torch.Tensor] | None = None) -> list[bool]:
    """Per output: does its storage exist outside ``fn`` (an input's, or state ``fn`` can
    reach: ``reachable`` when already found)? Those are never freed (NOTE [discard frees only
    fn's own storages])."""
    keys = [root_key(o) for o in outputs]
    outside = [key is None or isinstance(o._base if o._base is not None else o, nn.Parameter)
               for key, o in zip(keys, outputs)]
    wanted = {key for key, out in zip(keys, outside) if key is not None and not out}
    found: set[tuple[int, int]] = set()
    if wanted:
        if reachable is None:
            reachable = reachable_tensors(fn, args)
        for tensor in (*inputs, *reachable):
            key = root_key(tensor)
            if key in wanted:
                found.add(key)
                if found == wanted:
                    break
    return [out or key in found for key, out in zip(keys, outside)]


def _cell_filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell (a name assigned later in the enclosing scope)
        return False
    return True


def register_rebuild(hook_tensor: torch.Tensor, hook: Callable[[torch.Tensor], None], /
                     ) -> None:
    """Register a discard's rebuild ``hook`` for ``hook_tensor``'s gradient.

    NOTE [a hook tensor that is a view]: the consumer's output is often a view (``nn.Linear``
    on a 3-D input returns one of its 2-D matmul before torch 2.15), and a caller may change
    it in place after the discard (timm's ``LayerScale(inplace=True)``, ``out += residual``).
    Autograd then routes the gradient from the in-place op straight to the view's base, past
    the node a hook on the view sits on, so that hook never ran: nothing was rebuilt, and backward
    failed with torch's "data is not allocated yet". So a view's base gets the hook too: it
    sits on the node that made the base, which a change through any view leaves in place.
    The first of the two to run in a backward rebuilds, the other lets it be (by graph task:
    a second backward of a kept graph rebuilds again, and is refused as before); the view's
    own runs first where both run, which keeps the order a hook tensor that is an output of a
    discarded call, viewing its input, needs."""
    base = hook_tensor._base
    if base is None or not base.requires_grad or base.grad_fn is None:
        hook_tensor.register_hook(hook)
        return
    ran_in: list[int | None] = [None]  # the graph task whose backward ran it

    def once(grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if ran_in[0] != task:
            ran_in[0] = task
            hook(grad)

    hook_tensor.register_hook(once)
    base.register_hook(once)
