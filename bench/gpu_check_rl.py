"""The GPU check's training steps (bench/gpu_check.py): GRPO runs of ``launch/train.py`` on the
check's random model, each checked from the run's own outputs (metrics.jsonl, exported folders).

- ``grpo_torch`` / ``grpo_megatron``: GRPO, our engine, the run dtype; every step logged with a
  finite loss and a non-zero gradient; engine-vs-trainer logprob gap at step 1 within the bound.
- ``grpo_lora``: GRPO with LoRA (rank 8, alpha 16, all-linear) on the torch backend, 2 steps:
  the reference is the actor with its adapters off (KL exactly 0 at step 1, > 0 at step 2 after
  a large-lr update); the engine samples from the merged weights (gap within the bound at step
  2, where a base-weight engine would be off by the policy's move); the exported actor is the
  base plus (alpha / r) B A in float64 with every other tensor bit for bit the base's (the base
  weights were not trained); PEFT's own merge of the exported adapter folder equals it (when
  peft is installed: ``make gpu-wheels`` carries it).
- ``grpo_megatron_lora``: the same on the megatron backend, the targets named as verl's megatron
  LoRA block names them (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``: the
  exported folder names the seven HF projections they hold).
- ``grpo_bf16_params``: grpo_torch with ``actor.parallel.param_dtype=bf16`` (parameters,
  gradients and AdamW state in bf16), 2 steps at a learning rate bf16 rounding keeps: finite
  gradient norms, KL 0 then > 0, the gap within the bound, on CUDA peak memory below
  grpo_torch's.
- ``grpo_tools``: the ``grpo_tools`` recipe (multi-turn GRPO with configs/tools/calculator.yml,
  hermes format), 2 steps, at most 2 assistant turns. The random
  policy writes no tool calls, so in the training process every assistant turn is read as one
  call to the calculator (the parser is replaced; the tool, the agent loop, the chat-template
  rendering of the tool turn, the masks and the update run as they are) and turns end on a
  third of the text ids (``stop_token_ids``), so that most trajectories are model turn, tool
  answer, model turn (128 response tokens at least: room for the tool turn's template).
  Checked per step: the multi-turn metrics present and finite, more than one assistant turn
  and a tool call on average, no tool error, appended tokens > 0, response length = generated
  + appended tokens, engine-vs-trainer logprob gap on the model's tokens within the bound.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gpu_check_lib import REPO, Sizes, model_dir, require, work_dir
from results import check_ran

A, M = "actor_rollout_ref", "actor_rollout_ref.model"
MEGATRON_TARGETS = "[linear_qkv,linear_proj,linear_fc1,linear_fc2]"  # verl's megatron LoRA names
# grpo_megatron_lora runs with activation recompute on (megatron's full recompute passes the
# adapters a gradient only because the frozen embedding's output is marked as needing one)
RECOMPUTE = (f"{M}.enable_gradient_checkpointing=true",)
LORA_SCALE = 16 / 8
BF16_GAP_BOUND = 0.02  # grpo_bf16_params on the dry run (fp32 elsewhere): GPU.logprob_gap_bound
# launch/train.py (argv[1]) with every assistant turn read as one call to the calculator
EVERY_TURN_CALLS = """
import runpy, sys
from megarl.rollout.agent.tool_parser import ParsedTurn, ToolCall, register_tool_parser

class EveryTurnCalls:
    def parse(self, text):
        return ParsedTurn([ToolCall("calculator", {"expression": "(3 + 4) * 6"})], text)

