"""Every ``python3 -m verl.trainer.main_ppo`` command line of verl's ``examples/**/*.sh`` (the
corpus ``verl_corpus/lines.jsonl``, expanded by ``verl_corpus/expand.py`` from the verl commit
its header names) read by megarl's config check, as README "Coming from verl" says
(``verl_corpus/corpus.py``).

- The outcome of each line (accepted, or rejected with its problem lines) equals the committed
  table ``verl_corpus/outcomes.json``: any change fails (rewrite the table with
  ``python tests/config/verl_corpus/corpus.py`` when the change is meant).
- A line that uses none of the features megarl does not build passes; a rejected line names only
  keys megarl's verl rules refuse as not built (``rejected`` in ``megarl.config.verl_compat``),
  except the lines in ``NOT_PASSING``, each with the reason.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "verl_corpus"))
from corpus import (  # noqa: E402
    OUTCOMES,
    changed_lines,
    line_id,
    not_built,
    outcomes,
    problem_key,
    read_lines,
)

# features outside megarl's scope, found in a line's script path, arguments or config file
FEATURES = {
    "VLM / multi-modal": re.compile(
        r"_vl[-_]|geo3k|glm41v|minicpmo|image_key|freeze_vision_tower|multi_modal"),
    "Ascend NPU": re.compile(r"_npu\b|_npu\.sh|device=npu|ascend", re.I),
    "TensorRT-LLM": re.compile(r"trtllm"),
    "MTP": re.compile(r"\bmtp|mtp\."),
}

_UNSET = "the script reads it from a variable it gives no default (set by its environment)"
# lines that use none of FEATURES and still do not pass, with why (key: problem keys named)
NOT_PASSING = {
    "examples/cispo_trainer/run_cispo_qwen2_5_0_5b_gsm8k.sh#0": (
        {"actor_rollout_ref.model.torch_dtype"},
        "not a key of verl's config either (hydra refuses it in verl too); the dtype is "
        "actor_rollout_ref.model.dtype"),
    "examples/grpo_trainer/run_gptoss_20b.sh#0": ({"data.train_files"}, _UNSET),
    "examples/gspo_trainer/run_qwen30b_gspo.sh#0": ({"launch.nnodes", "launch.nproc_per_node"},
                                                    _UNSET),
    "examples/ppo_trainer/run_deepseek7b_llm_pfppo.sh#0": (
        {""}, "the script passes ' ' (a comment after a line continuation ends its command)"),
    "examples/ppo_trainer/run_moonlight16b_a3b_gsm8k_megatron.sh#0": (
        {"actor_rollout_ref.model.path"}, _UNSET),
    "examples/router_replay/run_qwen30_a3b_megatron_sglang.sh#0": (
        {"data.train_files", "actor_rollout_ref.model.path", "data.train_batch_size",
         "actor_rollout_ref.actor.router_replay.mode"},
        f"{_UNSET}; R3 routing replay with SGLang (megarl records routing in its torch engine)"),
    "examples/router_replay/run_qwen30_a3b_megatron_vllm.sh#0": (
        {"data.train_files", "actor_rollout_ref.model.path"}, _UNSET),
    "examples/sapo_trainer/run_qwen30b_sapo.sh#0": ({"launch.nnodes", "launch.nproc_per_node"},
                                                    _UNSET),
    "examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn_vllm_fsdp.sh#0": (
        {"actor_rollout_ref.actor.use_kl_loss"}, _UNSET),
    "examples/sglang_multiturn/search_r1_like/run_qwen2.5-3b_instruct_search_multiturn.sh#0": (
        {"actor_rollout_ref.rollout.multi_turn.format"},
        "format 'qwen' has no tool parser in verl either (hermes, gpt-oss)"),
    "examples/tuning/70b/qwen2-70b_grpo_32_h20_fsdp_vllm.sh#0": ({"data.train_files"}, _UNSET),
}


def features(line: dict) -> list[str]:
    text = " ".join([line["script"], *line["args"],
                     json.dumps(line.get("config", {}).get("keys", {}))])
    return [name for name, pattern in FEATURES.items() if pattern.search(text)]


@pytest.fixture(scope="module")
def today() -> dict[str, dict]:
    return outcomes()


def test_corpus_is_verls_examples():
    header, lines = read_lines()
    assert re.fullmatch(r"[0-9a-f]{40}", header["verl_commit"])
    assert len(lines) == header["lines"] >= 120
    assert {f["script"] for f in header["failed"]} == {
        "examples/gspo_trainer/run_qwen3_32b_gspo_npu.sh",
        "examples/gspo_trainer/test_gspo_qwen30b_a3b_ep.sh"}
    ids = [line_id(x) for x in lines]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("name,script", [
    ("run_qwen2-7b_math", "examples/grpo_trainer/run_qwen2-7b_math.sh"),
    ("test_gspo_3b_math", "examples/gspo_trainer/test_gspo_3b_math.sh"),
    ("run_qwen2.5-3b_gsm8k_multiturn", "examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh"),
    ("run_deepseek7b_llm", "examples/ppo_trainer/run_deepseek7b_llm.sh"),
])
def test_expansion_matches_the_hand_expanded_scripts(name, script):
    """The trainer tests' argument lists were expanded by hand from the same commit."""
    by_hand = (Path(__file__).resolve().parents[1] / "trainer" / "verl_scripts"
               / f"{name}.args").read_text().splitlines()
    _, lines = read_lines()
    args = next(x["args"] for x in lines if x["script"] == script)
    assert [a for a in args if not a.startswith("--config")] == by_hand


