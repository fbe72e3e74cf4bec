"""A save unit that keeps nothing at run time (NOTE [a unit that keeps nothing at run time] in
unit_use.py).

Helper CV: SDPA on CPU with dropout takes its math path, so a unit naming the fused kernels
kept nothing; the numbers stayed exact, the census showed no save-unit bytes, and nothing
said so.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

from pytree_ckpt import (ActivationCensus, KeptCallables, KeptOps, RecomputeConfig, SaveUnit,
                         apply_recompute_config, reuse_during_recompute)
from tests.conftest import assert_same_grads, grads_of

_FUSED = KeptOps("aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_efficient_attention",
                 "aten::_scaled_dot_product_flash_attention")


class _Attention(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(1, -1, 3, 2, 4).transpose(1, 3).unbind(2)
        out = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout)
        return out.transpose(1, 2).reshape(x.shape)

    def unused_score(self, x: torch.Tensor) -> torch.Tensor:
        return self.qkv(x)


class _Layer(nn.Module):
    def __init__(self, dropout: float, *, attends: bool = True) -> None:
        super().__init__()
        self.attn = _Attention(dropout)
        self.attends = attends
        self.mlp = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.attends:  # a layer without attention (a dense layer of a mixed model)
            x = x + self.attn(x)
        return x + torch.tanh(self.mlp(x))


def _steps(layers: nn.ModuleList, steps: int = 2
           ) -> tuple[list[torch.Tensor | None], list[str]]:
    """Steps over the layers (the same inputs and seeds for a twin): each step's grads, and
    the pytree_ckpt warnings given."""
    grads = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            torch.manual_seed(step)
            h = torch.randn(6, 8, requires_grad=True)
            for layer in layers:
                h = layer(h)
            h.square().sum().backward()
            grads += grads_of(layers.parameters())
            layers.zero_grad(set_to_none=True)
    return grads, [str(w.message) for w in caught if "pytree_ckpt" in str(w.message)]


def _pair(dropout: float, attends: tuple[bool, ...] = (True, True)
          ) -> tuple[nn.ModuleList, nn.ModuleList]:
    torch.manual_seed(0)
    eager = nn.ModuleList(_Layer(dropout, attends=a) for a in attends)
    return eager, copy.deepcopy(eager)


def test_fused_attention_kernels_sdpa_does_not_dispatch_are_warned_once_naming_the_unit(
        ) -> None:
    eager, layers = _pair(dropout=0.5)  # CPU with dropout: SDPA's math path
    apply_recompute_config(layers, RecomputeConfig(1.0, save=["attn"]), {SaveUnit.ATTN: _FUSED})
    expected, _ = _steps(eager)
    got, told = _steps(layers)
    assert_same_grads(expected, got)  # nothing kept: full recompute, exact
    assert len(told) == 1  # once, though every later forward keeps nothing too
    assert "save unit 'attn' kept nothing in the first forward" in told[0]
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in told[0]
    assert "KeptCallables('Attn.forward')" in told[0]  # the tip: keep the method instead


def _kept_bytes(layers: nn.ModuleList) -> int:
    """The bytes save units hold after one forward over the layers."""
    with ActivationCensus(layers) as census:
        h = torch.randn(6, 8, requires_grad=True)
        for layer in layers:
            h = layer(h)
        kept = census.bytes_by("mechanism").get("save unit", 0)
    h.sum().backward()
    return kept


@pytest.mark.parametrize("dropout, told", [(0.5, 1), (0.0, 0)])
def test_the_warning_is_given_exactly_when_the_unit_holds_no_bytes(dropout: float,
                                                                   told: int) -> None:
    _, layers = _pair(dropout=dropout)  # without dropout: the fused CPU kernel, kept
    apply_recompute_config(layers, RecomputeConfig(1.0, save=["attn"]), {SaveUnit.ATTN: _FUSED})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = _kept_bytes(layers)
    assert (kept == 0) == (told == 1)
    assert len([w for w in caught if "kept nothing" in str(w.message)]) == told


def test_the_warning_waits_until_every_checkpointed_layer_ran_once() -> None:
    _, layers = _pair(dropout=0.5)
    apply_recompute_config(layers, RecomputeConfig(1.0, save=["attn"]), {SaveUnit.ATTN: _FUSED})
    x = torch.randn(6, 8, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layers[0](x).sum().backward()
        layers[0](x).sum().backward()  # the same layer again: the other has not run
        before = len(caught)
        layers[1](x).sum().backward()
    assert before == 0 and len(caught) == 1


def test_a_unit_that_keeps_in_some_layers_only_is_not_warned() -> None:
    # The first layer is dense (no attention): the unit keeps in the second.
    eager, layers = _pair(dropout=0.0, attends=(False, True))
    apply_recompute_config(layers, RecomputeConfig(1.0, save=["attn"]), {SaveUnit.ATTN: _FUSED})
    expected, _ = _steps(eager)
    got, told = _steps(layers)
    assert told == []
    assert_same_grads(expected, got)


def test_a_kept_method_the_forward_never_calls_is_warned_naming_it() -> None:
    eager, layers = _pair(dropout=0.0)
    apply_recompute_config(layers, RecomputeConfig(1.0, save=["attn", "moe_gate"]),
                           {SaveUnit.ATTN: _FUSED,
                            SaveUnit.MOE_GATE: KeptCallables("_Attention.unused_score")})
    _, told = _steps(layers)
    assert len(told) == 1  # the attention unit kept: only the gate's is told
    assert "save unit 'moe_gate' kept nothing" in told[0]
    assert "['_Attention.unused_score'] kept nothing there" in told[0]


def test_a_copied_model_says_nothing_and_the_original_still_tells() -> None:
    # A deepcopy shares the installed options, policy and watch included (helper DD): the
    # watch waits for the original's layers, which the copy's are not.
    _, layers = _pair(dropout=0.5)
    apply_recompute_config(layers, RecomputeConfig(1.0, save=["attn"]), {SaveUnit.ATTN: _FUSED})
    copied = copy.deepcopy(layers)
    _, told = _steps(copied)
    assert told == []
    _, told = _steps(layers)  # the original still tells
    assert len(told) == 1


class _Routed(nn.Module):
    """Top-k ids from a reused call (as the DSA indexer's): replayed, never kept."""

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = reuse_during_recompute(_top2, self.score(x).detach())
        return x * self.score(x).gather(-1, ids).sum(-1, keepdim=True)


def _top2(scores: torch.Tensor) -> torch.Tensor:
    return scores.topk(2, dim=-1).indices


def test_a_unit_whose_ops_run_in_a_reused_call_is_not_warned() -> None:
    # The replay hands back the reused ids without running topk: what the unit asks for.
    torch.manual_seed(0)
    eager = nn.ModuleList([_Routed(), _Routed()])
    layers = copy.deepcopy(eager)
    apply_recompute_config(layers, RecomputeConfig(1.0, save=["dsa_indexer"]),
                           {SaveUnit.DSA_INDEXER: KeptOps("aten::topk")})
    expected, _ = _steps(eager)
    got, told = _steps(layers)
    assert told == []
    assert_same_grads(expected, got)


def test_a_kept_method_that_keeps_is_not_warned() -> None:
    # What a kept method dispatches is kept whatever kernel SDPA takes: the unit holds bytes.
    _, layers = _pair(dropout=0.5)
    apply_recompute_config(layers, RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptCallables("_Attention.forward")})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = _kept_bytes(layers)
    assert kept > 0
    assert [str(w.message) for w in caught if "kept nothing" in str(w.message)] == []


