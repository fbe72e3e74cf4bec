"""What the census records at the edges: buffers, outer hooks' copies, nesting, discarded and
refilled outputs, storages at reused addresses, its own lifetime."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

import pytree_ckpt
from offload import OffloadManager
from pytree_ckpt import ActivationCensus, CheckpointWithoutOutput, apply_activation_checkpointing


def nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class Scaled(nn.Module):
    """Multiplies by a buffer: mul saves the buffer for the input's gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.register_buffer("scale", torch.rand(64, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale


def test_buffers_of_the_model_are_not_counted_as_activations() -> None:
    model = Scaled()
    x = torch.randn(64, 16, requires_grad=True)
    with ActivationCensus(model) as census:
        out = model(x)
    # mul saves the buffer (for proj(x)'s gradient), not proj(x): only Linear's input is left
    assert census.bytes_by("module") == {"proj": nbytes(x)}
    out.sum().backward()


def test_an_outer_hook_that_stores_a_list_is_counted_by_what_it_stored() -> None:
    x = torch.randn(64, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: ["kept", t.to(torch.bfloat16)],
                                                  lambda packed: packed[1].float()):
        with ActivationCensus() as census:
            h = x
            for _ in range(3):
                h = (h * 1.0001).sin()
            loss = h.sum()
    assert census.total_bytes == 3 * 64 * 64 * 2  # three bf16 copies of the sin inputs
    loss.backward()


def test_after_its_block_the_census_records_nothing_and_leaves_no_hooks() -> None:
    layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
    apply_activation_checkpointing(layers[0])
    x = torch.randn(4, 8, requires_grad=True)
    with ActivationCensus(layers) as census:
        first = layers[0](x)
    assert census.bytes_by("mechanism") == {"checkpoint boundary": nbytes(x)}
    second = layers[1](layers[0](x * 2))  # another forward after the block: not counted
    assert census.bytes_by("mechanism") == {"checkpoint boundary": nbytes(x)}
    assert not pytree_ckpt.census.census_active()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in layers.modules())
    (first.sum() + second.sum()).backward()


