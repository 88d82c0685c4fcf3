"""R2 routing replay on the megatron backend (`megarl.backends.megatron.replay.record_logprobs`):
the old-logprob pass records the experts megatron's routers choose, and the update replays them
after the routers moved (checks in r2_testlib.py).

References (brute force): megarl's plain model in float64, one unpadded row at a time with
`record_experts`, for the recording (before) and for what the moved routers would choose (the
same noise on both models' router weights): some tokens flip (measured: qwen3_moe 25 of 78
real (token, layer) decisions, qwen3_moe_mixed 19 of 39), so an update without replay would
route differently; the update's routing (kept by `replay.recording`) equals the recording at
every real token. TP=2 with sequence parallelism, DP=2 and an interleaved pipeline (2 stages
x 2 chunks): tests/dist/megatron_r2.py.
Planted bugs: the s-major token order read b-major in `_scatter_recorded` (recording differs
from the row loop), the update not armed with the batch's routing (update_ok fails).
"""

import pytest
import r2_testlib as r2

pytestmark = pytest.mark.usefixtures("mcore_dist")


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_mixed"])
def test_r2_records_and_the_update_replays(tmp_path, name):
    import moe_testlib as ml

    res = r2.r2_checks(ml.moe_model(tmp_path, name))
    print(name, res)
    assert not r2.r2_failures(res), res


def test_r2_needs_the_replay_hooks(tmp_path):
    import mcore_testlib as lib
    import moe_testlib as ml

    from megarl.backends.megatron import MegatronBackend, replay
    from megarl.errors import UserInputError

    be = MegatronBackend("actor", str(ml.moe_model(tmp_path, "qwen3_moe")))
    with pytest.raises(UserInputError, match="router_replay.mode=R2"):
        replay.record_logprobs(be, lib.make_batch(B=2))


@pytest.mark.dist
@pytest.mark.e2e
def test_r2_at_tp2_sp_dp2_and_pp2(tmp_path):
    import json

    import mcore_testlib as lib
    import moe_testlib as ml

    for name in ("qwen3_moe_kv2", "qwen3_moe", "qwen3_moe_4l"):  # the worker's models
        ml.moe_model(tmp_path, name)
    out = tmp_path / "r2.json"
    lib.run_torchrun("megatron_r2.py", 2, [str(tmp_path), str(out)], timeout=400)
    res = json.loads(out.read_text())
    for layout, r in res.items():
        print(layout, r)
        assert not r2.r2_failures(r), (layout, r)
    assert sorted(res) == ["dp2", "pp2_vpp2", "tp2_sp"]