register_tool_parser("hermes", EveryTurnCalls)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def train(sizes: Sizes, out: Path, name: str, overrides: list[str], steps: int,
          strategy: str = "torch", lr: float = 1e-6, response_len: int | None = None,
          wrapper: Path | None = None, config: str = "grpo",
          dtype: str | None = None) -> tuple[Path, list[dict], float]:
    """``launch/train.py --config CONFIG`` on the check's model and prompts (``dtype``: the
    model.dtype, default the run's); (run folder, the training steps' metric rows, wall
    seconds). Every step logged, finite loss and gradient."""
    run_dir = work_dir(out) / name
    cmd = [sys.executable, *([str(wrapper)] if wrapper else []), str(REPO / "launch" / "train.py"),
           "--config", config,
           f"{M}.path={model_dir(out)}",
           f"data.train_files={work_dir(out) / 'train.parquet'}", "data.val_files=null",
           f"data.train_batch_size={sizes.prompts}", "data.max_prompt_length=64",
           f"data.max_response_length={response_len or sizes.response_len}",
           f"{A}.actor.strategy={strategy}", f"{A}.actor.ppo_mini_batch_size={sizes.prompts}",
           f"{M}.dtype={dtype or sizes.dtype}", f"{A}.rollout.name=torch",
           f"{A}.rollout.n={sizes.n}",
           f"{A}.actor.optim.lr={lr}",
           f"custom_reward_function.path={work_dir(out) / 'reward.py'}",
           f"trainer.total_training_steps={steps}", f"trainer.device={sizes.device}",
           "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1",
           "trainer.export_hf=false", "trainer.logger=[jsonl]",
           f"trainer.default_local_dir={run_dir}", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    print(proc.stdout[-20000:], proc.stderr[-20000:], sep="\n", flush=True)
    require(proc.returncode == 0, f"launch/train.py ({name}) exited {proc.returncode}: "
            + (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1])
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    rows = [r for r in rows if r.get("step", 0) > 0 and "timing_s/step" in r]
    require(len(rows) == steps, f"{len(rows)} training steps logged, {steps} asked")
    for r in rows:
        require(all(math.isfinite(r[k]) for k in ("actor/pg_loss", "actor/grad_norm")),
                f"non-finite loss or gradient norm at step {r['step']}")
        require(r["actor/grad_norm"] > 0, f"no gradient at step {r['step']} (advantages in "
                f"[{r.get('critic/advantages/min')}, {r.get('critic/advantages/max')}])")
    return run_dir, rows, wall


def gap_bound(sizes: Sizes, out: Path) -> float:
    """The engine and the trainer may disagree by twice what transformers in the run dtype
    disagrees with float64 on this model (step megatron_vs_hf), at least ``logprob_gap_bound``."""
    try:
        rec = json.loads((out / "megatron_vs_hf.json").read_text())
        return max(2 * rec["result"]["transformers"]["mean"], sizes.logprob_gap_bound)
    except (OSError, KeyError, ValueError):
        return sizes.logprob_gap_bound


def timings(rows: list[dict], wall: float) -> dict:
    """s/step and the timing keys, medians over the steps after the first (warm-up)."""
    steady = rows[1:] or rows
    return {"wall_s": round(wall, 1),
            "s_per_step": statistics.median(r["timing_s/step"] for r in steady),
            "peak_mem_gb": max(r.get("perf/max_memory_allocated_gb", 0.0) for r in rows),
            "timing_s": {k.removeprefix("timing_s/"): round(statistics.median(r[k] for r in steady), 3)
                         for k in steady[0] if k.startswith("timing_s/")}}


def grpo(sizes: Sizes, out: Path, strategy: str) -> dict:
    run_dir, rows, wall = train(sizes, out, f"grpo_{strategy}", [], sizes.steps, strategy)
    ran = check_ran(run_dir, engine="torch", backend=strategy, dtype=sizes.dtype,
                    device=sizes.device)
    steady = rows[1:] or rows
    n_resp = sizes.prompts * sizes.n
    gen_tok = [r["response_length/mean"] * n_resp for r in steady]
    gap_mean = rows[0].get("rollout/logprob_abs_diff_mean", float("nan"))
    bound = gap_bound(sizes, out)
    require(gap_mean <= bound, f"engine-vs-trainer logprob gap {gap_mean:.3g} > {bound:.3g}")
    return {
        "ran": ran, **timings(rows, wall),
        "gen_s": statistics.median(r["timing_s/gen"] for r in steady),
        "gen_tokens_per_s": statistics.median(n / r["timing_s/gen"]
                                              for n, r in zip(gen_tok, steady)),
        "tokens_per_s": statistics.median(r["perf/total_num_tokens"] / r["timing_s/step"]
                                          for r in steady),
        "logprob_gap_mean": gap_mean,
        "logprob_gap_max": rows[0].get("rollout/logprob_abs_diff_max", float("nan")),
        "response_length_mean": statistics.mean(r["response_length/mean"] for r in rows),
        "score_mean": [round(r["critic/score/mean"], 4) for r in rows],
        "grad_norm": [round(r["actor/grad_norm"], 4) for r in rows],
        "steps": sizes.steps, "prompts": sizes.prompts, "n": sizes.n,
        "response_len": sizes.response_len,
    }


def step_grpo_torch(sizes: Sizes, out: Path) -> dict:
    return grpo(sizes, out, "torch")


def step_grpo_megatron(sizes: Sizes, out: Path) -> dict:
    return grpo(sizes, out, "megatron")


def step_grpo_lora(sizes: Sizes, out: Path) -> dict:
    return lora_grpo(sizes, out, "grpo_lora", "torch", "all-linear")


def step_grpo_megatron_lora(sizes: Sizes, out: Path) -> dict:
    """LoRA on the megatron backend, named as verl's megatron LoRA block names the modules (its
    four linears hold the seven HF projections the exported adapter folder names). The dry run
    leaves out PEFT's merge (3-4 s of imports; grpo_lora runs the same comparison there and
    tests/trainer/test_lora_trainer.py runs PEFT on the megatron export)."""
    return lora_grpo(sizes, out, "grpo_megatron_lora", "megatron", MEGATRON_TARGETS,
                     RECOMPUTE, peft_merge=sizes.device == "cuda")


def lora_grpo(sizes: Sizes, out: Path, name: str, strategy: str, targets: str,
              extra: tuple[str, ...] = (), peft_merge: bool = True) -> dict:
    """2 GRPO steps with LoRA (rank 8, alpha 16, ``targets``) on ``strategy``. A large learning
    rate moves the policy far from the base in one update (an engine left on the base weights
    would be off by that move); 1e-2 on the GPU's 24 layers keeps the adapted model's bf16
    forward about as well conditioned as the base's."""
    lr = 3e-2 if sizes.device == "cpu" else 1e-2
    lora = [f"{M}.lora_rank=8", f"{M}.lora_alpha=16", f"{M}.target_modules={targets}"]
    run_dir, rows, wall = train(sizes, out, name, [
        *lora, *extra, f"{A}.rollout.check_logprobs=true", "trainer.export_hf=true"], 2,
        strategy, lr=lr)
    res = {"ran": check_ran(run_dir, engine="torch", backend=strategy, dtype=sizes.dtype,
                            device=sizes.device), "lr": lr, "target_modules": targets,
           **timings(rows, wall)}
    gap = [r["rollout/logprob_abs_diff_mean"] for r in rows]
    bound = gap_bound(sizes, out)
    res.update(logprob_gap_mean=gap, gap_bound=bound,
               logprob_gap_max=[r["rollout/logprob_abs_diff_max"] for r in rows])
    # B = 0 before the first update: actor = reference
    check_policy_moved(rows, sizes.dtype, res, "the reference is not the actor with its "
                       "adapters off", "the adapters did not move the policy")
    require(all(g <= bound for g in gap), f"engine-vs-trainer logprob gap {gap} > {bound:.3g} "
            "(step 2: the engine is not sampling from the merged adapters)", res)
    res["export"] = check_lora_export(sizes, out, run_dir, peft_merge)
    return res


def check_policy_moved(rows: list[dict], dtype: str, res: dict, at_start: str,
                       unmoved: str, moved_at: int = 1) -> None:
    """The steps' ``actor/kl_loss`` (recorded in ``res``): 0 at step 1, where the actor is the
    reference (bitwise in fp32; in bf16 on CUDA the actor's and the reference's micro-batches
    may pick different kernels: at most 1% of the moved step's), > 0 at step ``moved_at + 1``,
    after the updates before it."""
    kl = [r["actor/kl_loss"] for r in rows]
    res["kl_loss"] = kl
    kl0_bound = 0.0 if dtype == "fp32" else 0.01 * kl[moved_at]
    require(kl[0] <= kl0_bound, f"KL {kl[0]:.3g} at step 1 (> {kl0_bound:.3g}): {at_start}", res)
    require(kl[moved_at] > 0.0, f"KL 0 at step {moved_at + 1}: {unmoved}", res)


def first_signal_step(rows: list[dict]) -> int:
    """Index of the first step whose advantages are not all 0 (a step whose groups all scored
    alike updates on the KL term's gradient alone, ~1e-10 while the actor is the reference)."""
    signal = next((i for i, r in enumerate(rows)
                   if r["critic/advantages/max"] > r["critic/advantages/min"]), None)
    scores = [round(r["critic/score/mean"], 4) for r in rows]
    require(signal is not None, f"every step's advantages were 0 (mean scores {scores}): no "
            "update had a learning signal")
    return signal


def step_grpo_bf16_params(sizes: Sizes, out: Path) -> dict:
    """grpo_torch with the parameters, gradients and AdamW state held in bf16
    (``parallel.param_dtype=bf16``, verl's fsdp_config.model_dtype; model.dtype bf16, which it
    needs, on the dry run too), 3 steps. The learning rate is one whose AdamW steps bf16
    rounding keeps: an update survives on weights below about 512 lr in magnitude, so 1e-4 on
    the GPU moves the weights below 0.05 (the rescaled matrices' std is 0.033 and 0.014) and
    1e-3 on the dry run those below 0.5 (std 0.125 and 0.088); at grpo_torch's 1e-6 nearly
    every update would be lost. Checked: finite gradient norms, KL 0 at step 1 (the reference
    holds bf16 too) and > 0 at the step after the first update with nonzero advantages (the
    rounded update moved the policy; on the GPU the random policy's first responses all score
    0, so that update is step 2's: AdamW's step on step 1's ~1e-10 gradient is far below a
    bf16 rounding and rightly lost), the engine-vs-trainer gap within the bound at every step
    (the engine receives the bf16 weights), and on
    CUDA peak memory below grpo_torch's (fp32 parameters, gradients and AdamW state)."""
    lr = 1e-3 if sizes.device == "cpu" else 1e-4
    run_dir, rows, wall = train(sizes, out, "grpo_bf16_params", [
        f"{A}.actor.parallel.param_dtype=bf16", f"{A}.rollout.check_logprobs=true"], 3,
        lr=lr, dtype="bf16")
    res = {"ran": check_ran(run_dir, engine="torch", backend="torch", dtype="bf16",
                            device=sizes.device), "lr": lr, "param_dtype": "bf16",
           **timings(rows, wall), "grad_norm": [r["actor/grad_norm"] for r in rows]}
    gap = [r["rollout/logprob_abs_diff_mean"] for r in rows]
    bound = gap_bound(sizes, out) if sizes.dtype == "bf16" else BF16_GAP_BOUND
    res.update(logprob_gap_mean=gap, gap_bound=bound,
               logprob_gap_max=[r["rollout/logprob_abs_diff_max"] for r in rows])
    signal = first_signal_step(rows[:-1])
    check_policy_moved(rows, "bf16", res, "the reference is not the actor's weights",
                       f"bf16 rounding lost step {signal + 1}'s update (learning rate too small)",
                       moved_at=signal + 1)
    require(all(g <= bound for g in gap), f"engine-vs-trainer logprob gap {gap} > {bound:.3g}",
            res)
    try:
        fp32 = json.loads((out / "grpo_torch.json").read_text())["result"]["peak_mem_gb"]
    except (OSError, KeyError, TypeError, ValueError):
        fp32 = None  # grpo_torch not run or failed: nothing to compare with
    res["grpo_torch_peak_mem_gb"] = fp32
    if sizes.device == "cuda" and fp32 is not None:
        require(res["peak_mem_gb"] < fp32, f"peak memory {res['peak_mem_gb']} GB with bf16 "
                f"parameters, not below grpo_torch's {fp32} GB (fp32 parameters)", res)
    return res


def check_lora_export(sizes: Sizes, out: Path, run_dir: Path, peft_merge: bool = True) -> dict:
    """The run's hf_actor against the base folder and its lora_adapter folder: adapted weights
    = base + (alpha / r) B A (float64, within a rounding of the exported dtype), every other
    tensor bit for bit the base's; then (``peft_merge``) PEFT's merge of the folder onto
    transformers' base."""
    from safetensors.torch import load_file

    def folder(path: Path) -> dict:
        state = {}
        for f in sorted(path.glob("*.safetensors")):
            state.update(load_file(str(f)))
        return state

    base, exported = folder(model_dir(out)), folder(run_dir / "hf_actor")
    adapter = load_file(str(run_dir / "lora_adapter" / "adapter_model.safetensors"))
    config = json.loads((run_dir / "lora_adapter" / "adapter_config.json").read_text())
    require(config["r"] == 8 and config["lora_alpha"] == 16, f"adapter config {config}")
    adapted = {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in adapter}
    layers = 1 + max(int(k.split(".")[2]) for k in base if k.startswith("model.layers."))
    require(len(adapted) == 7 * layers, f"{len(adapted)} adapted modules, every linear "
            f"(7 per layer) of {layers} layers is {7 * layers}")
    b_norm = sum(float(t.float().norm()) for k, t in adapter.items() if ".lora_B." in k)
    require(b_norm > 0, "every lora_B is zero: the adapters did not train")
    worst, untouched = merge_error(exported, base, adapter, adapted, "hf_actor", sizes.device)
    res = {"adapted_modules": len(adapted), "untouched_tensors": untouched,
           "merge_err_eps": worst, "lora_B_norm": round(b_norm, 4),
           "exported_dtype": str(next(iter(exported.values())).dtype)}
    if not peft_merge:
        return {**res, "peft": "not compared (dry run)"}
    try:
        import peft
    except Exception as err:  # not installed, or not importable beside this transformers
        return {**res, "peft": f"not usable ({type(err).__name__}: {err}): merge not compared"}
    import transformers

    transformers.logging.set_verbosity_error()
    dtype = next(iter(exported.values())).dtype
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir(out), dtype=dtype)
    merged = peft.PeftModel.from_pretrained(hf.to(sizes.device), run_dir / "lora_adapter")
    state = {k: v.cpu() for k, v in merged.merge_and_unload().state_dict().items() if k in base}
    peft_worst, _ = merge_error(state, base, adapter, adapted, "PEFT's merge", sizes.device)
    return {**res, "peft": peft.__version__, "peft_merge_err_eps": peft_worst}


