"""``verify_replay=True``: the replay's output values compared with the original pass's, bit
for bit, so that a forward which reads something other than its inputs and its modules' state
(a call counter in a global, a flag on a shared config object) is refused in backward instead
of giving other gradients than eager's, silently.

NOTE [output prints]: the original pass's outputs are the caller's, and keeping copies of them
until backward would keep what checkpointing frees, so each output leaves a print: two int64
sums over its bits, read as integers (8-byte elements as int32 pairs: a sign bit worth 2**63
wraps to itself), so that any flipped bit counts and the total is the same in any order, on any
kernel schedule: one plain, one of a hash of each element's bits with its place (a swap of two
different values moves it, except by a chance of about 2**-64); and, for the message only, its
finite values' sum and absolute sum and the count of the others (both sums within 1e-3 of the
absolute one are named float rounding, and the tip then leads with the kernels that cause it).
What leaves the call with a gradient path is printed: its outputs, the submodule outputs its
forward hooks keep, and the tensor arguments of its kept ops (NOTE [the kept ops' arguments are
verified too]). The replay's get the same prints, compared in one ``torch.equal`` (one device
sync per replay, on CUDA). Plain strided tensors are printed, by place in row-major order
whatever their strides (an output broadcast with stride 0 by the one slice it repeats), and
sparse ones by their parts (NOTE [sparse tensors are printed by their parts]); a tensor
subclass, a nested or meta tensor is named in a warning at the call, and not compared. The
print reads each output once, a chunk of 2**20 4-byte words at a time (int64 temporaries of
about 8 MiB each, whatever the output's size): a switch to find a cause, not to train with.
"""

from __future__ import annotations

import itertools
import math
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .eager import user_stacklevel
from .errors import ReplayMismatchError

__all__ = ["OutputPrints", "arguments_print", "check_arguments", "check_rebuilt"]

# Signed integers of each element size: unsigned types lack reductions on some devices.
_BITS_AS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PLAIN = (torch.Tensor, nn.Parameter)
# SplitMix64's constants as int64s (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9). Weights linear in
# the place (place * constant) missed two rows of equal sums swapped: their change is the
# difference of the rows' sums times one constant. Mixed, the weights have no such structure.
_MIX = (-7046029254386353131, -4658895280553007687)
_CHUNK = 1 << 20  # 4-byte words printed at once: int64 temporaries of 8 MiB each


def _print(t: torch.Tensor, /) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(bit sums, value sums)`` of ``t``, or None for a tensor that has no such print: a
    plain strided tensor's (``_strided_print``), or a sparse one's made of its parts'."""
    parts = _sparse_parts(t)
    if parts is None:
        return _strided_print(t)
    made = []
    for part in parts:
        printed = _strided_print(part)
        if printed is None:
            return None  # a meta sparse tensor
        made.append(printed)
    # Each part's bits hashed with its place among the parts: indices and values that swap
    # their roles do not cancel. The message's value sums are the values part's (the last).
    bits = torch.stack([_finished(m[0] ^ _weights(k, 1, m[0].device))
                        for k, m in enumerate(made)]).sum(dim=0)
    return bits, made[-1][1]


# NOTE [sparse tensors are printed by their parts]: a kept op's sparse argument (an adjacency
# given to torch.sparse.mm) got a print of zeros in both passes, so other values there passed
# (helper HA: a graph layer's adjacency scaled by a shared counter, half of eager's gradients);
# a sparse output was only warned about. A sparse tensor's values are its indices' and values'
# (as the op made them: not coalesced here, which would sum duplicates), so those are printed.
_COMPRESSED = {torch.sparse_csr: ("crow_indices", "col_indices"),
               torch.sparse_bsr: ("crow_indices", "col_indices"),
               torch.sparse_csc: ("ccol_indices", "row_indices"),
               torch.sparse_bsc: ("ccol_indices", "row_indices")}


def _sparse_parts(t: torch.Tensor, /) -> list[torch.Tensor] | None:
    """The plain tensors a sparse ``t`` holds its values in (NOTE [sparse tensors are printed
    by their parts]), values last; None for any other tensor."""
    if type(t) not in _PLAIN:
        return None
    if t.layout is torch.sparse_coo:
        return [t._indices(), t._values()]
    names = _COMPRESSED.get(t.layout)
    if names is None:
        return None
    return [getattr(t, name)() for name in names] + [t.values()]


