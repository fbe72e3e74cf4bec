"""The grad probe: what a reused call's fn computes from tensors that require grad, watched
in the original pass where the static look (grad_reach.py) finds nothing trainable.

NOTE [the grad probe]: rule 3 (NOTE [differentiable results are refused where grad is on] in
frozen.py) reads fn's code for what it reaches, and Python hides reach in too many ways to find
every one (another object's method, ``super()`` in a delegate, a computed ``getattr``, a
metaclass, a weakref: each review round found another, and the gate silently got no gradient
under checkpointing where eager refuses). So where the look finds nothing and no tensor
argument requires grad (rule 2 covers those), the original pass watches fn's ops with a
``TorchFunctionMode``: an op given a tensor that requires grad (a parameter: it keeps
``requires_grad`` under no-grad), or one such an op made, marks its float outputs, as eager's
autograd would give them a graph at a call with grad on. A float leaf of the result so marked
is recorded with what it came from, and the replay, which sees the grad mode at the call,
refuses it where grad is on there, as eager does. fn runs exactly as before, under the
boundary's no-grad (helper GB: running it with grad on, the first form of this probe, changed
what it did at a call under the caller's ``no_grad``: a buffer it updated took a graph, NumPy
refused, a CPU LSTM picked another kernel). What the watch cannot see: a ``with
torch.no_grad():`` inside fn (the pass is under no-grad already: its floats are marked, and
refused at a call with grad on, as the static rule refuses them, but where the block holds
all of fn's body: NOTE [a body under its own no-grad] in grad_blocks.py; so are the floats of an op
torch runs under its own no-grad, a distribution's ``sample()``, and an ``autograd.Function``'s
output marked non-differentiable: the refusal's tip says to detach what fn reads there), and
a tensor that has a graph in the replay only (the layer's own activations, computed under the
original pass's no-grad), ``torch.vmap`` inside fn (its results are not the tensors the
batched ops made: helper GF), ``Tensor.set_`` (it bypasses the modes), and a tensor
``torch.utils.swap_tensors`` swaps (it refuses one with weak references, which the marks are:
helper GD; both documented). Ops giving one output per input (``broadcast_tensors``) mark each
output from its own input; ``detach_`` drops a mark. A ``torch.autograd.Function`` is seen only
through the ops its forward runs (its ``apply`` does not reach the mode): one running a kernel
the mode does not see (Triton, a C++ extension) is missed, one given a marked tensor inside a
list is marked where eager gives its output no graph (both documented, with the other
over-marks helper GH's randomized comparison with eager found). An op writing in place (a trailing
underscore, ``t[i] = v``, ``out=``) marks what it wrote, and the base of a view it wrote
through, so every view of that base reads as marked. Ops dynamo traces inside a higher-order op
(``torch.cond``, flex_attention) are not marked; the eager call around the op is. Cost: a
Python call per op of a probed fn (a few microseconds each on a CPU), in the original pass
only; none where the look finds a trainable module (a router with its gate returning top-k ids,
the usual replay, is not probed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from .function_reach import unwrap_partials
from .grad_reach import grad_reach
from .tree import FlatTree, dunder, flatten, hidden_tensor, leaf_paths

__all__ = ["GradProbe", "probe_for"]


class GradProbe(TorchFunctionMode):
    """Marks the float tensors fn's ops compute from tensors that require grad (NOTE above)."""

    def __init__(self) -> None:
        super().__init__()
        # Weak, by identity: a tensor fn made and dropped must not live on, nor its id mark
        # another (a WeakKeyDictionary compares tensors with ==, elementwise).
        self.marked = WeakIdKeyDictionary()
        # Bases written in place with a marked value (buf[0].add_(g), buf[:] = g): every view
        # of one, made before or after, reads what eager gives a graph (helper GC).
        self.written = WeakIdKeyDictionary()

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if torch.compiler.is_compiling():
            # dynamo tracing a higher-order op's body (torch.cond, flex_attention) under this
            # mode: the marks are made by the eager call around the op (helper GH: tracing
            # them raised in the original pass)
            return out
        if func in _NO_GRAPH:
            if func is torch.Tensor.detach_ or func is torch.Tensor.requires_grad_:
                self.marked.pop(args[0], None)  # no graph from here on, as in eager
                self.written.pop(args[0], None)
            return out
        if func in _SPECIAL and not _differentiable(func, args):
            return out
        if func in _PER_INPUT:  # one output per input (broadcast_tensors, meshgrid)
            inputs = list(_tensors(args, kwargs))
            outputs = list(_tensors(out, None))
            if len(inputs) == len(outputs):
                for given, made in zip(inputs, outputs):
                    source = self.source(given)
                    if source is not None and _is_float(made):
                        self.marked[made] = source
                return out
        shaped = func in _SHAPE_FROM_OTHERS
        source = None
        for tensor in _tensors(args[:1] if shaped else args, None if shaped else kwargs):
            source = self.source(tensor)
            if source is not None:
                break
        if source is None:
            return out
        written = list(_tensors(kwargs.get("out") if kwargs else None, None))
        if func in _IN_PLACE or _in_place(getattr(func, "__name__", "").split(".")[0]):
            written += _tensors(args[:1], None)  # self, changed in place
        for tensor in [*_tensors(out, None), *written]:
            if tensor.is_floating_point() or tensor.is_complex():
                self.marked[tensor] = source
        for tensor in written:
            if tensor.is_floating_point() or tensor.is_complex():
                self.written[tensor._base if tensor._base is not None else tensor] = source
        return out

    def source(self, tensor: torch.Tensor, /) -> str | None:
        """What gives ``tensor`` a graph in eager (a call with grad on), or ``None``."""
        if tensor.requires_grad:
            return _what(tensor)
        found = self.marked.get(tensor)
        if found is None and self.written:
            found = self.written.get(tensor._base if tensor._base is not None else tensor)
        return found

    def found(self, result: Any, /) -> tuple[str, str] | None:
        """The key path of the first float leaf of ``result`` eager computes with grad, and what
        it came from; ``None`` if none."""
        flat = flatten(result)
        for i, leaf in enumerate(flat.leaves):
            if isinstance(leaf, torch.Tensor):
                where, source = "", self.source(leaf) if _is_float(leaf) else None
            else:  # NOTE [leaves that hold tensors] (tree.py): looked into as the rules do
                hidden = hidden_tensor(leaf, lambda t: _is_float(t) and
                                       self.source(t) is not None)
                where, source = ("", None) if hidden is None else \
                    (hidden[0], self.source(hidden[1]))
            if source is not None:
                return f"{leaf_paths(flat.spec, root='result')[i]}{where}", source
        return None


