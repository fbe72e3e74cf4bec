"""Output-discard replay composed with the rest of training: parameters frozen or unfrozen
between forward and backward, restricted backwards, offload, census.

Each test compares against an unwrapped eager twin with exact equality in fp32. Storage sizes
are read into a local before they are asserted (a freed tensor must never reach a repr)."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch import nn

import pytree_ckpt
from pytree_ckpt import CheckpointError, CheckpointWithoutOutput
from tests.conftest import assert_same_grads, grads_of
from tests.pytree_ckpt.models import RmsNorm as _Norm
from tests.pytree_ckpt.models import project_norm


@pytest.mark.parametrize("frozen_in_forward", [False, True],
                         ids=["frozen-since-forward", "unfrozen-since-forward"])
def test_a_norm_weight_frozen_or_unfrozen_between_forward_and_backward_gets_eagers_gradient(
        frozen_in_forward: bool) -> None:
    # Eager: the graph was built in the forward; a parameter frozen since still gets nothing
    # (its AccumulateGrad does nothing), one unfrozen since was never in the graph. The
    # discard raised torch's "One of the differentiated Tensors does not require grad" for
    # the first, and a CheckpointError calling the norm's own weight a foreign tensor (tip:
    # "pass it as an argument") for the second.
    torch.manual_seed(0)
    norm, proj = _Norm(), nn.Linear(8, 8)
    twin = copy.deepcopy(norm)
    x = torch.randn(4, 8, requires_grad=True)
    norm.weight.requires_grad_(not frozen_in_forward)
    twin.weight.requires_grad_(not frozen_in_forward)
    out = proj(norm(x))
    norm.weight.requires_grad_(frozen_in_forward)
    out.square().sum().backward()
    expected = grads_of([x, norm.weight, *proj.parameters()])
    x.grad = None
    proj.zero_grad(set_to_none=True)
    ckpt = CheckpointWithoutOutput()
    out = proj(ckpt.checkpoint(twin, x))
    ckpt.discard_output_and_register_recompute(out)
    twin.weight.requires_grad_(frozen_in_forward)
    out.square().sum().backward()
    assert twin.weight.grad is None
    assert_same_grads(expected, grads_of([x, twin.weight, *proj.parameters()]))


def _two_consumers(hook_on_both: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    norm, first, second = _Norm(), nn.Linear(8, 8), nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    ckpt = CheckpointWithoutOutput()
    normed = ckpt.checkpoint(norm, x)
    a, b = first(normed), second(normed)  # both save `normed`
    joined = a.square() + b
    ckpt.discard_output_and_register_recompute(joined if hook_on_both else b)
    return [first.weight], joined.sum()


def test_a_restricted_backward_skipping_the_last_consumer_never_fires_its_hook() -> None:
    # docs/discard.md: the last consumer's result is enough for loss.backward(), not for a
    # backward restricted to the first consumer's weight: the second's branch is skipped, its
    # hook never fires, and the first consumer's backward meets the freed output.
    weights, loss = _two_consumers(hook_on_both=False)
    with pytest.raises(RuntimeError, match="data is not allocated yet"):
        loss.backward(inputs=weights)


def test_a_hook_on_a_tensor_every_consumer_feeds_rebuilds_under_a_restricted_backward() -> None:
    weights, loss = _two_consumers(hook_on_both=True)
    loss.backward(inputs=weights)
    got = weights[0].grad
    # the eager twin: the same seed builds the same modules and input
    torch.manual_seed(0)
    norm, first, second = _Norm(), nn.Linear(8, 8), nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    normed = norm(x)
    (first(normed).square() + second(normed)).sum().backward(inputs=[first.weight])
    assert torch.equal(got, first.weight.grad)


def test_an_expert_that_got_no_tokens_discards_its_empty_activation_without_error() -> None:
    # MoE: each expert's activation is discarded on its slice of the permuted tokens; an
    # expert with no tokens this step has an empty output and an empty hook tensor, both at
    # address 0. The hook tensor was refused as "the discarded output itself".
    torch.manual_seed(0)
    proj = nn.Linear(8, 8)
    tokens = torch.randn(6, 8, requires_grad=True)
    counts = [4, 0, 2]

    def experts(discard: bool) -> torch.Tensor:
        outs, start = [], 0
        for count in counts:
            rows = tokens[start:start + count]  # a slice: the buffer's address, not 0
            if discard:
                ckpt = CheckpointWithoutOutput()
                out = proj(ckpt.checkpoint(torch.nn.functional.silu, rows))
                ckpt.discard_output_and_register_recompute(out)
            else:
                out = proj(torch.nn.functional.silu(rows))
            outs.append(out)
            start += count
        return torch.cat(outs)

    experts(discard=False).square().sum().backward()
    expected = grads_of([tokens, *proj.parameters()])
    tokens.grad = None
    proj.zero_grad(set_to_none=True)
    experts(discard=True).square().sum().backward()
    assert_same_grads(expected, grads_of([tokens, *proj.parameters()]))


@pytest.mark.parametrize("tied_first", [False, True], ids=["tied-use-after", "tied-use-first"])
def test_a_parametrized_op_discarded_inside_a_cached_block_gives_eager_gradients(
        tied_first: bool) -> None:
    # Guards against the discard's passes sharing the caller's parametrize cache (NOTE [each
    # pass caches its own parametrizations], as at the boundary): the no-grad forward cached a
    # weight without graph that a tied use after it read (the parametrization silently lost
    # that gradient), and a replay in backward read the weight a tied use before it cached,
    # sending its gradient into the caller's graph. Equal to float rounding: the replay's use
    # comes back as a gradient of its own.
    torch.manual_seed(0)
    lin, proj = nn.Linear(8, 8), nn.Linear(8, 8)
    torch.nn.utils.parametrizations.weight_norm(lin)
    twin = copy.deepcopy(lin)
    x = torch.randn(4, 8, requires_grad=True)
    grads = []
    for layer, discard in ((lin, False), (twin, True)):
        with torch.nn.utils.parametrize.cached():
            head = layer.weight.exp().sum() if tied_first else 0
            if discard:
                ckpt = CheckpointWithoutOutput()
                out = proj(ckpt.checkpoint(layer, x))
                ckpt.discard_output_and_register_recompute(out)
            else:
                out = proj(layer(x))
            if not tied_first:
                head = layer.weight.exp().sum()
            (out.square().sum() + head).backward()
        grads.append(grads_of([x, *layer.parameters(), *proj.parameters()]))
        x.grad = None
        proj.zero_grad(set_to_none=True)
    for expected, got in zip(*grads):
        assert expected is not None and got is not None
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_a_weight_used_several_times_in_a_discarded_op_is_cached_in_its_replay_as_in_its_forward(
) -> None:
    # NOTE [the replay caches parametrizations as the forward did] (helper KJ), for the
    # discard's replay: cached() around the forward only (torch's own example, an RNN loop over
    # a spectral-normed kernel), backward after the block. The replay ran uncached: one power
    # iteration per use, so later steps saw other weights than the forward's.
    torch.manual_seed(0)
    rec = torch.nn.utils.parametrizations.spectral_norm(nn.Linear(6, 6, bias=False))
    twin = copy.deepcopy(rec)
    xs = torch.randn(4, 3, 6)

    def loop(kernel: nn.Module, xs: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(3, 6)
        for x in xs:
            h = torch.tanh(x + kernel(h))
        return h

    seen = []
    for kernel, discard in ((rec, False), (twin, True)):
        with torch.nn.utils.parametrize.cached():
            if discard:
                ckpt = CheckpointWithoutOutput()
                h = ckpt.checkpoint(loop, kernel, xs)
                out = h.exp()
                ckpt.discard_output_and_register_recompute(out)
            else:
                out = loop(kernel, xs).exp()
        out.sum().backward()
        seen.append([*grads_of(kernel.parameters()), *(b.clone() for b in kernel.buffers())])
    for want, got in zip(*seen):
        assert torch.equal(want, got)


def test_an_attention_layer_in_eval_mode_discarded_gives_eager_outputs_and_gradients() -> None:
    # Guards against the discard's no-grad forward taking attention's fused fast path (NOTE
    # [no fast path by grad mode]): its output then differed from eager's by rounding, and the
    # replay (composite, grad enabled) rebuilt another one than the forward had used.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    proj = nn.Linear(8, 8)
    twin = copy.deepcopy(layer)
    x = torch.randn(2, 4, 8, requires_grad=True)
    outs, grads = [], []
    for model, discard in ((layer, False), (twin, True)):
        if discard:
            ckpt = CheckpointWithoutOutput()
            out = proj(ckpt.checkpoint(model, x))
            ckpt.discard_output_and_register_recompute(out)
        else:
            out = proj(model(x))
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append(grads_of([x, *model.parameters(), *proj.parameters()]))
        x.grad = None
        proj.zero_grad(set_to_none=True)
    assert torch.equal(*outs)
    assert_same_grads(*grads)


def _discarding_body(lin: nn.Linear):
    def body(h: torch.Tensor) -> torch.Tensor:
        h = h * 2
        ckpt = CheckpointWithoutOutput()
        y = ckpt.checkpoint(torch.nn.functional.rms_norm, h, (8,))
        out = torch.tanh(lin(y))
        ckpt.discard_output_and_register_recompute(out)
        return out * 3
    return body


def test_a_compiled_body_runs_output_discard_eagerly_without_dynamo_warnings() -> None:
    # NOTE [discard stays eager] in discard.py: dynamo traced the Function's forward frame by
    # frame, down to the replay environment's kernel-switch reads, and warned about each
    # builtin it could not trace there.
    import warnings

    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    eager_lin = nn.Linear(8, 8)
    compiled_lin = copy.deepcopy(eager_lin)
    x = torch.randn(4, 8)
    torch._dynamo.reset()
    try:
        counter = CompileCounter()
        compiled = torch.compile(_discarding_body(compiled_lin), backend=counter)
        xs = [x.clone().requires_grad_() for _ in range(2)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled(xs[0]).sum().backward()
        # Nothing from inside the Function. (torch 2.9 also warns of optree, which
        # checkpoint()'s own argument checks call, traced before the Function's call; on
        # Python 3.13.0 dynamo warns of that interpreter: "Guards may run slower".)
        told = [str(w.message) for w in caught if "Guards may run slower" not in str(w.message)]
        assert not [m for m in told if "optree" not in m], told
        if "optree" not in " ".join(told):
            assert counter.op_count > 0  # the ops around the discard compiled
        # else: torch 2.9's dynamo cannot trace optree and ran the body eagerly, before this
        # change too
        _discarding_body(eager_lin)(xs[1]).sum().backward()
        assert torch.equal(xs[0].grad, xs[1].grad)
        assert_same_grads(grads_of(eager_lin.parameters()), grads_of(compiled_lin.parameters()))

        torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.Unsupported) as refused, \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch 2.9's optree warning, as above
            torch.compile(_discarding_body(compiled_lin), backend="eager", fullgraph=True)(
                x.clone().requires_grad_())
        # The reason where dynamo reaches the call (torch 2.13); older ones stop before it, in
        # checkpoint()'s argument checks (an id() of a traced tensor, or a `in fn.__dict__` it
        # cannot trace, on 2.11; optree on 2.9).
        assert any(sign in str(refused.value) for sign in (
            "output discard (CheckpointWithoutOutput) runs eagerly", "call_id", "optree",
            "hasattr(GetSetDescriptorVariable, __iter__)"))
    finally:
        torch._dynamo.reset()


class _PreNormLayer(nn.Module):
    """A decoder layer's pre-norm, discarded: the discarded module reads the layer's input."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ckpt = CheckpointWithoutOutput()
        y = self.up(ckpt.checkpoint(self.norm, x))
        ckpt.discard_output_and_register_recompute(y)
        return x + self.down(torch.nn.functional.gelu(y))


