"""What a ``__torch_function__`` tensor subclass needs to come back as itself.

NOTE [subclasses come back as themselves]: the replay and an offload restore hand fn a new
tensor object (a detached alias, a restored copy): of class ``torch.Tensor`` unless made
otherwise, and without the attributes the original carried. A layer may branch on either
(``isinstance``, a scale stored on the tensor), so both are recorded at the save and given
back: the class by ``as_subclass``, the instance dict by reference for an offload restore (the
object's own, as eager autograd hands back the tensor it saved), and ``__slots__`` values as
they were. A plain ``nn.Parameter`` passed as an argument comes back as one too (a forward
may branch on ``isinstance(w, nn.Parameter)``: the replay took the other branch, silently);
its subclasses (a quantized parameter with its own ``__new__`` and state) stay what the
boundary makes of them, detached aliases of class ``torch.Tensor``, unless they have a
``__torch_function__`` of their own (nn.Parameter disables it): then the ops they run
depend on their class, and it is given back as to any other subclass (helper MN: a
fake-quantized weight passed in computed without its rounding in the replay, silently).

NOTE [a subclass's attributes as the forward began]: the replay runs the forward again, so its
inputs carry the attributes the original pass saw, read when it began (``kind_of(...,
as_now=True)``: a shallow copy of the instance dict). Read by reference, an attribute assigned
anew between forward and backward (a scale updated after the step's forward), or one the
forward itself set on its input, reached the replay: it computed with other values than the
forward did, and the gradients differed from eager's, silently. A value changed in place (a
list appended to) is still seen changed (docs/limits.md).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import (is_traceable_wrapper_subclass,
                                          is_traceable_wrapper_subclass_type)

__all__ = ["SubclassKind", "alias_as_kind", "as_kind", "detached", "kind_of",
           "plain_parameter_class", "plain_parts", "rebuilt_by_parts", "rebuilt_parts",
           "with_attributes_of"]


class SubclassKind(NamedTuple):
    cls: type
    attributes: dict[str, Any]
    slots: tuple[tuple[str, Any], ...]


_DISABLED = torch._C._disabled_torch_function_impl  # nn.Parameter's __torch_function__


def plain_parameter_class(cls: type, /) -> bool:
    """Whether ``cls`` is a subclass of ``nn.Parameter`` with torch functions off, as
    nn.Parameter's own: its instances reach the replay as plain tensors (NOTE [subclasses
    come back as themselves]); tree.py's alias and ``kind_of`` must agree on it."""
    return issubclass(cls, nn.Parameter) and cls.__torch_function__ is _DISABLED


def kind_of(tensor: torch.Tensor, /, *, as_now: bool = False) -> SubclassKind | None:
    """``tensor``'s subclass and attributes; ``None`` for a plain tensor without attributes or
    a subclass of ``nn.Parameter`` with torch functions off, nn.Parameter's own way (NOTE
    [subclasses come back as themselves]).
    ``as_now``: its instance dict as it is now (a shallow copy), not the dict itself (NOTE [a
    subclass's attributes as the forward began]).

    A wrapper subclass's inner tensors (a DTensor's ``_local_tensor`` slot, a TwoTensor's
    ``a`` and ``b`` attributes) are no attributes to give back: the saved wrapper comes back
    with its own (autograd's, or an offload window's rebuilt around the restored ones, NOTE [a
    wrapper subclass's bytes are its inner tensors']). Recorded, they kept every offloaded
    DTensor input's device shard alive until backward, and put it back in the restored one.
    """
    cls = type(tensor)
    if cls is torch.Tensor:  # its attributes only (`x.meta` a forward reads: helper JY)
        held = tensor.__dict__
        return SubclassKind(cls, dict(held) if as_now else held, ()) if held else None
    if cls is not nn.Parameter and plain_parameter_class(cls):
        return None
    inner = _inner_tensors(tensor) or {}
    slots = []
    for klass in cls.__mro__:
        names = klass.__dict__.get("__slots__", ())
        for name in (names,) if isinstance(names, str) else names:
            if name not in ("__dict__", "__weakref__") and name not in inner \
                    and hasattr(tensor, name):
                slots.append((name, getattr(tensor, name)))
    attributes = (dict(tensor.__dict__) if as_now else tensor.__dict__) if not inner else \
        {name: value for name, value in tensor.__dict__.items() if name not in inner}
    return SubclassKind(cls, attributes, tuple(slots))


def as_kind(tensor: torch.Tensor, kind: SubclassKind | None, /, *,
            attributes: bool = True) -> torch.Tensor:
    """``tensor`` as ``kind``'s class, with its attributes unless ``attributes`` is false."""
    if kind is None:
        return tensor
    if type(tensor) is not kind.cls:
        tensor = tensor.as_subclass(kind.cls)
    if attributes:
        tensor.__dict__.update(kind.attributes)
        for name, value in kind.slots:
            setattr(tensor, name, value)
    return tensor


def alias_as_kind(alias: torch.Tensor, leaf: torch.Tensor, kind: SubclassKind | None, /
                  ) -> torch.Tensor:
    """``alias`` (a view of the detached input ``leaf``) as ``kind``'s class, with its attributes.

    NOTE [a subclass whose view is plain]: a traceable wrapper subclass whose ops other than
    ``detach`` run on its inner value (a float8 activation that dequantizes: helper LD) gives
    a plain tensor for the view; ``as_subclass`` would give that the class without its inner
    tensors (the layer's first read of one raised AttributeError in backward). It gets a
    wrapper of its own class around ``leaf``'s inner tensors instead, on a node of its own
    that passes the gradient to ``leaf`` (``_Rewrapped``): the non-leaf the replay wants
    (recompute.py: a module tracker's multi-grad hook, autocast casting at each use; helper LP
    found both broken on ``leaf`` itself). Any other class (a ``__torch_function__``
    subclass, an ``nn.Parameter`` given as an argument) lives on the alias's own data, and
    ``as_subclass`` of the alias serves (helper LN)."""
    if kind is not None and type(alias) is not kind.cls \
            and is_traceable_wrapper_subclass_type(kind.cls):
        return as_kind(_Rewrapped.apply(leaf, (leaf,)), kind)
    return as_kind(alias, kind)


