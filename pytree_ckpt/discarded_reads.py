"""A debug mode for output discard: reads of an output freed and not rebuilt yet are errors.

Output discard frees each output's storage in place (NOTE [discard lifetimes] in discard.py).
A late reader (a logging hook, a second branch that consumes the output after the discard, a
consumer's backward that runs before the rebuild) then gets torch's raw "data is not allocated
yet" or, where torch does not check (plain arithmetic on CPU), crashes the process. Under
``detect_discarded_reads()`` every op is looked at before its kernel runs: one given a tensor
on a storage that a discard freed (NOTE [discarded storages are marked] in discard.py) and that
backward has not rebuilt raises ``CheckpointError`` naming the op, the argument and the
discarded op instead. Ops that read no data (``detach``, ``empty_like``, ``new_zeros``) pass, and
views too where torch can make them (``view``, ``reshape``); one it refuses on a freed storage
(indexing, ``t()``, ``unsqueeze``) is named as a read.

It costs a Python call per op, in forward and backward: a mode for finding the reader, as
``torch.autograd.detect_anomaly`` is, not for training runs.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode

from .discard import DISCARDED_MARK
from .errors import CheckpointError

__all__ = ["detect_discarded_reads"]

_aten = torch.ops.aten
# Ops that read a tensor's metadata only (every overload but those with ``out=``, which write
# a tensor given, and randint_like's with a tensor ``high``, which read it); views
# (``OpOverload.is_view``) are found by schema.
_METADATA_ONLY = frozenset(
    getattr(packet, name) for packet in (
        _aten.empty_like, _aten.new_empty, _aten.new_empty_strided, _aten.new_zeros,
        _aten.new_ones, _aten.new_full, _aten.zeros_like, _aten.ones_like, _aten.full_like,
        _aten.rand_like, _aten.randn_like, _aten.randint_like, _aten.is_same_size,
        _aten.sym_size, _aten.sym_stride, _aten.sym_numel, _aten.sym_storage_offset)
    for name in packet.overloads() if "out" not in name and "Tensor" not in name)


class detect_discarded_reads(TorchDispatchMode):
    """Within the block, an op reading an output that output discard freed, before backward
    rebuilt it, raises ``CheckpointError`` (without it: torch's "data is not allocated yet" or
    a crash). For debugging: it sees every op, as ``torch.autograd.detect_anomaly`` does.
    Wrap the whole step, backward included::

        with pytree_ckpt.detect_discarded_reads():
            loss = model(batch)
            loss.backward()
    """

    # NOTE [higher-order ops pass through our modes]: torch refuses a higher-order op
    # (flex_attention, a control-flow op) under a dispatch mode without a rule for it ("There
    # was no rule registered for HigherOrderOperator ..."; helper FC) unless the mode says it
    # supports them; then the op reaches __torch_dispatch__ with the mode already popped, and
    # runs there as it is: its inputs are checked, the ops inside it are not seen.
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Off while torch.compile compiles, on for what the compiled code runs: a compiled
        # region (flex_attention compiles its own call, with fullgraph=True, even uncompiled)
        # compiles as without the mode, where dynamo refused to ("non-infra torch dispatch
        # mode present": helper FC). What inductor fuses is not seen.
        return True

    def __init__(self) -> None:
        # TorchDispatchMode's own signature takes a private ``_dispatch_key``: an argument
        # given here (``detect_discarded_reads(True)``) got torch's assertion about it.
        super().__init__()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            # NOTE [higher-order ops pass through our modes]: inputs checked, run as it is.
            _check_all(func, args, kwargs)
            return func(*args, **kwargs)
        if not func.is_view and func not in _METADATA_ONLY:
            _check_all(func, args, kwargs)
            return func(*args, **kwargs)
        try:
            return func(*args, **kwargs)
        except RuntimeError as error:
            # Most views of a freed storage torch refuses ("setStorage: ... out of bounds for
            # storage of size 0"): named as a read (``view``, ``reshape``, ``detach`` pass).
            try:
                _check_all(func, args, kwargs)
            except CheckpointError as named:
                raise named from error
            raise


def _argument_names(func: Any, /) -> list[str]:
    """The names of ``func``'s positional arguments: from its schema, or, for a higher-order
    op (which has none), from its ``__call__``'s signature (flex_attention's ``key``: helper
    FH; it was named by position)."""
    schema = getattr(func, "_schema", None)
    if schema is not None:
        return [argument.name for argument in schema.arguments]
    try:
        parameters = list(inspect.signature(type(func).__call__).parameters)[1:]  # not self
    except (TypeError, ValueError):
        return []
    return [] if any(name in ("args", "kwargs") for name in parameters) else parameters


def _check_all(func: Any, args: Any, kwargs: dict[str, Any], /) -> None:
    for index, value in enumerate(args):
        _check(func, value, index, None)
    for name, value in kwargs.items():
        _check(func, value, None, name)


def _check(func: Any, value: Any, index: int | None, name: str | None) -> None:
    tensors = value if isinstance(value, (list, tuple)) else (value,)
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
            continue
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, or no storage of its own
            continue
        discarded_by = getattr(storage, DISCARDED_MARK, None)
        if discarded_by is None or storage.nbytes() > 0:  # never discarded, or rebuilt
            continue
        if name is None:
            names = _argument_names(func)
            name = names[index] if index is not None and index < len(names) else f"#{index}"
        raise CheckpointError(
            f"{func} read its argument {name!r} (shape {tuple(tensor.shape)}, "
            f"{tensor.dtype}), an output of {discarded_by} that output discard freed and "
            "backward has not rebuilt yet",
            expected="every read of a discarded output before its discard, or after the "
                     "rebuild its hook tensor's gradient starts",
            got=f"a read in between, by {func}",
            tip="discard only once every consumer of the output has run (a hook or a second "
                "branch reading it later reads freed memory), and register the rebuild on a "
                "tensor whose gradient arrives before any consumer's backward needs the output: "
                "under a restricted backward, one that every consumer's result feeds "
                "(docs/discard.md, 'After the discard, do not read the output')")