# NOTE [tensor parallel outputs are compared by their shards]: a tensor-parallel layer's
# output is a wrapper torch made, not the user: a DTensor (``use_local_output=False``) or an
# AsyncCollectiveTensor (a RowwiseParallel's reduced output, still in flight). Each rank's
# replay recomputes its own shard, so each shard is compared on its rank; an in-flight
# reduction is waited for first, as the next op to read it would (helper KL: both went
# unchecked, with a tip to return a tensor the user never made). Looked up in sys.modules:
# no such tensor exists unless torch.distributed's modules were imported, and importing them
# here would make ``import pytree_ckpt`` pay for them.
def _rank_local(t: torch.Tensor, /) -> torch.Tensor:
    """The plain tensor that holds a tensor-parallel wrapper's values on this rank, else ``t``
    (NOTE [tensor parallel outputs are compared by their shards]); called under no_grad."""
    while type(t) not in _PLAIN:
        dtensor = sys.modules.get("torch.distributed.tensor")
        collectives = sys.modules.get("torch.distributed._functional_collectives")
        if dtensor is not None and isinstance(t, dtensor.DTensor):
            t = t.to_local()
        elif collectives is not None and isinstance(t, collectives.AsyncCollectiveTensor):
            t = t.trigger_wait()
        else:
            break
    return t


def _on_this_rank(t: torch.Tensor, /) -> str:
    """For a tensor-parallel wrapper, what a message says of the shard compared: its rank and
    the whole tensor (NOTE [tensor parallel outputs are compared by their shards]); else ""."""
    if _rank_local(t) is t:
        return ""
    dist = sys.modules.get("torch.distributed")
    rank = dist.get_rank() if dist is not None and dist.is_initialized() else 0
    dtensor = sys.modules.get("torch.distributed.tensor")
    what = f"shard of a DTensor of shape {tuple(t.shape)}" if dtensor is not None and \
        isinstance(t, dtensor.DTensor) else type(t).__name__
    return f", rank {rank}'s {what}, compared on each rank: other ranks may have passed"


def _plain_view(t: torch.Tensor, /) -> torch.Tensor | None:
    """``t``'s values as a plain tensor where its class gives one: a subclass that is not a
    traceable wrapper (a ``__torch_function__`` tag) by ``as_subclass(torch.Tensor)``, a
    wrapper whose view is plain (a float8 activation that dequantizes) by its view."""
    if type(t) in _PLAIN or t.layout is not torch.strided:
        return None
    if not is_traceable_wrapper_subclass(t):
        return t.as_subclass(torch.Tensor)
    view = t.view_as(t)
    return view if type(view) in _PLAIN else None