def test_a_forward_that_raised_is_not_a_first_pass() -> None:
    # Every layer's first call fails before its attention ran: nothing is known yet of what
    # the unit keeps, so nothing is told; the passes that follow keep, as in eager.
    eager, layers = _pair(dropout=0.0)  # the fused CPU kernel: kept
    apply_recompute_config(layers, RecomputeConfig(1.0, save=["attn"]), {SaveUnit.ATTN: _FUSED})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for layer in layers:
            with pytest.raises(RuntimeError):
                layer(torch.randn(6, 5, requires_grad=True))  # not the 8 features qkv takes
    expected, _ = _steps(eager)
    got, told = _steps(layers)
    assert [str(w.message) for w in caught if "pytree_ckpt" in str(w.message)] == []
    assert told == []
    assert_same_grads(expected, got)


def test_a_policy_loaded_from_a_pickle_does_not_know_its_layers_and_says_nothing() -> None:
    # torch.save / torch.load rebuild the policy from its pickle, without its layers: a
    # dense first layer ending its pass is no sign the unit keeps nothing.
    eager, layers = _pair(dropout=0.0, attends=(False, True))
    apply_recompute_config(layers, RecomputeConfig(1.0, save=["attn"]), {SaveUnit.ATTN: _FUSED})
    loaded = pickle.loads(pickle.dumps(layers))
    expected, _ = _steps(eager)
    got, told = _steps(loaded)
    assert told == []
    assert_same_grads(expected, got)