def test_rows_of_one_module_sum_every_storage_it_saved() -> None:
    class TwoSaves(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a.sin() + b.cos()  # two storages saved under one module and mechanism

    model = TwoSaves()
    a, b = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    with ActivationCensus(model) as census:
        a2, b2 = a * 1.0, b * 1.0
        out = model(a2, b2)
    rows = census.to_dict()["rows"]
    assert rows == [{"module": "<root>", "mechanism": "autograd", "device": "cpu",
                     "bytes": nbytes(a2) + nbytes(b2)}]
    assert f"{nbytes(a2) + nbytes(b2):>14,}" in census.report()
    out.sum().backward()


def test_the_report_names_every_module_whole_so_long_names_stay_apart() -> None:
    # The reference model's experts (mtp_layers.0.block.mlp.experts.0.gate_proj, .up_proj,
    # .down_proj) were cut to 32 characters: three rows of one name and three byte counts.
    names = ("projections_of_expert_number_0_gate", "projections_of_expert_number_0_up")
    experts = nn.ModuleDict({name: nn.Linear(8, 8) for name in names})
    model = nn.Sequential(nn.Sequential(experts))
    x = torch.randn(4, 8, requires_grad=True)
    with ActivationCensus(model) as census:
        out = experts[names[0]](x * 1.0) + experts[names[1]](x * 2.0)  # each saves its input
    rows = census.to_dict()["rows"]
    assert len(rows) == 2 and all(len(row["module"]) > 32 for row in rows)
    printed = [line.split() for line in census.report().splitlines()]
    for row in rows:
        assert [row["module"], "autograd", "cpu", f"{row['bytes']:,}"] in printed
    out.sum().backward()


def test_empty_saved_tensors_leave_no_rows() -> None:
    x = torch.randn(0, 4, requires_grad=True)
    with ActivationCensus() as census:
        out = (x * 1.0).sin()
    assert census.to_dict()["rows"] == [] and census.bytes_by("mechanism") == {}
    out.sum().backward()


class Norm(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * self.weight


def _discarding_forward(norm: nn.Module, proj: nn.Module, x: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    ckpt = CheckpointWithoutOutput()
    normed = ckpt.checkpoint(norm, x)
    out = proj(normed)  # saves normed
    ckpt.discard_output_and_register_recompute(out)
    return out, normed


def test_a_census_nested_in_another_sees_the_same_discarded_bytes() -> None:
    norm, proj = Norm(), nn.Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)
    with ActivationCensus() as outer, ActivationCensus() as inner:
        out, _ = _discarding_forward(norm, proj, x)
    assert outer.discarded_bytes == inner.discarded_bytes == 8 * 16 * 4
    assert outer.total_bytes == inner.total_bytes
    assert outer.to_dict()["discarded_bytes"] == 8 * 16 * 4
    out.sum().backward()


def test_a_refilled_output_is_resident_again_for_every_census() -> None:
    # _note_refilled: after a backward that keeps the graph, the rebuilt output is held again.
    norm, proj = Norm(), nn.Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)
    with ActivationCensus() as outer, ActivationCensus() as inner:
        out, normed = _discarding_forward(norm, proj, x)
        held = outer.total_bytes
    loss = out.sum()
    loss.backward(retain_graph=True)  # the proj node still saves normed, now refilled
    for census in (outer, inner):
        assert census.discarded_bytes == 0
        assert census.total_bytes == held + nbytes(normed) == held + 8 * 16 * 4


def test_a_dropped_graph_leaves_no_discarded_bytes() -> None:
    norm, proj = Norm(), nn.Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)
    with ActivationCensus() as census:
        out, normed = _discarding_forward(norm, proj, x)
    assert census.discarded_bytes == 8 * 16 * 4
    del out, normed  # the graph, and with it the discard, is gone without a backward
    gc.collect()
    assert census.discarded_bytes == 0 and census.total_bytes == 0


def _norm_discarded_into_an_offloaded_layer() -> tuple[
        ActivationCensus, OffloadManager, CheckpointWithoutOutput, torch.Tensor, torch.Tensor]:
    """A norm's output discarded after an offloaded layer took it as input (its window copied
    it to host), under a census: (census, manager, ckpt, the norm's output, the layer's)."""
    from tests.offload.blocks import manager, offloaded_stack

    norm = nn.LayerNorm(32)
    m = manager()
    layers = offloaded_stack(m, 1)
    x = torch.randn(16, 32, requires_grad=True)
    with ActivationCensus(nn.ModuleList([norm, layers])) as census:
        ckpt = CheckpointWithoutOutput()
        normed = ckpt.checkpoint(norm, x)
        out = layers[0](normed)
        ckpt.discard_output_and_register_recompute(out)
    return census, m, ckpt, normed, out


def test_a_discarded_offloaded_input_whose_graph_was_dropped_is_not_flagged() -> None:
    # flagged(): the discard freed the storage in place (0 bytes left); a caller's alias of
    # the tensor keeps only the empty storage object, so no offload "saved nothing".
    census, m, ckpt, normed, out = _norm_discarded_into_an_offloaded_layer()
    m.stats()  # the manager lets go of its device tensors
    alias = normed.detach()  # holds the (freed) storage, not the graph
    del out, normed, ckpt  # a step abandoned without backward
    gc.collect()
    assert alias.untyped_storage().nbytes() == 0
    assert census.flagged() == [] and census.total_bytes == census.discarded_bytes == 0


def test_a_discarded_offloaded_input_counts_as_discarded_until_backward_rebuilds_it() -> None:
    # Output discard holds what it freed until backward rebuilds it, whoever else lets go
    # (_note_discarded's keeper). Here the freed output is the next layer's input, which its
    # offload window copied to host: the window lets go of the device storage once the copy
    # is done (stats() collects it), and nothing else holds the record. Without the discard
    # among its holders, discarded_bytes dropped to 0 while backward still needed the bytes.
    census, m, _, _, out = _norm_discarded_into_an_offloaded_layer()
    assert census.discarded_bytes == 16 * 32 * 4
    m.stats()  # the manager lets go of its device tensors
    assert census.discarded_bytes == 16 * 32 * 4
    out.sum().backward()
    assert census.discarded_bytes == 0 and census.total_bytes == 0


