"""Helper NX's mutation round over today's code (state_changes.small_unsaved, stored_state's
late-first-change warning, kept_callables.unmatched, tree._PROXIES, discard's sparse-layout
branch): each test kills a hand-made mutant the suite let live (named in its comment)."""
from __future__ import annotations

import copy
import warnings
import weakref
from collections.abc import Callable

import pytest
import torch
from torch import nn

import pytree_ckpt
from pytree_ckpt import CheckpointWithoutOutput, KeptCallables, RecomputeConfig, SaveUnit
from tests.pytree_ckpt.twins import late_change_steps

_N = 4
_LATE = "for the first time after the layer's first replay"


def _late_steps() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, _N, generator=g) * s for s in (0.1, 0.1, 50.0, 50.0)]


def _eager_and_ours(make: Callable[[], nn.Module]) -> tuple[bool, list[str]]:
    """Gradients and state alike over steps whose first two skip the state change, and the
    late-first-change warnings given."""
    return late_change_steps(make, _late_steps())


class _LateFrozenParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(_N, _N)
        self.scale = nn.Parameter(torch.ones(_N), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if x.abs().mean().item() > 1.0:
            with torch.no_grad():
                self.scale.mul_(0.5)
        return h * self.scale


def test_a_small_frozen_parameter_first_changed_late_is_warned_of_by_name() -> None:
    # Kills small_unsaved() reading buffers only (`for d, moved in self.buffers`): docs/limits.md
    # says "a buffer (or frozen parameter)" of at most 64 KiB first changed late is warned of.
    alike, told = _eager_and_ours(_LateFrozenParameter)
    assert not alike  # the documented limit: the replay reads it one update ahead
    assert len(told) == 1 and "changed scale in place" in told[0], told


class _LateLargeBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(_N, _N)
        self.register_buffer("big", torch.ones(20000, _N))  # 320 KB: never copied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if x.abs().mean().item() > 1.0:
            self.big.mul_(0.5)
        return h * self.big[0]


def test_a_buffer_over_64_kib_first_changed_late_is_not_named_in_the_small_buffer_warning(
        ) -> None:
    # Kills small_unsaved() without its size check: a buffer over 64 KiB is never copied, at
    # any call (limits.md: "silent for one over 64 KiB"), so the warning about small buffers
    # no longer copied would be wrong about it.
    alike, told = _eager_and_ours(_LateLargeBuffer)
    assert not alike and told == []


class _LateNormReadByAHook(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = nn.Linear(_N, _N), nn.BatchNorm1d(_N)
        # the hook's output reads the running mean: the layer's output does too
        self.bn.register_forward_pre_hook(lambda m, args: (args[0] - m.running_mean,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return self.bn(h) if x.abs().mean().item() > 1.0 else h


def test_a_batch_norm_whose_forward_pre_hook_reads_its_running_stats_first_run_late_is_warned_of(
        ) -> None:
    # Kills _a_norm_read_by_nothing without `module._forward_pre_hooks` (the forward hook case
    # was tested, the pre-hook one not): gradients differ from eager's, and that is told.
    alike, told = _eager_and_ours(_LateNormReadByAHook)
    assert not alike
    assert len(told) == 1 and "bn.running_mean" in told[0], told


class _LateBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = nn.Linear(_N, _N), nn.BatchNorm1d(_N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return self.bn(h) if x.abs().mean().item() > 1.0 else h


class _LateSparseBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(_N, _N)
        self.register_buffer("adj", torch.eye(_N).to_sparse())  # a small sparse COO buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if x.abs().mean().item() > 1.0:
            self.adj.mul_(0.5)  # moves its version, as a dense one's
        return torch.sparse.mm(self.adj, h.t()).t()


def test_a_small_sparse_buffer_first_changed_late_gives_eager_gradients_or_is_warned_of(
        ) -> None:
    # Guards against (helper NX) small_unsaved counting strided tensors only: a small sparse
    # buffer first changed late was read one update ahead (lin's gradient 2253.3 against
    # eager's 4506.6), silently.
    alike, told = _eager_and_ours(_LateSparseBuffer)
    assert alike or any("adj" in m for m in told), told
    assert any("adj" in m for m in told), told


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(_N, _N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.q(x) @ x.transpose(-1, -2), -1) @ x


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(_N, _N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).relu()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.mlp = Attn(), Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x + self.attn(x))


def test_a_mistyped_kept_callable_named_before_a_matching_one_is_told_with_its_near_miss(
        ) -> None:
    # Kills unmatched() skipping the first target (`target.targets[1:]`): the suite named the
    # mistyped method second only.
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        pytree_ckpt.apply_recompute_config(
            [_Block()], RecomputeConfig(1.0, save=["attn"]),
            {SaveUnit.ATTN: KeptCallables("Mlp.foward", "Attn.forward")})
    assert any("Mlp.foward" in str(w.message) and "did you mean 'Mlp.forward'" in str(w.message)
               for w in told), [str(w.message) for w in told]


def test_a_weakref_proxy_to_a_callable_config_among_the_inputs_is_refused_as_any_proxy(
        ) -> None:
    # Kills tree._PROXIES without weakref.CallableProxyType: a proxy to an object with
    # __call__ has that type (NOTE [a weakref.proxy leaf]).
    class Scale:
        factor = 0.5

        def __call__(self, t: torch.Tensor) -> torch.Tensor:
            return t * self.factor

    def scaled(x: torch.Tensor, scale: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return scale(torch.tanh(x))

    scale = Scale()
    assert type(weakref.proxy(scale)) is weakref.CallableProxyType
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(pytree_ckpt.CheckpointError, match=r"a weakref.proxy to a Scale at "
                       r"args\[1\]"):
        pytree_ckpt.checkpoint(scaled, x, weakref.proxy(scale))


@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")  # torch's
def test_a_discarded_sparse_output_is_said_to_be_kept_once_per_layout(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # Kills discard.py's sparse branch without `_WARNED_LAYOUTS.add`: the warning is once per
    # layout, not once per call; the gradients stay eager's at each call.
    from pytree_ckpt import discard
    monkeypatch.setattr(discard, "_WARNED_LAYOUTS", set())
    n = 6
    edge_index = torch.tensor([[0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 0]])

    def adjacency(logits: torch.Tensor) -> torch.Tensor:
        return torch.sparse_coo_tensor(edge_index, torch.sigmoid(logits), (n, n)).coalesce()

    lin = nn.Linear(3, 3)
    x = torch.randn(n, 3)
    with caplog.at_level("WARNING", logger="pytree_ckpt.discard"):
        for _ in range(2):
            logits = torch.randn(6, requires_grad=True)
            eager = torch.autograd.grad(torch.sparse.mm(adjacency(logits), lin(x)).tanh().sum(),
                                        [logits, *lin.parameters()])
            ckpt = CheckpointWithoutOutput()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                adj = ckpt.checkpoint(adjacency, logits)
                out = torch.sparse.mm(adj, lin(x)).tanh()
                ckpt.discard_output_and_register_recompute(out)
            got = torch.autograd.grad(out.sum(), [logits, *lin.parameters()])
            assert all(torch.equal(a, b) for a, b in zip(eager, got))
    said = [r for r in caplog.records if "no storage of its own" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]


def test_a_tuple_state_reset_to_a_namedtuple_holding_a_graph_before_backward_is_refused(
        ) -> None:
    # Kills plain_values._tensors_of reading plain tuples only (`type(value) is tuple`): the
    # caller's reset to a namedtuple (h0 * 1, zeros) would have been replayed into h0's graph,
    # giving h0 a gradient eager does not; refused as the plain-tuple reset is.
    import collections

    from pytree_ckpt import CheckpointError
    from tests.pytree_ckpt.test_recurrent_state import D, _KeptState
    pair = collections.namedtuple("pair", "ssm conv")
    torch.manual_seed(0)
    eager = _KeptState("tuple, in place", 2)
    eager.h0 = nn.Parameter(torch.randn(2, D))
    wrapped = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager))
    x = torch.randn(2, 3, D)
    loss = eager(x).square().sum()
    eager.state = pair(eager.h0 * 1, torch.zeros(2, D))
    loss.backward()
    assert eager.h0.grad is None  # eager: the reset is read by no call of this step
    loss = wrapped(x).square().sum()
    wrapped.state = pair(wrapped.h0 * 1, torch.zeros(2, D))
    with pytest.raises(CheckpointError, match="reads the module attribute 'state'"):
        loss.backward()


def test_a_unit_whose_kept_op_result_is_changed_in_place_later_names_that_cause() -> None:
    # Kills unit_use.py's ops-branch wording without "results changed in place later in the
    # forward" (helper NQ's cause): the suite checked only that the unit was said to keep
    # nothing. Exact gradients either way (full recompute).
    from pytree_ckpt import KeptOps
    from tests.conftest import assert_same_grads
    from tests.pytree_ckpt.test_unit_use import _kept_bytes, _MaskedTopk, _steps
    torch.manual_seed(0)
    eager = nn.ModuleList(_MaskedTopk() for _ in range(2))
    layers = copy.deepcopy(eager)
    pytree_ckpt.apply_recompute_config(layers, RecomputeConfig(1.0, save=["dsa_indexer"]),
                                       {SaveUnit.DSA_INDEXER: KeptOps("aten::topk")})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _kept_bytes(layers) == 0
    layers.zero_grad(set_to_none=True)
    assert_same_grads(_steps(eager)[0], _steps(layers)[0])
    told = [str(w.message) for w in caught if "'dsa_indexer' kept nothing" in str(w.message)]
    assert len(told) == 1 and "changed in place later in the forward" in told[0], told


def test_a_graph_set_since_on_a_submodule_under_an_output_discard_is_refused_naming_its_path(
        ) -> None:
    # The boundary's refusal names 'cell.state' (test_recurrent_state's
    # test_a_graph_set_since_on_a_submodule_is_refused_naming_its_path); an output discard's
    # names 'state', an attribute the checkpointed module does not have.
    from pytree_ckpt import CheckpointError
    from tests.pytree_ckpt.test_recurrent_state import D, _HoldsACell
    torch.manual_seed(0)
    model = _HoldsACell()
    model.cell.h0 = nn.Parameter(torch.randn(3000, D))
    ckpt = CheckpointWithoutOutput()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = ckpt.checkpoint(model, torch.randn(3000, 3, D)).tanh()
        ckpt.discard_output_and_register_recompute(y)
    model.cell.state = model.cell.h0 * 1
    with pytest.raises(CheckpointError) as refused:
        y.sum().backward()
    assert "'cell.state'" in str(refused.value)


class _LateTracker(nn.Module):
    """A small EMA first updated at a step the first calls skip, passed into the layer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(_N))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.abs().mean().item() > 1.0:
            with torch.no_grad():
                self.ema.mul_(0.5).add_(h.mean(0))
        return h * self.ema.exp()


class _UsesAPassedTracker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(_N, _N)

    def forward(self, x: torch.Tensor, tracker: nn.Module) -> torch.Tensor:
        return tracker(self.lin(x))


def test_a_late_buffer_of_a_module_passed_in_is_named_with_that_modules_type() -> None:
    # Kills stored_state.warn_first_change_unsaved naming every root's buffers without the
    # "(Type)" prefix of a root other than the owner (helper NX's W5): "ema" alone would say
    # the layer's own attribute, which it has not.
    layer, tracker = _UsesAPassedTracker(), _LateTracker()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in _late_steps():
            pytree_ckpt.checkpoint(layer, x, tracker).sum().backward()
    told = [str(w.message) for w in caught if _LATE in str(w.message)]
    assert len(told) == 1 and "changed (_LateTracker).ema in place" in told[0], told


class _NestedState(nn.Module):
    """A state held as a tuple inside a tuple, its innermost first tensor written in place."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(_N, _N)
        self.h0 = nn.Parameter(torch.randn(2, _N))
        self.state = ((torch.zeros(2, _N), torch.zeros(2, _N)),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.tanh(0.5 * self.state[0][0] + self.lin(x))
        self.state[0][0].copy_(s.detach())
        return s


def test_a_nested_tuple_state_reset_to_a_graph_before_backward_is_refused() -> None:
    # Kills plain_values._tensors_of looking one tuple deep only (helper NX's P7): the reset
    # `((h0 * 1, z),)` would be replayed into h0's graph, a gradient eager does not give.
    from pytree_ckpt import CheckpointError
    torch.manual_seed(0)
    eager = _NestedState()
    wrapped = pytree_ckpt.apply_activation_checkpointing(copy.deepcopy(eager))
    x = torch.randn(2, _N)
    loss = eager(x).square().sum()
    eager.state = ((eager.h0 * 1, torch.zeros(2, _N)),)
    loss.backward()
    assert eager.h0.grad is None  # eager: the reset is read by no call of this step
    loss = wrapped(x).square().sum()
    wrapped.state = ((wrapped.h0 * 1, torch.zeros(2, _N)),)
    with pytest.raises(CheckpointError, match="reads the module attribute 'state'"):
        loss.backward()
