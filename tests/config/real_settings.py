"""What each seed recipe must resolve to on a real model, written out from the sources (not read
from configs/), and a random tiny HF policy / PRM / parquet standing in for a 7B run's inputs.

Sources: verl's examples/grpo_trainer/run_qwen2_5-7b_math.sh, examples/rloo_trainer/
run_qwen2-7b.sh, examples/ppo_trainer (run_deepseek7b_llm.sh) and docs/algo/grpo.md; PACS's
scripts/pacs/pacs_beta_1.0.sh; PURE's main branch examples/scripts/train_pure.sh (the run behind
PURE's published numbers) and, for the KL rule, PURE's verl branch (KL in the reward unless
use_kl_loss)."""

from __future__ import annotations

from pathlib import Path

COMMON = {
    "actor_rollout_ref.model.dtype": "bf16",
    "actor_rollout_ref.rollout.name": "vllm",
    "actor_rollout_ref.actor.strategy": "torch",
    "actor_rollout_ref.model.enable_gradient_checkpointing": True,
}
PURE = {
    "data.train_batch_size": 64, "data.max_prompt_length": 1024, "data.max_response_length": 2048,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 32,
    "actor_rollout_ref.actor.optim.lr": 5e-7,
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.03,
    "actor_rollout_ref.actor.optim.betas": [0.9, 0.95],
    "actor_rollout_ref.actor.optim.weight_decay": 0.0,
    "actor_rollout_ref.actor.entropy_coeff": 0.0,
    "actor_rollout_ref.actor.use_kl_loss": False,
    "actor_rollout_ref.rollout.n": 4, "actor_rollout_ref.rollout.temperature": 0.5,
    "actor_rollout_ref.rollout.val_kwargs.do_sample": False,
    "algorithm.adv_estimator": "pure_rloo",
    "algorithm.use_kl_in_reward": True, "algorithm.kl_penalty": "kl",
    "algorithm.kl_ctrl.type": "fixed", "algorithm.kl_ctrl.kl_coef": 0.001,
    "reward_model.credit_assignment": 0.1,
    "trainer.total_training_steps": 500,
}
PRM = {
    "reward_model.step_separator": "\n\n", "reward_model.prm_step_token": "\n",
    "reward_model.micro_batch_size_per_gpu": 2,
    "reward_model.forward_max_token_len_per_gpu": 24000,
}
VERL = {
    "data.train_batch_size": 1024, "actor_rollout_ref.actor.ppo_mini_batch_size": 256,
    "actor_rollout_ref.actor.optim.lr": 1e-6, "actor_rollout_ref.actor.optim.betas": [0.9, 0.999],
    "actor_rollout_ref.actor.optim.weight_decay": 0.01, "actor_rollout_ref.actor.entropy_coeff": 0.0,
}
PAPER: dict[str, dict[str, object]] = {
    "grpo": {**COMMON, **VERL, "data.max_prompt_length": 1024, "data.max_response_length": 1024,
             "actor_rollout_ref.rollout.n": 5, "actor_rollout_ref.actor.use_kl_loss": True,
             "actor_rollout_ref.actor.kl_loss_coef": 0.001,
             "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
             "algorithm.use_kl_in_reward": False, "algorithm.adv_estimator": "grpo"},
    "rloo": {**COMMON, **VERL, "data.max_prompt_length": 512, "data.max_response_length": 1024,
             "actor_rollout_ref.rollout.n": 5, "actor_rollout_ref.actor.use_kl_loss": False,
             "algorithm.use_kl_in_reward": True, "algorithm.kl_penalty": "kl",
             "algorithm.kl_ctrl.kl_coef": 0.001, "algorithm.adv_estimator": "rloo"},
    "ppo": {**COMMON, **VERL, "data.max_prompt_length": 512, "data.max_response_length": 512,
            "actor_rollout_ref.rollout.n": 1, "critic.enable": True, "critic.optim.lr": 1e-5,
            "algorithm.adv_estimator": "gae", "algorithm.use_kl_in_reward": False},
    "pacs": {**COMMON, **VERL, "data.max_prompt_length": 512, "data.max_response_length": 4096,
             "actor_rollout_ref.rollout.n": 8, "actor_rollout_ref.actor.use_dynamic_bsz": False,
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 8,
             "actor_rollout_ref.actor.grad_clip": None, "actor_rollout_ref.actor.use_kl_loss": False,
             "pacs.enable": True, "pacs.beta": 1.0, "pacs.reward_method": "1",
             "pacs.adv_estimator": "rloo", "pacs.weight_mode": "question",
             "trainer.total_training_steps": 300},
    "pure_prm_vr": {**COMMON, **PURE, **PRM, "reward_model.enable": True,
                    "reward_model.reward_manager": "prime"},
    "pure_prm": {**COMMON, **PURE, **PRM, "reward_model.enable": True,
                 "reward_model.reward_manager": "blank"},
    "pure_vr": {**COMMON, **PURE, "reward_model.enable": False,
                "reward_model.reward_manager": "prime"},
}

# The embedded demo's small-scale values (its overlay): none may survive on a real model.
DEMO_SCALE = {
    "actor_rollout_ref.actor.optim.lr": 3e-4,
    "actor_rollout_ref.actor.optim.betas": [0.9, 0.98],
    "data.max_prompt_length": 64,
    "data.max_response_length": 64,
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 4096,
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": 4096,
    "actor_rollout_ref.actor.entropy_coeff": 0.01,
    "actor_rollout_ref.model.dtype": "fp32",
    "actor_rollout_ref.rollout.name": "torch",
    "actor_rollout_ref.rollout.max_num_seqs": 512,
    "trainer.project_name": "megarl_demo",
}
DEMO_STEPS = (100, 150)  # trainer.total_training_steps of the demo


def write_tokenizer(path: Path) -> None:
    """The character-level test tokenizer plus a "\\n\\n" token, as Qwen's has (PURE's step ends
    are tokens whose text ends with "\\n\\n"; "\\n" stays one token for the PRM's step marker)."""
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    from megarl.models.testing import CHAT_TEMPLATE, SPECIAL_TOKENS

    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t", "\n\n"]
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n\n|[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def make_inputs(root: Path) -> dict[str, Path]:
    """A random tiny Llama policy and PRM (head_dim 32, as vLLM's CPU attention needs) with the
    tokenizer above, and 8 math rows (train) / 4 (val) as parquet: not embedded assets."""
    from megarl.data.rows import write_rows
    from megarl.models.testing import make_tiny_hf_model

    out = {"policy": root / "Qwen2.5-Math-7B", "prm": root / "PURE-PRM-7B",
           "train": root / "math" / "train.parquet", "val": root / "math500.parquet"}
    for key, head in (("policy", "lm"), ("prm", "token_cls")):
        make_tiny_hf_model(out[key], "llama", head=head, tokenizer=False,
                           num_attention_heads=2, num_key_value_heads=1)
        write_tokenizer(out[key])
    rows = [{"data_source": "math",
             "prompt": [{"role": "user", "content": f"What is {a}+{a}? Answer in \\boxed{{}}."}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * a)},
             "extra_info": {"index": a}} for a in range(8)]
    write_rows(rows, str(out["train"]))
    write_rows(rows[:4], str(out["val"]))
    return out