def test_outcomes_equal_the_table(today):
    changed = changed_lines(today, OUTCOMES)
    assert not changed, "outcome changed for: " + ", ".join(changed) + "; rewrite the table " \
        "with python tests/config/verl_corpus/corpus.py if meant"


def test_everyday_lines_pass_or_name_only_what_is_not_built(today):
    _, lines = read_lines()
    unexplained = {}
    for line in lines:
        if features(line):
            continue
        lid = line_id(line)
        everyday = {problem_key(p) for p in today[lid]["problems"]
                    if not_built(problem_key(p)) is None}
        if everyday != (NOT_PASSING[lid][0] if lid in NOT_PASSING else set()):
            unexplained[lid] = everyday
    assert not unexplained, unexplained


def test_rejected_features_are_named_with_the_reason(today):
    """A not-built key's problem line carries the rule's reason."""
    seen = 0
    for got in today.values():
        for p in got["problems"]:
            reason = not_built(problem_key(p))
            if reason is not None:
                assert p.endswith(f"not supported by megarl: {reason}"), p
                seen += 1
    assert seen >= 5  # the not-built features still named in the corpus (6 now: MTP, VLM)


def test_no_everyday_line_is_refused_for_a_feature_not_built(today):
    """Every line free of FEATURES is accepted unchanged or is a script defect of NOT_PASSING;
    none is refused for a feature megarl lacks (megatron's context parallelism was the last:
    before it was built, two lines, a LoRA and a multi-turn one, were refused for it alone)."""
    _, lines = read_lines()
    refused = {}
    for line in lines:
        lid = line_id(line)
        if features(line):
            continue
        named = [p for p in today[lid]["problems"] if not_built(problem_key(p)) is not None]
        if named:
            refused[lid] = named
    assert not refused, refused
    everyday = [line_id(x) for x in lines if not features(x)]
    accepted = sum(today[lid]["outcome"] == "accepted" for lid in everyday)
    assert accepted == len(everyday) - len(NOT_PASSING)


def test_readme_states_the_pass_count(today):
    """README "Coming from verl" gives the number of corpus lines that pass."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    stated = re.search(r"kept in a table:\s+(\d+) pass;", text)
    assert stated is not None, "README no longer states the corpus pass count"
    assert int(stated.group(1)) == sum(o["outcome"] == "accepted" for o in today.values())