def test_a_new_storage_at_the_address_of_a_dead_one_is_counted_by_its_own_size() -> None:
    # Two storage objects at one address, one after the other (what the allocator does with
    # freed memory): the second is a new entry, not the first's.
    buffer = bytearray(torch.randn(32, 32).numpy().tobytes())
    w = torch.randn(32, 32, requires_grad=True)
    with ActivationCensus() as census:
        first = torch.frombuffer(buffer, dtype=torch.float32).view(32, 32)
        out = w * first  # saves first
        del out, first   # its graph and its storage are gone
        second = torch.frombuffer(buffer, dtype=torch.float32, count=8 * 32).view(8, 32)
        out = w[:8] * second
    assert nbytes(second) == 8 * 32 * 4
    assert census.total_bytes == nbytes(second)
    out.sum().backward()


def test_a_storage_at_the_address_of_a_discarded_one_is_counted_as_resident() -> None:
    # _note_discarded: output discard frees the memory at once and the allocator may hand the
    # address to the next tensor; that one is a new, resident storage. (Two storage objects at
    # one address are made here from one buffer, as in test_manager, without the allocator.)
    buffer = bytearray(torch.randn(32, 32).numpy().tobytes())
    w = torch.randn(32, 32, requires_grad=True)
    discard = CheckpointWithoutOutput()  # stands for the discard that holds it for backward
    with ActivationCensus() as census:
        first = torch.frombuffer(buffer, dtype=torch.float32).view(32, 32)
        loss = (w * first).sum()  # saves first
        census._note_discarded(first, keeper=discard)
        second = torch.frombuffer(buffer, dtype=torch.float32, count=16 * 32).view(16, 32)
        assert second.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        loss = loss + (w[:16] * second).sum()  # saves second
    assert census.discarded_bytes == nbytes(first) == 32 * 32 * 4
    assert census.total_bytes == nbytes(second) == 16 * 32 * 4
    del loss


class _Compressed:
    """An outer hook's opaque handle: a half-precision copy, not the tensor it was given."""

    given: list[int] = []  # the ground truth: the storages the hook was given, by address

    def __init__(self, tensor: torch.Tensor) -> None:
        self.half = tensor.detach().half()
        _Compressed.given.append(tensor.untyped_storage().data_ptr())


def test_a_storage_at_the_address_of_a_dead_one_whose_handle_lives_is_counted() -> None:
    # The first storage is saved through an opaque handle that does not keep it: it dies while
    # the graph still holds the handle. The allocator hands its address to the next tensor,
    # which the graph also saves: that is a new storage, held, and must be counted (it was
    # merged into the dead one's record and counted as nothing). (Two storages at one address,
    # one after the other, made from one buffer as in the tests above.)
    buffer = bytearray(torch.randn(32, 32).numpy().tobytes())
    w = torch.randn(32, 32, requires_grad=True)
    _Compressed.given.clear()
    with torch.autograd.graph.saved_tensors_hooks(_Compressed, lambda c: c.half.float()):
        with ActivationCensus() as census:
            first = torch.frombuffer(buffer, dtype=torch.float32).view(32, 32)
            out = w * first  # saves first, through a handle that does not keep it
            del first
            gc.collect()
            second = torch.frombuffer(buffer, dtype=torch.float32, count=8 * 32).view(8, 32)
            out2 = w[:8] * second  # saves second: alive (the test holds it) and held
    assert _Compressed.given[-1] == second.untyped_storage().data_ptr()  # mul saved second
    assert census.total_bytes == nbytes(second) == 8 * 32 * 4
    (out.sum() + out2.sum()).backward()


