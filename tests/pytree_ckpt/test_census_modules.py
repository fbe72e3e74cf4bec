"""Which module a census files a save under when it was entered inside the model's forward (a
framework measuring part of a model, a user's hook): the modules already running count."""

from __future__ import annotations

import torch
from torch import nn

from pytree_ckpt import ActivationCensus


def nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class _Inner(nn.Module):
    """Enters a census around part of its forward (when given the model to measure) and leaves
    it open for its caller to end."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.root: nn.Module | None = None
        self.census: ActivationCensus | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.root is not None:
            self.census = ActivationCensus(self.root).__enter__()
        return self.proj(x).tanh()  # 0.inner.proj saves x, 0.inner itself tanh's output


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).sigmoid()  # 0 itself saves sigmoid's output, inner's census open


def test_a_census_entered_inside_a_forward_files_saves_under_the_modules_already_running(
) -> None:
    # Entered inside 0.inner's forward, the census learnt the module stack from pre-hooks it
    # never saw for 0.inner and 0 (already running): their own saves were filed as outside
    # any module. After they return, nothing stays filed under them (they ran without hooks,
    # so no forward hook of the census ever ends them): exp's save is outside the model.
    model = nn.Sequential(_Outer())
    x = torch.randn(4, 8, requires_grad=True)
    with ActivationCensus(model) as twin:  # entered outside the model: the reference
        twin_loss = model(x).exp().sum()
    inner = model[0].inner
    inner.root = model
    loss = model(x).exp().sum()
    assert inner.census is not None
    inner.census.__exit__(None, None, None)
    hidden = torch.tanh(inner.proj(x))
    assert inner.census.bytes_by("module") == twin.bytes_by("module") == {
        "0.inner.proj": nbytes(x), "0.inner": nbytes(hidden), "0": nbytes(hidden),
        "<outside any module>": nbytes(hidden)}
    (loss + twin_loss).backward()


class _Own(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).tanh()  # 0.proj saves x, 0 itself tanh's output


def test_a_census_entered_in_a_pre_hook_files_that_modules_own_saves_under_it() -> None:
    # A census a forward pre-hook enters (a profiler's hook): the module whose call runs the
    # hook is already running, but its own saves are its own.
    model = nn.Sequential(_Own())
    opened: list[ActivationCensus] = []
    model[0].register_forward_pre_hook(
        lambda module, args: opened.append(ActivationCensus(model).__enter__()) if not opened
        else None)
    x = torch.randn(4, 8, requires_grad=True)
    out = model(x)
    loss = out.exp().sum()  # exp saves its output, outside the model
    opened[0].__exit__(None, None, None)
    assert opened[0].bytes_by("module") == {"0.proj": nbytes(x), "0": nbytes(out),
                                            "<outside any module>": nbytes(out)}
    loss.backward()


def test_a_module_running_now_under_the_id_of_one_running_at_entry_is_not_taken_for_it() -> None:
    # Guards the identity check of NOTE [entered inside] (running_modules.py): the modules found
    # running at entry are known by id, and one that has ended and been freed may leave its id
    # to a new module whose call runs later (CPython reuses addresses). Its saves are not the
    # old module's: they are filed by what the census knows, here nothing. Reuse itself cannot
    # be forced, so the table is given an entry whose weak reference is another module's.
    import weakref

    from pytree_ckpt.running_modules import running_module

    seen: list[str] = []
    elsewhere = nn.Linear(2, 2)  # the module that was running at entry, by its weak reference

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(running_module(table))
            return x

    probe = Probe()
    table = {id(probe): (weakref.ref(elsewhere), "layers.0")}
    probe(torch.ones(1))
    table[id(probe)] = (weakref.ref(probe), "layers.0")  # the same module: known
    probe(torch.ones(1))
    assert seen == ["<outside any module>", "layers.0"]
