"""GRPO trained on a generative judge's verdicts (verl's ``reward_model.use_reward_loop`` with
``reward_model.rollout.*``) on the embedded demo, the judge served by megarl's torch engine.

The judge is a "scripted" tiny Llama (as in tests/rewards/test_judge.py): identity embeddings,
blocks that write zeros, and an LM head that maps each character to the next one of a fixed
successor map, so greedy decoding walks that map from the last character of the judge prompt.
The template ends with the response, so the verdict of every response is known in plain Python:
a response ending in one of `SCORED` gets ``\\boxed{7}`` (score 7), one ending elsewhere an
unparsable or empty verdict (score 0). Responses are cut at 8 tokens, so their last characters
vary. The test recomputes each response's score from the run's dumped generations and compares
it with the reward the run trained on.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rewards"))
from test_judge import make_scripted_judge, reference_parse  # noqa: E402

EOS = 2  # the tiny tokenizer's <|im_end|>
VERDICT = "\\boxed{7}"
# last characters whose verdict is VERDICT: some digits, the letters outside the verdict's chain
SCORED = [c for c in "01234abcdefghijklmnopqrstuvwxyz" if c not in VERDICT]
TEMPLATE = "A: {response}"
RESPONSE_LENGTH = 16  # verdict tokens at most


def successors() -> dict[str, str | None]:
    """Character -> the next one the scripted judge writes (None: EOS)."""
    nxt: dict[str, str | None] = {c: VERDICT[0] for c in SCORED}
    for a, b in zip(VERDICT, VERDICT[1:]):
        nxt[a] = b
    nxt[VERDICT[-1]] = None
    return nxt


def expected_score(response: str) -> tuple[float, bool]:
    """(score, parsed) of a response: its rendered judge prompt's last character walked through
    `successors` in Python, the verdict read by test_judge's brute-force parser."""
    nxt, c, verdict = successors(), TEMPLATE.format(response=response)[-1], []
    while len(verdict) < RESPONSE_LENGTH:
        c = nxt.get(c)
        if c is None:
            break
        verdict.append(c)
    value = reference_parse("".join(verdict), "boxed")
    return (0.0 if value is None else value), value is not None


def make_judge_model(path: Path) -> Path:
    """Write the scripted judge (and the character tokenizer) to ``path``."""
    return Path(make_scripted_judge(path, successors()))


def judge_overrides(model: Path, engine: str = "torch") -> list[str]:
    vllm = ["reward_model.rollout.gpu_memory_utilization=0.05"] if engine == "vllm" else []
    return [*vllm, "reward_model.enable=true", "reward_model.use_reward_loop=true",
            f"reward_model.rollout.name={engine}", f"reward_model.model.path={model}",
            "reward_model.rollout.dtype=fp32", f"reward_model.rollout.template='{TEMPLATE}'",
            "reward_model.rollout.apply_chat_template=false",
            "reward_model.rollout.prompt_length=256",
            f"reward_model.rollout.response_length={RESPONSE_LENGTH}",
            "reward_model.rollout.max_num_seqs=16"]