def _strided_print(t: torch.Tensor, /) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(bit sums, value sums)`` of a plain strided ``t``, or None for another tensor.

    One pass over ``t`` in chunks of at most ``_CHUNK`` 4-byte words in row-major order: the
    temporaries (a chunk of an output that is not contiguous copied, or resolved from a
    conjugate or negative view; its values widened for their sums; the weights) are a
    chunk's, about 8 MiB each, not the output's (whole-output float64 copies took 4x a bf16
    output: helper GU; chunks of whole rows, one chunk for a batch of one: helper GV; 8-byte
    and complex chunks of 16-32 MiB, a conjugate output resolved whole: helper GW)."""
    if type(t) not in _PLAIN or t.layout is not torch.strided or t.is_quantized or t.is_meta:
        return None  # (a meta tensor has no values, and torch.equal no meta kernel)
    t = t.detach()
    if t.dim() == 0:
        t = t.reshape(1)
    probe = t[(0,) * t.dim()].reshape(1) if t.numel() else t.reshape(0)  # one element
    if _as_bits(probe.resolve_conj().resolve_neg()) is None:
        return None
    # Bit words per element: a complex one's two halves, an 8-byte one's two int32s.
    words = (2 if t.is_complex() else 1) * (2 if probe.element_size() // (
        2 if t.is_complex() else 1) == 8 else 1)
    wide = torch.complex128 if t.is_complex() else \
        torch.float64 if t.is_floating_point() else torch.int64
    zero = torch.zeros((), dtype=torch.int64, device=t.device)
    plain, mixed = zero.clone(), zero.clone()
    total = torch.zeros((), dtype=wide, device=t.device)
    absolute = torch.zeros((), dtype=torch.float64 if wide is not torch.int64 else wide,
                           device=t.device)
    unfinished = zero.clone()
    for first, values in _chunks(t, max(1, _CHUNK // words)):
        # A conjugate or negative view holds its values' other bits: resolved a chunk at a time.
        values = values.resolve_conj().resolve_neg()
        bits = _as_bits(values)
        assert bits is not None  # as the probe's
        part = bits.reshape(-1)
        if part.element_size() == 8:
            # 8-byte elements as pairs of int32: a sign bit read in an int64 is worth 2**63,
            # which wraps to itself in an int64 sum, so two sign flips left the plain sum as
            # it was (a float64 output negated: helper GR). Through a trailing dimension of 1,
            # which any stride allows (a strided column: helper GT; one element with a stride,
            # which counts as contiguous: helper GW).
            part = part.unsqueeze(-1).view(torch.int32).reshape(-1)
        plain += part.sum(dtype=torch.int64)
        mixed += _mixed(part, first * words).sum()
        try:
            summed, size, bad = _value_sums(values, wide, absolute.dtype)
        except RuntimeError:  # no kernel for the dtype (float8, uint32): through the wide
            # dtype. All read before any is added (an unsigned output's sum was added twice:
            # helper GW).
            summed, size, bad = _value_sums(values.to(wide), wide, absolute.dtype)
        total += summed
        absolute += size
        unfinished += bad
    return torch.stack([plain, mixed]), torch.stack([total, absolute.to(wide),
                                                     unfinished.to(wide)])


def _value_sums(values: torch.Tensor, wide: torch.dtype, absolute: torch.dtype, /
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the message: the sum and absolute sum of ``values``' finite ones, and how many are
    not finite (masked logits hold -inf in both passes: a sum of -inf each told nothing, and
    read as memory never written: helper GX)."""
    if not (values.is_floating_point() or values.is_complex()):
        return (values.sum(dtype=wide), (values if values.dtype is torch.bool else
                                         values.abs()).sum(dtype=absolute),
                torch.zeros((), dtype=torch.int64, device=values.device))
    finite = torch.isfinite(values)
    kept = torch.where(finite, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return (kept.sum(dtype=wide), kept.abs().sum(dtype=absolute),
            finite.numel() - finite.sum(dtype=torch.int64))


def _chunks(t: torch.Tensor, limit: int, /) -> Iterator[tuple[int, torch.Tensor]]:
    """``t`` in pieces of at most ``limit`` elements, in row-major order, each with the place
    of its first element: the innermost dimensions whole while they fit, the next one sliced,
    the outer ones an index at a time."""
    inner, k = 1, t.dim() - 1
    while k >= 0 and inner * t.shape[k] <= limit:
        inner *= t.shape[k]
        k -= 1
    if k < 0:
        yield 0, t
        return
    step = max(1, limit // max(inner, 1))
    for outer in itertools.product(*(range(n) for n in t.shape[:k])):
        base = 0
        for size, index in zip(t.shape[:k], outer):
            base = base * size + index
        piece = t[outer]
        for first in range(0, t.shape[k], step):
            yield (base * t.shape[k] + first) * inner, piece[first:first + step]


def _shifted(z: torch.Tensor, bits: int, /) -> torch.Tensor:
    """``z >> bits`` as unsigned (logical): torch shifts an int64 arithmetically, which hashed
    bits b and their complement ~b alike (helper GV)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mixed(part: torch.Tensor, start: int, /) -> torch.Tensor:
    """Each element's bits hashed together with its place ``start + k``, non-linearly.

    Weights times bits (linear in the bits) missed a value swapped with its negation wherever
    the two places' weights agreed in their low 33 bits (the sign bit is 2**31 in an int32):
    about 74 place pairs of a million (helper GU). The place enters twice: xored into the bits
    alone, two places whose weights shared their high 33 bits could trade bits and keep the
    sum (about one place pair in 2**32: helper GW). A swap of two different values now moves
    the sum, except by a chance of about 2**-64."""
    w = _weights(start, part.numel(), part.device)
    return _finished(_finished(w ^ part.to(torch.int64)) + w)


def _finished(z: torch.Tensor, /) -> torch.Tensor:
    """SplitMix64's finishing mix (logical shifts: ``_shifted``)."""
    z = (z ^ _shifted(z, 31)) * _MIX[1]
    z = (z ^ _shifted(z, 29)) * _MIX[0]
    return z ^ _shifted(z, 32)


def _weights(start: int, count: int, device: torch.device, /) -> torch.Tensor:
    """Pseudo-random int64 weights of places ``start .. start + count`` (they wrap around)."""
    z = torch.arange(start + 1, start + 1 + count, dtype=torch.int64, device=device) * _MIX[0]
    z = (z ^ (z >> 30)) * _MIX[1]
    return z ^ (z >> 27)


_STATE = ("the forward read something that changed before backward: state your code set "
          "between the call and its backward (an attribute set on the layer between "
          "micro-batches, a sub-network's width or a flag: the replay reads it as it is now; "
          "pass it as an argument, or change it after backward), state outside its inputs and "
          "its modules (a call counter or flag in a global or a shared config object: keep it "
          "on the layer or pass it in), or state of its modules the replay cannot put back (a "
          "buffer or attribute over 64 KiB changed in place, a MoCo queue; a frozen parameter "
          "written through .data, a momentum encoder; a small buffer first changed after the "
          "layer's first replay, warned of 'for the first time after the layer's first "
          "replay'): change it outside the checkpointed call (docs/limits.md, 'State the "
          "forward changes')")
_ROUNDING = ("the passes rounded otherwise: a kernel chosen by grad mode, which the original "
             "pass runs without (docs/limits.md, 'Float rounding and other kernels': inductor "
             "in low precision, a padded LSTM on CPU, torch.linalg.eigvalsh or svdvals: use "
             "eigh(A).eigenvalues, svd(A).S), or a nondeterministic one (atomic adds: "
             "index_add_, scatter_add_ on CUDA; index_put_(accumulate=True), a gather's "
             "backward, on CPU with threads: torch.use_deterministic_algorithms(True))")
_AROUND = ("a mode or generator the replay runs without, or a branch on grad mode (a "
           "TorchFunctionMode entered around the forward, a torch.Generator neither passed in "
           "nor held by the layer, Python's random or NumPy drawn inside the forward: draw "
           "outside and pass the choice in; `if torch.is_grad_enabled():`): docs/limits.md, "
           "'Random numbers and modes around the call'")
_RNG = ("preserve_rng_state=False, which lets the replay draw other random numbers than the "
        "forward (dropout): leave it True")
_UNWRITTEN_ARGUMENT = ("a buffer the kept op fills, made uninitialized (torch.scatter into "
                       "torch.empty_like: other garbage in each pass, which the op overwrites): "
                       "make it with torch.zeros_like, or run under "
                       "torch.use_deterministic_algorithms(True), which fills new memory with "
                       "NaN in both passes")
_UNWRITTEN = ("an output holding uninitialized memory, which its forward never wrote "
              "(torch.empty or new_empty padding left as it was): fill it (torch.zeros), or run "
              "under torch.use_deterministic_algorithms(True), which fills new memory with NaN "
              "in both passes")


def _described(fn: Any, /) -> str:
    """How a message names ``fn``: a name given as it is, a callable with its boundary's label
    (``DecoderLayer (model.layers.3)``: layers of one class look alike)."""
    if isinstance(fn, str):
        return fn
    from .module import described  # an error path: imported here (module imports the boundary)

    return described(fn)


def _broadcast_dims(t: torch.Tensor, /) -> tuple[int, ...]:
    """The dimensions ``t`` repeats one slice along (stride 0: ``expand``, a broadcast mask);
    none for a tensor of another layout (a sparse COO tensor reports strides of 0 too)."""
    if t.layout is not torch.strided or type(t) not in _PLAIN:
        return ()
    return tuple(d for d, (size, stride) in enumerate(zip(t.shape, t.stride()))
                 if stride == 0 and size > 1)


def _slice(t: torch.Tensor, dims: tuple[int, ...], /) -> torch.Tensor:
    """``t`` with ``dims`` narrowed to their first index: the one slice a broadcast repeats."""
    for d in dims:
        t = t.narrow(d, 0, 1)
    return t


# NOTE [the kept ops' arguments are verified too]: a save unit's kept op hands the replay the
# original pass's output, so a replay that computes other values before it (a counter scaling
# the attention's q) gives the layer the forward's output, whose print then agrees, while the
# kept op's backward reads the replay's arguments: other gradients, silently (helper GR). Under
# verify_replay each record keeps the bit sums of the op's tensor arguments, and the replay's
# arguments are compared where the record is handed over.
def arguments_print(tensors: Sequence[torch.Tensor], /, *, op: Any, fn: Any,
                    warn: bool = True) -> torch.Tensor | None:
    """The bit sums of ``tensors`` (the tensor arguments of ``op``, which a save unit of
    ``fn`` keeps: NOTE [output prints]), one row each, zeros for one without a print (named in
    a warning unless ``warn`` is false, as outputs are: not compared); None for none."""
    if not tensors:
        return None
    rows = []
    unprinted = []
    with torch.no_grad():
        for position, t in enumerate(tensors):
            t = _rank_local(t)  # NOTE [tensor parallel outputs are compared by their shards]
            made = _print(_slice(t, _broadcast_dims(t)))
            if made is None:
                unprinted.append(position)
            rows.append(made[0] if made is not None else
                        torch.zeros(2, dtype=torch.int64, device=t.device))
    if unprinted and warn:
        listed = ", ".join(f"tensor argument {p + 1} of {len(tensors)} ({_kind(tensors[p])})"
                           for p in unprinted)
        warnings.warn(
            f"verify_replay=True compares the tensor arguments of {op}, which a save unit of "
            f"{_described(fn)} keeps, where they are plain strided or sparse tensors: {listed} "
            "not compared. Tip: leave that op to the replay (not kept), or verify_replay off "
            "for this layer", stacklevel=user_stacklevel())
    return _stacked(rows)


def _kind(t: torch.Tensor, /) -> str:
    return f"{type(t).__name__}, {t.layout}, {t.dtype}" + (", meta" if t.is_meta else "")


def _stacked(rows: Sequence[torch.Tensor], /) -> torch.Tensor:
    """``rows`` stacked on one device: the first accelerator's among them, else the CPU (a CPU
    scalar tensor beside CUDA ones: helper GS)."""
    device = next((r.device for r in rows if r.device.type != "cpu"), rows[0].device)
    return torch.stack([r.to(device) for r in rows])


def check_arguments(recorded: torch.Tensor, tensors: Sequence[torch.Tensor], /, *, fn: Any,
                    op: Any, preserve_rng: bool) -> None:
    """Refuse a kept op's replayed call whose tensor arguments (``tensors``) have other values
    than the original pass's (``recorded``: their ``arguments_print``)."""
    # Told in the forward already. Not through warnings.catch_warnings, whose exit resets
    # every module's once-per-line record: each replay let every warning repeat (helper HB).
    now = arguments_print(tensors, op=op, fn=fn, warn=False)
    if now is not None and now.shape == recorded.shape and torch.equal(now, recorded):
        return
    differ = [i for i, (a, b) in enumerate(zip(recorded.tolist(), (
        now.tolist() if now is not None else []))) if a != b] or [0]
    t = _rank_local(tensors[differ[0]]) if differ[0] < len(tensors) else None
    causes = [_STATE, _AROUND, _ROUNDING, _UNWRITTEN_ARGUMENT]
    # Widened first: float8 has no isnan kernel (helper GT); an error path, a copy is fine.
    # NaN, not inf: a mask's -inf is no garbage (helper GX).
    # A sparse argument's values part: a compressed layout has no any() (helper HB).
    parts = _sparse_parts(t) if t is not None else None
    values = parts[-1] if parts is not None else t
    if values is not None and (values.is_floating_point() or values.is_complex()) and \
            bool(torch.isnan(values.to(torch.complex128 if values.is_complex()
                                       else torch.float64)).any()):
        causes.remove(_UNWRITTEN_ARGUMENT)  # NaN: more likely garbage than a counter
        causes.insert(0, _UNWRITTEN_ARGUMENT)
    if not preserve_rng:
        causes.insert(0, _RNG)
    shard = _on_this_rank(tensors[differ[0]]) if t is not None else ""
    raise ReplayMismatchError(
        f"the replay of {_described(fn)} in backward called {op}, which a save unit keeps, on "
        f"other values than its original pass did (tensor argument {differ[0] + 1} of "
        f"{len(recorded)}, in call order{shard}): verify_replay=True compares them bit for bit, "
        "and the kept op's backward may read the replay's values beside the forward's output",
        expected="the original pass's values", got="other values, of the same shapes and dtypes",
        tip="most likely " + "; else ".join(causes))


class OutputPrints:
    """The prints of one call's output tensors (NOTE [output prints])."""

    __slots__ = ("positions", "sums", "values", "broadcast", "inputs_as_is")

    def __init__(self, positions: list[int], sums: torch.Tensor | None,
                 values: list[torch.Tensor], broadcast: dict[int, tuple[int, ...]]) -> None:
        self.positions = positions  # places in the output's tensor leaves that have a print
        self.sums = sums  # one row per printed output; None where none has a print
        self.values = values
        # NOTE [output prints]: an output the forward broadcast (stride 0) is printed by the one
        # slice it repeats, not by a copy of every place (a mask expanded to heads x tokens**2:
        # about 1 GiB and 28 s on this CPU, helper GR); by place in the tensor leaves.
        self.broadcast = broadcast
        # Places of inputs the call returned as they are, or views of them (given to ``of`` by
        # the boundary), printed in both passes by their plain view where their class has one
        # (a subclass input whose view the class's own ops make plain, or its as_subclass
        # alias: NOTE [tensors of other layouts] in tree.py).
        self.inputs_as_is: frozenset[int] = frozenset()

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], paths: Callable[[], list[str]], /, *,
           fn: Any, inputs_as_is: frozenset[int] = frozenset()) -> OutputPrints:
        """The original pass's prints; warns, naming them, about outputs that have none.
        ``inputs_as_is``: the places of inputs returned as they are (the ``inputs_as_is``
        attribute), printed by their plain view where their class has one."""
        positions: list[int] = []
        sums: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        broadcast: dict[int, tuple[int, ...]] = {}
        unprinted: list[int] = []
        with torch.no_grad():
            for position, t in enumerate(tensors):
                t = _rank_local(t)
                dims = _broadcast_dims(t)
                made = _print(_slice(t, dims) if dims else t)
                plain = _plain_view(t) if made is None and position in inputs_as_is else None
                if plain is not None:  # read as check() reads the replay's
                    made = _print(_slice(plain, dims) if dims else plain)
                if made is None:
                    unprinted.append(position)
                    continue
                if dims:  # the message's sums are the whole output's (helper GX)
                    made = made[0], made[1] * math.prod(t.shape[d] for d in dims)
                if dims:
                    broadcast[position] = dims
                positions.append(position)
                sums.append(made[0])
                values.append(made[1])
        if unprinted:
            named = paths()
            listed = ", ".join(f"{named[p]} ({_kind(tensors[p])})" for p in unprinted)
            warnings.warn(
                f"verify_replay=True compares the replay's outputs of {_described(fn)} with the "
                f"forward's where they are plain strided or sparse tensors: {listed} not "
                "compared. Tip: "
                "return the plain tensor (a subclass's local tensor, a nested tensor's values) "
                "to have it compared, or leave verify_replay off for this layer",
                stacklevel=user_stacklevel())
        prints = cls(positions, _stacked(sums) if sums else None, values, broadcast)
        prints.inputs_as_is = inputs_as_is
        return prints

    def check(self, tensors: Sequence[torch.Tensor], paths: Callable[[], list[str]], /, *,
              fn: Any, preserve_rng: bool) -> None:
        """Raise ``ReplayMismatchError`` naming the first replayed output whose print differs
        from the original pass's (``tensors``: the replay's, in the same places). One whose
        storage an output discard inside the replay freed is compared once it is rebuilt
        (NOTE [a hooked output the replay discarded])."""
        if self.sums is None:
            return
        with torch.no_grad():
            made, rows = [], []
            for row, position in enumerate(self.positions):
                t = _rank_local(tensors[position])
                if t.layout is torch.strided and t.numel() and \
                        not t.untyped_storage().nbytes():
                    _check_when_rebuilt(t, self.sums[row], self.values[row],
                                        self.broadcast.get(position, ()), paths()[position],
                                        fn, preserve_rng)
                    continue
                dims = self.broadcast.get(position, ())
                if dims and not _repeats(t, dims):
                    _raise_other_values(fn, paths()[position], "", t, None, None,
                                        preserve_rng, broadcast=dims)
                m = _print(_slice(t, dims) if dims else t)
                plain = _plain_view(t) if m is None and position in self.inputs_as_is else None
                if plain is not None:
                    # An input returned as it is: the forward's print is of the plain alias
                    # the boundary returned (its class's view is plain), the replay's output
                    # has the class back (helper LN; a wrapper subclass's, helper LT): the
                    # same values, read as the forward's view read them.
                    m = _print(_slice(plain, dims) if dims else plain)
                if m is not None and dims:
                    m = m[0], m[1] * math.prod(t.shape[d] for d in dims)
                if m is None:  # shapes and dtypes agree (the structure check): not the kind
                    raise ReplayMismatchError(
                        f"the replay of {_described(fn)} in backward returned another kind of "
                        "tensor than "
                        f"its original pass at {paths()[position]}, whose values "
                        "verify_replay=True cannot compare",
                        expected="a plain strided or sparse tensor, as the forward returned",
                        got=f"{type(t).__name__} of layout {t.layout}",
                        tip="return the same kind of tensor in both passes (not one chosen by "
                            "current_phase() or grad mode)")
                made.append(m)
                rows.append(row)
            if not made:
                return
            sums = _stacked([m[0] for m in made])
            expected = self.sums if len(rows) == len(self.positions) else self.sums[rows]
            if torch.equal(sums, expected):
                return
            differ = (sums != expected).any(dim=1).tolist()
        first = differ.index(True)
        position = self.positions[rows[first]]
        more = sum(differ) - 1
        also = f" (and {more} more output{'s' if more > 1 else ''})" if more else ""
        _raise_other_values(fn, paths()[position], also, tensors[position],
                            self.values[rows[first]], made[first][1], preserve_rng)


