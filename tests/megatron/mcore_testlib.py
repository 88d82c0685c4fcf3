"""Shared helpers of the megatron backend / conversion tests (pytest files and tests/dist
workers). References are computed with transformers in float64, independently of megarl."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
DIST_DIR = REPO / "tests" / "dist"
if str(REPO / "tests") not in sys.path:  # fp32_bounds, for the tests/dist workers too
    sys.path.insert(0, str(REPO / "tests"))


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else (
        torch.device("cpu")
    )


def ensure_dist() -> None:
    """A process group (a world of one when not under torchrun), gloo on CPU / nccl on GPU."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    from megarl.utils.dist import init_distributed, resolve_device

    init_distributed(resolve_device("auto"))


def make_model(path: Path, family: str, head: str = "lm", **overrides) -> Path:
    """Tiny random HF folder (transformers' save_pretrained) unless it exists already."""
    from megarl.models.testing import make_tiny_hf_model

    path = Path(path)
    if (path / "config.json").is_file():
        return path
    kw = {"num_labels": overrides.pop("num_labels")} if "num_labels" in overrides else {}
    return make_tiny_hf_model(path, family, head=head, tokenizer=False, **kw, **overrides)


# Model zoo of the tests: (family, head, overrides)
ZOO = {
    "llama_tied_gqa": ("llama", "lm", {"tie_word_embeddings": True, "num_key_value_heads": 2}),
    "qwen2_bias": ("qwen2", "lm", {}),
    "qwen3_qknorm": ("qwen3", "lm", {}),
    "llama3_rope": ("llama3", "lm", {}),
    "llama4_tied": ("llama", "lm", {"tie_word_embeddings": True, "num_hidden_layers": 4}),
    "qwen2_critic": ("qwen2", "token_cls", {"num_labels": 1}),
    "qwen3_prm": ("qwen3", "token_cls", {"num_labels": 2}),
}


def zoo_model(root: Path, name: str) -> Path:
    family, head, overrides = ZOO[name]
    return make_model(Path(root) / name, family, head, **dict(overrides))


def make_batch(B: int = 4, P: int = 6, L: int = 5, vocab: int = 128, seed: int = 0):
    """A SequenceBatch with ragged left-padded prompts and right-padded responses."""
    from megarl.backends.protocol import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, P + L), generator=g)
    mask = torch.ones(B, P + L, dtype=torch.long)
    for i in range(B):
        pad_left = int(torch.randint(0, P - 1, (1,), generator=g))
        resp = int(torch.randint(1, L + 1, (1,), generator=g))
        mask[i, :pad_left] = 0
        mask[i, P + resp :] = 0
    return SequenceBatch(ids * mask, mask, L)


def hf_model(path: Path, head: str = "lm", dtype=torch.float64):
    import transformers

    cls = (
        transformers.AutoModelForCausalLM if head == "lm"
        else transformers.AutoModelForTokenClassification
    )
    return cls.from_pretrained(path, dtype=dtype)


def hf_outputs(model, batch) -> torch.Tensor:
    """HF logits [B, P+L, V or labels] with position_ids = cumsum(mask) - 1 (left padding)."""
    mask = batch.attention_mask
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return model(input_ids=batch.input_ids, attention_mask=mask, position_ids=pos).logits


def hf_logprobs(model, batch, temperature: float = 1.0):
    """(logprob [B, L], entropy [B, L], logits [B, L, V]) of the response tokens, float64,
    zero outside the response mask; differentiable w.r.t. the HF parameters."""
    L = batch.response_length
    P = batch.input_ids.shape[1] - L
    logits = hf_outputs(model, batch)[:, P - 1 : -1].double() / temperature
    lsm = torch.log_softmax(logits, -1)
    m = batch.response_mask.double()
    lp = lsm.gather(-1, batch.response_ids[..., None])[..., 0] * m
    ent = -(lsm.exp() * lsm).sum(-1) * m
    return lp, ent, logits * m[..., None]


def hf_values(model, batch) -> torch.Tensor:
    """Critic values [B, L]: token-classification output at column P + j - 1."""
    L = batch.response_length
    P = batch.input_ids.shape[1] - L
    return hf_outputs(model, batch)[:, P - 1 : -1, 0].double() * batch.response_mask.double()


def hf_scores(model, batch) -> torch.Tensor:
    """PRM scores [B, L, labels]: token-classification output at the token's own column."""
    L = batch.response_length
    return hf_outputs(model, batch)[:, -L:].double() * batch.response_mask.double()[..., None]


