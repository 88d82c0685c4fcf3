"""Routing replay (R3) on the megatron backend (`megarl.backends.megatron.replay`).

The batch's ``routed_experts`` are random distinct experts per (token, sparse layer), with 20%
of rows -1 (routed by the router): far from what the routers choose (``replay_flipped`` near
1), so a replay that is not applied, or applied to the wrong tokens or layers, moves the
logprobs by O(1). Reference: megarl's plain model in float64 given the routing as its
``routing`` argument (checked against a float64 loop over tokens in
tests/models/test_moe_replay.py): logprobs, loss and every gradient (router and experts
included) within the fp32 tolerances derived from the model and batch (`moe_testlib`,
tests/fp32_bounds.py: logprobs and loss 2.7e-5 for qwen3_moe at T 0.7, gradients 4.1e-5 relative),
as the megatron MoE layers against transformers.

Measured (qwen3_moe, one process): logprobs 8.6e-7, loss 6.6e-7, gradients 1.3e-6 relative,
flipped fraction 0.77, logprob gap without replay 1.56.

Planted bugs (run by hand on qwen3_moe), each fails here: routing rows in b-major instead of
megatron's s-major token order: logprob 2.34; sparse layers swapped: logprob 1.49; -1 rows
replayed as expert 0: logprob 0.98; targets not queued for the checkpointed layers' recompute
(the backward routes by the router): gradients 1.33 relative.
"""

import moe_testlib as ml
import pytest


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay_zoo")
    return {name: ml.moe_model(root, name) for name in ("qwen3_moe", "qwen2_moe",
                                                        "qwen3_moe_mixed")}


@pytest.mark.parametrize("name,recompute", [("qwen3_moe", None), ("qwen2_moe", None),
                                            ("qwen3_moe_mixed", None), ("qwen3_moe", "full")])
def test_replayed_forward_and_gradients_match_the_reference(zoo, mcore_dist, name, recompute):
    res = {}
    ml.replay_checks(res, zoo[name], name, recompute=recompute)
    assert not ml.replay_failures(res, name), ml.replay_failures(res, name)


def test_dense_model_refuses_replay(mcore_dist, tmp_path):
    import mcore_testlib as lib

    from megarl.backends.megatron import MegatronBackend
    from megarl.errors import UserInputError

    path = lib.make_model(tmp_path / "dense", "qwen2", "lm")
    with pytest.raises(UserInputError, match="router_replay.mode=R3 needs a mixture-of-experts"):
        MegatronBackend("actor", str(path), router_replay=True)
