"""The reference model under verify_replay=True: no false alarm with replay, save units and
offload, and the silent case it exists for (an indexer rerun in the replay) refused."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch

from examples.glm_dsa import make_packed_batch
from examples.glm_dsa import attention as attention_module
from offload import OffloadConfig, OffloadManager
from pytree_ckpt import ReplayMismatchError
from pytree_ckpt.refusals import fn_name
from pytree_ckpt.replay_values import OutputPrints
from tests.examples.test_glm_dsa_model import (SEQ_LENS, ErraticIndexers, _one_thread,
                                               assert_same_grads, build, differing_grads,
                                               grads, train_step)

__all__ = ["_one_thread"]  # the module-scoped one-thread fixture applies here too


@pytest.mark.parametrize("save", [None, True])
def test_replay_save_units_and_offload_pass_verification_with_eager_gradients(
        save: bool | None) -> None:
    config, eager = build(moe=True, dropout=0.2)
    model = copy.deepcopy(eager)
    manager = OffloadManager(OffloadConfig(min_bytes=0), device="cpu")
    model.checkpoint_layers(1.0, offload=manager, save=save, verify_replay=True)
    batch = make_packed_batch(config, SEQ_LENS)
    assert torch.equal(train_step(eager, batch), train_step(model, batch))
    assert_same_grads(grads(eager), grads(model))
    assert manager.stats()["offloaded_bytes"] > 0


def test_an_erratic_indexer_rerun_in_the_replay_is_refused_and_its_replayed_ids_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # test_glm_dsa_model's test_reuse_keeps_grads_exact_under_a_nondeterministic_indexer...
    # shows the direct call's gradients silently wrong; verify_replay turns that into an error.
    erratic = ErraticIndexers(monkeypatch)
    config, eager = build()
    batch = make_packed_batch(config, SEQ_LENS)
    erratic.restart()
    eager_loss = train_step(eager, batch)
    expected = grads(eager)
    for reuse in (True, False):
        model = copy.deepcopy(eager)
        model.zero_grad(set_to_none=True)
        model.checkpoint_layers(1.0, verify_replay=True)
        for attn in (m for m in model.modules() if isinstance(m, attention_module.MlaAttention)):
            attn.reuse_indexer = reuse
        erratic.restart()  # the original pass sees the same ids as the eager run
        if reuse:
            assert torch.equal(train_step(model, batch), eager_loss)
            assert differing_grads(expected, grads(model)) == []
            continue
        with pytest.raises(ReplayMismatchError) as raised:
            train_step(model, batch)
        message = str(raised.value)
        # The MTP layer's replay runs first in backward; its indexer reran with other noise.
        assert "in backward computed other values than its original pass at output" in message
        assert "verify_replay=True compares them bit for bit" in message


def _counted_prints(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts OutputPrints.of by what made the prints: a discard's name, a boundary's class."""
    made: Counter[str] = Counter()
    original = OutputPrints.of.__func__  # type: ignore[attr-defined]

    def counted(cls: type[OutputPrints], *args: Any, **kwargs: Any) -> OutputPrints:
        fn = kwargs["fn"]  # a discard's name, or a boundary's fn
        made[fn if isinstance(fn, str) else fn_name(fn)] += 1
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(OutputPrints, "of", classmethod(counted))
    return made


def test_the_training_script_with_verify_replay_trains_as_without_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from examples.glm_dsa import train

    made = _counted_prints(monkeypatch)
    plain = train.main(["--steps", "2", "--moe"])
    assert not made
    verified = train.main(["--steps", "2", "--moe", "--verify-replay"])
    assert verified == plain
    # Two steps of eight decoder layers and two MTP depths, each printed once per call.
    assert made == Counter({"DecoderLayer": 2 * 8, "MtpLayer": 2 * 2})
    assert "--verify-replay" in train.__doc__
    capsys.readouterr()


def test_the_training_scripts_verify_replay_reaches_the_norms_output_discards(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # With --ratio 0.5 the unchecked layers' norm discards rebuild in the outer backward, where
    # no boundary's check sees them: the flag reaches their CheckpointWithoutOutput through the
    # model's checkpoint_layers.
    from examples.glm_dsa import train

    made = _counted_prints(monkeypatch)
    argv = ["--steps", "2", "--discard-norms", "--ratio", "0.5"]
    plain = train.main(argv)
    assert not made
    capsys.readouterr()
    assert train.main([*argv, "--verify-replay"]) == plain
    # Per step: 4 checkpointed decoder layers and 2 MTP depths printed once each (in forward);
    # two norms in each of the 10 layers, discarded for real (and printed) once a step: in the
    # unchecked layers' forward, in the checkpointed ones' replay.
    assert made == Counter({"RMSNorm": 2 * 2 * 10, "DecoderLayer": 2 * 4, "MtpLayer": 2 * 2})
    assert "verify_replay: every replay and every norm rebuild matched its forward, bit for bit" \
        in capsys.readouterr().out


def test_the_training_script_does_not_claim_a_check_that_verified_nothing(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # At --ratio 0 no layer is checkpointed and, without --discard-norms, nothing is discarded:
    # no print is made. Guards against (helper GV) the closing line saying every replay
    # matched there: it says nothing was compared.
    from examples.glm_dsa import train

    made = _counted_prints(monkeypatch)
    train.main(["--steps", "1", "--ratio", "0", "--verify-replay"])
    assert not made  # nothing was verified ...
    out = capsys.readouterr().out
    assert "matched its forward" not in out, out  # ... and the script says so
    assert "verify_replay: nothing was compared" in out


def test_the_models_checkpoint_layers_verify_replay_reaches_the_norms_output_discards(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Inside each checkpointed layer's replay both norms are discarded for real and rebuilt in
    # its backward, and a CheckpointWithoutOutput verifies only with its own flag (the
    # boundary's check compares the layer's outputs, made before the rebuild). Guards against
    # (helper GV) model.checkpoint_layers(verify_replay=True) not reaching them (only train.py
    # set a config flag): it sets every decoder layer's, checkpointed or not.
    made = _counted_prints(monkeypatch)
    config, model = build(discard_norm_outputs=True)
    model.checkpoint_layers(1.0, verify_replay=True)
    train_step(model, make_packed_batch(config, SEQ_LENS))
    # One step: 8 decoder layers and 2 MTP depths, each printed once, and their two norms each,
    # discarded for real (and printed) in the layers' replays.
    assert made == Counter({"RMSNorm": 2 * 10, "DecoderLayer": 8, "MtpLayer": 2})


# Guards against (helper KC), as it was found:
def test_the_training_script_does_not_claim_a_check_at_a_ratio_that_checkpoints_no_layer(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # --ratio 0.1 of 8 layers checkpoints none (the script prints "[]") and --mtp-depth 0 leaves
    # no MTP layer to wrap: as at --ratio 0, nothing is verified, but the closing line, which
    # tested args.ratio == 0 rather than what was checkpointed, said every replay matched.
    from examples.glm_dsa import train

    made = _counted_prints(monkeypatch)
    train.main(["--steps", "1", "--ratio", "0.1", "--mtp-depth", "0", "--verify-replay"])
    assert not made  # nothing was verified ...
    out = capsys.readouterr().out
    assert "checkpointed decoder layers: []" in out
    assert "matched its forward" not in out, out  # ... so the script must not claim it