def fp32_tols(path: Path, ref_logits: torch.Tensor, mask: torch.Tensor,
              temperature: float = 1.0) -> dict[str, float]:
    """How far one fp32 forward of ``path`` may be from transformers in float64 on the
    response tokens of ``mask`` [B, L] (tests/fp32_bounds.py: lambda |w_j| max|g| (L + 1)
    sqrt(n) u / T per logit, twice that plus the logsumexp's sum per logprob), given the
    reference's float64 logits / T ``ref_logits`` [B, L, V] (for the entropy's sensitivity
    sum_v p_v |log p_v + H| and its size H): {"logits", "logprob", "entropy"}. The logprob
    bound also bounds the token-mean loss (a mean is at most the largest term)."""
    from fp32_bounds import fp32_ref_gap_bound, fp32_ref_logit_bound

    tokens = int(mask.sum())
    logp = torch.log_softmax(ref_logits.detach().double()[mask.bool()], -1)
    ent = -(logp.exp() * logp).sum(-1, keepdim=True)
    spread = float((logp.exp() * (logp + ent).abs()).sum(-1).max())
    return {
        "logits": fp32_ref_logit_bound(path, tokens, temperature),
        "logprob": fp32_ref_gap_bound(path, tokens, temperature),
        "entropy": fp32_ref_gap_bound(path, tokens, temperature, spread=spread,
                                      entropy=float(ent.max())),
    }


def fp32_value_tol(path: Path, mask: torch.Tensor) -> float:
    """How far one fp32 forward's values / scores (token-classification head) of ``path``
    may be from transformers in float64 on the tokens of ``mask`` (`fp32_ref_logit_bound`)."""
    from fp32_bounds import fp32_ref_logit_bound

    return fp32_ref_logit_bound(path, int(mask.sum()))


def fp32_grad_tol(path: Path, batch, temperature: float = 1.0) -> float:
    """How far one fp32 backward's gradients of ``path`` (a loss of per-token logprob terms of
    ``batch``) may be from float64, relative to each tensor's largest entry
    (`fp32_grad_rel_bound`, one side)."""
    from fp32_bounds import fp32_grad_rel_bound

    return fp32_grad_rel_bound(path, int(batch.attention_mask.sum()), temperature, sides=1)


def pg_loss(outputs, mb, n_tokens: float):
    """-sum(logprob * mask) / n_tokens (a globally normalised LM loss)."""
    m = mb.response_mask.to(outputs.logprob.device).float()
    loss = -(outputs.logprob * m).sum() / n_tokens
    return loss, {"tokens": float(m.sum())}


def value_loss(outputs, mb, n_tokens: float):
    m = mb.response_mask.to(outputs.values.device).float()
    target = mb.tensors["returns"].to(outputs.values.device)
    return ((outputs.values - target) ** 2 * m).sum() / n_tokens, {}


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b.double().cpu()).abs().max())


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def run_torchrun(script: str, nproc: int, args: list[str], timeout: int = 240) -> str:
    """Run ``tests/dist/<script>`` under ``torchrun --standalone`` (NCCL with one GPU per rank,
    else gloo on CPU; one thread per process); return its output, raise AssertionError with it
    when it fails."""
    import torchrun  # tests/ is on the path of pytest, not of the workers that import this

    env: dict[str, str | None] = {}
    if torch.cuda.is_available() and torch.cuda.device_count() < nproc:
        env["CUDA_VISIBLE_DEVICES"] = ""  # not one GPU per rank: run the workers on gloo / CPU
    return torchrun.run_torchrun(DIST_DIR / script, nproc, args, timeout, env)


def read_results(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def write_results(path: Path, results: dict) -> None:
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def worker_setup() -> None:
    """Common start of a tests/dist worker: one thread, quiet warnings, process group."""
    import warnings

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)


# ---------------------------------------------------------------- DP=2 vs DP=1 optimizer run

DP_STEPS = 3
DP_OPTIM = {
    "lr": 2e-2,
    "betas": (0.9, 0.95),
    "eps": 1e-6,
    "weight_decay": 0.1,
    "grad_clip": 0.5,
    "lr_warmup_steps": 1,
    "lr_scheduler_type": "cosine",
    "min_lr_ratio": 0.1,
    "total_training_steps": 3,
}


def dp_global_batch(step: int):
    return make_batch(B=8, seed=100 + step)


