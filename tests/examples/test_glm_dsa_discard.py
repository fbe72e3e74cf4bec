"""The reference model with its pre-norms through output-discard replay, against eager."""

from __future__ import annotations

import pytest
import torch

from examples.glm_dsa import make_packed_batch
from pytree_ckpt import ActivationCensus
from tests.examples.test_glm_dsa_model import SEQ_LENS, _one_thread, build, grads

__all__ = ["_one_thread"]  # the module-scoped one-thread fixture applies here too


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_norm_outputs_through_output_discard_match_eager(ratio: float) -> None:
    config, eager = build()
    _, discarding = build(discard_norm_outputs=True)  # same seed: same weights
    discarding.checkpoint_layers(ratio, mtp=False)
    batch = make_packed_batch(config, SEQ_LENS)
    with ActivationCensus(discarding) as census:
        loss = discarding(**batch)["loss"]
    if ratio == 0.0:  # 2 norms in each of 8 decoder layers and 2 MTP depths (the MTP block)
        per_norm = sum(SEQ_LENS) * config.hidden_size * 4
        assert census.discarded_bytes == 2 * (config.num_layers + config.mtp_depth) * per_norm
    eager_loss = eager(**batch)["loss"]  # dropout is 0: no RNG to align
    assert torch.equal(loss, eager_loss)  # the forward is the same computation
    eager_loss.backward()
    loss.backward()
    # A block's input feeds its norm (inside the discard's replayed graph) and the residual:
    # its gradient sums in another order (NOTE [exactness] in pytree_ckpt/discard_function.py).
    for name, want in grads(eager).items():
        got = dict(discarding.named_parameters())[name].grad
        assert (want is None) == (got is None), name
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=name)


def test_train_with_compile_and_discard_norms_runs_and_gives_the_uncompiled_losses() -> None:
    # `train --compile --discard-norms` crashed in the first backward: compile_layer_bodies
    # compiled the consumer layers (3, 4, 5, 7) with fullgraph=True, and their replay (grad on)
    # cannot trace CheckpointWithoutOutput: "torch.compile with fullgraph=True found no
    # compiled frames". Such bodies now compile with graph breaks, like the reuse sites.
    # One compiled run (it compiles every body, about a minute on 2 cores): the script's.
    from torch._dynamo.utils import counters

    from examples.glm_dsa import GlmDsaConfig, GlmDsaForCausalLM, train
    from examples.glm_dsa.distributed import body_allows_fullgraph, compile_layer_bodies

    torch._dynamo.reset()
    try:
        model = GlmDsaForCausalLM(GlmDsaConfig(discard_norm_outputs=True))
        assert not any(body_allows_fullgraph(layer) for layer in model.layers)
        assert set(compile_layer_bodies(model, backend="eager").values()) == {False}  # lazy
        graphs = counters["stats"]["unique_graphs"]  # process-wide: reset() keeps them
        argv = ["--steps", "1", "--discard-norms"]
        compiled = train.main([*argv, "--compile", "--compile-backend", "eager"])
        assert counters["stats"]["unique_graphs"] > graphs  # the bodies did compile
        assert compiled == train.main(argv)
    finally:
        torch._dynamo.reset()