def merge_error(state: dict, base: dict, adapter: dict, adapted: set[str], what: str,
                device: str) -> tuple[float, int]:
    """(the largest error of ``state``'s adapted weights from base + (alpha / r) B A in float64,
    in units of its dtype's eps times the element's scale: one rounding of the result plus the
    rank's sums of products; the tensors no adapter touches, which must equal the base's).
    The float64 arithmetic runs on ``device`` (seconds on the CPU at the GPU model's size)."""
    import torch

    worst, untouched = 0.0, 0
    for name, t in base.items():
        module, kind = name.rsplit(".", 1)
        got = state[name]
        if module not in adapted or kind != "weight":  # biases, norms, embeddings
            require(torch.equal(got, t.to(got.dtype)), f"{what}: {name} is not the base's "
                    "(the base weights were trained)")
            untouched += 1
            continue
        a = adapter[f"base_model.model.{module}.lora_A.weight"].to(device, torch.float64)
        b = adapter[f"base_model.model.{module}.lora_B.weight"].to(device, torch.float64)
        want = t.to(device, torch.float64) + LORA_SCALE * (b @ a)
        scale = want.abs() + (a.shape[0] + 1) * LORA_SCALE * (b.abs() @ a.abs()) + 1e-30
        err = float(((got.to(device, torch.float64) - want).abs() / scale).max())
        err /= torch.finfo(got.dtype).eps
        worst = max(worst, err)
        require(err <= 1.0, f"{what}: {name} is off base + (alpha/r) B A by {err:.3g} eps of "
                f"{got.dtype} (bound 1): the merged weights are wrong")
    return worst, untouched


