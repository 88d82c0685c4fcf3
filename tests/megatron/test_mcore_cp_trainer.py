"""GRPO on megatron with context parallelism, end to end: 2 steps on the embedded task with the
demo policy on 2 gloo ranks at verl's ``actor_rollout_ref.actor.megatron.context_parallel_size=2``
(one data-parallel rank: both ranks run every sequence, each on its load-balanced half). The
rollouts run on megarl's own engine fed with the weights the megatron actor exports, and
``rollout.check_logprobs`` compares the engine's logprobs with the actor's (computed under CP)
on both steps, within the fp32 bound tests/fp32_bounds.py derives from the policy's shape and
weights (5.3e-4). Step 2 checks the weights after an update made under CP. Measured max gaps
(step 1 / step 2): 7.2e-6 / 3.6e-6 on an Intel Xeon.

Planted: the attention mask one column wider than causal (`ContextParallelAttention` showing
each query the next key): gaps 13.8 / 14.7, fails."""

import json
import os

import mcore_testlib as lib
import pytest
from fp32_bounds import fp32_gap_bound
from warm_runs import run_script

pytestmark = pytest.mark.dist
RESPONSE_TOKENS = 16 * 48  # the 4 prompts x 4 responses of 48 tokens at most, below


@pytest.fixture(scope="module")
def demo_assets():
    """The embedded demo assets (built once, cached under assets/)."""
    from megarl.demo.assets import build_all

    return build_all()


def test_grpo_two_steps_at_cp2_engine_and_trainer_agree(tmp_path, demo_assets):
    policy = lib.REPO / "assets" / "policy"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(lib.REPO))
    env.pop("TRITON_INTERPRET", None)
    argv = ["launch/train.py", "--config", "grpo", "--demo", "on",
            f"trainer.default_local_dir={tmp_path}", "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=4",
            "data.max_response_length=48", "trainer.test_freq=-1",
            "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.export_hf=false",
            "trainer.total_training_steps=2", "trainer.n_gpus_per_node=2",
            f"actor_rollout_ref.model.path={policy}", "actor_rollout_ref.actor.strategy=megatron",
            "actor_rollout_ref.actor.megatron.context_parallel_size=2",
            "actor_rollout_ref.rollout.check_logprobs=true"]
    proc = run_script(argv, lib.REPO, env, timeout=600, nproc=2)  # as torchrun, forked warm
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x]
    rows = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2]
    bound = fp32_gap_bound(policy, RESPONSE_TOKENS)
    assert bound < 1e-3, bound
    gaps = [r["rollout/logprob_abs_diff_max"] for r in rows]
    assert all(g <= bound for g in gaps), (gaps, bound)
