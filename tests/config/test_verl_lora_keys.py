"""verl's LoRA keys read by megarl's config: verl's megatron LoRA block
(``actor_rollout_ref.model.lora.*``, defaults from verl 0.9.1's ``megatron_peft.py``: alpha 32,
``lora_A_init_method`` xavier, targets linear_qkv / linear_proj / linear_fc1 / linear_fc2) lands
on megarl's LoRA keys with megatron module names read as the HF projections they hold; both
spellings set differently, unsupported values, and the critic's LoRA are refused naming the
key; ``lora_adapter_path`` is a key of its own. The expected values are written out by hand
from verl's defaults and Megatron-Bridge's module layout."""

from __future__ import annotations

import pytest

from megarl.config import ConfigError
from megarl.config.loader import resolve_config

BASE = """
data: {train_files: train.parquet, train_batch_size: 8, max_response_length: 64}
actor_rollout_ref:
  model: {path: base/model}
  actor: {ppo_mini_batch_size: 8}
  rollout: {n: 2}
algorithm: {adv_estimator: grpo}
"""
M = "actor_rollout_ref.model"
ALL_HF = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_FIELDS = ("lora_rank", "lora_alpha", "target_modules", "exclude_modules",
               "lora_A_init_method", "lora_B_init_method", "lora_adapter_path")


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(BASE)

    def resolve(*overrides: str) -> dict:
        m = resolve_config(str(path), list(overrides)).config.actor_rollout_ref.model
        return {k: getattr(m, k) for k in LORA_FIELDS}

    resolve.path = path
    return resolve


def test_corpus_line_block_lands_on_megarl_keys(model):
    """examples/grpo_trainer/run_qwen2-7b_math_megatron_lora.sh: rank 256, alpha 512, A drawn
    kaiming; the unset targets are verl's four megatron modules = every HF projection."""
    got = model(f"{M}.lora.rank=256", f"{M}.lora.alpha=512", f"{M}.lora.lora_A_init_method=kaiming")
    assert got == {"lora_rank": 256, "lora_alpha": 512, "target_modules": ALL_HF,
                   "exclude_modules": None, "lora_A_init_method": "kaiming",
                   "lora_B_init_method": "zero", "lora_adapter_path": None}


def test_block_rank_alone_brings_the_block_defaults(model):
    """verl's block defaults (alpha 32, xavier), not the FSDP keys' (lora_alpha 16, PEFT's
    kaiming). Planted: alpha left at 16 or the init at kaiming fails."""
    got = model(f"{M}.lora.rank=8")
    assert (got["lora_rank"], got["lora_alpha"], got["lora_A_init_method"]) == (8, 32, "xavier")
    assert got["target_modules"] == ALL_HF
    # without the block nothing changes: megarl's (and verl's FSDP) defaults
    assert model() == {"lora_rank": 0, "lora_alpha": 16, "target_modules": "all-linear",
                       "exclude_modules": None, "lora_A_init_method": "kaiming",
                       "lora_B_init_method": "zero", "lora_adapter_path": None}


def test_megatron_names_become_hf_projections(model):
    got = model(f"{M}.lora.rank=4", f"{M}.lora.target_modules=[linear_qkv,linear_fc2]",
                f"{M}.lora.exclude_modules=[linear_k,linear_fc1_up]",
                f"{M}.lora.lora_B_init_method=normal")
    assert got["target_modules"] == ["q_proj", "k_proj", "v_proj", "down_proj"]
    assert got["exclude_modules"] == ["k_proj", "up_proj"]
    assert got["lora_B_init_method"] == "normal"
    # HF names and a regular expression pass unchanged; canonical_lora is read the same way
    got = model(f"{M}.lora.rank=4", f"{M}.lora.type=canonical_lora",
                f"{M}.lora.target_modules=[linear_proj,gate_proj]",
                f"{M}.lora.exclude_modules=.*layers\\.0\\..*")
    assert got["target_modules"] == ["o_proj", "gate_proj"]
    assert got["exclude_modules"] == r".*layers\.0\..*"


def test_flat_keys_next_to_the_block_fill_what_it_leaves(model):
    """A flat key the block does not set stays (no block default over it); the same value in
    both spellings is fine."""
    got = model(f"{M}.lora.rank=8", f"{M}.lora_alpha=64", f"{M}.target_modules=[q_proj]",
                f"{M}.lora_rank=8")
    assert (got["lora_rank"], got["lora_alpha"], got["target_modules"]) == (8, 64, ["q_proj"])


