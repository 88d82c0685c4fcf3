"""One config -> both backends: the keyword arguments `megarl.backends.torch.config` and
`megarl.backends.megatron.config` build for every role carry the values written in the config
(checked against the keys set here, not against the settings layer), and agree where both
backends have the setting.

Planted: megatron's former PRM dtype (the actor's ``megatron.param_dtype`` before
``reward_model.model.dtype``) gives bf16 for the fp32 PRM below and fails
`test_every_role_reads_its_own_keys`."""

from __future__ import annotations

import pytest

from megarl.backends.torch.config import backend_kwargs as torch_kwargs
from megarl.config import load_config
from megarl.config.schema import Config
from megarl.errors import UserInputError
from megarl.trainer.settings import role_settings

megatron_config = pytest.importorskip("megarl.backends.megatron.config")

OVERRIDES = [
    "trainer.seed=7", "trainer.device=cpu", "launch.nproc_per_node=4",
    "data.train_files=train.parquet",
    "actor_rollout_ref.model.path=/policy", "actor_rollout_ref.model.dtype=bf16",
    "actor_rollout_ref.actor.parallel.tensor_model_parallel_size=2",
    "actor_rollout_ref.actor.optim.lr=2e-6", "actor_rollout_ref.actor.grad_clip=0.5",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=5",
    "critic.model.path=/critic", "critic.optim.lr=5e-6",
    "critic.parallel.pipeline_model_parallel_size=2",
    "critic.ppo_micro_batch_size_per_gpu=6", "critic.use_dynamic_bsz=false",
    "reward_model.enable=true", "reward_model.model.path=/prm",
    "reward_model.model.dtype=fp32", "reward_model.use_dynamic_bsz=true",
]
# role: (path, dtype, tp, pp, lr or None, no-grad rows or None = token budget)
EXPECTED = {
    "actor": ("/policy", "bf16", 2, 1, 2e-6, 3),
    "ref": ("/policy", "bf16", 2, 1, None, 5),
    "critic": ("/critic", "bf16", 1, 2, 5e-6, 6),
    "prm": ("/prm", "fp32", 1, 1, None, None),
}


@pytest.mark.parametrize("role", list(EXPECTED))
def test_every_role_reads_its_own_keys(role):
    cfg = load_config("ppo", OVERRIDES)
    path, dtype, tp, pp, lr, rows = EXPECTED[role]
    t_path, t = torch_kwargs(role_settings(role, cfg))
    m_path, m = megatron_config.backend_kwargs(role_settings(role, cfg))
    assert t_path == m_path == path
    assert t["dtype"] == m["dtype"] == dtype
    assert (t["tp"], t["pp"]) == (m["tp"], m["pp"]) == (tp, pp)
    assert t["seed"] == m["seed"] == 7
    assert t["forward_micro_batch_size"] == m["forward_micro_batch_size"] == rows
    assert (t["forward_max_tokens"] is None) == (rows is not None)
    if lr is None:
        assert "optim" not in t and m["optim"] is None
    else:  # one settings object, the same for both backends
        assert t["optim"] == m["optim"] and t["optim"].lr == lr
        clip = 0.5 if role == "actor" else cfg.critic.grad_clip
        assert t["optim"].grad_clip == clip


def test_bare_config_follows_the_loaders_rules():
    """Unfilled keys (a Config not passed through load_config): a ref micro size without a
    flag means fixed rows; the critic's model path and dtype are the actor's; a missing PRM
    path names its key."""
    cfg = Config()
    cfg.actor_rollout_ref.model.path = "/policy"
    cfg.actor_rollout_ref.model.dtype = "fp32"
    cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu = 4
    for kwargs in (torch_kwargs, megatron_config.backend_kwargs):
        assert kwargs(role_settings("ref", cfg))[1]["forward_micro_batch_size"] == 4
        assert kwargs(role_settings("actor", cfg))[1]["forward_micro_batch_size"] is None
        path, critic = kwargs(role_settings("critic", cfg))
        assert path == "/policy" and critic["dtype"] == "fp32"
    with pytest.raises(UserInputError, match="reward_model.model.path"):
        role_settings("prm", cfg)


def test_megatron_keys_stay_megatrons():
    """param_dtype and recompute are read by megatron only; the torch backend refuses a
    virtual pipeline, naming the role's key."""
    cfg = load_config("ppo", ["actor_rollout_ref.model.path=/policy", "launch.nproc_per_node=2",
                              "data.train_files=train.parquet",
                              "actor_rollout_ref.model.dtype=bf16",
                              "actor_rollout_ref.actor.megatron.param_dtype=fp32",
                              "actor_rollout_ref.model.enable_gradient_checkpointing=true",
                              "critic.parallel.pipeline_model_parallel_size=2",
                              "critic.parallel.virtual_pipeline_model_parallel_size=2"])
    _, m = megatron_config.backend_kwargs(role_settings("actor", cfg))
    _, t = torch_kwargs(role_settings("actor", cfg))
    assert (m["dtype"], t["dtype"]) == ("fp32", "bf16")
    assert m["recompute"] == "full" and t["activation_checkpointing"] is True
    assert megatron_config.backend_kwargs(role_settings("critic", cfg))[1]["vpp"] == 2
    with pytest.raises(UserInputError, match="critic.parallel.virtual_pipeline"):
        torch_kwargs(role_settings("critic", cfg))


@pytest.mark.parametrize("extra,rows,budget", [
    # verl's reward loop needs no micro size: without one the reward model packs by tokens
    (["reward_model.use_dynamic_bsz=false", "reward_model.forward_max_token_len_per_gpu=777"],
     None, 777),
    (["reward_model.use_dynamic_bsz=false", "reward_model.micro_batch_size_per_gpu=4"], 4, None),
])
def test_reward_model_without_a_micro_size_packs_by_its_token_budget(extra, rows, budget):
    over = [o for o in OVERRIDES if not o.startswith("reward_model.use_dynamic_bsz")]
    cfg = load_config("ppo", over + ["actor_rollout_ref.actor.use_dynamic_bsz=false",
                                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                     *extra])
    t = torch_kwargs(role_settings("prm", cfg))[1]
    assert (t["forward_micro_batch_size"], t["forward_max_tokens"]) == (rows, budget)
    m = megatron_config.backend_kwargs(role_settings("prm", cfg))[1]
    assert m["forward_micro_batch_size"] == rows