def test_only_the_checkpointed_layers_are_waited_for() -> None:
    # ratio 0.5: one of two layers is checkpointed; the other never runs a boundary's pass.
    _, layers = _pair(dropout=0.5)
    apply_recompute_config(layers, RecomputeConfig(0.5, save=["attn"]), {SaveUnit.ATTN: _FUSED})
    _, told = _steps(layers, steps=1)
    assert len(told) == 1 and "save unit 'attn' kept nothing" in told[0]


def test_the_warning_names_the_users_line() -> None:
    # The mode's exit runs inside an ExitStack (contextlib): the line named is the call here.
    _, layers = _pair(dropout=0.5)
    apply_recompute_config(layers, RecomputeConfig(1.0, save=["attn"]), {SaveUnit.ATTN: _FUSED})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _kept_bytes(layers)
    told = [w for w in caught if "kept nothing" in str(w.message)]
    assert len(told) == 1 and told[0].filename == __file__


@pytest.mark.parametrize("target", [KeptOps("x::y"), KeptCallables("_Attention.no_such")],
                         ids=["an op not in this build", "a method no layer has"])
def test_a_unit_warned_at_apply_as_keeping_nothing_is_not_told_again(target: object) -> None:
    eager, layers = _pair(dropout=0.5)
    with pytest.warns(UserWarning, match="'attn' keeps nothing"):
        apply_recompute_config(layers, RecomputeConfig(1.0, save=["attn"]),
                               {SaveUnit.ATTN: target})
    expected, _ = _steps(eager)
    got, told = _steps(layers)
    assert told == []
    assert_same_grads(expected, got)


class _MaskedTopk(nn.Module):
    """A DSA-style top-k: the kept op's ids are then changed in place (invalid slots set to
    -1), so rule 4 drops the record and the replay recomputes the top-k."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        with torch.no_grad():
            ids = h.topk(3, dim=-1).indices
            ids.masked_fill_(ids > 6, -1)        # in place on the kept output
        return x + h.gather(-1, ids.clamp(min=0)).sum(-1, keepdim=True)


def test_a_unit_whose_only_kept_output_is_changed_in_place_later_is_warned_as_keeping_nothing(
) -> None:
    torch.manual_seed(0)
    eager = nn.ModuleList(_MaskedTopk() for _ in range(2))
    layers = copy.deepcopy(eager)
    apply_recompute_config(layers, RecomputeConfig(1.0, save=["dsa_indexer"]),
                           {SaveUnit.DSA_INDEXER: KeptOps("aten::topk")})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = _kept_bytes(layers)
    layers.zero_grad(set_to_none=True)
    expected, _ = _steps(eager)
    got, _ = _steps(layers)
    assert_same_grads(expected, got)                   # exact: full recompute
    assert kept == 0                                   # the unit holds nothing ...
    assert any("'dsa_indexer' kept nothing" in str(w.message) for w in caught)  # ... say so


class _RoutedByMethod(nn.Module):
    """Top-k ids from a reused call made inside a method a unit keeps (KeptCallables)."""

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = self.indices(self.score(x).detach())
        return x * self.score(x).gather(-1, ids).sum(-1, keepdim=True)

    def indices(self, scores: torch.Tensor) -> torch.Tensor:
        return reuse_during_recompute(_top2, scores)


def test_a_kept_method_whose_ops_run_in_a_reused_call_is_not_warned() -> None:
    # The ops of a reused call count for the kept method running them, as they count for a
    # unit naming the ops: the replay hands back their results without running them.
    torch.manual_seed(0)
    eager = nn.ModuleList([_RoutedByMethod(), _RoutedByMethod()])
    layers = copy.deepcopy(eager)
    apply_recompute_config(layers, RecomputeConfig(1.0, save=["dsa_indexer"]),
                           {SaveUnit.DSA_INDEXER: KeptCallables("_RoutedByMethod.indices")})
    expected, _ = _steps(eager)
    got, told = _steps(layers)
    assert told == []
    assert_same_grads(expected, got)


# Guards against (helper HU), as it was found:
def test_a_unit_keeping_casts_under_the_callers_autocast_is_told_that_such_casts_are_never_kept() -> None:
    import warnings

    from torch import nn

    from pytree_ckpt import KeptOps, RecomputeConfig, SaveUnit, apply_recompute_config

    class Cast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.lin(h).float()

    layer = Cast()
    apply_recompute_config([layer], RecomputeConfig(1.0, save=["attn"]),
                           {SaveUnit.ATTN: KeptOps("aten::_to_copy")})
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(torch.randn(2, 8, requires_grad=True))
        out.sum().backward()
    said = [str(w.message) for w in told if "kept nothing" in str(w.message)]
    assert said and "autocast" in said[0]
