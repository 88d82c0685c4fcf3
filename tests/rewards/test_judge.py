"""The generative judge (megarl.judge.judge) on megarl's torch engine.

The judge model is a "scripted" tiny Llama: embeddings are the identity, every attention and
MLP block writes zeros (o_proj = down_proj = 0) and the LM head maps each character to the next
character of a fixed chain, so greedy decoding walks the chain (`CHAINS`) from the last prompt
character. The expected verdict of any prompt is therefore known independently of every
engine: `expected_verdict` walks the chain in plain Python, `reference_parse` reads it.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from megarl.config.schema_judge import JudgeRolloutConfig
from megarl.errors import UserInputError
from megarl.judge.judge import Judge, JudgeTimeoutError, build_judge, judge_from_section
from megarl.judge.template import load_template
from megarl.rollout.protocol import Completion

EOS = 2
# last prompt character -> the verdict the scripted model writes after it (then EOS)
CHAINS = {".": "\\boxed{1}", "?": "SCORE: 7", "!": None}  # "!": "[" forever (never ends)
TEMPLATE = "Q: {prompt}\nA: {response}"  # ends with the response: its last char picks the chain


def char_id(c: str) -> int:
    """The tiny tokenizer's id of a character (3 + printable ASCII, then newline, tab)."""
    return {"\n": 98, "\t": 99}.get(c, 3 + ord(c) - 32)


def successor_map() -> dict[str, str | None]:
    """Character -> the next one the model writes (None: EOS)."""
    nxt: dict[str, str | None] = {"!": "[", "[": "["}
    for start, verdict in CHAINS.items():
        if verdict is None:
            continue
        walk = start + verdict
        for a, b in zip(walk, walk[1:]):
            assert nxt.get(a, b) == b, f"chain conflict at {a!r}"
            nxt[a] = b
        nxt[walk[-1]] = None
    return nxt


def expected_verdict(prompt_text: str, max_tokens: int) -> tuple[str, str]:
    """(verdict text, finish reason) of greedy decoding, by walking the chain in Python."""
    nxt, c, out = successor_map(), prompt_text[-1], []
    while len(out) < max_tokens:
        c = nxt.get(c)
        if c is None:
            return "".join(out), "stop"
        out.append(c)
    return "".join(out), "length"


def make_scripted_judge(path, successors: dict[str, str | None] | None = None) -> str:
    """Write the scripted judge model (and the character tokenizer) to ``path``: greedy
    decoding writes ``successors[c]`` after character c (None: EOS; default `successor_map`)."""
    import transformers

    from megarl.models.testing import make_tiny_tokenizer, tiny_hf_config

    config = tiny_hf_config("llama", hidden_size=128, intermediate_size=256)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    head = torch.zeros(128, 128)
    nxt = successor_map() if successors is None else successors
    head[EOS, :] = 1.0
    for a, b in nxt.items():
        if b is not None:
            head[EOS, char_id(a)] = 0.0
            head[char_id(b), char_id(a)] = 1.0
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(128))
        model.lm_head.weight.copy_(head)
        model.model.norm.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(path)
    make_tiny_tokenizer(128).save_pretrained(path)
    return str(path)