def step_grpo_tools(sizes: Sizes, out: Path) -> dict:
    """2 multi-turn GRPO steps with the calculator (every turn read as one call)."""
    wrapper = work_dir(out) / "every_turn_calls.py"
    wrapper.write_text(EVERY_TURN_CALLS)
    mt = f"{A}.rollout.multi_turn"
    stops = list(range(40, 70))  # 30 of the tokenizer's 100 text ids: turns of a few tokens
    run_dir, rows, wall = train(sizes, out, "grpo_tools", [
        f"{mt}.max_assistant_turns=2", f"{A}.rollout.check_logprobs=true",
        f"{A}.rollout.stop_token_ids=[{','.join(map(str, stops))}]"],
        2, response_len=max(sizes.response_len, 128), wrapper=wrapper, config="grpo_tools")
    keys = ("multi_turn/assistant_turns/mean", "multi_turn/tool_calls/mean",
            "multi_turn/tool_errors/mean", "multi_turn/appended_tokens/mean",
            "multi_turn/generated_tokens/mean", "multi_turn/truncated_ratio",
            "multi_turn/sanity_mismatch_ratio", "num_turns/mean", "response_length/mean",
            "rollout/logprob_abs_diff_mean", "rollout/logprob_abs_diff_max")
    res = {"ran": check_ran(run_dir, engine="torch", backend="torch", dtype=sizes.dtype,
                            device=sizes.device), **timings(rows, wall),
           "metrics": [{k: r.get(k) for k in keys} for r in rows]}
    bound = gap_bound(sizes, out)
    res["gap_bound"] = bound
    for r in rows:
        missing = [k for k in keys if not isinstance(r.get(k), (int, float))
                   or not math.isfinite(r[k])]
        require(not missing, f"step {r['step']}: missing or non-finite {missing}", res)
        require(r["multi_turn/tool_errors/mean"] == 0, f"tool errors at step {r['step']}", res)
        require(r["multi_turn/tool_calls/mean"] > 0 and r["multi_turn/appended_tokens/mean"] > 0,
                f"step {r['step']}: no tool call reached the trajectories", res)
        require(r["multi_turn/assistant_turns/mean"] > 1, f"step {r['step']}: one assistant "
                "turn per trajectory (no turn after the tool's answer)", res)
        require(r["rollout/logprob_abs_diff_mean"] <= bound, f"step {r['step']}: engine-vs-"
                f"trainer logprob gap {r['rollout/logprob_abs_diff_mean']:.3g} on the model's "
                f"tokens > {bound:.3g}", res)
        total = r["multi_turn/generated_tokens/mean"] + r["multi_turn/appended_tokens/mean"]
        require(abs(r["response_length/mean"] - total) <= 1e-6 * max(total, 1.0),
                f"step {r['step']}: response length {r['response_length/mean']} != generated + "
                f"appended tokens {total}", res)
    return res
