"""The generative judge's config rules: ``reward_model.use_reward_loop`` + ``rollout.name``
turn it on; ``reward_model.enable`` then means the judge (no PRM / outcome RM, no PURE PRM
mode); its keys are listed as read when it is on and as not read (with the switch) when off."""

from __future__ import annotations

import pytest

from megarl.config import ConfigError
from megarl.config.loader import resolve_config
from megarl.config.provenance import UNUSED
from megarl.judge.judge import judge_from_section


def run_judge(cfg, device="cpu"):
    """The judge a run of ``cfg`` serves (None: none)."""
    return judge_from_section(cfg.reward_model, cfg.trainer.seed, device)


JUDGE = ["reward_model.use_reward_loop=true", "reward_model.rollout.name=torch",
         "reward_model.model.path=some/judge"]


def _unused_line(report: str) -> str:
    lines = [line for line in report.splitlines() if line.startswith(f"  {UNUSED} (")]
    return lines[0] if lines else ""


def _listed(report: str, key: str) -> bool:
    return any(line.startswith(f"  {key} ") for line in report.splitlines())


def _problems(recipe: str, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        resolve_config(recipe, overrides)
    return str(err.value)


def test_judge_keys_read_when_on_prm_keys_not(tmp_path):
    """Planted: judge keys flagged unused while the judge is on, or the PRM's keys read."""
    model = _model_folder(tmp_path / "lm", "lm")
    report = resolve_config("grpo", [*JUDGE, "reward_model.enable=true",
                                     f"reward_model.model.path={model}",
                                     "reward_model.rollout.prompt_length=512",
                                     "reward_model.credit_assignment=min"]).report()
    unused = _unused_line(report)
    assert "reward_model.rollout.prompt_length" not in unused, unused
    assert _listed(report, "reward_model.rollout.prompt_length")
    assert _listed(report, "reward_model.model.path")
    assert "reward_model.credit_assignment" in unused, unused
    assert "reward_model.rollout.name=torch" in unused  # the reason the PRM keys are not read


def test_judge_keys_unused_when_off():
    for off, why in (("reward_model.use_reward_loop=false", "reward_model.use_reward_loop=false"),
                     ("reward_model.rollout.name=null", "reward_model.rollout.name=null")):
        cfg = resolve_config("grpo", [*JUDGE, "reward_model.rollout.prompt_length=512", off])
        unused = _unused_line(cfg.report())
        assert "reward_model.rollout.prompt_length" in unused, (off, unused)
        assert why in unused, (off, unused)
        assert run_judge(cfg.config) is None


def test_torch_judge_does_not_read_vllm_keys(tmp_path):
    model = _model_folder(tmp_path / "lm", "lm")
    report = resolve_config("grpo", [*JUDGE, "reward_model.rollout.enforce_eager=false",
                                     f"reward_model.model.path={model}"]).report()
    assert "reward_model.rollout.enforce_eager" in _unused_line(report)


def test_classifier_rollout_keys_unused_unknown_model_says_nothing(tmp_path):
    """verl's "disrm" (a classifier under use_reward_loop + rollout.name): the rollout keys are
    named unused; a hub id (not read before start-up) leaves the judge's and the RM's keys
    unlisted either way."""
    model = _model_folder(tmp_path / "rm", "seq_cls")
    keys = ["reward_model.enable=true", "reward_model.rollout.prompt_length=512",
            "reward_model.credit_assignment=min"]
    unused = _unused_line(resolve_config(
        "grpo", [*JUDGE, *keys, f"reward_model.model.path={model}"]).report())
    assert "reward_model.rollout.prompt_length" in unused and "classifier" in unused, unused
    assert "reward_model.credit_assignment" not in unused  # the outcome RM's settings
    unused = _unused_line(resolve_config("grpo", [*JUDGE, *keys]).report())
    assert "reward_model.rollout" not in unused and "credit_assignment" not in unused, unused


def test_enable_means_the_judge_no_prm_checks():
    """enable=true with the judge: neither the PRM's layout nor PURE's blank rule applies, and
    the judge may be the only reward (reward_manager blank)."""
    cfg = resolve_config("grpo", [*JUDGE, "reward_model.enable=true",
                                  "reward_model.reward_manager=blank"]).config
    assert cfg.reward_model.enable and cfg.reward_model.use_reward_loop
    resolve_config("grpo", [*JUDGE, "reward_model.reward_manager=blank"])


def _model_folder(path, head: str) -> str:
    """A folder holding only config.json: a causal LM, or a classifier head (``seq_cls`` /
    ``token_cls``), as the judge's start-up reads it."""
    from megarl.models.testing import tiny_hf_config

    config = tiny_hf_config("llama")
    config.architectures = [{"lm": "LlamaForCausalLM", "seq_cls": "LlamaForSequenceClassification",
                             "token_cls": "LlamaForTokenClassification"}[head]]
    config.save_pretrained(path)
    return str(path)


def test_judge_with_pure_prm_mode_refused(tmp_path):
    from megarl.errors import UserInputError
    from megarl.trainer.parts import serves_judge

    model = _model_folder(tmp_path / "lm", "lm")
    cfg = resolve_config("pure_prm_vr", [*JUDGE, f"reward_model.model.path={model}"]).config
    with pytest.raises(UserInputError) as err:
        serves_judge(cfg, {"prm": model})
    text = str(err.value)
    assert text.startswith("reward_model.enable=true") and "pure_rloo" in text, text
    # PURE's VR mode on the judge's score is served
    cfg = resolve_config("pure_prm_vr", [*JUDGE, f"reward_model.model.path={model}",
                                         "reward_model.enable=false"]).config
    assert serves_judge(cfg, {"prm": model})


@pytest.mark.parametrize("head", ["seq_cls", "token_cls"])
def test_classifier_is_not_a_judge(tmp_path, head):
    """verl's reward loop serves classifiers too ("disrm"): megarl scores them with one forward
    (outcome RM / PRM); the rollout keys are not read, a bad one is no error."""
    from megarl.trainer.parts import serves_judge

    model = _model_folder(tmp_path / head, head)
    cfg = resolve_config("pure_prm_vr", [*JUDGE, f"reward_model.model.path={model}",
                                         "reward_model.rollout.name=sglang"]).config
    assert not serves_judge(cfg, {"prm": model})
    assert run_judge(cfg) is None


def test_judge_needs_its_model():
    text = _problems("grpo", [*JUDGE, "reward_model.model.path=null"])
    assert "reward_model.model.path" in text and "judge" in text, text


@pytest.mark.parametrize("override,key", [
    ("reward_model.rollout.name=sglang", "reward_model.rollout.name"),
    ("reward_model.rollout.data_parallel_size=2", "reward_model.rollout.data_parallel_size"),
    ("reward_model.rollout.timeout_s=0", "reward_model.rollout.timeout_s"),
])
def test_bad_engine_keys_name_the_key(tmp_path, override, key):
    """Refused before any engine starts (the folder holds no weights)."""
    from megarl.errors import UserInputError

    model = _model_folder(tmp_path / "lm", "lm")
    cfg = resolve_config("grpo", [*JUDGE, f"reward_model.model.path={model}", override]).config
    with pytest.raises(UserInputError) as err:
        run_judge(cfg)
    assert str(err.value).startswith(key), str(err.value)
    # the same value without the judge is not read: no error
    off = resolve_config("grpo", [*JUDGE, f"reward_model.model.path={model}", override,
                                  "reward_model.use_reward_loop=false"]).config
    assert run_judge(off) is None


def test_judge_sequence_longer_than_the_model_refused(tmp_path):
    """prompt_length + response_length past the judge's max_position_embeddings: refused naming
    the keys before any engine starts (vLLM would fail deep in its own config)."""
    from megarl.errors import UserInputError
    from megarl.models import read_hf_config

    model = _model_folder(tmp_path / "lm", "lm")
    limit = read_hf_config(model)["max_position_embeddings"]
    cfg = resolve_config("grpo", [*JUDGE, f"reward_model.model.path={model}",
                                  f"reward_model.rollout.prompt_length={limit}",
                                  "reward_model.rollout.response_length=1"]).config
    with pytest.raises(UserInputError) as err:
        run_judge(cfg)
    text = str(err.value)
    assert "reward_model.rollout.prompt_length" in text and f"={limit}" in text, text


def test_verl_091_spelling_sets_the_judge_engine_and_turns_the_loop_on():
    """verl 0.9.1's reward.reward_model.rollout.* lands on reward_model.rollout.*, and its
    rollout.name turns the reward loop on (that release always serves its reward model through
    it); engine details are inert, settings megarl lacks are refused by name. Planted: the
    section left inert (the judge never starts), or the loop not switched on."""
    rm = resolve_config("grpo", ["reward.reward_model.enable=true",
                                 "reward.reward_model.model_path=some/judge",
                                 "reward.reward_model.rollout.name=torch",
                                 "reward.reward_model.rollout.temperature=0.5",
                                 "reward.reward_model.rollout.scheduling_policy=fcfs"]).config.reward_model
    assert rm.use_reward_loop is True and rm.enable is True
    assert (rm.rollout.name, rm.rollout.temperature, rm.model.path) == ("torch", 0.5, "some/judge")
    # without a rollout.name, the loop stays off (an outcome RM / PRM path)
    assert resolve_config("grpo", ["reward.reward_model.rollout.temperature=0.5"]
                          ).config.reward_model.use_reward_loop is False
    assert "reward.reward_model.rollout.n" in _problems(
        "grpo", ["reward.reward_model.rollout.name=torch", "reward.reward_model.rollout.n=4"])