@pytest.mark.e2e
@pytest.mark.parametrize("engine", ["torch", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_grpo_trains_on_judge_verdicts(tmp_path, demo_assets, engine):
    from trainer_helpers import train, train_rows

    model = make_judge_model(tmp_path / "judge")
    dumps = tmp_path / "gens"
    t0 = time.perf_counter()
    proc = train(tmp_path / "run", "grpo", "trainer.total_training_steps=2",
                 "data.max_response_length=8",
                 f"trainer.rollout_data_dir={dumps}", *judge_overrides(model, engine))
    print(f"judge trainer run ({engine}): {time.perf_counter() - t0:.1f} s")
    said = proc.stdout + proc.stderr
    assert f"reward_model.rollout.name={engine} engine" in said and "reward_model.enable=true means this judge" in said
    assert "is an outcome reward model" not in said and "process reward model (PURE)" not in said
    rows = train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    everything = []
    for row in rows:
        lines = (dumps / f"{row['step']}.jsonl").read_text().splitlines()
        gens = [json.loads(line) for line in lines]
        assert len(gens) == 16
        expected = [expected_score(g["output"]) for g in gens]
        everything += [s for s, _ in expected]
        # each response's training reward is the judge's verdict, read independently
        assert [g["score"] for g in gens] == [s for s, _ in expected]
        mean = sum(s for s, _ in expected) / len(expected)
        assert math.isclose(row["critic/score/mean"], mean, abs_tol=1e-6)
        unparsed = sum(not ok for _, ok in expected) / len(expected)
        assert math.isclose(row["reward/judge_unparsed_ratio"], unparsed, abs_tol=1e-9)
        assert math.isclose(row["reward/judge_score/mean"], mean, abs_tol=1e-6)
        assert "reward/score/mean" in row  # the rule reward is still logged
        assert math.isfinite(row["actor/pg_loss"])
    assert 0 < sum(s > 0 for s in everything) < len(everything), everything  # verdicts differ


@pytest.mark.e2e
def test_judge_timeout_ends_the_run(tmp_path, demo_assets):
    """A judge past reward_model.rollout.timeout_s ends the run with JudgeTimeoutError naming the
    judge (engine, model, batch) and the key; the process exits (nothing left waiting)."""
    from trainer_helpers import train, train_rows

    model = make_judge_model(tmp_path / "judge")
    proc = train(tmp_path / "run", "grpo", "trainer.total_training_steps=1",
                 "data.max_response_length=8", *judge_overrides(model),
                 "reward_model.rollout.timeout_s=0.001", check=False, timeout=120)
    assert proc.returncode != 0
    err = proc.stderr
    assert "JudgeTimeoutError" in err, err[-3000:]
    assert f"the generative judge (torch engine, model {model})" in err, err[-3000:]
    assert "reward_model.rollout.timeout_s=0.001" in err, err[-3000:]
    logged = tmp_path / "run" / "metrics.jsonl"
    assert not logged.exists() or not train_rows(tmp_path / "run")  # no step finished


def test_rank_shares_merge_to_the_whole_batch(tmp_path):
    """The shares ranks judge (`share`) cover the batch once, in order, and their metrics merged
    (`declared` + megarl.metrics.merge, as `judge_samples` gathers them) equal one judge call
    over the whole batch: counted by hand from the verdicts."""
    from megarl.config.schema_judge import JudgeRolloutConfig
    from megarl.judge.judge import build_judge
    from megarl.judge.ranks import TIME, declared, share
    from megarl.metrics import merge

    for n, world in ((7, 3), (2, 4), (16, 1)):
        got = [i for r in range(world) for i in share(n, world, r)]
        assert got == list(range(n)), (n, world)
    cfg = JudgeRolloutConfig(name="torch", dtype="fp32", template=TEMPLATE,
                             apply_chat_template=False, prompt_length=12,
                             response_length=RESPONSE_LENGTH, max_num_seqs=8)
    judge = build_judge(cfg, str(make_judge_model(tmp_path / "judge")))
    try:
        responses = ["x=1", "a", "12+30=42", "b", "q" * 20, "ok!", "7"]  # "q"*20: over 12 tokens
        whole, _ = judge.score(responses, responses)
        expected = [expected_score(r) for r in responses]
        judged = [i for i, r in enumerate(responses) if len(TEMPLATE.format(response=r)) <= 12]
        assert whole.tolist() == [s if i in judged else 0.0 for i, (s, _) in enumerate(expected)]
        parts = []
        for r in range(3):
            idx = list(share(len(responses), 3, r))
            _, m = judge.score([responses[i] for i in idx], [responses[i] for i in idx])
            parts.append(declared(m, len(idx)))
        merged = merge(parts)
        unparsed = sum(not expected[i][1] for i in judged) / len(judged)
        assert math.isclose(merged["reward/judge_unparsed_ratio"].value, unparsed, abs_tol=1e-12)
        assert math.isclose(merged["reward/judge_overlong_ratio"].value,
                            1 - len(judged) / len(responses), abs_tol=1e-12)
        assert math.isclose(merged["reward/judge_score/mean"].value,
                            float(whole.mean()), abs_tol=1e-6)
        assert merged[TIME].value == max(p[TIME].value for p in parts)
    finally:
        judge.close()