def reference_parse(text: str, mode: str) -> float | None:
    """The verdict's score, read the slow way: every prefix tried for the grammar."""
    def number(s: str) -> float | None:
        s = s.strip(" \t\n")
        body = s[1:] if s[:1] in "+-" else s
        if not body or len(s) > 32 or body.count(".") > 1 or body == ".":
            return None
        if any(ch not in "0123456789." for ch in body):
            return None
        return float(s)

    if mode == "yes_no":
        spots = [(i, 1.0) for i in range(len(text)) if text.startswith("[[YES]]", i)]
        spots += [(i, 0.0) for i in range(len(text)) if text.startswith("[[NO]]", i)]
        return max(spots)[1] if spots else None
    if mode == "score":
        lines = [ln for ln in text.split("\n") if ln.strip()]
        if not lines:
            return None
        line = lines[-1].strip()
        head, sep, tail = line.partition(":")
        return number(tail) if sep and head.rstrip(" \t").lower() == "score" else None
    starts = [i for i in range(len(text)) if text.startswith("\\boxed", i)
              and not text[i + 6 : i + 7].isalpha()]
    if not starts:
        return None
    j = starts[-1] + 6
    if text[j : j + 1] == " ":  # the space form: \boxed 7 -> the next word
        words = text[j:].split("$")[0].split()
        return number(words[0]) if words else None
    while j < len(text) and text[j] in " \t":
        j += 1
    if j >= len(text) or text[j] != "{":
        return None
    depth = 0
    for k in range(j, len(text)):
        if text[k] == "\\":
            continue
        depth += {"{": 1, "}": -1}.get(text[k], 0)
        if depth == 0:
            return number(text[j + 1 : k])
    return None


@pytest.fixture(scope="module")
def judge_folder(tmp_path_factory):
    return make_scripted_judge(tmp_path_factory.mktemp("scripted_judge") / "m")


def cfg_of(**kw) -> JudgeRolloutConfig:
    base = dict(name="torch", dtype="fp32", template=TEMPLATE, apply_chat_template=False,
                prompt_length=96, response_length=24, max_num_seqs=8, timeout_s=120.0)
    return JudgeRolloutConfig(**{**base, **kw})


RESPONSES = ["It is 4.", "Maybe 5?", "Wow!", "plain", "x" * 120 + "."]


@pytest.fixture(scope="module")
def torch_judge(judge_folder):
    judge = build_judge(cfg_of(), judge_folder)
    yield judge
    judge.close()


def test_torch_judge_walks_the_script_and_parses(torch_judge):
    prompts = ["What is 2+2?"] * len(RESPONSES)
    scores, metrics = torch_judge.score(prompts, RESPONSES, ["4"] * len(RESPONSES))
    texts = [TEMPLATE.format(prompt=p, response=r) for p, r in zip(prompts, RESPONSES)]
    assert torch_judge.last_prompts == texts
    want = []
    unparsed = judged = truncated = 0
    for text, got in zip(texts, torch_judge.last_verdicts):
        if len(text) > 96:  # one character, one token: over prompt_length -> not judged
            assert got is None
            want.append(0.0)
            continue
        verdict, finish = expected_verdict(text, 24)
        assert got == verdict
        judged += 1
        truncated += finish == "length"
        value = reference_parse(verdict, "boxed")
        unparsed += value is None
        want.append(0.0 if value is None else value)
    assert scores.dtype == torch.float32 and scores.tolist() == want == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert torch_judge.last_verdicts[:4] == ["\\boxed{1}", "SCORE: 7", "[" * 24, ""]
    assert metrics["reward/judge_unparsed_ratio"] == unparsed / judged == 3 / 4
    assert metrics["reward/judge_overlong_ratio"] == 1 / 5
    assert metrics["reward/judge_truncated_ratio"] == truncated / judged == 1 / 4
    assert metrics["reward/judge_score/mean"] == pytest.approx(1 / 5)


def test_score_line_parser_and_bounds(judge_folder, torch_judge):
    judge = Judge(torch_judge.engine, torch_judge.tokenizer, load_template(TEMPLATE),
                  cfg_of(score_parse="score", score_max=10.0))
    scores, m = judge.score(["q"] * 3, ["a.", "b?", "c?"])
    assert scores.tolist() == [0.0, 7.0, 7.0] and m["reward/judge_unparsed_ratio"] == 1 / 3
    capped = Judge(torch_judge.engine, torch_judge.tokenizer, load_template(TEMPLATE),
                   cfg_of(score_parse="score", score_max=5.0))
    scores, m = capped.score(["q"], ["b?"])  # 7 is outside [.., 5]: no verdict
    assert scores.tolist() == [0.0] and m["reward/judge_unparsed_ratio"] == 1.0