def test_a_compiled_body_that_discards_its_input_norm_stays_compiled_step_after_step() -> None:
    # Guards against (helper DN): the pre-norm of a decoder layer, discarded: the discarded
    # module reads the layer's own input. dynamo traces CheckpointWithoutOutput.checkpoint,
    # whose `skip = {id(a) ...}` (discard.py) guarded on the identity of that input
    # (___check_obj_id), so every call recompiled, and past dynamo's recompile_limit the
    # compiled graphs stopped running. Graphs run per step, three layers: 3, 3, 2, 0, 0, ...
    # (one layer, 2-D input: 2 eight times, then 1). The numbers stayed eager's; only the
    # compilation was silently lost.
    torch.manual_seed(0)
    layers = nn.ModuleList(_PreNormLayer() for _ in range(3))
    eager = copy.deepcopy(layers)
    runs: collections.Counter[str] = collections.Counter()

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        def run(*args: torch.Tensor):
            runs["graphs"] += 1
            return gm.forward(*args)
        return run

    torch._dynamo.reset()
    try:
        for layer in layers:
            layer.forward = torch.compile(layer.forward, backend=backend)
        per_step = []
        for step in range(12):
            x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(step))
            xs = [x.clone().requires_grad_() for _ in range(2)]
            runs.clear()
            for stack, h in ((layers, xs[0]), (eager, xs[1])):
                for layer in stack:
                    h = layer(h)
                h.square().sum().backward()
                if stack is layers:
                    per_step.append(runs["graphs"])
            assert torch.equal(xs[0].grad, xs[1].grad)
        assert_same_grads(grads_of(eager.parameters()), grads_of(layers.parameters()))
        assert per_step[-1] == per_step[1] > 0, str(per_step)
    finally:
        torch._dynamo.reset()