# NOTE [a hooked output the replay discarded]: a forward hook's output (a norm's, read by an
# activation-statistics logger) may be one an output discard frees inside the replay, which
# discards for real, before the replay's outputs are printed: its storage is empty then, and
# reading it raised torch's out-of-bounds error (helper HA). The original pass discards nothing
# (no grad), so its print is of the values. The replay's is taken when the discard rebuilds
# the storage (``check_rebuilt``, called by the discard after its refill), from the storage
# and the tensor's place in it: the check holds no tensor, so the storage's attribute makes no
# cycle. A storage never rebuilt is one nothing in backward reads.
_REBUILT_CHECKS = "_pytree_ckpt_rebuilt_checks"


def _check_when_rebuilt(t: torch.Tensor, expected: torch.Tensor, values: torch.Tensor,
                        dims: tuple[int, ...], where: str, fn: Any, preserve_rng: bool, /
                        ) -> None:
    place = (t.dtype, t.device, t.size(), t.stride(), t.storage_offset())

    def check(storage: torch.UntypedStorage) -> None:
        dtype, device, size, stride, offset = place
        again = torch.empty(0, dtype=dtype, device=device).set_(storage, offset, size, stride)
        with torch.no_grad():
            if dims and not _repeats(again, dims):
                _raise_other_values(fn, where, "", again, None, None, preserve_rng,
                                    broadcast=dims)
            m = _print(_slice(again, dims) if dims else again)
            assert m is not None  # a plain strided tensor, as the forward's
            if dims:
                m = m[0], m[1] * math.prod(again.shape[d] for d in dims)
            if torch.equal(m[0], expected):
                return
        _raise_other_values(fn, where, "", again, values, m[1], preserve_rng)

    storage = t.untyped_storage()
    checks = getattr(storage, _REBUILT_CHECKS, None)
    if checks is None:
        checks = []
        setattr(storage, _REBUILT_CHECKS, checks)
    checks.append(check)


