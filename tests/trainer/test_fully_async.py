"""The disaggregated mode end to end (``actor_rollout_ref.hybrid_engine=false``): GRPO on the
demo with two rollout worker processes (megarl/rollout/worker_pool.py), staleness 1 (a window
of 2 x 4 prompts), weights streamed after every step with the digest check on.

- each learner step trains 4 distinct prompts (all their samples), the weights it starts from
  are version step - 1, the first batch is all version 0 and no sample is from the future;
  every step streamed the weights; validation runs on the workers;
- resumed from the checkpoint of step 2, the run trains in steps 3 and 4 exactly the prompts
  the uninterrupted run trained there (those handed out but not trained when step 2 saved):
  none lost, none trained twice; the 16 prompts of the 4 steps are distinct;
- a worker killed (SIGKILL) as step 2 begins is dropped with a warning naming it, the weight
  group forms again without it and the run ends its 4 steps on the other, every prompt once;
- two trainer ranks (FSDP) with one worker: the batches, the weight export and validation
  span the world;
- a partial rollout (``async_training.partial_rollout=true``) on one worker that generates one
  sequence at a time, so it is always mid-sequence when new weights arrive: samples span
  versions, each token's version is at most the trained one and never decreases, a sample's
  version is its first token's, and the per-token lag metrics agree with the tokens.
"""

from __future__ import annotations

import json

import pytest
from trainer_helpers import metrics, train

pytestmark = pytest.mark.dist  # rollout worker processes

DISAGGREGATED = ["actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=1",
                 "rollout.n_gpus_per_node=2", "rollout.check_weight_digest=true",
                 "async_training.staleness_threshold=1", "trainer.total_training_steps=4"]


def _probe(tmp_path, name, *overrides, probe_args=()):
    out = tmp_path / f"{name}.json"
    proc = train(tmp_path / name, "grpo", *DISAGGREGATED, *overrides,
                 python_args=("tests/trainer/fully_async_probe.py", str(out), *probe_args),
                 timeout=900)
    return json.loads(out.read_text()), proc


def test_fully_async_trains_every_prompt_once_across_a_resume(tmp_path):
    rows, _ = _probe(tmp_path, "a", "trainer.save_freq=2", "trainer.test_freq=4",
                     "data.val_batch_size=100")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(len(r["prompts"]) == 4 and len(r["versions"]) == 16 for r in rows)
    assert all(0 <= v <= r["step"] - 1 for r in rows for v in r["versions"])
    assert set(rows[0]["versions"]) == {0}
    trained = [p for r in rows for p in r["prompts"]]
    assert len(set(trained)) == 16, trained
    m = {r["step"]: r for r in metrics(tmp_path / "a") if r["step"] > 0}
    for step in range(1, 5):
        assert m[step]["async/policy_version"] == step - 1
        assert m[step]["rollout/weight_sync_bytes"] > 0
        assert m[step]["async/policy_version_lag/min"] >= 0
    assert 0.0 <= m[4]["val/test_score/arith"] <= 1.0

    ckpt = tmp_path / "a" / "checkpoints" / "global_step_2"
    state = json.loads((ckpt / "trainer_state.json").read_text())["fully_async"]
    assert state["taken"] == 8 and len(state["untrained"]) == 8 and state["next_key"] == 16
    resumed, _ = _probe(tmp_path, "b", f"trainer.resume={ckpt}", "trainer.save_freq=-1",
                        "trainer.test_freq=-1")
    assert [r["step"] for r in resumed] == [3, 4]
    assert sorted(p for r in resumed for p in r["prompts"]) == sorted(trained[8:])


def test_a_worker_killed_mid_run_is_dropped_and_the_run_goes_on(tmp_path):
    rows, proc = _probe(tmp_path, "k", "trainer.save_freq=-1", "trainer.test_freq=-1",
                        probe_args=("--kill-worker-at=2",))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert len({p for r in rows for p in r["prompts"]}) == 16  # its prompts served by the other
    assert "rollout worker dropped: rollout worker 1 (pid " in proc.stderr
    assert "the weight group formed again with the 1 live rollout workers" in proc.stderr
    m = {r["step"]: r for r in metrics(tmp_path / "k") if r["step"] > 0}
    assert all(m[s]["rollout/weight_sync_bytes"] > 0 for s in range(1, 5))


def test_two_trainer_ranks_share_one_worker_s_batches(tmp_path):
    """SPMD: rank 0 takes the batch and hands it to rank 1, both export the weights (one
    stream), validation runs once on the worker for the whole world."""
    train(tmp_path, "grpo", *DISAGGREGATED[:4], "rollout.n_gpus_per_node=1",
          "async_training.staleness_threshold=1", "trainer.total_training_steps=3",
          "trainer.test_freq=3", "data.val_batch_size=100", "launch.nproc_per_node=2",
          nproc=2, timeout=900)
    m = {r["step"]: r for r in metrics(tmp_path) if r["step"] > 0}
    assert [m[s]["async/policy_version"] for s in (1, 2, 3)] == [0, 1, 2]
    assert m[1]["async/policy_version_lag/max"] == 0
    assert all(m[s]["rollout/weight_sync_bytes"] > 0 for s in (1, 2, 3))
    assert 0.0 <= m[3]["val/test_score/arith"] <= 1.0


def test_partial_rollout_samples_span_versions(tmp_path):
    rows, _ = _probe(tmp_path, "p", "rollout.n_gpus_per_node=1",
                     "async_training.partial_rollout=true",
                     "async_training.staleness_threshold=3",  # a window of 16 prompts
                     "actor_rollout_ref.rollout.max_num_seqs=1",  # one sequence at a time
                     "trainer.save_freq=-1", "trainer.test_freq=-1")
    m = {r["step"]: r for r in metrics(tmp_path / "p") if r["step"] > 0}
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    spanning = 0
    for r in rows:
        for first, tokens in zip(r["versions"], r["token_versions"], strict=True):
            assert tokens == sorted(tokens) and tokens[0] == first
            assert tokens[-1] <= r["step"] - 1  # none from weights not yet trained
            spanning += tokens[0] != tokens[-1]
        flat = [v for tokens in r["token_versions"] for v in tokens]
        lag = [r["step"] - 1 - v for v in flat]
        row = m[r["step"]]
        assert row["async/token_version_lag/max"] == max(lag)
        assert row["async/token_version_lag/min"] == min(lag)
        assert row["async/token_version_lag/mean"] == pytest.approx(sum(lag) / len(lag))
        share = sum(t[0] != t[-1] for t in r["token_versions"]) / len(r["token_versions"])
        assert row["async/partial_samples"] == pytest.approx(share)
    assert spanning > 0, "no sample spanned a weight sync"