_NORM_CALLS: collections.Counter[int] = collections.Counter()  # outside: a replay changes it


class _CountedNorm(_Norm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _NORM_CALLS[id(self)] += 1
        return super().forward(x)


class _KeptMix(nn.Module):
    """A layer whose kept method runs an output discard (kept in the original pass; the
    replay takes the kept norm output, discards it and rebuilds it)."""

    def __init__(self, discard: bool) -> None:
        super().__init__()
        self.norm, self.proj, self.out = _CountedNorm(), nn.Linear(8, 8), nn.Linear(8, 8)
        self.discard = discard

    def mix(self, h: torch.Tensor) -> torch.Tensor:
        return project_norm(self.proj, self.norm, h, discard=self.discard)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(self.mix(h).relu())


def test_a_backward_retried_after_an_error_before_a_kept_discards_rebuild_gets_eagers_gradients(
) -> None:
    # backward(retain_graph=True) raised (a hook: a NaN check, a KeyboardInterrupt) after the
    # replay had discarded the kept norm output and before its rebuild; retried on the same
    # graph, the replay was handed the emptied record and torch raised "The tensor has a
    # non-zero number of elements, but its data is not allocated yet" (eager: the retry works).
    from pytree_ckpt import KeptCallables, RecomputeConfig, apply_recompute_config
    torch.manual_seed(0)
    eager = _KeptMix(discard=False)
    twin = copy.deepcopy(eager)
    twin.discard = True
    apply_recompute_config(nn.ModuleList([twin]), RecomputeConfig(1.0, save=["attn"]),
                           {"attn": KeptCallables("_KeptMix.mix")})
    results = []
    for model in (eager, twin):
        raised = []

        def once(module: nn.Module, grad_in: object, grad_out: object) -> None:
            if not raised:
                raised.append(True)
                raise RuntimeError("a NaN check in a hook")

        handle = model.out.register_full_backward_hook(once)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        loss = model(x).square().sum()
        with pytest.raises(RuntimeError, match="a NaN check in a hook"):
            loss.backward(retain_graph=True)
        for p in (x, *model.parameters()):
            p.grad = None
        handle.remove()
        loss.backward()
        results.append((grads_of([x, *model.parameters()]), _NORM_CALLS[id(model.norm)]))
    (expected, eager_calls), (got, twin_calls) = results
    assert_same_grads(expected, got)
    # Eager calls the norm once; the twin in its original pass, in each of its two replays
    # (the first handed the kept record, the retry computing it again: the record was
    # emptied) and in the rebuild of the retry's discarded output.
    assert (eager_calls, twin_calls) == (1, 4)


class _DiscardingLayer(nn.Module):
    """A pre-norm block whose norm output is discarded, as GlmDsaConfig(discard_norm_outputs=
    True) does; ``discard=False`` is its plain twin."""

    def __init__(self, discard: bool) -> None:
        super().__init__()
        self.discard = discard
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.discard:
            return x + self.proj(self.norm(x))
        ckpt = CheckpointWithoutOutput()
        normed = ckpt.checkpoint(self.norm, x)
        out = self.proj(normed)
        ckpt.discard_output_and_register_recompute(out)
        return x + out


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
@pytest.mark.parametrize("transform", ["grad", "vmap", "jvp", "dual_level"])
def test_output_discard_inside_a_checkpointed_layer_under_a_torch_func_transform_is_eager(
        transform: str) -> None:
    import torch.autograd.forward_ad as fwad

    import pytree_ckpt

    torch.manual_seed(0)
    plain = _DiscardingLayer(discard=False)
    twin = copy.deepcopy(plain)
    twin.discard = True
    pytree_ckpt.apply_activation_checkpointing(twin)
    x = torch.randn(3, 8)
    results = []
    for model in (plain, twin):
        if transform == "grad":
            params = {k: v.detach() for k, v in model.named_parameters()}
            results.append(torch.func.grad(
                lambda p: torch.func.functional_call(model, p, (x,)).square().sum())(params))
        elif transform == "vmap":
            results.append({"out": torch.func.vmap(model)(x)})
        elif transform == "dual_level":
            with fwad.dual_level():
                out = model(fwad.make_dual(x, torch.ones_like(x)))
                results.append({"tangent": fwad.unpack_dual(out).tangent.clone()})
        else:
            results.append(dict(zip(("out", "tangent"),
                                    torch.func.jvp(model, (x,), (torch.ones_like(x),)))))
    assert results[0].keys() == results[1].keys()
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated")
@pytest.mark.filterwarnings("ignore:`torch.jit.trace_method` is deprecated")
def test_a_block_with_output_discard_traces_with_jit_as_without_it() -> None:
    # Guards against (helper DW): the discard's Function was applied while torch.jit.trace
    # recorded (the boundary already made itself a plain call there): "Graphs differed across
    # invocations", and with check_trace=False a graph holding the Python Function.
    torch.manual_seed(0)
    block = _DiscardingLayer(discard=True)
    x = torch.randn(3, 8)
    traced = torch.jit.trace(block, (x,))
    assert "DiscardFunction" not in str(traced.graph)
    assert torch.equal(traced(x), block(x))


def test_a_compiled_body_with_output_discard_compiles_its_compute_between_the_discards(
        ) -> None:
    # NOTE [discard stays eager] (discard.py): with only the Function's call marked eager,
    # dynamo ran the whole body eagerly (the object was made in the traced frame, and it could
    # not carry it across the break): no graph held the body's linears, and it compiled
    # checkpoint()'s own frame once per layer and pass, past the recompile limit (helper HA,
    # the reference model with --compile --discard-norms). Now the body's compute is compiled
    # between the discard's calls, ten layers share the graphs (no recompile from the second
    # step on), the discard's methods get no compiled frame, and the numbers stay eager's.
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    compiled_ops: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        compiled_ops.extend(str(node.target) for node in gm.graph.nodes
                            if node.op in ("call_function", "call_method", "call_module"))
        return gm.forward

    torch.manual_seed(0)
    layers = nn.ModuleList(_PreNormLayer() for _ in range(10))
    eager = copy.deepcopy(layers)
    torch._dynamo.reset()
    try:
        for layer in layers:
            layer.forward = torch.compile(layer.forward, backend=backend)
        per_step = []
        for step in range(3):
            x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(step))
            xs = [x.clone().requires_grad_() for _ in range(2)]
            for stack, h in ((layers, xs[0]), (eager, xs[1])):
                for layer in stack:
                    h = layer(h)
                h.square().sum().backward()
            assert torch.equal(xs[0].grad, xs[1].grad)
            per_step.append(len(compiled_ops))
        assert_same_grads(grads_of(eager.parameters()), grads_of(layers.parameters()))
        assert sum("linear" in op for op in compiled_ops) == 2, compiled_ops
        assert any("gelu" in op for op in compiled_ops), compiled_ops
        assert per_step[0] == per_step[-1], per_step  # nothing compiled after the first step
        for method in (CheckpointWithoutOutput.__init__, CheckpointWithoutOutput.checkpoint,
                       CheckpointWithoutOutput.discard_output_and_register_recompute):
            assert _debug_get_cache_entry_list(method.__wrapped__.__code__) == []
    finally:
        torch._dynamo.reset()