def check_rebuilt(storage: torch.UntypedStorage, /) -> None:
    """Run the checks waiting for ``storage``'s rebuild (NOTE [a hooked output the replay
    discarded]); an output discard calls it once it has refilled the storage."""
    checks = getattr(storage, _REBUILT_CHECKS, None)
    if checks:
        delattr(storage, _REBUILT_CHECKS)
        for check in checks:
            check(storage)


def _repeats(t: torch.Tensor, dims: tuple[int, ...], /) -> bool:
    """Whether ``t`` holds one slice repeated along ``dims`` (it does where it broadcasts)."""
    if all(t.stride(d) == 0 for d in dims):
        return True
    bits = _as_bits(t.detach().resolve_conj().resolve_neg())
    # Bit for bit, as the prints compare: a NaN repeated is the same slice, -0.0 is not 0.0.
    return bits is not None and torch.equal(bits, _slice(bits, dims).expand_as(bits))


def _as_bits(t: torch.Tensor, /) -> torch.Tensor | None:
    """``t``'s bits as integers of its element's size (a complex tensor's real view's)."""
    t = torch.view_as_real(t) if t.is_complex() else t
    bits_as = _BITS_AS.get(t.element_size())
    if bits_as is None:
        return None
    try:
        return t.view(bits_as)
    except RuntimeError:  # a dtype view does not support (sub-byte packed types)
        return None