@pytest.mark.parametrize("overrides, named", [
    ((f"{M}.lora.rank=8", f"{M}.lora_rank=16"), (f"{M}.lora.rank", f"{M}.lora_rank")),
    ((f"{M}.lora.rank=8", f"{M}.lora.alpha=16", f"{M}.lora_alpha=32"),
     (f"{M}.lora.alpha", f"{M}.lora_alpha")),
    ((f"{M}.lora.rank=8", f"{M}.lora.target_modules=[linear_qkv]",
      f"{M}.target_modules=[q_proj]"), (f"{M}.lora.target_modules", f"{M}.target_modules")),
    ((f"{M}.lora.rank=8", f"{M}.lora.dropout=0.1", f"{M}.lora_dropout=0.2"),
     (f"{M}.lora.dropout", f"{M}.lora_dropout")),
    ((f"{M}.lora.rank=8", f"{M}.lora.dropout_position=middle"),
     (f"{M}.lora_dropout_position",)),
    ((f"{M}.lora.rank=8", f"{M}.lora.type=dora"), (f"{M}.lora.type", "DoRA")),
    ((f"{M}.lora.rank=8", f"{M}.lora.adapter_path=/ckpt/adapter"),
     (f"{M}.lora.adapter_path", f"{M}.lora_adapter_path")),
    ((f"{M}.lora.rank=8", f"{M}.lora.lora_A_init_method=orthogonal"),
     (f"{M}.lora_A_init_method",)),
    (("critic.model.lora.rank=8",), ("critic.model.lora.rank", "actor only")),
])
def test_refusals_name_the_key(model, overrides, named):
    with pytest.raises(ConfigError) as e:
        model(*overrides)
    text = str(e.value)
    assert all(n in text for n in named), text


def test_inert_block_keys_are_accepted_with_a_notice(model):
    path = model.path
    r = resolve_config(str(path), [f"{M}.lora.rank=8", f"{M}.lora.merge=true",
                                   f"{M}.lora.dtype=bf16", f"{M}.lora.dropout=0.0"])
    text = "\n".join(r.notices)
    assert f"{M}.lora.merge=True" in text and f"{M}.lora.dtype='bf16'" in text
    assert r.config.actor_rollout_ref.model.lora_rank == 8


def test_adapter_path_is_read(model):
    got = model(f"{M}.lora_adapter_path=/saved/lora_adapter")
    assert got["lora_adapter_path"] == "/saved/lora_adapter" and got["lora_rank"] == 0


def test_backends_read_the_block_settings(model):
    """What both backends build from the resolved config (`lora_settings`): the block's
    rank, alpha, HF targets and draws. Planted: the init methods not passed on fails."""
    from megarl.trainer.settings import lora_settings

    cfg = resolve_config(str(model.path), [f"{M}.lora.rank=8",
                                           f"{M}.lora.lora_B_init_method=normal"]).config
    s = lora_settings(cfg)
    assert (s.rank, s.alpha, s.target_modules, s.init_a, s.init_b, s.adapter_path) == (
        8, 32.0, ALL_HF, "xavier", "normal", None)
    assert lora_settings(resolve_config(str(model.path)).config) is None


def test_dropout_keys_reach_the_backends(model):
    """Megatron-Bridge's block dropout (verl's megatron spelling) and PEFT's flat key land on
    the adapters' dropout and its position; a probability outside [0, 1) is one error naming
    the key. Planted: the block's dropout dropped (0.0) or its position ignored fails."""
    from megarl.errors import UserInputError
    from megarl.trainer.settings import lora_settings

    def settings(*overrides):
        return lora_settings(resolve_config(str(model.path), list(overrides)).config)

    s = settings(f"{M}.lora.rank=8", f"{M}.lora.dropout=0.05", f"{M}.lora.dropout_position=post")
    assert (s.dropout, s.dropout_position) == (0.05, "post")
    s = settings(f"{M}.lora_rank=8", f"{M}.lora_dropout=0.1")
    assert (s.dropout, s.dropout_position) == (0.1, "pre")
    assert settings(f"{M}.lora_rank=8").dropout == 0.0
    for bad in ("1.0", "-0.1"):
        with pytest.raises(UserInputError, match=f"{M}.lora_dropout="):
            settings(f"{M}.lora_rank=8", f"{M}.lora_dropout={bad}")


def test_block_without_rank_leaves_the_flat_keys(model):
    """verl reads the megatron block only with its rank set: verl's own defaults of both
    spellings together (lora.alpha 32 beside lora_alpha 16) load, the flat key winning; with
    the block's rank set the same pair is a conflict."""
    got = model(f"{M}.lora.alpha=32", f"{M}.lora_alpha=16", f"{M}.lora_rank=8")
    assert (got["lora_rank"], got["lora_alpha"]) == (8, 16)
    with pytest.raises(ConfigError, match=f"{M}.lora.alpha"):
        model(f"{M}.lora.rank=8", f"{M}.lora.alpha=32", f"{M}.lora_alpha=16")
