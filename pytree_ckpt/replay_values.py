"""``verify_replay=True``: the replay's output values compared with the original pass's, bit
for bit, so that a forward which reads something other than its inputs and its modules' state
(a call counter in a global, a flag on a shared config object) is refused in backward instead
of giving other gradients than eager's, silently.

NOTE [output prints]: the original pass's outputs are the caller's, and keeping copies of them
until backward would keep what checkpointing frees, so each output leaves a print: two int64
sums over its bits (the bits read as integers of the element's size, so any flipped bit counts,
and integer sums give the same total in any order, on any kernel schedule), one plain, one
with a pseudo-random weight per place (two different values swapped move it), and, for the
message only, its values' sum. The replay's outputs get the same prints, compared in
one ``torch.equal`` (one device sync per replay, on CUDA). Plain strided tensors are printed;
an output of another layout or a tensor subclass is named in a warning at the call, and not
compared. The check adds a few reductions per output in each pass, a few int64 temporaries of 8 MiB
(the weights, made a chunk at a time) and a copy of an output that is not contiguous: a switch
to find a cause, not to train with.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .eager import user_stacklevel
from .errors import ReplayMismatchError

__all__ = ["OutputPrints"]

# Signed integers of each element size: unsigned types lack reductions on some devices.
_BITS_AS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PLAIN = (torch.Tensor, nn.Parameter)
# SplitMix64's constants as int64s (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9). Weights linear in
# the place (place * constant) missed two rows of equal sums swapped: their change is the
# difference of the rows' sums times one constant. Mixed, the weights have no such structure.
_MIX = (-7046029254386353131, -4658895280553007687)
_CHUNK = 1 << 20  # elements weighted at once: int64 temporaries of 8 MiB each


def _print(t: torch.Tensor, /) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(bit sums, value sum)`` of ``t``, or None for a tensor that has no such print."""
    if type(t) not in _PLAIN or t.layout is not torch.strided or t.is_quantized:
        return None
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    try:
        value = t.sum(dtype=torch.float64 if t.is_floating_point() else torch.int64)
    except RuntimeError:  # no sum kernel for the dtype (float8): the message's sum only
        value = t.to(torch.float64).sum()
    bits_as = _BITS_AS.get(t.element_size())
    if bits_as is None:
        return None
    try:
        bits = t.view(bits_as)
    except RuntimeError:  # a dtype view does not support (sub-byte packed types)
        return None
    flat = bits.reshape(-1)  # row-major places: a copy where the output is not contiguous
    mixed = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, flat.numel(), _CHUNK):  # the weights' memory bounded by a chunk's
        part = flat[start:start + _CHUNK]
        mixed += (part * _weights(start, part.numel(), t.device)).sum()
    sums = torch.stack([flat.sum(dtype=torch.int64), mixed])
    return sums, value


def _weights(start: int, count: int, device: torch.device, /) -> torch.Tensor:
    """Pseudo-random int64 weights of places ``start .. start + count`` (they wrap around)."""
    z = torch.arange(start + 1, start + 1 + count, dtype=torch.int64, device=device) * _MIX[0]
    z = (z ^ (z >> 30)) * _MIX[1]
    return z ^ (z >> 27)


class OutputPrints:
    """The prints of one call's output tensors (NOTE [output prints])."""

    __slots__ = ("positions", "sums", "values")

    def __init__(self, positions: list[int], sums: torch.Tensor | None,
                 values: list[torch.Tensor]) -> None:
        self.positions = positions  # places in the output's tensor leaves that have a print
        self.sums = sums  # one row per printed output; None where none has a print
        self.values = values

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], paths: Callable[[], list[str]], /, *,
           fn: str) -> OutputPrints:
        """The original pass's prints; warns, naming them, about outputs that have none."""
        positions: list[int] = []
        sums: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        unprinted: list[int] = []
        with torch.no_grad():
            for position, t in enumerate(tensors):
                made = _print(t)
                if made is None:
                    unprinted.append(position)
                    continue
                positions.append(position)
                sums.append(made[0])
                values.append(made[1])
        if unprinted:
            named = paths()
            listed = ", ".join(f"{named[p]} ({type(tensors[p]).__name__}, {tensors[p].layout}, "
                               f"{tensors[p].dtype})" for p in unprinted)
            warnings.warn(
                f"verify_replay=True compares the replay's outputs of {fn} with the forward's "
                f"where they are plain strided tensors: {listed} not compared. Tip: return "
                "the plain tensor (a subclass's local tensor, a nested tensor's values) to have "
                "it compared, or leave verify_replay off for this layer",
                stacklevel=user_stacklevel())
        return cls(positions, torch.stack(sums) if sums else None, values)

    def check(self, tensors: Sequence[torch.Tensor], paths: Callable[[], list[str]], /, *,
              fn: str) -> None:
        """Raise ``ReplayMismatchError`` naming the first replayed output whose print differs
        from the original pass's (``tensors``: the replay's, in the same places)."""
        if self.sums is None:
            return
        with torch.no_grad():
            made = [_print(tensors[p]) for p in self.positions]
            for position, m in zip(self.positions, made):
                if m is None:  # shapes and dtypes agree (the structure check): not the kind
                    t = tensors[position]
                    raise ReplayMismatchError(
                        f"the replay of {fn} in backward returned another kind of tensor than "
                        f"its original pass at {paths()[position]}, whose values "
                        "verify_replay=True cannot compare",
                        expected="a plain strided tensor, as the forward returned",
                        got=f"{type(t).__name__} of layout {t.layout}",
                        tip="return the same kind of tensor in both passes (not one chosen by "
                            "current_phase() or grad mode)")
            sums = torch.stack([m[0] for m in made if m is not None])
            if torch.equal(sums, self.sums):
                return
            differ = (sums != self.sums).any(dim=1).tolist()
        first = differ.index(True)
        position = self.positions[first]
        t = tensors[position]
        replayed = made[first]
        assert replayed is not None
        more = sum(differ) - 1
        also = f" (and {more} more output{'s' if more > 1 else ''})" if more else ""
        raise ReplayMismatchError(
            f"the replay of {fn} in backward computed other values than its original pass at "
            f"{paths()[position]}{also}: verify_replay=True compares them bit for bit, and the "
            "gradients would be those of other values than the forward returned",
            expected=f"the forward's Tensor(shape={tuple(t.shape)}, dtype={t.dtype}), values "
                     f"summing to {self.values[first].item()!r}",
            got=f"the replay's, summing to {replayed[1].item()!r}",
            tip="the forward read something that changed before backward outside its inputs "
                "and its modules' state (a call counter or flag in a global or a shared config "
                "object): keep it on the layer, or pass it in as an input (docs/limits.md, "
                "'State the forward changes'). Where the sums differ in their last digits "
                "only, the passes rounded otherwise: a kernel chosen by grad mode, which the "
                "original pass runs without (docs/limits.md, 'Float rounding and other "
                "kernels': inductor in low precision, a padded LSTM on CPU), or a "
                "nondeterministic one (atomic adds: index_add_, scatter_add_ on CUDA: "
                "torch.use_deterministic_algorithms(True))")