def test_do_sample_false_is_greedy_at_any_temperature(torch_judge):
    judge = Judge(torch_judge.engine, torch_judge.tokenizer, load_template(TEMPLATE),
                  cfg_of(temperature=5.0, do_sample=False))
    scores, _ = judge.score(["q"] * 3, ["a.", "b.", "c."])
    assert judge.last_verdicts == ["\\boxed{1}"] * 3 and scores.tolist() == [1.0] * 3


def test_chat_template_encoding(judge_folder, torch_judge):
    """apply_chat_template wraps the rendered prompt as one user turn (the tiny tokenizer's
    template, spelled out here with its ids: 1 <|im_start|>, 2 <|im_end|>)."""
    judge = Judge(torch_judge.engine, torch_judge.tokenizer, load_template(TEMPLATE),
                  cfg_of(apply_chat_template=True))
    text = "Q: x\nA: y."
    want = ([1] + [char_id(c) for c in "user\n" + text] + [2, char_id("\n"), 1]
            + [char_id(c) for c in "assistant\n"])
    assert judge.encode(text) == want
    assert torch_judge.encode(text) == [char_id(c) for c in text]


class HungEngine:
    """An engine whose generation never returns until released (a hung device)."""

    def __init__(self):
        self.release, self.calls = threading.Event(), 0

    def generate(self, prompts, sampling, prompt_keys=None):
        self.calls += 1
        self.release.wait()
        return [Completion(i, [char_id("7")], None, "stop") for i in range(len(prompts))]

    def close(self):
        self.release.set()


def test_a_judge_that_never_finishes_times_out_naming_it(torch_judge):
    import time

    engine = HungEngine()
    judge = Judge(engine, torch_judge.tokenizer, load_template(TEMPLATE),
                  cfg_of(timeout_s=0.3, score_parse="score"), model_path="/models/judge-x")
    safety = threading.Timer(10.0, engine.release.set)  # a judge without a bound still ends
    safety.start()
    t0 = time.perf_counter()
    with pytest.raises(JudgeTimeoutError) as err:
        judge.score(["q", "q"], ["a", "b"])
    waited = time.perf_counter() - t0
    safety.cancel()
    assert 0.3 <= waited < 3.0
    msg = str(err.value)
    for part in ("HungEngine", "/models/judge-x", "2 verdicts", "timeout_s=0.3"):
        assert part in msg
    with pytest.raises(JudgeTimeoutError, match="still busy"):
        judge.score(["q"], ["a"])
    assert engine.calls == 1  # the busy engine was not handed a second batch
    engine.release.set()
    judge._pending.join(5)
    scores, _ = judge.score(["q"], ["Score: 7"])  # the engine answers "7": not a score line
    assert scores.tolist() == [0.0] and engine.calls == 2


def test_engine_errors_reach_the_caller(torch_judge):
    class Broken(HungEngine):
        def generate(self, prompts, sampling, prompt_keys=None):
            raise RuntimeError("device lost")

    judge = Judge(Broken(), torch_judge.tokenizer, load_template(TEMPLATE), cfg_of())
    with pytest.raises(RuntimeError, match="device lost"):
        judge.score(["q"], ["a"])