def test_storages_on_the_meta_device_are_counted_each_once() -> None:
    # Meta storages all have data_ptr 0: keyed by address they were one storage, and a model
    # on meta (a shape-only memory estimate) had every activation "excluded" as a parameter.
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64)).to("meta")
    x = torch.empty(32, 64, device="meta", requires_grad=True)
    packed: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:  # the ground truth: what autograd saves
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with ActivationCensus(model) as census:
            out = model(x).exp()
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    truth = {t.untyped_storage()._cdata: nbytes(t) for t in packed
             if t.untyped_storage()._cdata not in params}
    assert len(truth) == 3  # x, the tanh output (saved by Tanh and Linear 2), the exp output
    assert census.total_bytes == sum(truth.values())
    del out


def test_an_activation_at_the_address_of_a_replaced_buffer_is_counted() -> None:
    # Parameters and buffers were left out by their addresses when the census was entered. A
    # buffer rebuilt later frees its old storage, and the allocator hands that address to the
    # next activation, which was then left out as the buffer. (Two storages at one address,
    # one after the other, made from one buffer as in the tests above.)
    memory = bytearray(torch.randn(32, 32).numpy().tobytes())
    model = nn.Module()
    model.register_buffer("mask", torch.frombuffer(memory, dtype=torch.float32).view(32, 32))
    w = torch.randn(32, 32, requires_grad=True)
    with ActivationCensus(model) as census:
        model.mask = torch.ones(32, 32)  # rebuilt (a mask, a cache): the old storage is freed
        gc.collect()
        h = torch.frombuffer(memory, dtype=torch.float32).view(32, 32)  # at the freed address
        loss = (w * h).sum()  # saves h
    saved = loss.grad_fn.next_functions[0][0]._saved_other  # the ground truth: mul saved h
    assert saved.untyped_storage().data_ptr() == h.untyped_storage().data_ptr()
    assert census.total_bytes == nbytes(h)
    loss.backward()