def dp_micro_batches(step: int, rank: int, size: int):
    """(micro-batches of 2 rows of DP rank ``rank``'s share, tokens in the global batch)."""
    batch = dp_global_batch(step)
    per = batch.batch_size // size
    share = batch.select(slice(rank * per, (rank + 1) * per))
    mbs = [share.select(slice(i, i + 2)) for i in range(0, per, 2)]
    return mbs, float(batch.response_mask.sum())


def lr_lambda(step: int) -> float:
    """DP_OPTIM's schedule written out independently: warmup 1, cosine to 0.1 over 3 steps."""
    import math

    if step < 1:
        return step / 1
    progress = (step - 1) / (3 - 1)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def dp_step_lr(step: int) -> float:
    """The LR of the DP run's step ``step`` (0-based): DP_OPTIM's lr x `lr_lambda`."""
    return DP_OPTIM["lr"] * lr_lambda(step)


def dp_loss(model, step: int) -> torch.Tensor:
    """The DP run's loss of step ``step`` on the HF model: -sum(logprob) / tokens."""
    batch = dp_global_batch(step)
    lp, _, _ = hf_logprobs(model, batch)
    return -lp.sum() / batch.response_mask.sum()


def _f64_grads(path: Path, weights: dict[str, torch.Tensor], step: int):
    """float64 gradients of `dp_loss` at ``weights`` (HF names) and their global norm."""
    model = hf_model(path)
    model.load_state_dict({k: v.detach().double().cpu() for k, v in weights.items()},
                          strict=False)
    dp_loss(model, step).backward()
    grads = {n: p.grad.detach() for n, p in model.named_parameters()}
    return grads, float(torch.sqrt(sum(g.pow(2).sum() for g in grads.values())))


def dp_adamw_bounds(path: Path, runs: dict[str, list[dict[str, torch.Tensor]]]):
    """The DP run replayed on transformers in float64 with torch.optim.AdamW, clip_grad_norm_
    and LambdaLR, and for each fp32 run in ``runs`` ({name: its weights after each of the
    DP_STEPS steps}) an entry-wise bound on its final weights' distance from the float64 ones
    (tests/fp32_bounds.py). Returns (reference weights, {name: {HF name: bound}},
    {name: [grad-norm bound per step]}).

    A run's step-k gradient is off from the float64 one by
    - rounding: `fp32_grad_rel_bound` (one fp32 backward against float64) of each tensor's
      largest entry;
    - from step 2, what the run's weight gap to the float64 run so far does to the gradient,
      computed in float64 at both weight sets, entry by entry;
    after clipping (min(1, clip / norm)) times that coefficient, plus the coefficient's error
    (norm bound / norm) times the clipped gradient. `AdamErrorBound` carries it through AdamW
    (one fp32 side: the rounding of the run's own updates). Two runs' gap is at most the sum
    of their bounds."""
    from fp32_bounds import AdamErrorBound, fp32_grad_norm_bound, fp32_grad_rel_bound

    model = hf_model(path)
    params = dict(model.named_parameters())
    count = sum(p.numel() for p in params.values())
    opt = torch.optim.AdamW(model.parameters(), lr=DP_OPTIM["lr"], betas=DP_OPTIM["betas"],
                            eps=DP_OPTIM["eps"], weight_decay=DP_OPTIM["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    trackers = {name: AdamErrorBound(DP_OPTIM["betas"], DP_OPTIM["eps"],
                                     DP_OPTIM["weight_decay"], sides=1) for name in runs}
    norm_bounds: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(DP_STEPS):
        tokens = int(dp_global_batch(step).attention_mask.sum())
        rel = fp32_grad_rel_bound(path, tokens, sides=1)
        mine = {n: p.detach().clone() for n, p in params.items()}
        carried = {}
        for name, steps in runs.items():
            if step:
                g_run, n_run = _f64_grads(path, {**mine, **steps[step - 1]}, step)
                g_mine, n_mine = _f64_grads(path, mine, step)
                carried[name] = ({n: (g_run[n] - g_mine[n]).abs() for n in params},
                                 abs(n_run - n_mine))
            else:
                carried[name] = ({n: 0.0 for n in params}, 0.0)
        opt.zero_grad()
        dp_loss(model, step).backward()
        raw = {n: p.grad.detach().clone() for n, p in params.items()}
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), DP_OPTIM["grad_clip"]))
        clipped = {n: p.grad.detach().clone() for n, p in params.items()}
        coef = min(1.0, DP_OPTIM["grad_clip"] / (norm + 1e-6))
        largest = max(float(g.abs().max()) for g in raw.values())
        lr = dp_step_lr(step)
        opt.step()
        sched.step()
        for name, tracker in trackers.items():
            grads_gap, norm_gap = carried[name]
            norm_bound = fp32_grad_norm_bound(norm, largest, count, rel, sides=1) + norm_gap
            norm_bounds[name].append(norm_bound)
            delta = {n: coef * (rel * float(raw[n].abs().max()) + grads_gap[n])
                     + (clipped[n].abs() * norm_bound / norm if coef < 1 else 0.0)
                     for n in params}
            tracker.step(lr, clipped, delta, params)
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    return weights, {name: t.bound for name, t in trackers.items()}, norm_bounds