def probe_for(fn: Callable[..., Any], call: FlatTree, /, *, stores: bool = False
              ) -> GradProbe | None:
    """The probe to watch ``fn`` with in the original pass, or ``None``: where the static look
    finds what gives its floats a graph (rule 3 refuses them in the replay), where a tensor
    argument requires grad (rule 2 does), and for a compiled fn (dynamo would trace the mode).
    ``stores``: fn stores floats on its module, and its call is watched for them whatever
    rules 2 and 3 find (NOTE [floats a reused fn stores on its module] in frozen.py); not a
    compiled fn's."""
    if _compiled(fn):
        return None
    if stores:
        return GradProbe()
    if any(call.leaves[j].requires_grad for j in call.tensor_index):
        return None
    return GradProbe() if grad_reach(fn, call) is None else None


def _compiled(fn: Any, /) -> bool:
    """``fn`` is compiled (``torch.compile(f)``, a module after ``module.compile()``, a partial
    of either): dynamo would trace the mode (graph breaks; with fullgraph, an error: helper
    GD), so such a call is left to the static look."""
    inner, _ = unwrap_partials(fn)
    for candidate in (fn, inner, dunder(inner, "__self__")):
        # (dunder, not hasattr: a __getattr__ may raise a KeyError for them: helper HG)
        if dunder(candidate, "_torchdynamo_orig_callable") is not None or \
                dunder(candidate, "_orig_mod") is not None:
            return True
        if isinstance(candidate, torch.nn.Module) and candidate is fn and \
                getattr(candidate, "_compiled_call_impl", None) is not None:
            return True
    return False


def _tensors(value: Any, kwargs: Any, /) -> Iterator[torch.Tensor]:
    """The tensors among an op's arguments or outputs: at the top, and one list or tuple down
    (``torch.cat([a, b])``, ``topk``'s (values, indices))."""
    for group in (value, kwargs.values() if kwargs else ()):
        items: Any = (group,) if isinstance(group, torch.Tensor) else group \
            if isinstance(group, (list, tuple, type({}.values()))) else ()
        for item in items:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, (list, tuple)):
                yield from (t for t in item if isinstance(t, torch.Tensor))


