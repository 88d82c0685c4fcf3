"""The build steps behind ``megarl.demo.assets`` (one function per component, in ``BUILDERS``).

Each ``build_<name>(staging, base, config, log) -> metadata`` writes the component into the
empty-or-missing folder ``staging``; ``assets.py`` adds the common metadata fields, writes
metadata.json and renames the folder into place. Dependencies are read from ``base``.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from megarl.data.rows import write_rows
from megarl.demo import arith
from megarl.demo.recipe import BuildConfig, read_meta

Log = Callable[[str], None]
Builder = Callable[[Path, Path, BuildConfig, Log], dict]


def _seed(config: BuildConfig, purpose: int) -> int:
    return config.seed * 1000 + purpose


def _problem_sets(config: BuildConfig) -> dict[str, list[arith.Problem]]:
    """val first; every other set excludes the val problems."""
    val = arith.sample_problems(_seed(config, 1), config.n_val, 3)
    held = {p.text for p in val}
    return {
        "val": val,
        "train": arith.sample_problems(_seed(config, 2), config.n_train, 3, exclude=held),
        "sft": arith.sample_problems(_seed(config, 3), config.n_sft, (1, 2, 3), exclude=held),
        "dev": arith.sample_problems(_seed(config, 4), config.n_dev, 3, exclude=held),
        "prm_train": arith.sample_problems(_seed(config, 5), config.n_prm_train, (2, 3),
                                           exclude=held),
    }


def _load_tokenizer(base: Path):
    from megarl.data.tokenizer import load_tokenizer

    return load_tokenizer(str(base / "tokenizer"))


def build_tokenizer(staging: Path, base: Path, config: BuildConfig, log: Log) -> dict:
    from megarl.demo.tokenizer import CHAT_TEMPLATE, save_tokenizer

    tok = save_tokenizer(str(staging))
    log(f"  tokenizer: {len(tok)} tokens")
    return {"vocab_size": len(tok), "chat_template": CHAT_TEMPLATE,
            "eos_token": tok.eos_token, "pad_token": tok.pad_token}


def build_arith(staging: Path, base: Path, config: BuildConfig, log: Log) -> dict:
    """The RL, held-out and SFT problem sets. Its build id is a digest of the rows (integer
    draws from seeded generators: the same on every machine), so a shipped policy trained on
    these rows finds them again wherever they are rebuilt."""
    sets = _problem_sets(config)
    staging.mkdir(parents=True, exist_ok=True)
    rows = {}
    digest = hashlib.sha256()
    for name, split, with_response in (("train", "train", False), ("val", "val", False),
                                        ("sft", "sft", True)):
        data = [arith.to_row(p, split, i, with_response) for i, p in enumerate(sets[name])]
        write_rows(data, str(staging / f"{name}.parquet"))
        rows[f"{name}.parquet"] = len(data)
        digest.update(json.dumps([name, data], sort_keys=True).encode())
    log(f"  arith: {rows}")
    return {
        "build_id": digest.hexdigest()[:32],
        "rows": rows,
        "task": "multi-step 2-digit +/- arithmetic; steps joined by '\\n\\n'; \\boxed{answer}",
        "example": {"prompt": sets["val"][0].prompt, "solution": sets["val"][0].solution},
        "val_excluded_from": ["train", "sft"],
    }


def _arith_problems(path: Path) -> list[arith.Problem]:
    import pyarrow.parquet as pq

    col = pq.read_table(path, columns=["prompt"]).column("prompt").to_pylist()
    return [arith.parse_problem(m[0]["content"]) for m in col]


def build_policy(staging: Path, base: Path, config: BuildConfig, log: Log) -> dict:
    import pyarrow.parquet as pq

    from megarl.demo.sft import arith_accuracy, encode_sft, policy_config, train_sft
    from megarl.models import ModelArgs, Transformer, save_model

    tok = _load_tokenizer(base)
    sft_rows = pq.read_table(base / "arith" / "sft.parquet",
                             columns=["prompt", "response", "extra_info"]).to_pylist()
    val = _arith_problems(base / "arith" / "val.parquet")
    dev = _problem_sets(config)["dev"] if config.n_dev else val[:0]
    t0 = time.perf_counter()
    examples = encode_sft([r["prompt"] for r in sft_rows], [r["response"] for r in sft_rows], tok)
    encode_s = time.perf_counter() - t0
    hf_config = policy_config(tok)
    torch.manual_seed(_seed(config, 10))
    gen = torch.Generator().manual_seed(_seed(config, 10))
    model = Transformer(ModelArgs.from_hf_config(hf_config), head="lm")
    model.init_weights(gen)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"  policy: qwen2, {n_params / 1e6:.2f}M params, {len(examples)} SFT rows "
        f"(tokenised in {encode_s:.1f}s), {torch.get_num_threads()} threads")
    result = train_sft(
        model, examples, tok.pad_token_id, config.sft_max_steps, config.sft_batch,
        config.sft_lr, config.sft_warmup, seed=_seed(config, 11),
        eval_fn=(lambda: arith_accuracy(model, tok, dev)) if dev else None,
        eval_every=config.sft_eval_every, eval_after=config.sft_eval_after,
        stop_at=config.sft_stop_at, fine_eval_every=config.sft_fine_eval_every,
        fine_below_loss=config.sft_fine_below_loss, fine_from_acc=config.sft_fine_from_acc,
        buckets=[r["extra_info"]["num_ops"] for r in sft_rows] if config.sft_bucket_by_ops
        else None,
        log=log,
    )
    t1 = time.perf_counter()
    val_acc, texts = arith_accuracy(model, tok, val, return_responses=True)
    log(f"  policy: SFT {result.steps} steps in {result.seconds:.0f}s; greedy accuracy on "
        f"{len(val)} held-out 3-op problems: {val_acc:.3f} ({time.perf_counter() - t1:.1f}s)")
    save_model(model, staging, source_dir=base / "tokenizer")
    return {
        "params": n_params,
        "val_accuracy": round(val_acc, 4),
        "val_problems": len(val),
        "threads": torch.get_num_threads(),
        "sft": {"steps": result.steps, "seconds": round(result.seconds, 1),
                "history": result.history, "rows": len(examples)},
        "samples": [{"prompt": p.prompt, "response": t} for p, t in zip(val[:5], texts[:5])],
    }


def build_policy_moe(staging: Path, base: Path, config: BuildConfig, log: Log) -> dict:
    """The dense SFT policy upcycled into a Qwen2-MoE (`megarl.models.upcycle`): same start,
    no training of its own."""
    from safetensors.torch import load_file

    from megarl.demo.sft import arith_accuracy
    from megarl.models import ModelArgs, Transformer, read_hf_config, save_model
    from megarl.models.hf_io import hf_weight_map
    from megarl.models.upcycle import upcycle_qwen2_config, upcycle_qwen2_state

    dense: dict[str, torch.Tensor] = {}
    for file in sorted(set(hf_weight_map(base / "policy").values())):
        dense.update(load_file(base / "policy" / file))
    hf_config = upcycle_qwen2_config(read_hf_config(base / "policy"), config.moe_experts,
                                     config.moe_top_k)
    state = upcycle_qwen2_state(dense, hf_config, noise=config.moe_noise, seed=_seed(config, 30))
    model = Transformer(ModelArgs.from_hf_config(hf_config), head="lm")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"upcycled weights do not fit the MoE model: missing {missing}, "
                           f"unexpected {unexpected}")
    model.tie_weights()
    tok = _load_tokenizer(base)
    val = _arith_problems(base / "arith" / "val.parquet")
    val_acc = arith_accuracy(model, tok, val)
    dense_acc = (read_meta(base / "policy") or {}).get("val_accuracy")
    n_params = sum(p.numel() for p in model.parameters())
    log(f"  policy_moe: qwen2_moe, {n_params / 1e6:.2f}M params, {config.moe_experts} experts "
        f"top-{config.moe_top_k}; greedy held-out accuracy {val_acc:.3f} (dense {dense_acc})")
    save_model(model, staging, source_dir=base / "tokenizer")
    return {"params": n_params, "num_experts": config.moe_experts, "top_k": config.moe_top_k,
            "noise": config.moe_noise, "val_accuracy": round(val_acc, 4),
            "dense_val_accuracy": dense_acc,
            "init": "sparse upcycling of policy/ (megarl.models.upcycle)"}


def build_critic(staging: Path, base: Path, config: BuildConfig, log: Log) -> dict:
    from megarl.models import load_model, save_model

    model = load_model(base / "policy", head="token_cls", num_labels=1, allow_new_head=True)
    with torch.no_grad():
        model.score.weight.zero_()
        if model.score.bias is not None:
            model.score.bias.zero_()
    save_model(model, staging, source_dir=base / "tokenizer")
    log("  critic: policy body + zero 1-label score head")
    return {"init": "policy body; score head zero (values start at 0)", "num_labels": 1}


def build_prm(staging: Path, base: Path, config: BuildConfig, log: Log) -> dict:
    from megarl.data.steps import step_end_token_ids
    from megarl.demo import prm as prm_lib
    from megarl.demo.greedy import greedy_generate
    from megarl.models import load_model, save_model

    tok = _load_tokenizer(base)
    step_ids = step_end_token_ids(tok)
    sets = _problem_sets(config)
    train = prm_lib.make_examples(sets["prm_train"], tok, _seed(config, 20))
    val = sets["val"][: config.n_prm_eval]
    held = prm_lib.make_examples(val, tok, _seed(config, 21))
    frac = float(np.mean([lbl for e in train for lbl in e.labels]))
    log(f"  prm: {len(train)} training solutions, {frac:.2f} of steps labelled correct")
    model = load_model(base / "policy", head="token_cls", num_labels=2, allow_new_head=True,
                       seed=_seed(config, 22))
    seconds = prm_lib.train_prm(model, train, tok.pad_token_id, step_ids, config.prm_steps,
                                config.prm_batch, config.prm_lr, seed=_seed(config, 23), log=log)
    eval_corrupted = prm_lib.evaluate_prm(model, held, tok.pad_token_id, step_ids)

    # The PRM on what the RL run will actually score: the policy's own greedy solutions.
    policy = load_model(base / "policy", head="lm")
    prompts = [prm_lib.make_example(p, p.steps(), tok).prompt_ids for p in val]
    outs = greedy_generate(policy, prompts, tok.eos_token_id, tok.pad_token_id, 48)
    samples = []
    for p, pr, out in zip(val, prompts, outs):
        steps = prm_lib.step_texts(out, tok, step_ids)
        samples.append(prm_lib.PRMExample(pr, out, arith.label_steps(p, steps), "policy"))
    eval_policy = prm_lib.evaluate_prm(model, samples, tok.pad_token_id, step_ids)
    log(f"  prm: {config.prm_steps} steps in {seconds:.0f}s; step accuracy "
        f"{eval_corrupted['step_accuracy']:.3f} on held-out corrupted/clean solutions, "
        f"{eval_policy['step_accuracy']:.3f} on the policy's greedy solutions")
    save_model(model, staging, source_dir=base / "tokenizer")
    return {
        "labels": {"0": "incorrect step", "1": "correct step"},
        "input": "chat-templated prompt + response + <|im_end|>, unchanged; scores are read at "
                 "step ends = '\\n\\n' tokens and the last response token "
                 "(megarl.data.build_prm_inputs with replace_step_end_with=None)",
        "train_seconds": round(seconds, 1),
        "train_steps": config.prm_steps,
        "eval_corrupted": _rounded(eval_corrupted),
        "eval_policy_samples": _rounded(eval_policy),
    }


def build_policy_tools(staging: Path, base: Path, config: BuildConfig, log: Log) -> dict:
    """The SFT policy taught to call the calculator (`megarl.demo.tool_sft`): a short SFT on
    3-op traces calling it on the first 1 or 2 operations, stopped at the first dev accuracy
    (trajectories of the agent loop on megarl's torch engine, greedy) >= tools_stop_at."""
    from megarl.demo.sft import train_sft
    from megarl.demo.tool_sft import (
        TOOL_NAME,
        TOOL_OPS,
        agent_accuracy,
        calculator_tool,
        encode_trace,
        tool_sft_batch,
    )
    from megarl.models import load_model, save_model
    from megarl.rollout.agent import tool_schemas
    from megarl.rollout.agent.chat import ChatContinuation

    tok = _load_tokenizer(base)
    val = _arith_problems(base / "arith" / "val.parquet")
    held = {p.text for p in val}
    dev = arith.sample_problems(_seed(config, 40), config.n_tools_dev, 3, exclude=held)
    problems = arith.sample_problems(_seed(config, 41), config.n_tools_sft, 3,
                                     exclude=held | {p.text for p in dev})
    rng = np.random.Generator(np.random.PCG64(_seed(config, 42)))
    if not set(config.tools_ops) <= set(TOOL_OPS) - {0}:
        raise ValueError(f"BuildConfig.tools_ops={config.tools_ops}: each in 1..{max(TOOL_OPS)}")
    calls = [int(k) for k in rng.choice(list(config.tools_ops), size=len(problems))]
    chat = ChatContinuation(tok)
    schemas = tool_schemas({TOOL_NAME: calculator_tool()})
    examples = [encode_trace(p, k, tok, chat, schemas) for p, k in zip(problems, calls)]
    model = load_model(base / "policy", head="lm")
    shares: dict[int, float] = {}

    def dev_accuracy() -> float:
        ev = agent_accuracy(model, tok, dev, config.tools_max_response_length)
        shares[len(shares)] = ev.tool_share
        return ev.accuracy

    result = train_sft(
        model, examples, tok.pad_token_id, config.tools_max_steps, config.tools_batch,
        config.tools_lr, config.tools_warmup, seed=_seed(config, 43),
        eval_fn=dev_accuracy if dev else None, eval_every=config.tools_eval_every,
        eval_after=config.tools_eval_after, stop_at=config.tools_stop_at, buckets=calls,
        log=log, batch_fn=tool_sft_batch,
    )
    for i, entry in enumerate(result.history):
        entry["tool_share"] = round(shares[i], 4)
    t1 = time.perf_counter()
    ev = agent_accuracy(model, tok, val, config.tools_max_response_length)
    log(f"  policy_tools: SFT {result.steps} steps in {result.seconds:.0f}s; held-out accuracy "
        f"through the agent loop {ev.accuracy:.3f}, {ev.tool_share:.2f} of the trajectories "
        f"call the calculator ({time.perf_counter() - t1:.1f}s)")
    save_model(model, staging, source_dir=base / "tokenizer")
    return {
        "val_accuracy": round(ev.accuracy, 4),
        "val_tool_share": round(ev.tool_share, 4),
        "val_tool_errors_per_trajectory": round(ev.tool_errors, 4),
        "val_problems": len(val),
        "dev_accuracy": result.history[-1]["acc"] if result.history else None,
        "threads": torch.get_num_threads(),
        "tool": TOOL_NAME,
        "format": "hermes",
        "max_response_length": config.tools_max_response_length,
        "sft": {"steps": result.steps, "seconds": round(result.seconds, 1),
                "history": result.history, "rows": len(examples),
                "calls_by_ops": {str(k): calls.count(k) for k in sorted(set(calls))}},
        "samples": [{"prompt": p.prompt, "response": t} for p, t in zip(val[:5], ev.texts[:5])],
    }


def _rounded(d: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}


# component -> its build step (the components of megarl.demo.recipe.COMPONENTS)
BUILDERS: dict[str, Builder] = {
    "tokenizer": build_tokenizer,
    "arith": build_arith,
    "policy": build_policy,
    "critic": build_critic,
    "prm": build_prm,
    "policy_moe": build_policy_moe,
    "policy_tools": build_policy_tools,
}