# ------------------------------------------------- checkpoint resharding: the next Adam step

# AdamW of the resharded TP=2 checkpoint (written by megatron_tp2.py, loaded at PP=2 and TP=1).
# eps 1e-6 (not 1e-8): Adam divides by sqrt(v) + eps, so with 1e-8 an entry whose gradient is
# itself ~1e-8 turns fp32 reduction-order noise into an O(lr) weight difference.
RESHARD_OPTIM = {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.01, "grad_clip": 0.0}


def next_step_path(ckpt: Path, layout: str) -> Path:
    """Where a worker writes the HF weights after the step that follows loading ``ckpt``."""
    return Path(ckpt).parent / f"{Path(ckpt).name}_next_step_{layout}.safetensors"


def reshard_next_step(be) -> dict[str, torch.Tensor]:
    """One more train_step (batch seed 5, two micro-batches, pg_loss) on ``be``; returns the
    full HF-named weights afterwards (collective: every rank gets all of them)."""
    batch = make_batch(seed=5)
    n = float(batch.response_mask.sum())
    be.train_step([batch.select(slice(0, 2)), batch.select(slice(2, 4))],
                  lambda o, mb: pg_loss(o, mb, n))
    return {k: v.detach().cpu().contiguous() for k, v in be.export_weights()}


@torch.no_grad()
def zero_adam_moments(be) -> int:
    """Planted bug for the resharding check: zero every exp_avg / exp_avg_sq in ``be``'s
    megatron optimizer (the step counters stay). Returns how many tensors were zeroed."""
    count = 0
    for sub in getattr(be.optimizer, "chained_optimizers", [be.optimizer]):
        for state in sub.optimizer.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key].zero_()
                    count += 1
    return count


# ----------------------------------------- megatron vs torch backend at the same layout

# The AdamW run both backends take in tests/dist/megatron_vs_torch.py: keys both constructors
# accept (MegatronBackend(optim=...), TorchBackend(**...)). eps 1e-4: each Adam entry's
# update is lr * g / (|g| + eps), whose sensitivity to gradient noise is lr / eps at most, so
# eps bounds how far fp32 reduction-order noise travels into the weights, and against the
# clipped gradients (entries ~1e-4) both eps and the clipping change the update. grad_clip 0.5
# is below the grad norms (8 to 16): the clipping acts on both steps.
VS_OPTIM = {
    "lr": 1e-2,
    "betas": (0.9, 0.95),
    "eps": 1e-4,
    "weight_decay": 0.1,
    "grad_clip": 0.5,
    "lr_warmup_steps": 0,
    "lr_scheduler_type": "cosine",
    "min_lr_ratio": 0.1,
    "total_training_steps": 2,
}
VS_TEMPERATURE = 0.7
VS_ENT_COEF = 0.01


def vs_batch(step: int):
    """Step ``step``'s batch: make_batch(B=4) plus signed per-token advantages ``adv``."""
    batch = make_batch(B=4, seed=20 + step)
    g = torch.Generator().manual_seed(40 + step)
    batch.tensors["adv"] = torch.randn(batch.response_mask.shape, generator=g)
    return batch


def vs_loss(outputs, mb, n_tokens: float):
    """-(logprob * adv) - VS_ENT_COEF * entropy, summed over response tokens / n_tokens."""
    m = mb.response_mask.to(outputs.logprob.device).float()
    adv = mb.tensors["adv"].to(m.device)
    per_token = -(outputs.logprob * adv) - VS_ENT_COEF * outputs.entropy
    return (per_token * m).sum() / n_tokens, {"tokens": float(m.sum())}


