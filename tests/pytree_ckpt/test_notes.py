"""Notes on errors raised by others: the Python 3.10 path, taken here on any Python."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import pytree_ckpt
from pytree_ckpt import notes


class RegistersAHook(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 2
        x.register_hook(lambda grad: grad)  # needs grad: refused in the no-grad original pass
        return x


def test_on_python_3_10_a_note_is_kept_in_dunder_notes_and_logged_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Guards against: the tip reaching no one on Python 3.10, which has no add_note and whose
    # traceback printing ignores __notes__ (the notes were skipped there before).
    monkeypatch.setattr(notes, "_NATIVE", False)
    layer = pytree_ckpt.apply_activation_checkpointing(RegistersAHook())
    with caplog.at_level(logging.WARNING, logger="pytree_ckpt.notes"), \
            pytest.raises(RuntimeError, match="register a hook") as raised:
        layer(torch.randn(3, requires_grad=True))
    (note,) = raised.value.__notes__  # type: ignore[attr-defined]
    assert note.startswith("pytree_ckpt: raised in the original pass of RegistersAHook")
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == f"RuntimeError: {raised.value}\n{note}"
    # Only strings in the record: a kept record held the error's traceback, and with it the
    # step's tensors (test_failed_steps' leak checks on 3.10).
    assert all(isinstance(arg, str) for arg in record.args or ())


def test_on_python_3_10_a_second_note_joins_the_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(notes, "_NATIVE", False)
    error = ValueError("first")
    error.__notes__ = ["an earlier note"]  # type: ignore[attr-defined]
    notes.add_note(error, "a second note")
    assert error.__notes__ == ["an earlier note", "a second note"]  # type: ignore[attr-defined]


@pytest.mark.skipif(not hasattr(BaseException, "add_note"), reason="Python 3.11+ only")
def test_on_python_3_11_a_note_is_added_natively_and_not_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    # The 3.10 path (log as well) is taken only where add_note is missing: a 3.11 traceback
    # shows the note itself, and a log line would repeat the whole error.
    layer = pytree_ckpt.apply_activation_checkpointing(RegistersAHook())
    with caplog.at_level(logging.DEBUG, logger="pytree_ckpt.notes"), \
            pytest.raises(RuntimeError, match="register a hook") as raised:
        layer(torch.randn(3, requires_grad=True))
    (note,) = raised.value.__notes__  # type: ignore[attr-defined]
    assert note.startswith("pytree_ckpt: raised in the original pass of RegistersAHook")
    assert caplog.records == []