_UNDER_TORCH_CHECKPOINT = """
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from pytree_ckpt import CheckpointWithoutOutput

torch.manual_seed(0)
gate, up, down = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
params = [*gate.parameters(), *up.parameters(), *down.parameters()]


def mlp(x, discard):
    g, u = gate(x), up(x)
    if not discard:
        return down(F.silu(g) * u)
    ckpt = CheckpointWithoutOutput()
    m = ckpt.checkpoint(F.silu, g) * u           # SwiGLU, the activation's output discarded
    ckpt.discard_output_and_register_recompute(m)
    return down(m)


x = torch.randn(4, 8, requires_grad=True)
mlp(x, False).square().sum().backward()
expected = [t.grad.clone() for t in (x, *params)]
for t in (x, *params):
    t.grad = None
# transformers' gradient_checkpointing (and torchtune, torchtitan) wrap layers so
torch_checkpoint(mlp, x, True, use_reentrant=False).square().sum().backward()
print(all(torch.equal(a, t.grad) for a, t in zip(expected, (x, *params))))
"""


# Guards against (helper HO), as it was found:
def test_a_discard_inside_torchs_non_reentrant_checkpoint_gives_eagers_gradients_without_crashing(
        ) -> None:
    # torch's non-reentrant checkpoint reruns the body in backward to get the saved tensors
    # back: the rerun's checkpoint() makes a new output, the consumer's recomputed saved
    # tensor is that output, and the rerun's discard frees it; its hook is on a recomputed
    # tensor no backward reaches, so the consumer's backward reads freed memory (a
    # segmentation fault on CPU; detect_discarded_reads() names aten.mul). Run in a child
    # process: the crash would take pytest down.
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = subprocess.run([sys.executable, "-c", _UNDER_TORCH_CHECKPOINT], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, f"exit status {out.returncode}: {out.stderr[-500:]}"
    assert out.stdout.strip() == "True"


def test_a_discard_inside_torchs_non_reentrant_checkpoint_frees_nothing_in_either_run(
        ) -> None:
    # NOTE [a discard inside torch's non-reentrant checkpoint]: a plain call there, in
    # torch's forward and in its recompute in backward (each run's output kept whole).
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    gate, up, down = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
    made: list[torch.Tensor] = []

    def mlp(x: torch.Tensor) -> torch.Tensor:
        ckpt = CheckpointWithoutOutput()
        a = ckpt.checkpoint(torch.nn.functional.silu, gate(x))
        made.append(a)
        m = a * up(x)
        ckpt.discard_output_and_register_recompute(m)
        return down(m)  # saves m: torch's recompute stops here, after the discard

    x = torch.randn(4, 8, requires_grad=True)
    out = torch_checkpoint(mlp, x, use_reentrant=False)
    # Sizes compared, not tensors: a freed one's repr would read freed memory.
    assert [a.untyped_storage().nbytes() for a in made] == [4 * 8 * 4]
    out.sum().backward()
    assert [a.untyped_storage().nbytes() for a in made] == [4 * 8 * 4] * 2


# Guards against (helper HO), as it was found:
def test_chained_discards_registered_on_one_tensor_in_reverse_order_give_eagers_gradients(
        ) -> None:
    # norm -> gelu -> proj, each op with its own CheckpointWithoutOutput (Megatron-style: one
    # per op), both registered on proj's output. Registered in forward order it works; in the
    # reverse order gelu's rebuild runs first and finds its input (the norm's output) still
    # freed, and is refused as "a discarded output that nothing can rebuild: ... it reached
    # this op only through .detach(), and the caller dropped it", with the tip "pass the output
    # itself (not .detach())": neither is what happened, and the norm's rebuild was one hook
    # away. Eager has no order here; docs/discard.md names none.
    torch.manual_seed(0)
    norm, proj = _Norm(), nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    params = [x, *norm.parameters(), *proj.parameters()]
    proj(torch.nn.functional.gelu(norm(x))).square().sum().backward()
    expected = grads_of(params)
    for t in params:
        t.grad = None
    first, second = CheckpointWithoutOutput(), CheckpointWithoutOutput()
    normed = first.checkpoint(norm, x)
    out = proj(second.checkpoint(torch.nn.functional.gelu, normed))
    second.discard_output_and_register_recompute(out)   # the later op's discard first
    first.discard_output_and_register_recompute(out)
    out.square().sum().backward()
    assert_same_grads(expected, grads_of(params))


# Guards against (helper HP), as it was found:
def test_a_discard_registered_before_the_manager_whose_output_it_reads_gives_eagers_gradients(
        ) -> None:
    # docs/discard.md: separate objects work "discarded and registered in any order: a rebuild
    # that finds its input still freed rebuilds the op that made it first". A manager's block
    # (norm -> gelu) feeding a separate object's op (a second norm), both registered on one
    # tensor, the separate one first: its rebuild rebuilds the manager's checkpoints early
    # (NOTE [chained discards in any order]), then the manager's own hook replays them again
    # and is refused as "already replayed", with a retain_graph tip (before dbc8e5a: refused
    # blaming a .detach()).
    from pytree_ckpt import CheckpointWithoutOutputManager

    torch.manual_seed(0)
    norm, norm2, proj = _Norm(), _Norm(), nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    params = [x, *norm.parameters(), *norm2.parameters(), *proj.parameters()]
    proj(norm2(torch.nn.functional.gelu(norm(x)))).square().sum().backward()
    expected = grads_of(params)
    for t in params:
        t.grad = None
    manager, last = CheckpointWithoutOutputManager(), CheckpointWithoutOutput()
    gelu = manager.checkpoint(torch.nn.functional.gelu, manager.checkpoint(norm, x))
    out = proj(last.checkpoint(norm2, gelu))
    last.discard_output_and_register_recompute(out)
    manager.discard_all_outputs_and_register_unified_recompute(out)
    out.square().sum().backward()
    assert_same_grads(expected, grads_of(params))


class _DiscardedLinear(nn.Module):
    """A linear whose output is discarded once its sine read it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        discard = CheckpointWithoutOutput()
        y = torch.sin(discard.checkpoint(self.lin, x))
        discard.discard_output_and_register_recompute(y)
        return y


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "in_a_checkpointed_layer"])
def test_a_discard_under_compiled_autograd_is_refused_naming_it_or_gives_eagers_gradients(
        checkpointed: bool) -> None:
    # Guards against (helper LI) a discard outside any checkpointed layer under compiled
    # autograd: its rebuild hook read the op's inputs from the op's node, whose saved tensors
    # compiled autograd had taken and freed: torch's "backward through the graph a second
    # time" with its retain_graph tip. Refused now, naming compiled autograd; inside a
    # checkpointed layer the rebuild runs in the boundary's eager replay: eager's gradients.
    from torch._dynamo import compiled_autograd

    enable = getattr(compiled_autograd, "enable", None) or compiled_autograd._enable
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        layer = _DiscardedLinear()
        twin = copy.deepcopy(layer)
        if checkpointed:
            pytree_ckpt.apply_activation_checkpointing(layer)
        x = torch.randn(4, 8)
        xe, xl = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.sin(twin.lin(xe)).sum().backward()
        y = layer(xl)
        with enable(torch.compile(backend="eager")):
            if not checkpointed:
                with pytest.raises(CheckpointError, match="under compiled autograd") as refused:
                    y.sum().backward()
                assert "inside a checkpointed layer" in str(refused.value)
                return
            y.sum().backward()
        assert torch.equal(xl.grad, xe.grad)
        assert_same_grads(grads_of(list(twin.parameters())), grads_of(list(layer.parameters())))
    finally:
        torch._dynamo.reset()