def vs_reference_loss(logprob: torch.Tensor, entropy: torch.Tensor, batch) -> torch.Tensor:
    """`vs_loss` on the whole batch from float64 (logprob, entropy) [B, L] (zero off-mask)."""
    m = batch.response_mask.double()
    adv = batch.tensors["adv"].double()
    return ((-(logprob * adv) - VS_ENT_COEF * entropy) * m).sum() / m.sum()


def vs_step_inputs(step: int):
    """(micro-batches of rows [0] and [1, 2, 3] of `vs_batch`, loss_fn(outputs, mb))."""
    batch = vs_batch(step)
    n = float(batch.response_mask.sum())
    mbs = [batch.select(slice(0, 1)), batch.select(slice(1, 4))]
    return mbs, lambda o, mb: vs_loss(o, mb, n)


def hf_weights(path: Path):
    """(HF name, tensor) of the HF folder's safetensors."""
    from megarl.models.hf_io import load_hf_state_dict

    return load_hf_state_dict(path).items()


def clipped(grads: dict[str, torch.Tensor], norm: float) -> dict[str, torch.Tensor]:
    """``grads`` scaled as clipping to VS_OPTIM's grad_clip does with total norm ``norm``:
    by min(1, grad_clip / (norm + 1e-6)) (torch.nn.utils.clip_grad_norm_'s rule)."""
    coef = min(1.0, VS_OPTIM["grad_clip"] / (norm + 1e-6))
    return {k: g * coef for k, g in grads.items()}


def critic_checks(res: dict, root: Path, batch, **layout) -> None:
    """A critic at ``layout`` against transformers' token classifier (float64): values, and
    the gradients of a squared value loss (``critic.values`` / ``critic.values_tol`` /
    ``critic.grads`` in ``res``). Adds ``returns`` to ``batch``."""
    from megarl.backends.megatron import MegatronBackend

    path = zoo_model(root, "qwen2_critic")
    critic = MegatronBackend("critic", str(path), **layout, optim={"grad_clip": 0})
    hf = hf_model(path, head="token_cls")
    ref_v = hf_values(hf, batch)
    res["critic.values"] = max_diff(critic.values(batch), ref_v)
    res["critic.values_tol"] = fp32_value_tol(path, batch.response_mask)
    n = float(batch.response_mask.sum())
    batch.tensors["returns"] = torch.randn(batch.response_mask.shape,
                                           generator=torch.Generator().manual_seed(3))
    critic.train_step([batch], lambda o, mb: value_loss(o, mb, n))
    ((ref_v - batch.tensors["returns"].double()) ** 2 * batch.response_mask).sum().div(n).backward()
    grads = dict(critic.export_grads())
    res["critic.grads"] = max(
        rel_diff(grads[k], p.grad) for k, p in hf.named_parameters() if p.grad is not None
    )


def prm_checks(res: dict, root: Path, batch, **layout) -> None:
    """A PRM at ``layout``: token scores [B, L, 2] against transformers (``prm.shape``,
    ``prm.scores``, ``prm.scores_tol`` in ``res``)."""
    from megarl.backends.megatron import MegatronBackend

    path = zoo_model(root, "qwen3_prm")
    prm = MegatronBackend("prm", str(path), **layout)
    scores = prm.token_scores(batch)
    res["prm.shape"] = list(scores.shape)
    res["prm.scores"] = max_diff(scores, hf_scores(hf_model(path, "token_cls"), batch))
    res["prm.scores_tol"] = fp32_value_tol(path, batch.response_mask)


def grpo_two_steps(tmp_path: Path, policy: Path, *extra: str) -> list[dict]:
    """GRPO on the embedded demo for 2 steps on 2 gloo ranks (torchrun, forked warm) with the
    actor on megatron and ``rollout.check_logprobs`` on: 4 prompts x 4 responses of at most
    48 tokens, ``extra`` overrides last. Returns the two steps' metric rows."""
    from warm_runs import run_script

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    argv = ["launch/train.py", "--config", "grpo", "--demo", "on",
            f"trainer.default_local_dir={tmp_path}", "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=4",
            "data.max_response_length=48", "trainer.test_freq=-1",
            "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.export_hf=false",
            "trainer.total_training_steps=2", "trainer.n_gpus_per_node=2",
            f"actor_rollout_ref.model.path={policy}", "actor_rollout_ref.actor.strategy=megatron",
            "actor_rollout_ref.rollout.check_logprobs=true", *extra]
    proc = run_script(argv, REPO, env, timeout=600, nproc=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x]
    rows = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2]
    return rows