@pytest.mark.parametrize("change, match", [
    (dict(name=None), r"reward_model\.rollout\.name is required"),
    (dict(name="sglang"), r"name=sglang.*vllm or torch"),
    (dict(timeout_s=0), r"reward_model\.rollout\.timeout_s must be > 0"),
    (dict(response_length=0), r"reward_model\.rollout\.response_length"),
    (dict(temperature=-1.0), r"reward_model\.rollout\.temperature"),
    (dict(score_min=2.0, score_max=1.0), r"score_min=2\.0 > reward_model\.rollout\.score_max"),
    (dict(max_model_len=10), r"reward_model\.rollout\.max_model_len=10 < prompt_length"),
    (dict(dtype="fp8"), r"reward_model\.rollout\.dtype='fp8'"),
    (dict(data_parallel_size=2), r"reward_model\.rollout\.data_parallel_size=2.*set it to 1"),
    (dict(skip_tokenizer_init=True), r"reward_model\.rollout\.skip_tokenizer_init=true"),
    (dict(limit_images=2), r"reward_model\.rollout\.limit_images=2"),
    (dict(load_format="dummy"), r"reward_model\.rollout\.load_format='dummy'"),
    (dict(engine_kwargs={"swap_space": 4}), r"reward_model\.rollout\.engine_kwargs must map"),
    (dict(template="no/such/template.txt"), r"reward_model\.rollout\.template=.*not a file"),
    (dict(template="{question} {response}"), r"unknown field \{question\}"),
])
def test_config_errors_name_the_key(change, match, judge_folder):
    with pytest.raises(UserInputError, match=match):
        build_judge(replace(cfg_of(), **change), judge_folder)


def test_score_needs_one_prompt_per_response(torch_judge):
    with pytest.raises(ValueError, match="2 prompts, 1 responses"):
        torch_judge.score(["a", "b"], ["x"])


def test_every_verl_reward_rollout_key_is_in_the_schema():
    """verl's reward_model.rollout keys (megarl/config/verl_keys.yaml, from verl's generated
    trainer config) all exist in the judge's schema, and verl's defaults type-check."""
    from pathlib import Path

    import yaml

    from megarl.config.typecheck import build

    keys = yaml.safe_load((Path(__file__).parents[2] / "megarl/config/verl_keys.yaml")
                          .read_text())["keys"]
    verl = sorted(k.split(".", 2)[2] for k in keys if k.startswith("reward_model.rollout."))
    assert len(verl) >= 20
    fields = set(JudgeRolloutConfig.__dataclass_fields__)
    assert [k for k in verl if k not in fields] == []
    defaults = {"name": "vllm", "dtype": "bfloat16", "gpu_memory_utilization": 0.5,
                "enforce_eager": True, "cudagraph_capture_sizes": None, "free_cache_engine": True,
                "data_parallel_size": 1, "expert_parallel_size": 1,
                "tensor_model_parallel_size": 1, "max_num_batched_tokens": 8192,
                "max_model_len": None, "max_num_seqs": 1024, "load_format": "auto",
                "engine_kwargs": {}, "limit_images": None, "enable_chunked_prefill": True,
                "enable_prefix_caching": True, "disable_log_stats": True,
                "skip_tokenizer_init": False, "prompt_length": 2048, "response_length": 2048}
    assert sorted(defaults) == verl
    errors: list[str] = []
    cfg = build(JudgeRolloutConfig, defaults, "reward_model.rollout", errors, lambda _: "")
    assert errors == [] and cfg.dtype == "bf16" and cfg.name == "vllm"
    build(JudgeRolloutConfig, {"name": "hf", "score_parse": "eval", "nope": 1},
          "reward_model.rollout", errors, lambda _: "")
    assert len(errors) == 3 and all(e.startswith("reward_model.rollout") for e in errors)


def test_judge_from_section(judge_folder):
    """On iff reward_model.use_reward_loop and reward_model.rollout.name; the model path is
    reward_model.model.path (verl's keys)."""
    from types import SimpleNamespace as NS

    def run(use, name, path):
        return NS(use_reward_loop=use, rollout=cfg_of(name=name), model=NS(path=path))

    def run_judge(rm):
        return judge_from_section(rm, 3)

    assert run_judge(run(False, "torch", judge_folder)) is None
    assert run_judge(run(True, None, judge_folder)) is None
    with pytest.raises(UserInputError, match=r"reward_model\.model\.path is not set"):
        run_judge(run(True, "torch", None))
    judge = run_judge(run(True, "torch", judge_folder))
    try:
        assert judge.seed == 3 and judge.sampling().seed == 3
        scores, _ = judge.score(["q"], ["ok."])
        assert scores.tolist() == [1.0]
    finally:
        judge.close()