def _in_place(name: str, /) -> bool:
    """An op named as one changing its first argument in place: ``add_``, ``__ior__``; not
    ``__eq__`` or ``__mul__``, which also end with an underscore (helper GE: ``noise ==
    scores`` marked ``noise``). On torch 2.13 an augmented assignment of floats reaches the
    mode as the in-place op (``x += y`` as ``add_``, ``x *= y`` as ``mul_``); only the bitwise
    ones (``__iand__``, ``__ior__``, ...) come under their dunder names, on integer or bool
    tensors, which are never marked (helper GI). The dunder names are looked at all the same,
    for a torch that sends the others so."""
    if name.startswith("__"):
        return name.startswith("__i") and name[3:-2] in _AUGMENTED
    return name.endswith("_")


# The operators an augmented assignment (x += y) calls in place, as __i<name>__.
_AUGMENTED = frozenset({"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or",
                        "xor", "lshift", "rshift", "matmul"})


def _is_float(tensor: torch.Tensor, /) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def _what(tensor: torch.Tensor, /) -> str:
    if isinstance(tensor, torch.nn.Parameter):
        return f"computed from a parameter of shape {tuple(tensor.shape)}"
    if tensor.grad_fn is not None:
        return f"computed from a tensor with a graph, of shape {tuple(tensor.shape)}"
    return f"computed from a tensor that requires grad, of shape {tuple(tensor.shape)}"


# Ops whose outputs eager gives no graph whatever their inputs: a detached alias, a new tensor
# of the input's shape, the .data and .grad attributes.
_NO_GRAPH = frozenset({
    torch.Tensor.detach, torch.Tensor.detach_, torch.detach, torch.Tensor.requires_grad_,
    torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
    torch.randn_like, torch.randint_like, torch.Tensor.new_zeros, torch.Tensor.new_ones,
    torch.Tensor.new_empty, torch.Tensor.new_full, torch.Tensor.new_tensor,
    torch.Tensor.new_empty_strided, torch.Tensor.new, torch.tensor, torch.linspace,
    torch.logspace, torch.arange,
    *(vars(torch._C.TensorBase)[name].__get__ for name in ("data", "grad")),
    # not differentiable in eager: their float outputs take no graph (helpers GC, GH)
    torch.histc, torch.Tensor.histc, torch.Tensor.logical_and_, torch.Tensor.logical_or_,
    torch.Tensor.logical_xor_, torch.Tensor.logical_not_,
})
# torch.special's Bessel functions and orthogonal polynomials: not differentiable on torch
# 2.13 (helper GH), some are on 2.15; asked of torch once each, on one-element tensors.
_SPECIAL = frozenset(getattr(torch.special, name) for name in dir(torch.special)
                     if "bessel" in name or "polynomial" in name or name == "airy_ai")
_DIFFERENTIABLE: dict[Any, bool] = {}  # a fact about the running torch, not step state


def _differentiable(func: Any, args: Any, /) -> bool:
    known = _DIFFERENTIABLE.get(func)
    if known is None:
        tiny = [torch.ones(1, dtype=a.dtype, device=a.device, requires_grad=True)
                if isinstance(a, torch.Tensor) and _is_float(a) else a for a in args]
        with torch.enable_grad():
            known = _DIFFERENTIABLE[func] = func(*tiny).requires_grad
    return known
# Ops whose other tensor arguments give only a dtype, device or shape (x.type_as(w),
# x.to(w), x.expand_as(w)): only their first one is followed (helper GC).
_SHAPE_FROM_OTHERS = frozenset({
    torch.Tensor.type_as, torch.Tensor.to, torch.Tensor.expand_as, torch.Tensor.view_as,
    torch.Tensor.reshape_as, torch.Tensor.resize_as_, torch.resize_as_,
})
# Ops giving one output per input, each from its own input only (helper GD).
_PER_INPUT = frozenset({torch.broadcast_tensors, torch.meshgrid, torch.atleast_1d,
                        torch.atleast_2d, torch.atleast_3d})
# In place though not named with a trailing underscore: indexed assignment (table[0] = g).
_IN_PLACE = frozenset({torch.Tensor.__setitem__})