class _Cached(nn.Module):
    """Rebuilds its table buffer when a longer input arrives (as rotary caches do)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.rand(4, 16), persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.shape[0] > self.table.shape[0]:
            self.table = torch.rand(h.shape[0], 16)
        return h * self.table[: h.shape[0]]  # saves the table for h's gradient


def test_a_buffer_the_model_rebuilds_in_its_forward_is_not_counted() -> None:
    # docs/census.md: parameters and buffers of the model are left out; one made during the
    # forward was counted as an activation.
    model = _Cached()
    x = torch.randn(8, 16, requires_grad=True)
    with ActivationCensus(model) as census:
        out = model(x)
    assert out.grad_fn._saved_other.untyped_storage().data_ptr() == \
        model.table.untyped_storage().data_ptr()  # what mul saved: the new buffer only
    assert census.total_bytes == 0
    out.sum().backward()


def test_a_census_kept_for_its_report_does_not_keep_the_model_alive() -> None:
    # The census holds weak references only (docs/census.md); it held the model it was given,
    # and with it every parameter, for as long as the census object lived.
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
    weight = weakref.ref(model[0].weight)
    x = torch.randn(8, 64, requires_grad=True)
    with ActivationCensus(model) as census:
        out = model(x)
    out.sum().backward()
    del out, model
    gc.collect()
    assert weight() is None
    assert census.total_bytes == 0 and census.report().startswith("module")


def test_a_weight_a_pre_hook_sets_is_filed_under_the_boundary_that_holds_it() -> None:
    # Guards against the census being told only of the call's own inputs: the weight that
    # weight_norm's pre-hook computes is saved by the boundary too (NOTE [attributes set before
    # the call]); filed as a plain autograd save, the report put the layer's weight among the
    # activations outside any checkpoint. Ground truth: the boundary holds x and the weight;
    # autograd outside it holds weight_norm's norms. The totals equal eager's.
    import warnings

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is old
        eager = torch.nn.utils.weight_norm(nn.Linear(64, 64))
        twin = torch.nn.utils.weight_norm(nn.Linear(64, 64))
    twin.load_state_dict(eager.state_dict())
    apply_activation_checkpointing(twin)
    x = torch.randn(32, 64, requires_grad=True)
    totals, by_mechanism = [], []
    for model in (eager, twin):
        with ActivationCensus(model) as census:
            out = model(x)
        totals.append(census.total_bytes)
        by_mechanism.append(census.bytes_by("mechanism"))
        weight_bytes = nbytes(model.weight)
        out.sum().backward()
    norms = totals[0] - nbytes(x) - weight_bytes
    assert norms == 64 * 4  # one norm per output row, fp32
    assert by_mechanism[1] == {"checkpoint boundary": nbytes(x) + weight_bytes,
                               "autograd": norms}
    assert totals[0] == totals[1]


def test_a_storage_saved_through_an_opaque_handle_counts_nothing_once_it_died() -> None:
    # docs/census.md: a hook that returns another object is counted as the tensor it was
    # given "while that tensor is alive"; a handle that keeps only a compressed form of a
    # tensor since freed counts nothing. The handle (the graph's) still lives: only the
    # storage's death says it is gone. Nothing else is saved at its address afterwards.
    x = torch.randn(64, 16, requires_grad=True)
    _Compressed.given.clear()
    with torch.autograd.graph.saved_tensors_hooks(_Compressed, lambda c: c.half.float()):
        with ActivationCensus() as census:
            loss = x.sin().exp().sum()  # sin saves x (alive), exp its result (dropped now)
            gc.collect()
    assert len(_Compressed.given) == 2 and _Compressed.given[0] == x.untyped_storage().data_ptr()
    assert census.total_bytes == nbytes(x) == 64 * 16 * 4  # x only: exp's result died
    assert census.bytes_by("mechanism") == {"autograd": 64 * 16 * 4}
    assert census.to_dict()["rows"] == [{"module": "<outside any module>",
                                         "mechanism": "autograd", "device": "cpu",
                                         "bytes": 64 * 16 * 4}]
    loss.backward()


class _Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("stands for an OOM a training loop catches and retries")


def test_saves_after_a_module_forward_raised_are_filed_outside_any_module() -> None:
    # A forward that raised (an OOM caught to retry with a smaller batch) still leaves the
    # modules it entered: the loss computed afterwards outside the model is not filed under
    # the module that failed.
    model = nn.Sequential(_Fails())
    x = torch.randn(16, 16, requires_grad=True)
    with ActivationCensus(model) as census:
        try:
            model(x)
        except torch.OutOfMemoryError:
            pass
        loss = x.sin().sum()  # sin saves x
    assert census.bytes_by("module") == {"<outside any module>": nbytes(x)}
    loss.backward()


def test_a_discarded_record_its_keeper_still_holds_outlives_the_pruning_of_dead_records() -> None:
    # Guards against: _prune dropping every record whose storage is gone, held or not (NOTE
    # [records of dead storages]: "A record still held ... stays"). discarded_bytes counts the
    # records a discard's keeper holds, whatever became of the storage object; a long run's
    # pruning must not change that reading.
    class Keeper:
        pass

    w = torch.randn(1024, requires_grad=True)
    with ActivationCensus() as census:
        a = torch.randn(1024)
        y = w * a  # saves a: a record of 4096 bytes
        keeper = Keeper()
        census._note_discarded(a, keeper=keeper)
        del y, a  # the graph and the storage are gone; the keeper holds the record
        gc.collect()
        assert census.discarded_bytes == 1024 * 4
        outs = [w[:16] * torch.randn(16) for _ in range(80)]  # 80 new records: a prune runs
        assert census.discarded_bytes == 1024 * 4
        del outs, keeper
    assert census.discarded_bytes == 0


class _KeptLinearThenDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # dropout writes in place on a tensor of its own (bernoulli_, div_): not the kept result
        return torch.nn.functional.dropout(self.lin(x).tanh(), 0.1) + x


def test_a_save_unit_memory_estimate_on_meta_counts_the_kept_bytes_the_real_device_counts(
        ) -> None:
    # census.md: 'A model on the meta device is counted by its tensors' sizes ... a memory
    # estimate of a model too large to run'. Under save units, KeepMode files each kept result
    # by _storage_id = untyped_storage().data_ptr() (keep.py:406), which is 0 for every meta
    # storage; _unkeep_written (keep.py:~686) then takes back every kept result when any meta
    # tensor is written in place (dropout's bernoulli_): the estimate misses the kept bytes, and
    # the unit warns it "kept nothing", where on CPU the same layer keeps the addmm result.
    from pytree_ckpt import KeptOps, RecomputeConfig, SaveUnit, apply_recompute_config
    counted = {}
    for device in ("cpu", "meta"):
        torch.manual_seed(0)
        layer = _KeptLinearThenDropout().to(device)
        apply_recompute_config([layer], RecomputeConfig(1.0, save=["attn"]),
                               {SaveUnit.ATTN: KeptOps("aten::addmm")}, offload=False)
        x = torch.empty(32, 64, device=device).normal_().requires_grad_()
        with ActivationCensus(layer) as census:
            out = layer(x * 1.0)
            counted[device] = census.bytes_by("mechanism")
        out.sum().backward()
    assert counted["cpu"].get("save unit")  # the kept addmm output
    assert counted["meta"] == counted["cpu"]


def test_an_output_discard_memory_estimate_on_meta_counts_the_bytes_the_real_device_frees(
        ) -> None:
    # docs/discard.md's first example under a census, on CPU and on meta (census.md: a model on
    # meta is a memory estimate). On meta, made_outside (discard_aliases.py) keys storages by
    # root_key = (get_device(), data_ptr()), which is (-1, 0) for every meta storage: the norm's
    # output matches its input x, is filed as made outside fn, and is never freed: the estimate
    # shows 0 discarded bytes and counts the norm output under autograd (8192 vs CPU's 4096).
    counted = {}
    for device in ("cpu", "meta"):
        norm = nn.LayerNorm(64, device=device)
        proj = nn.Linear(64, 64, device=device)
        x = torch.empty(16, 64, device=device).normal_().requires_grad_()
        with ActivationCensus(nn.ModuleList([norm, proj])) as census:
            ckpt = CheckpointWithoutOutput()
            out = proj(ckpt.checkpoint(norm, x))
            ckpt.discard_output_and_register_recompute(out)
            counted[device] = (census.discarded_bytes, census.bytes_by("mechanism"))
        (x + out).sum().backward()
    assert counted["cpu"][0] == 16 * 64 * 4
    assert counted["meta"] == counted["cpu"]


class _KeptMatmul3d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.w)  # a 3-D input: aten.mm, then _unsafe_view on its storage


def test_a_meta_estimate_refuses_an_output_on_a_kept_storage_changed_in_place_as_cpu_does(
        ) -> None:
    # NOTE [outputs on a kept storage]: on CPU, `out += 1` on matmul's _unsafe_view of the kept
    # mm is refused in backward (the replay would compute on with the changed result). Before
    # d82b948 meta refused it too (both keys 0); now the kept dict is keyed by storage._cdata
    # on meta while on_kept_storages looks the output up by data_ptr() (0): never found.
    from pytree_ckpt import CheckpointError, KeptOps, RecomputeConfig, SaveUnit, \
        apply_recompute_config
    refused = {}
    for device in ("cpu", "meta"):
        torch.manual_seed(0)
        layer = _KeptMatmul3d().to(device)
        apply_recompute_config([layer], RecomputeConfig(1.0, save=["attn"]),
                               {SaveUnit.ATTN: KeptOps("aten::mm")}, offload=False)
        x = torch.empty(2, 4, 8, device=device).normal_().requires_grad_()
        out = layer(x * 1.0)
        out += 1
        try:
            out.tanh().sum().backward()
            refused[device] = False
        except CheckpointError as error:
            refused[device] = "shares its memory with the result of aten.mm" in str(error)
    assert refused == {"cpu": True, "meta": True}
