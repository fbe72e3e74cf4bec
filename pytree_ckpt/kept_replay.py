"""A replay's graph kept between the passes of a split backward (a zero-bubble pipeline's input
pass, then its weight pass), so the second pass computes the remaining gradients from it
instead of replaying the call again. ``replay_backward`` (recompute.py) makes and reads it.

NOTE [a replay kept between restricted backwards]: torch's zero-bubble schedules
(``ScheduleZBVZeroBubble``, ``ScheduleInterleavedZeroBubble``, ``ScheduleDualPipeV``) split a
stage's backward: ``torch.autograd.grad(outputs, [stage input], retain_graph=True)``, then,
later, gradients from the graph's nodes to the parameters. The boundary's node runs in both,
and would replay the call in each without what follows (three forwards a micro-batch where
eager runs one, the checkpoint's usual two). Eager keeps the block's graph between the two
passes; so does a replay whose backward is *restricted* (``used_by_this_backward`` leaves out
some gradient the node could give) and *keeps the graph* (the outer task's ``keep_graph``: the
node may run again): its replayed outputs and the tensors its gradients are taken to live here,
on the call, and the replay's gradient call retains its graph. A later run of the node takes
its gradients from this graph, with the gradients autograd hands it then (any: the graph is a
function of the inputs alone), and replays nothing; a weight pass handed the very gradients of
the input pass computes only the parameters' share, from the gradients the input pass left at
the graph's nodes that feed them (NOTE [a weight pass from captured gradients] in
kept_weights.py). Dropped from the call as soon as it can never be used again: when the
gradients taken from it so far cover every one the node can give (a later run replays anew, as
a second ``backward(retain_graph=True)`` does), when a backward without ``keep_graph`` runs the
node (its gradient call retains nothing then; should it raise halfway, a retry replays from the
saved inputs and the frame, which only a run that returns releases), or with the call itself,
which only the node (ctx) holds: ``torch.autograd.grad(out, x, retain_graph=True)`` with no
weight pass after it keeps the replay's graph as long as the user keeps ``out``'s graph, and no
longer (what a restricted backward with ``retain_graph`` costs in eager too: its graph).
Nothing in the kept graph refers to the node (its leaves are the detached inputs and the
parameters), so no cycle holds it past that (tests/pytree_ckpt/test_kept_replay.py checks it by
weak reference). Under ``keep_graph`` every use retains the graph, the last one too, and
dropping it frees it by reference once no gradient call runs it: eager lets several threads run
backwards through one retained graph at once, and a last use that retained nothing freed it
under the others ("backward through the graph a second time"); the cost is that its buffers go
at the end of that gradient call, not node by node during it. (Threads that keep a graph at
once may each keep their own replay, the last one on the call; ``taken`` is updated in place.)

What else a replay touches, with a kept graph:

- Frozen results (NOTE [frame lifetime] in frames.py): a reuse of the graph reads no frame;
  the frame is still cleared only by a backward without ``keep_graph`` (a kept graph released
  because every gradient was taken, under ``keep_graph``, leaves a later run a full replay,
  which needs it). Offloaded frozen results are restored once, by the one replay.
- Parameter hooks (NOTE [parameter hooks run once] in parameter_hooks.py): each use of the
  graph pauses them around its gradient call, as a replay does (the pause's prehooks go on
  views of the kept outputs made for that call: on the outputs' own nodes, shared by calls
  other threads run at once, one call's pause marked and unmarked the others' tasks), so each
  hook runs once per gradient, where the outer backward delivers it: the input pass gives no
  parameter a gradient, the weight pass each. Post-accumulate-grad hooks: as with a replay
  (``accumulated_nothing`` for the ``None`` each pass returns).
- The in-place check: a reuse unpacks ``ctx.saved_tensors`` again (``_saved_unchanged`` in
  recompute.py; the inputs' hooks read them too), so an input changed in place since the call (a
  stage input between the input and the weight pass) is refused, naming it, as eager's
  weight pass refuses it. The graph's own version checks cannot be relied on for this: with
  offload on the graph is built on the restored copy, a tensor with its own version counter,
  and where backward reused the last window's device bytes that copy is the caller's very
  storage, so without this check the weight pass would read the changed bytes beside the
  replay's statistics of the old ones.
- Offload: that unpack restores nothing a second time (a copy keeps what it restored while
  autograd holds its handles), and sets off no prefetch (the windows were restored by the
  input pass); the restored inputs stay alive while the graph holds their detached aliases
  (offload never frees a restored storage in place: refcounted).
- Module state (NOTE [the replay changes copies] in state_changes.py): each replay's copies are
  its own, made afresh, so the kept graph's saved tensors stay the replay's; the snapshots
  (``call.changed_state``) are dropped, as before, by a backward without ``keep_graph``. A
  module's buffer the replay saved as it is (not a copy) and a later forward changes in place
  before the weight pass fails autograd's version check, as eager's graph would.
- Held generators and RNG: a replay leaves every generator as it found it (``Replaying``), so a
  skipped replay changes nothing outside.
- Census: the replay's graph is shadowed from a census (recompute.py), kept or not: its bytes
  are not counted (docs/limits.md), and nothing else changes: the frame is released when it
  was before.
- ``verify_leaves`` (refusals.py): at the first replay, which a kept graph comes from; one
  that leaves made leaves to check keeps no graph (NOTE [leaves the call makes]: the kept
  graph would hold them), and the next pass replays anew.
- A second input pass (``torch.autograd.grad(loss, [x], retain_graph=True)`` twice): reuses
  the graph again, the same products on the same values: equal to eager's second pass.

Not kept, the node replays in each pass as before: a replay that made an output discard
(``CheckpointWithoutOutput``, discard.py): its rebuild and its node's backward run once per
forward (``owner.recomputed`` is dropped after the first, and a second rebuild raises), so a
second pass through the same discarded op cannot work; a fresh replay discards and rebuilds
anew. ``note_discard`` marks the invocations the discard is made in (the replay's, through any
nested boundary's), on this thread's context: the state lives on the replay, not in the
process. A callable that is no module (``call.params`` unknown) is never restricted (refused
there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .kept_weights import WeightCapture
from .phase import ACTIVE

__all__ = ["KeptReplay", "note_discard"]


def note_discard() -> None:
    """An output discard is being made (its graph is one-shot): every boundary invocation it is
    made in, innermost out, is marked."""
    invocation = ACTIVE.get()
    while invocation is not None:
        invocation.discarded = True
        invocation = invocation.parent


class KeptReplay:
    """NOTE [a replay kept between restricted backwards]: one replay's graph, for the node's
    next runs."""

    __slots__ = ("outs", "wrt", "taken", "weights", "__weakref__")

    def __init__(self, outs: Sequence[tuple[int, torch.Tensor]], wrt: Sequence[torch.Tensor],
                 taken: set[int], weights: WeightCapture | None, /) -> None:
        # The replayed outputs that require grad, by their place in the node's grad_outputs.
        self.outs = tuple(outs)
        self.wrt = tuple(wrt)      # the detached inputs, then the parameters
        self.taken = taken         # the places in wrt whose gradients were taken so far
        # NOTE [a weight pass from captured gradients] (kept_weights.py)
        self.weights = weights

    def pairs(self, grad_outputs: Sequence[Any], /
              ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The kept outputs that get a gradient this time, and those gradients."""
        outs, grads = [], []
        for place, out in self.outs:
            grad = grad_outputs[place]
            if grad is not None:
                outs.append(out)
                grads.append(grad)
        return outs, grads
