"""Recommendation models in checkpointed layers (helper NV): DLRM (hashed int64 ids, sparse
tables, a dot interaction through bmm and a triu_indices buffer, a DCN-v2 cross), EmbeddingBag
modes with offsets, per-sample weights and padding, a two-tower model with a logQ frequency-count
buffer updated in the forward and negatives drawn inside and outside the layer, a SASRec-style
causal encoder with padding masks, KeyedJaggedTensor-like views of one int64 values tensor,
multi-hot COO and CSR inputs, jagged nested sequences, a table shared by two towers, and save
units. Each is stepped against its unwrapped eager twin (two steps of two micro-batches), losses,
every gradient (sparse ones as dense and by layout), buffers and optimizer state compared bit
for bit in fp32."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload
import pytree_ckpt
from pytree_ckpt import KeptCallables, KeptOps, RecomputeConfig, SaveUnit

_D = 8
_V = 64


def _dense(t: torch.Tensor | None) -> Any:
    if t is None or t.layout == torch.strided:
        return t
    return (t.layout, t.to_dense() if t.layout != torch.sparse_coo else t.coalesce().to_dense())


def _equal(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, tuple) or isinstance(b, tuple):
        return (isinstance(a, tuple) and isinstance(b, tuple) and a[0] == b[0]
                and torch.equal(a[1], b[1]))
    return bool(torch.equal(a, b))


def _steps(model: nn.Module, batch: Callable[[int, int], tuple[Any, ...]],
           loss_fn: Callable[..., torch.Tensor],
           optimizers: Callable[[nn.Module], list[torch.optim.Optimizer]]) -> list[Any]:
    """Two steps of two micro-batches: every loss, gradient, the state and optimizer state."""
    opts = optimizers(model)
    got: list[Any] = []
    for step in range(2):
        for o in opts:
            o.zero_grad(set_to_none=True)
        for micro in range(2):
            torch.manual_seed(10 * step + micro)  # the same draws in both twins
            loss = loss_fn(model, *batch(step, micro))
            loss.backward()
            got.append(loss.detach())
        got.extend(_dense(p.grad) for p in model.parameters())
        for o in opts:
            o.step()
    got.extend(t.detach().clone() for t in model.state_dict().values())
    for o in opts:
        got.extend(t.to_dense() if t.layout != torch.strided else t.clone()
                   for t in optree.tree_leaves(o.state_dict()["state"], namespace="torch")
                   if isinstance(t, torch.Tensor))
    return got


def _assert_twins(build: Callable[[], nn.Module], wrap: Callable[[nn.Module], Any],
                  batch: Callable[[int, int], tuple[Any, ...]],
                  loss_fn: Callable[..., torch.Tensor],
                  optimizers: Callable[[nn.Module], list[torch.optim.Optimizer]]) -> None:
    torch.manual_seed(0)
    eager = build()
    ours = copy.deepcopy(eager)
    wrap(ours)
    expected = _steps(eager, batch, loss_fn, optimizers)
    got = _steps(ours, batch, loss_fn, optimizers)
    assert len(expected) == len(got)
    assert all(_equal(e, g) for e, g in zip(expected, got))


def _layers(**options: Any) -> Callable[[nn.Module], None]:
    def wrap(model: Any) -> None:
        for layer in model.layers:
            pytree_ckpt.apply_activation_checkpointing(layer, **options)
    return wrap


def _offload() -> offload.OffloadManager:
    return offload.OffloadManager(offload.OffloadConfig(min_bytes=0), device="cpu")


_WRAPS: dict[str, Callable[[], Callable[[nn.Module], None]]] = {
    "plain": lambda: _layers(offload=False),
    "verify_replay": lambda: _layers(offload=False, verify_replay=True),
    "offload": lambda: _layers(offload=_offload()),
}


def _sgd(model: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.SGD(model.parameters(), lr=0.1)]


# DLRM: hashed ids, sparse tables (SparseAdam), dot interaction, DCN-v2 cross


class _Dlrm(nn.Module):
    tri: torch.Tensor

    def __init__(self, bag: bool = False) -> None:
        super().__init__()
        self.bag = bag
        self.bottom = nn.Linear(4, _D)
        self.tables = nn.ModuleList(
            nn.EmbeddingBag(_V, _D, mode="sum", sparse=True) if bag
            else nn.Embedding(_V, _D, sparse=True) for _ in range(3))
        self.register_buffer("tri", torch.triu_indices(4, 4, offset=1))
        self.cross = nn.Linear(4 * _D, 4 * _D)
        self.top = nn.Linear(4 * _D + 6, _D)

    def interact(self, stacked: torch.Tensor) -> torch.Tensor:
        z = torch.bmm(stacked, stacked.transpose(1, 2))
        return z[:, self.tri[0], self.tri[1]]

    def forward(self, dense: torch.Tensor, raw_ids: torch.Tensor,
                weights: torch.Tensor | None = None) -> torch.Tensor:
        hashed = torch.remainder(raw_ids, _V)  # the hashing trick, on int64 ids
        if self.bag:
            offsets = torch.arange(0, 2 * dense.shape[0], 2)
            looked = [t(hashed[:, i].repeat_interleave(2), offsets, per_sample_weights=weights)
                      for i, t in enumerate(self.tables)]
        else:
            looked = [t(hashed[:, i]) for i, t in enumerate(self.tables)]
        feats = [torch.relu(self.bottom(dense)), *looked]
        x0 = torch.cat(feats, 1)
        crossed = x0 * self.cross(x0) + x0  # DCN-v2
        return self.top(torch.cat([crossed, self.interact(torch.stack(feats, 1))], 1))


class _DlrmModel(nn.Module):
    def __init__(self, bag: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Dlrm(bag)])
        self.head = nn.Linear(_D, 1)
        self.weights = nn.Parameter(torch.rand(12))


def _dlrm_batch(step: int, micro: int) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(7 * step + micro)
    return torch.randn(6, 4, generator=g), torch.randint(-10**12, 10**12, (6, 3), generator=g)


def _dlrm_loss(model: Any, dense: torch.Tensor, raw_ids: torch.Tensor) -> torch.Tensor:
    layer: Any = model.layers[0]
    out = layer(dense, raw_ids, model.weights if layer.bag else None)
    return F.binary_cross_entropy_with_logits(model.head(out).squeeze(-1), torch.ones(6))


def _sparse_adam(model: nn.Module) -> list[torch.optim.Optimizer]:
    named = list(model.named_parameters())
    return [torch.optim.SparseAdam([p for n, p in named if "tables" in n], lr=0.01),
            torch.optim.Adagrad([p for n, p in named if "tables" not in n], lr=0.01)]


@pytest.mark.parametrize("wrap", list(_WRAPS))
@pytest.mark.parametrize("bag", [False, True], ids=["Embedding", "EmbeddingBag"])
def test_a_dlrm_with_hashed_ids_sparse_tables_and_sparse_adam_gives_eager_numbers(
        wrap: str, bag: bool) -> None:
    _assert_twins(lambda: _DlrmModel(bag), _WRAPS[wrap](), _dlrm_batch, _dlrm_loss,
                  _sparse_adam)


@pytest.mark.parametrize("targets", [
    {SaveUnit.ATTN: KeptOps("aten::bmm")},
    {SaveUnit.ATTN: KeptCallables("_Dlrm.interact")},
    {SaveUnit.ATTN: KeptOps("aten::_embedding_bag")},
], ids=["bmm", "interact", "_embedding_bag"])
def test_a_dlrm_keeping_its_interaction_or_bag_lookups_with_offload_gives_eager_numbers(
        targets: Any) -> None:
    def wrap(model: Any) -> None:
        pytree_ckpt.apply_recompute_config(model.layers, RecomputeConfig(1.0, save=["attn"]),
                                           targets, offload=_offload(), verify_replay=True)
    _assert_twins(lambda: _DlrmModel(bag=True), wrap, _dlrm_batch, _dlrm_loss, _sparse_adam)


# EmbeddingBag: modes, offsets (an empty bag), per-sample weights, padding_idx


class _Bag(nn.Module):
    def __init__(self, mode: str, sparse: bool, padding_idx: int | None) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(_V, _D, mode=mode, sparse=sparse, padding_idx=padding_idx)
        self.lin = nn.Linear(_D, _D)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor,
                weights: torch.Tensor | None) -> torch.Tensor:
        return torch.tanh(self.lin(self.bag(ids, offsets, per_sample_weights=weights)))


class _BagModel(nn.Module):
    def __init__(self, mode: str, sparse: bool, padding_idx: int | None) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Bag(mode, sparse, padding_idx)])
        self.weights = nn.Parameter(torch.rand(20))


def _bag_batch(step: int, micro: int) -> tuple[Any, ...]:
    ids = torch.randint(0, _V, (20,), generator=torch.Generator().manual_seed(7 * step + micro))
    ids[3:5] = 0  # padding
    return ids, torch.tensor([0, 3, 3, 9, 15])


@pytest.mark.parametrize("padding_idx", [None, 0])
@pytest.mark.parametrize("mode,sparse", [("sum", True), ("sum", False), ("mean", True),
                                         ("max", False)])
def test_embedding_bag_modes_with_offsets_weights_and_padding_give_eager_numbers(
        mode: str, sparse: bool, padding_idx: int | None) -> None:
    def loss(model: Any, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        weights = model.weights if mode == "sum" else None
        return model.layers[0](ids, offsets, weights).square().sum()
    _assert_twins(lambda: _BagModel(mode, sparse, padding_idx), _layers(offload=False),
                  _bag_batch, loss, _sgd)


# two towers: a logQ frequency-count buffer updated in the forward, negatives sampled


class _Tower(nn.Module):
    counts: torch.Tensor

    def __init__(self, sample_inside: bool) -> None:
        super().__init__()
        self.item = nn.Embedding(_V, _D, sparse=True)
        self.query = nn.Linear(_D, _D)
        self.register_buffer("counts", torch.ones(_V))
        self.sample_inside = sample_inside

    def forward(self, user: torch.Tensor, pos: torch.Tensor,
                neg: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self.counts.index_add_(0, pos, torch.ones(pos.shape[0]))
        if self.sample_inside:
            neg = torch.multinomial(self.counts.pow(0.75), 4, replacement=True).expand(5, 4)
        assert neg is not None
        u = self.query(user)
        cand = torch.cat([pos[:, None], neg], 1)
        scale = torch.rsqrt(self.counts[cand])  # reads the counts: the gradients depend on them
        sampled = (u[:, None, :] * self.item(cand)).sum(-1) * scale
        in_batch = u @ self.item(pos).T - torch.log(self.counts[pos] / self.counts.sum())
        return sampled, in_batch


class _Towers(nn.Module):
    def __init__(self, sample_inside: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Tower(sample_inside)])


def _tower_batch(step: int, micro: int) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(7 * step + micro)
    return torch.randn(5, _D, generator=g), torch.randint(0, _V, (5,), generator=g)


def _tower_loss(model: Any, user: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    neg = torch.randint(0, _V, (5, 4))  # drawn outside the layer
    sampled, in_batch = model.layers[0](user, pos, neg)
    return (F.cross_entropy(sampled, torch.zeros(5, dtype=torch.long))
            + F.cross_entropy(in_batch, torch.arange(5)))


@pytest.mark.parametrize("wrap", ["plain", "verify_replay"])
@pytest.mark.parametrize("sample_inside", [False, True], ids=["outside", "inside"])
def test_two_towers_with_a_logq_counts_buffer_and_sampled_negatives_give_eager_numbers(
        wrap: str, sample_inside: bool) -> None:
    def optimizers(model: Any) -> list[torch.optim.Optimizer]:
        tower = model.layers[0]
        return [torch.optim.SparseAdam([tower.item.weight], lr=0.01),
                torch.optim.SGD(tower.query.parameters(), lr=0.1)]
    _assert_twins(lambda: _Towers(sample_inside), _WRAPS[wrap](), _tower_batch, _tower_loss,
                  optimizers)


def test_a_sparse_table_shared_by_two_checkpointed_towers_gets_eagers_raw_sparse_gradient(
        ) -> None:
    # the uncoalesced gradient's indices and values in eager's order, not only its sum
    class Tower(nn.Module):
        def __init__(self, table: nn.Embedding) -> None:
            super().__init__()
            self.table, self.lin = table, nn.Linear(_D, _D)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.lin(self.table(ids).mean(1)).tanh()

    grads = []
    for wrap in (False, True):
        torch.manual_seed(0)
        table = nn.Embedding(12, _D, sparse=True)
        users, items = Tower(table), Tower(table)
        if wrap:
            for tower in (users, items):
                pytree_ckpt.apply_activation_checkpointing(tower, offload=False)
        for micro in range(2):
            g = torch.Generator().manual_seed(micro)
            u = users(torch.randint(0, 12, (6, 5), generator=g))
            v = items(torch.randint(0, 12, (6, 1), generator=g))
            F.cross_entropy(u @ v.T * 5, torch.arange(6)).backward()
        assert table.weight.grad is not None
        grads.append(table.weight.grad)
    assert not grads[0].is_coalesced() and not grads[1].is_coalesced()
    assert torch.equal(grads[0]._indices(), grads[1]._indices())
    assert torch.equal(grads[0]._values(), grads[1]._values())


# SASRec: causal blocks over item sequences with left padding


class _SasBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(_D, 2, 16, dropout=0.1, batch_first=True,
                                              norm_first=True)

    def forward(self, h: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        causal = torch.ones(h.shape[1], h.shape[1], dtype=torch.bool).triu(1)
        return self.enc(h, src_mask=causal, src_key_padding_mask=pad) * (~pad)[..., None]


class _SasRec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.item = nn.Embedding(40, _D, padding_idx=0)
        self.pos = nn.Embedding(6, _D)
        self.layers = nn.ModuleList([_SasBlock(), _SasBlock()])


def _sas_batch(step: int, micro: int) -> tuple[Any, ...]:
    seq = torch.randint(1, 40, (3, 6), generator=torch.Generator().manual_seed(7 * step + micro))
    seq[0, :2] = 0
    seq[1, :4] = 0
    return (seq,)


def _sas_loss(model: Any, seq: torch.Tensor) -> torch.Tensor:
    pad = seq == 0
    h = model.item(seq) + model.pos(torch.arange(6))[None]
    for layer in model.layers:
        h = layer(h, pad)
    target = torch.roll(seq, -1, 1)
    target[:, -1] = 0
    return F.cross_entropy((h @ model.item.weight.T).reshape(-1, 40), target.reshape(-1),
                           ignore_index=0)


@pytest.mark.parametrize("wrap", list(_WRAPS))
def test_a_sasrec_with_causal_and_padding_masks_and_dropout_gives_eager_numbers(
        wrap: str) -> None:
    _assert_twins(_SasRec, _WRAPS[wrap](), _sas_batch, _sas_loss,
                  lambda m: [torch.optim.Adam(m.parameters(), lr=0.01)])


# jagged features: views of one int64 values tensor, multi-hot COO/CSR, nested sequences


class _Feature(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(_V, _D, mode="sum", sparse=True)
        self.lin = nn.Linear(_D, _D)

    def forward(self, h: torch.Tensor, kjt: dict[str, Any], key: str) -> torch.Tensor:
        values, offsets = kjt[key]
        pooled = self.bag(torch.remainder(values, _V), offsets - offsets[0],
                          per_sample_weights=kjt["weights"][key])
        return h + self.lin(pooled).tanh()


class _Features(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Feature() for _ in range(3)])


def _kjt_batch(step: int, micro: int) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(7 * step + micro)
    values = torch.randint(0, 10**15, (30,), generator=g)
    weights = torch.rand(30, generator=g)
    starts = [0, 8, 20, 30]
    kjt: dict[str, Any] = {"weights": {}}
    for i in range(3):  # views of one values tensor and one weights tensor, as a KJT holds
        kjt[f"f{i}"] = (values[starts[i]:starts[i + 1]],
                        torch.tensor([0, 2, 2, starts[i + 1] - starts[i] - 3]) + starts[i])
        kjt["weights"][f"f{i}"] = weights[starts[i]:starts[i + 1]]
    return torch.randn(4, _D, generator=g), kjt


def _kjt_loss(model: Any, h: torch.Tensor, kjt: dict[str, Any]) -> torch.Tensor:
    for i, layer in enumerate(model.layers):
        h = layer(h, kjt, f"f{i}")
    return h.square().sum()


@pytest.mark.parametrize("wrap", ["offload", "verify_replay"])
def test_keyed_jagged_features_as_views_of_one_int64_values_tensor_give_eager_numbers(
        wrap: str) -> None:
    _assert_twins(_Features, _WRAPS[wrap](), _kjt_batch, _kjt_loss, _sgd)


class _MultiHot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(_V, _D))
        self.lin = nn.Linear(_D, _D)

    def forward(self, multi_hot: torch.Tensor, ids: torch.Tensor, h: torch.Tensor
                ) -> torch.Tensor:
        pooled = torch.sparse.mm(multi_hot, self.table)
        looked = F.embedding(torch.remainder(ids, _V), self.table, sparse=True).sum(1)
        return torch.tanh(self.lin(pooled + looked)) + h


class _MultiHots(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_MultiHot(), _MultiHot()])


@pytest.mark.parametrize("wrap", ["offload", "verify_replay"])
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")  # torch's, once
@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")  # torch's
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_multi_hot_sparse_inputs_and_int64_ids_give_eager_numbers(wrap: str, layout: str
                                                                  ) -> None:
    def batch(step: int, micro: int) -> tuple[Any, ...]:
        g = torch.Generator().manual_seed(7 * step + micro)
        index = torch.stack([torch.randint(0, 6, (15,), generator=g),
                             torch.randint(0, _V, (15,), generator=g)])
        multi_hot = torch.sparse_coo_tensor(index, torch.rand(15, generator=g), (6, _V))
        multi_hot = multi_hot.coalesce()
        if layout == "csr":
            multi_hot = multi_hot.to_sparse_csr()
        return (multi_hot, torch.randint(0, 10**9, (6, 3), generator=g),
                torch.randn(6, _D, generator=g))

    def loss(model: Any, multi_hot: torch.Tensor, ids: torch.Tensor, h: torch.Tensor
             ) -> torch.Tensor:
        for layer in model.layers:
            h = layer(multi_hot, ids, h)
        return h.square().sum()
    _assert_twins(_MultiHots, _WRAPS[wrap](), batch, loss, _sgd)


class _JaggedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(_D, _D)
        self.norm = nn.LayerNorm(_D)

    def forward(self, nt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.norm(self.lin(nt).relu()) + nt  # shares the input's offsets: allowed
        return out, out.to_padded_tensor(0.0).sum(1)


class _JaggedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(_V, _D)
        self.layers = nn.ModuleList([_JaggedBlock(), _JaggedBlock()])


@pytest.mark.parametrize("wrap", ["plain", "offload"])
def test_jagged_nested_item_sequences_in_and_out_give_eager_numbers(wrap: str) -> None:
    def batch(step: int, micro: int) -> tuple[Any, ...]:
        g = torch.Generator().manual_seed(7 * step + micro)
        return torch.randint(0, _V, (11,), generator=g), torch.tensor([0, 2, 4, 7, 11])

    def loss(model: Any, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        nt = torch.nested.nested_tensor_from_jagged(model.emb(values), offsets)
        nt, first = model.layers[0](nt)
        nt, second = model.layers[1](nt)
        return (first * second).sum() + nt.values().sum()
    _assert_twins(_JaggedModel, _WRAPS[wrap](), batch, loss,
                  lambda m: [torch.optim.Adam(m.parameters(), lr=0.01)])


# max_norm on a table passed in: refused, and the tip must not lose eager's renorm


class _RenormedTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return self.lin(F.embedding(ids, table, max_norm=1.0)).tanh()


def test_a_max_norm_lookup_on_a_table_passed_in_is_refused_with_a_tip_that_keeps_eagers_renorm(
        ) -> None:
    # Eager renorms the caller's table in place (F.embedding's max_norm): what the tip's first
    # remedy, a clone inside the layer, never does, so the table ends the step unrenormed
    # (a row of norm 5.06 where eager's is 1.0). The tip should name what works, as the
    # warning for an nn.Embedding(max_norm=...) does: torch.embedding_renorm_ under no_grad
    # before the layer, or the table held by the layer.
    torch.manual_seed(0)
    table = nn.Parameter(torch.randn(6, 4) * 3)
    tower = pytree_ckpt.apply_activation_checkpointing(_RenormedTower(), offload=False)
    with pytest.raises(pytree_ckpt.CheckpointError) as caught:
        tower(torch.tensor([[0, 1, 2], [2, 3, 4]]), table)
    assert "embedding_renorm_" in str(caught.value)


# a sampler run once through reuse_during_recompute, updating a counts buffer over 64 KiB


class _ReusedSampler(nn.Module):
    counts: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.item = nn.Embedding(20000, _D, sparse=True)  # counts of 80 KB: over 64 KiB
        self.query = nn.Linear(_D, _D)
        self.drop = nn.Dropout(0.3)
        self.register_buffer("counts", torch.ones(20000))
        self.gen = torch.Generator().manual_seed(3)

    def sample(self, pos: torch.Tensor) -> torch.Tensor:
        self.counts.index_add_(0, pos, torch.ones(pos.shape[0]))
        return torch.multinomial(self.counts[:_V].pow(0.75), 4, replacement=True,
                                 generator=self.gen)

    def forward(self, user: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        neg = pytree_ckpt.reuse_during_recompute(self.sample, pos)
        cand = torch.cat([pos[:, None], neg[None].expand(pos.shape[0], -1)], 1)
        scale = torch.rsqrt(self.counts[cand])
        return (self.drop(self.query(user))[:, None] * self.item(cand)).sum(-1) * scale


class _ReusedSamplers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_ReusedSampler()])


@pytest.mark.parametrize("wrap", ["plain", "offload"])
def test_negatives_sampled_once_by_a_reused_call_updating_large_counts_give_eager_numbers(
        wrap: str) -> None:
    def batch(step: int, micro: int) -> tuple[Any, ...]:
        g = torch.Generator().manual_seed(7 * step + micro)
        return torch.randn(5, _D, generator=g), torch.randint(0, 8, (5,), generator=g)

    def loss(model: Any, user: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model.layers[0](user, pos), torch.zeros(5, dtype=torch.long))
    _assert_twins(_ReusedSamplers, _WRAPS[wrap](), batch, loss, _sgd)


@pytest.mark.parametrize("sparse", [False, True])
def test_residual_stream_discard_of_embedding_lookups_gives_eager_gradients(sparse: bool) -> None:
    grads = []
    for discard in (False, True):
        torch.manual_seed(0)
        table = nn.EmbeddingBag(_V, _D, mode="sum", sparse=sparse)
        projs = nn.ModuleList(nn.Linear(_D, _D) for _ in range(4))
        raw = torch.randint(0, 10**12, (4, 6), generator=torch.Generator().manual_seed(1))
        offsets = torch.tensor([0, 2, 2, 4, 5, 5])
        h = torch.randn(6, _D, requires_grad=True)
        plan = pytree_ckpt.build_residual_stream_recompute_plan(4, 2)
        for i, (ctx, proj) in enumerate(zip(plan, projs)):
            hashed = torch.remainder(raw[i], _V)
            looked = ctx.checkpoint(table, hashed, offsets) if discard else table(hashed, offsets)
            h = h + proj(looked * h).tanh()
            if discard:
                ctx.finalize(h)
        h.square().sum().backward()
        grads.append([_dense(p.grad) for p in [table.weight, *projs.parameters()]])
    assert all(_equal(e, g) for e, g in zip(*grads))
