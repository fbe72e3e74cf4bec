"""``detect_discarded_reads``: a read of a discarded output before its rebuild is named, not a
raw torch error or a crash; a correct step under it raises nothing and gives eager's numbers.

A discarded output is never read outside the mode here: plain arithmetic on it crashes the
process on CPU (docs/discard.md)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import pytree_ckpt
import pytree_ckpt.discarded_reads as discarded_reads
from pytree_ckpt import CheckpointError, CheckpointWithoutOutput, detect_discarded_reads
from tests.conftest import assert_same_grads, grads_of
from tests.pytree_ckpt.models import RmsNorm
from tests.pytree_ckpt.test_discard_composition import _two_consumers


def test_a_read_after_the_discard_raises_naming_the_op_the_argument_and_the_discarded_op(
        ) -> None:
    torch.manual_seed(0)
    norm, proj = RmsNorm(), nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    expected = norm(x).detach()
    ckpt = CheckpointWithoutOutput()
    normed = ckpt.checkpoint(norm, x)
    out = proj(normed)
    ckpt.discard_output_and_register_recompute(out)
    with detect_discarded_reads():
        with pytest.raises(CheckpointError) as error:
            normed * 2  # a logging hook, a second branch: a crash without the mode
        out.sum().backward()
        assert torch.equal(normed, expected)  # rebuilt: reads pass again
    message = str(error.value)
    assert message.startswith("aten.mul.Tensor read its argument 'self' (shape (4, 8), "
                              "torch.float32), an output of RmsNorm that output discard freed")
    assert message.count("tip:") == 1 and "docs/discard.md" in message


def test_a_restricted_backward_reading_the_freed_output_is_named_under_the_mode() -> None:
    # Without the mode: torch's "data is not allocated yet" (test_discard_composition.py).
    weights, loss = _two_consumers(hook_on_both=False)
    with detect_discarded_reads(), pytest.raises(CheckpointError,
                                                 match=r"^aten\.mm\.default read its argument "
                                                       r"'mat2' .* an output of RmsNorm"):
        loss.backward(inputs=weights)


def test_views_and_metadata_of_a_discarded_output_read_no_data_and_pass() -> None:
    normed, out = _discarded()
    with detect_discarded_reads():
        view, alias = normed.view(-1), normed.detach()
        fresh = torch.empty_like(normed)
        assert view.shape == (32,) and alias.shape == fresh.shape == (4, 8)
        out.sum().backward()


def test_an_empty_slice_of_a_discarded_output_reads_no_bytes_and_passes() -> None:
    # An expert that got no tokens slices no rows of a discarded norm output: an op given that
    # slice reads nothing (and without the mode torch reads nothing either), so it is no error.
    normed, out = _discarded()
    with detect_discarded_reads():
        none = normed[2:2]
        assert (none * 2).shape == (0, 8)
        with pytest.raises(CheckpointError, match="read its argument 'self'"):
            normed[2:3] * 2  # one row is a read
        out.sum().backward()


def test_a_correct_step_under_the_mode_checks_every_op_and_changes_no_number(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Megatron's residual plan (docs/discard.md), without the mode first, then under it; the
    # checks that ran are counted, forward and backward, so a mode seeing nothing fails. The
    # twin is the discard run without the mode: the residual stream's gradients differ from
    # eager's by the order of a sum (NOTE [exactness] in discard_function.py).
    def step() -> list[torch.Tensor | None]:
        torch.manual_seed(0)
        norms = nn.ModuleList(RmsNorm() for _ in range(4))
        projs = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        x = torch.randn(4, 8, requires_grad=True)
        plan = pytree_ckpt.build_residual_stream_recompute_plan(4, 2)
        h = x
        for ctx, norm, proj in zip(plan, norms, projs):
            h = h + proj(ctx.checkpoint(norm, h))
            ctx.finalize(h)
        counted["forward"] = counted["all"]
        h.square().sum().backward()
        return grads_of([x, *norms.parameters(), *projs.parameters()])

    counted = {"all": 0}
    check = discarded_reads._check

    def counting(*args: object) -> None:
        counted["all"] += 1
        check(*args)  # type: ignore[arg-type]

    unchecked = step()
    monkeypatch.setattr(discarded_reads, "_check", counting)
    counted["all"] = 0
    with detect_discarded_reads():
        checked = step()
    assert_same_grads(unchecked, checked)
    assert counted["forward"] > 0 and counted["all"] > counted["forward"]


def _discarded() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    norm, proj = RmsNorm(), nn.Linear(8, 8)
    ckpt = CheckpointWithoutOutput()
    normed = ckpt.checkpoint(norm, torch.randn(4, 8, requires_grad=True))
    out = proj(normed)
    ckpt.discard_output_and_register_recompute(out)
    return normed, out


@pytest.mark.parametrize("make", [
    lambda t: t.new_zeros(3), lambda t: t.new_ones(3), lambda t: t.new_full((3,), 1.0),
    lambda t: t.new_empty(3), lambda t: torch.rand_like(t), lambda t: torch.randn_like(t),
    lambda t: torch.randint_like(t, 5), lambda t: torch.randint_like(t, 1, 5)],
    ids=["new_zeros", "new_ones", "new_full", "new_empty", "rand_like", "randn_like",
         "randint_like", "randint_like low"])
def test_new_tensors_made_from_a_discarded_outputs_metadata_pass(make: Any) -> None:
    # Guards against: only the *_like ops of zeros, ones, full and empty were known to read no
    # data; new_zeros (a mask shaped like the output) raised CheckpointError, where torch runs.
    normed, out = _discarded()
    with detect_discarded_reads():
        try:
            made = make(normed)
        finally:
            out.sum().backward()  # rebuilt before a failure's report reads normed (a crash)
    assert made.dtype == normed.dtype


@pytest.mark.parametrize("take", [lambda t: t[0], lambda t: t[:, -1], lambda t: t.t(),
                                  lambda t: t.unsqueeze(0), lambda t: t.chunk(2)[1]],
                         ids=["row", "column", "t", "unsqueeze", "chunk"])
def test_a_view_torch_cannot_make_of_a_discarded_output_is_named(take: Any) -> None:
    # Guards against: views passed unchecked, and torch refuses most of them on a freed storage
    # (its "setStorage: ... out of bounds for storage of size 0"): a logging hook reading
    # normed[:, -1] got torch's error under the mode, not the discarded op's name.
    normed, out = _discarded()
    with detect_discarded_reads():
        try:
            with pytest.raises(CheckpointError, match=r"an output of RmsNorm that output "
                                                      r"discard freed") as error:
                take(normed)
        finally:
            out.sum().backward()  # rebuilt before a failure's report reads normed (a crash)
        take(normed)
    assert isinstance(error.value.__cause__, RuntimeError)


def test_a_read_by_keyword_names_the_keyword_and_other_ops_run_as_without_the_mode() -> None:
    # A discarded output passed as a keyword-only argument (histogram's weight=) is named by
    # that keyword; a sparse operand (no storage to check) and a view torch refuses for its
    # own reason pass through unchanged: the same result, the same error, as without the mode.
    torch.manual_seed(0)
    x = torch.randn(16, requires_grad=True)
    samples, sparse = torch.randn(16), torch.randn(3, 3).relu().to_sparse()
    ckpt = CheckpointWithoutOutput()
    gate = ckpt.checkpoint(torch.sigmoid, x)
    out = gate * 2
    ckpt.discard_output_and_register_recompute(out)
    with pytest.raises(RuntimeError) as plain:
        samples.view(5)
    with detect_discarded_reads():
        with pytest.raises(CheckpointError) as error:
            torch.histogram(samples, 4, weight=gate)
        with pytest.raises(RuntimeError) as passed:
            samples.view(5)
        doubled = sparse * 2
        out.sum().backward()
    assert str(error.value).startswith(
        "aten.histogram.bin_ct read its argument 'weight' (shape (16,), torch.float32), an "
        "output of torch.sigmoid that output discard freed and backward has not rebuilt yet")
    assert "tip: discard only once every consumer of the output has run" in str(error.value)
    assert type(passed.value) is type(plain.value) and str(passed.value) == str(plain.value)
    assert torch.equal(doubled.to_dense(), sparse.to_dense() * 2)
    twin = x.detach().clone().requires_grad_()
    (torch.sigmoid(twin) * 2).sum().backward()
    assert torch.equal(x.grad, twin.grad)


def test_a_discarded_output_inside_a_list_argument_is_named_as_a_read() -> None:
    # torch.cat and torch.stack take their tensors as one list argument: a discarded output
    # in it is read as any other argument is.
    normed, out = _discarded()
    with detect_discarded_reads():
        with pytest.raises(CheckpointError, match=r"^aten\.cat\.default read its argument "
                                                  r"'tensors' .* an output of RmsNorm"):
            torch.cat([torch.ones(1, 8), normed])
        out.sum().backward()
        assert torch.cat([torch.ones(1, 8), normed]).shape == (5, 8)  # rebuilt: passes


def test_a_write_into_a_discarded_output_by_an_out_overload_of_a_metadata_op_is_named() -> None:
    # zeros_like reads only its input's metadata, but its out= overload writes the tensor
    # given: into a freed storage, a write to no memory (a crash without the mode).
    normed, out = _discarded()
    with detect_discarded_reads():
        with pytest.raises(CheckpointError, match=r"^aten\.zeros_like\.out read its argument "
                                                  r"'out' .* an output of RmsNorm"):
            torch.ops.aten.zeros_like.out(torch.ones(4, 8), out=normed)
        out.sum().backward()


def test_the_mode_takes_no_arguments_rather_than_torchs_private_dispatch_key() -> None:
    # Helper DO: its signature was TorchDispatchMode's (_dispatch_key=None), and
    # detect_discarded_reads(1) raised torch's assertion about that private argument.
    import inspect
    assert list(inspect.signature(detect_discarded_reads).parameters) == []
    with pytest.raises(TypeError, match="positional argument"):
        detect_discarded_reads(1)  # type: ignore[call-arg]
    with detect_discarded_reads():
        assert torch.ones(2).add(1).tolist() == [2.0, 2.0]


def test_a_correct_step_calling_flex_attention_under_the_mode_gives_eager_grads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    import torch.nn.attention.flex_attention as flex
    # torch refuses flex_attention's backward on CPU in this check only; the unfused eager
    # implementation behind it differentiates (stands in for CUDA, where it is allowed).
    monkeypatch.setattr(flex, "_validate_device", lambda *args: None)
    torch.manual_seed(0)
    proj = nn.Linear(8, 24)
    x = torch.randn(1, 2, 8, 8)

    def step() -> list[torch.Tensor | None]:
        proj.zero_grad(set_to_none=True)
        q, k, v = proj(x).chunk(3, -1)
        flex.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s - (qi - kv).abs()
                            ).square().sum().backward()
        return grads_of(proj.parameters())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention's "called without torch.compile()"
        expected = step()
        with detect_discarded_reads():
            got = step()
    assert_same_grads(expected, got)


def test_a_higher_order_op_reading_a_discarded_output_is_named_under_the_mode() -> None:
    # Mutant M43 (helper FH): a higher-order op passed through the mode without its inputs
    # checked read the freed storage (NOTE [higher-order ops pass through our modes]: its
    # inputs are checked, the ops inside it are not seen).
    import warnings

    import torch.nn.attention.flex_attention as flex
    normed, out = _discarded()
    q = torch.randn(1, 1, 4, 8)
    with detect_discarded_reads(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention's "called without torch.compile()"
        with pytest.raises(CheckpointError, match=r"flex_attention read its argument .* an "
                                                  r"output of RmsNorm that output discard"):
            flex.flex_attention(q, normed.detach().view(1, 1, 4, 8), q)
        out.sum().backward()


def test_a_higher_order_op_reading_a_discarded_output_names_the_argument() -> None:
    import warnings

    import torch.nn.attention.flex_attention as flex
    normed, out = _discarded()
    q = torch.randn(1, 1, 4, 8)
    with detect_discarded_reads(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention's "called without torch.compile()"
        with pytest.raises(CheckpointError) as error:
            flex.flex_attention(q, normed.detach().view(1, 1, 4, 8), q)
        out.sum().backward()
    assert str(error.value).startswith("flex_attention read its argument 'key' (shape "
                                       "(1, 1, 4, 8), torch.float32), an output of RmsNorm")
