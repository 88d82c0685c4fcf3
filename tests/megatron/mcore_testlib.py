"""Shared helpers of the megatron backend / conversion tests (pytest files and tests/dist
workers). References are computed with transformers in float64, independently of megarl."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
DIST_DIR = REPO / "tests" / "dist"


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


def torch_adamw_reference(path: Path) -> dict[str, torch.Tensor]:
    """The DP run replayed on transformers in float64 with torch.optim.AdamW, clip_grad_norm_
    and LambdaLR: the HF state dict after DP_STEPS steps."""
    model = hf_model(path)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=DP_OPTIM["lr"],
        betas=DP_OPTIM["betas"],
        eps=DP_OPTIM["eps"],
        weight_decay=DP_OPTIM["weight_decay"],
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    for step in range(DP_STEPS):
        batch = dp_global_batch(step)
        lp, _, _ = hf_logprobs(model, batch)
        loss = -lp.sum() / batch.response_mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), DP_OPTIM["grad_clip"])
        opt.step()
        sched.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


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
# accept (MegatronBackend(optim_config=...), TorchBackend(**...)). eps 1e-4: each Adam entry's
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