def _raise_other_values(fn: Any, where: str, also: str, t: torch.Tensor,
                        forward: torch.Tensor | None, replay: torch.Tensor | None,
                        preserve_rng: bool, /, *, broadcast: tuple[int, ...] = ()) -> None:
    """The ``ReplayMismatchError`` of an output whose values differ between the passes; the
    values' sums (``forward``, ``replay``) choose the tip's first cause."""
    state, rounding = _STATE, _ROUNDING
    what = (f"the replay of {_described(fn)} in backward computed other values than its "
            f"original pass at {where}{also}: verify_replay=True compares them bit for bit, and "
            "the gradients would be those of other values than the forward returned")
    if forward is None or replay is None:
        raise ReplayMismatchError(
            what, expected=f"the forward's {where}, broadcast along dimension(s) "
                           f"{list(broadcast)}: one slice repeated",
            got="the replay's, which differs along them", tip=state)
    (summed, absolute, bad), (again, again_absolute, again_bad) = forward.tolist(), \
        replay.tolist()
    absolute, again_absolute, bad, again_bad = abs(absolute), abs(again_absolute), \
        int(abs(bad)), int(abs(again_bad))
    floating = t.is_floating_point() or t.is_complex()
    # Rounding moves both sums a little: the plain one alone stays near 0 for a normed output
    # at any scale (helper GX: a changed scale read as rounding).
    close = floating and summed != again and bad == again_bad and \
        abs(summed - again) <= 1e-3 * absolute and \
        abs(absolute - again_absolute) <= 1e-3 * absolute
    causes = [state, _AROUND, rounding, _UNWRITTEN]
    if not preserve_rng:
        causes.insert(0, _RNG)
    if bad != again_bad:  # NaN or inf in other numbers: garbage more likely than a counter
        causes.remove(_UNWRITTEN)
        causes.insert(0, _UNWRITTEN)
    elif close:
        causes.remove(rounding)
        causes.insert(0, rounding)
    if close:  # a few changed values of many look the same (helper ND: a MoCo queue)
        what += (f"; the sums differ by {abs(summed - again):.3g}, within 1e-3 of the values' "
                 f"absolute sum ({absolute:.6g}), as float rounding does (and as a change to a "
                 "few of many values can)")
    def counted(n: int) -> str:
        return f" ({n} not finite, left out)" if n else ""

    shard = _on_this_rank(t)
    if shard:
        t = _rank_local(t)
    raise ReplayMismatchError(
        what, expected=f"the forward's Tensor(shape={tuple(t.shape)}, dtype={t.dtype}){shard}, "
                       f"values summing to {summed!r}{counted(bad)}",
        got=f"the replay's, summing to {again!r}{counted(again_bad)}",
        tip="most likely " + "; else ".join(causes))