class _Rewrapped(torch.autograd.Function):
    """A new wrapper of ``like``'s class around ``like``'s inner tensors, on a node that passes
    its gradient to ``source`` (NOTE [a subclass whose view is plain])."""

    @staticmethod
    def forward(ctx: Any, source: torch.Tensor, like: tuple[torch.Tensor], /) -> torch.Tensor:
        wrapper = like[0]
        names, meta = wrapper.__tensor_flatten__()  # type: ignore[attr-defined]
        return type(wrapper).__tensor_unflatten__(  # type: ignore[attr-defined,no-any-return]
            {name: getattr(wrapper, name) for name in names}, meta, wrapper.size(),
            wrapper.stride())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def with_attributes_of(tensor: torch.Tensor, given: torch.Tensor, /) -> torch.Tensor:
    """``tensor`` (the alias autograd returns for an input returned as it is) with ``given``'s
    attributes and slots, a parameter subclass's too (whose class it does not take); a
    traceable wrapper subclass's plain alias as a wrapper around ``given``'s inner tensors
    (NOTE [a subclass whose view is plain]: it reached the caller without them, helper LP)."""
    kind = kind_of(given)
    if kind is not None:
        if type(tensor) is not kind.cls and is_traceable_wrapper_subclass_type(kind.cls):
            return as_kind(_Rewrapped.apply(tensor, (given,)), kind)
        return as_kind(tensor, kind)
    tensor.__dict__.update(given.__dict__)  # a parameter subclass (kind_of leaves it out)
    return tensor


# NOTE [a wrapper subclass's bytes are its inner tensors']: a traceable wrapper subclass
# (DTensor, and the like) has no storage of its own; its bytes live in the tensors it flattens
# to (``__tensor_flatten__``: a DTensor's local shard, on this rank). Those are what a save
# holds: the census counts them (this rank's bytes, not the global tensor's) and an offload
# window copies them, rebuilding the wrapper around the restored ones in backward
# (tests/distributed/test_tensor_parallel.py). Before, both left such tensors out: a boundary
# over DTensor inputs showed nothing held, and its window copied nothing. Not a jagged nested
# tensor (``rebuilt_by_parts``): its ragged dimension is tied to its offsets tensor object, so
# one rebuilt around restored offsets gets a new one (``j3`` for ``j2``) and its replay's
# output no longer matches; it stays on the device, logged, as before.
def _inner_tensors(tensor: torch.Tensor, /) -> dict[str, torch.Tensor] | None:
    """A wrapper subclass's inner tensors by attribute name (what else it flattens to, such as
    DTensor's ``device_mesh`` on torch 2.13, holds no bytes); ``None`` for any other tensor."""
    if not is_traceable_wrapper_subclass(tensor):
        return None
    names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    return {name: inner for name in names
            if isinstance(inner := getattr(tensor, name), torch.Tensor)}


def plain_parts(tensor: torch.Tensor, /) -> list[torch.Tensor]:
    """``tensor``, or the plain tensors a wrapper subclass flattens to, recursively."""
    if type(tensor) is torch.Tensor:  # every note of a census: the test alone, not the call
        return [tensor]
    inner = _inner_tensors(tensor)
    if inner is None:
        return [tensor]
    return [plain for t in inner.values() for plain in plain_parts(t)]


def rebuilt_by_parts(tensor: torch.Tensor, /) -> bool:
    """Whether an offload window copies ``tensor``'s inner tensors and rebuilds it around the
    restored ones: a traceable wrapper subclass (a DTensor), not a jagged nested tensor (NOTE [a
    wrapper subclass's bytes are its inner tensors'])."""
    if type(tensor) is torch.Tensor:  # every saved tensor under offload: the test alone
        return False
    return is_traceable_wrapper_subclass(tensor) and not tensor.is_nested


def rebuilt_parts(tensor: torch.Tensor, /) -> list[torch.Tensor]:
    """What an offload window copies of ``tensor``: the plain parts of one rebuilt by its parts
    (a DTensor's local shard), else ``tensor`` itself."""
    if not rebuilt_by_parts(tensor):
        return [tensor]
    return [plain for t in (_inner_tensors(tensor) or {}).values() for plain in rebuilt_parts(t)]


def detached(tensor: torch.Tensor, /) -> torch.Tensor:
    """``tensor.detach()``, of ``tensor``'s class: a traceable wrapper subclass whose ops
    return plain tensors (PyG's ``EdgeIndex``: its ``detach()`` is a plain tensor) is rebuilt
    around its detached inner tensors, as an offload window rebuilds one. Given back by
    ``as_subclass`` alone, it lacked its inner tensor, and the replay failed in backward
    (AttributeError '_data'; helper ET)."""
    alias = tensor.detach()
    if type(alias) is type(tensor) or not rebuilt_by_parts(tensor):
        return alias
    names, context = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = {name: detached(getattr(tensor, name)) for name in names}
    return type(tensor).__tensor_unflatten__(  # type: ignore[attr-defined]
        inner, context, tensor.size(), tensor.stride())

