"""The torch backend with its parameters held in bf16 (``param_dtype="bf16"``, verl's
``fsdp_config.model_dtype: bf16``), a world of one on a tiny random Qwen2 (weights N(0, 0.1)):
parameters, gradients and AdamW state are bf16; one update equals AdamW computed in float64
on the bf16 parameters and gradients, rounded to bf16 (an independent computation here);
logprobs and gradients match transformers' bf16 model; a checkpoint resumes bit for bit.

Measured (AMD EPYC, 2 cores, one step, weight decay 0.01):
  lr 1e-3: 91.5% of the weights change; 98.8% equal the float64 reference exactly, the rest
           differ by the bf16 rounding of AdamW's own arithmetic (below one bf16 spacing plus
           3% of lr).
  lr 1e-6: 0.35% of the weights change (those below about 5e-4 in magnitude), exactly the
           reference's set and values; with fp32 parameters every weight with a gradient changes.
Planted in the reference: lr x 2 mismatches 88.7% of the weights, AdamW without bias
correction (update x 3.2) 92.5% (the bound is 3%); fp32 parameters fail the dtype checks.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import transformers
from policy_batch import loss_fn, make_batch
from torch.distributed.tensor import DTensor
from warm_runs import run_script

from megarl.backends.protocol import SequenceBatch
from megarl.backends.torch import TorchBackend
from megarl.backends.torch.config import backend_kwargs
from megarl.config.schema import Config
from megarl.errors import UserInputError
from megarl.trainer.settings import role_settings
from megarl.utils import dist as mdist

ROOT = Path(__file__).resolve().parents[2]
BF16 = torch.bfloat16
BETAS, EPS, WD = (0.9, 0.999), 1e-8, 0.01


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from megarl.models.testing import make_tiny_hf_model

    mdist.init_distributed(torch.device("cpu"))
    return make_tiny_hf_model(tmp_path_factory.mktemp("param_dtype") / "m", "qwen2",
                              tokenizer=False, lm_head_scale=3.0)


def actor(folder, lr: float = 1e-3, param_dtype: str | None = "bf16") -> TorchBackend:
    return TorchBackend("actor", str(folder), device="cpu", dtype="bf16", param_dtype=param_dtype,
                        use_fused_kernels=False,
                        optim={"lr": lr, "betas": BETAS, "eps": EPS, "weight_decay": WD,
                               "grad_clip": None})


def plain(t: torch.Tensor) -> torch.Tensor:
    """A full copy of ``t`` (the fp32 parameters run under FSDP2: DTensors)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def params(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: plain(p) for n, p in backend.model.named_parameters()}


def adamw_first_step(p: torch.Tensor, g: torch.Tensor, lr: float) -> torch.Tensor:
    """AdamW's first update (decoupled weight decay, bias-corrected moments) in float64 on
    the bf16 parameter ``p`` and gradient ``g``, rounded to bf16."""
    p, g = p.double(), g.double()
    m, v = (1 - BETAS[0]) * g, (1 - BETAS[1]) * g * g
    m_hat, v_hat = m / (1 - BETAS[0]), v / (1 - BETAS[1])
    return (p * (1 - lr * WD) - lr * m_hat / (v_hat.sqrt() + EPS)).to(BF16)


def adamw_first_step_window(p: torch.Tensor, g: torch.Tensor, lr: float
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(lowest, highest) bf16 results AdamW's own bf16 arithmetic can give for the first step
    of ``p`` and ``g``. Its update lr m / (sqrt(v) + eps) goes through about 6 bf16 roundings
    (the moments, the square, the square root, the bias correction, eps, the quotient), each
    within u = 2^-8 of its value; its decoupled decay p (1 - lr wd) rounds back to p in bf16
    whenever lr wd < u / 2 (so it can be missing entirely); the final add is in fp32. So the
    value rounded to bf16 is within e = 6 u |update| + lr wd |p| + 2 u32 |p| of the float64
    reference x, and rounding is monotone: the result lies in [bf16(x - e), bf16(x + e)].
    That window is one value except where x lies within e of a rounding boundary: there the
    CPU's own rounding of the gradient (another CPU, another float order) picks the side."""
    p, g = p.double(), g.double()
    m_hat, v_hat = g, g * g  # the bias-corrected first moments
    update = lr * m_hat / (v_hat.sqrt() + EPS)
    x = p * (1 - lr * WD) - update
    e = 6 * 2.0**-8 * update.abs() + (lr * WD + 2 * 2.0**-24) * p.abs()
    return (x - e).to(BF16), (x + e).to(BF16)


def one_step(folder, lr: float, param_dtype: str | None = "bf16"):
    """(parameters before, gradients of the step, parameters after, the backend) of one
    train_step; the gradients come from a twin backend's forward_backward on the same batch."""
    twin = actor(folder, lr, param_dtype)
    twin.forward_backward([make_batch()], loss_fn)
    grads = {n: plain(p.grad) for n, p in twin.model.named_parameters()}
    a = actor(folder, lr, param_dtype)
    before = params(a)
    a.train_step([make_batch()], loss_fn)
    return before, grads, params(a), a


def check_update(before: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
                 after: dict[str, torch.Tensor], lr: float) -> None:
    """``after`` = `adamw_first_step` of ``before`` and ``grads``: exactly for most weights,
    the rest within one bf16 spacing plus the bf16 rounding of AdamW's own arithmetic."""
    assert {t.dtype for t in [*before.values(), *grads.values(), *after.values()]} == {BF16}
    total = exact = changed = 0
    for n, new in after.items():
        want = adamw_first_step(before[n], grads[n], lr)
        spacing = torch.finfo(BF16).eps * want.double().abs()  # one bf16 step at |want|
        err = (new.double() - want.double()).abs()
        assert bool((err <= spacing + 0.03 * lr).all()), (n, float(err.max()))
        total += new.numel()
        exact += int((new == want).sum())
        changed += int((new != before[n]).sum())
    assert exact / total > 0.97, exact / total
    assert changed / total > 0.85, changed / total  # lr 1e-3 moves most weights


def test_parameters_gradients_and_adamw_state_are_bf16_and_the_update_is_adamw(folder):
    lr = 1e-3
    before, grads, after, a = one_step(folder, lr)
    assert a.param_dtype == BF16 and a.compute_dtype == BF16
    state = [a.optimizer.state[p] for p in a.model.parameters()]
    assert len(state) == len(before)
    assert {s[k].dtype for s in state for k in ("exp_avg", "exp_avg_sq")} == {BF16}
    check_update(before, grads, after, lr)
    sent = dict(a.export_weights())  # what engines and the HF export receive: the bf16 weights
    assert set(sent) == set(after) and all(torch.equal(sent[n], after[n]) for n in sent)


@pytest.mark.e2e
@pytest.mark.dist
def test_fsdp2_on_two_ranks_holds_bf16_shards_and_applies_adamw(folder, tmp_path):
    """FSDP2 over 2 gloo ranks (tests/dist/param_dtype_worker.py): the local shards, their
    gradients (reduced in fp32, kept in bf16) and the AdamW state are bf16; the update of the
    full parameters is AdamW's on the full gradients."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    out = tmp_path / "out.pt"
    proc = run_script([str(ROOT / "tests" / "dist" / "param_dtype_worker.py"), str(folder),
                       str(out)], ROOT, env, timeout=300, nproc=2)
    if proc.returncode != 0 or not out.is_file():
        pytest.fail(f"worker failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    r = torch.load(out)
    assert r["dtypes"] == ["torch.bfloat16"] and r["n_state"] > 0
    check_update(r["before"], r["grads"], r["after"], r["lr"])


def test_small_lr_updates_round_away_as_the_reference_predicts(folder):
    """At lr 1e-6 only the weights below about 5e-4 in magnitude move: measured 0.35% here,
    each as the float64 reference rounded to bf16 up to AdamW's own bf16 rounding
    (`adamw_first_step_window`: an Intel Xeon matched the reference exactly, an AMD EPYC one
    weight of a down_proj on the other side of a rounding boundary); fp32 parameters all move
    (those with a gradient). Planted: lr x 2 or no bias correction in the reference leave
    the window for most moved weights."""
    lr = 1e-6
    before, grads, after, _ = one_step(folder, lr)
    total = changed = 0
    for n, new in after.items():
        lo, hi = adamw_first_step_window(before[n], grads[n], lr)
        outside = (new < lo) | (new > hi)
        assert not bool(outside.any()), (n, int(outside.sum()))
        total += new.numel()
        changed += int((new != before[n]).sum())
    assert 0 < changed / total < 0.01, changed / total
    before32, grads32, after32, a32 = one_step(folder, lr, param_dtype=None)
    assert a32.param_dtype == torch.float32
    fed = {n: g != 0 for n, g in grads32.items()}  # unused embedding rows have no gradient
    moved = sum(int((after32[n] != before32[n])[fed[n]].sum()) for n in after32)
    assert moved == sum(int(f.sum()) for f in fed.values())


def _hf_logprob(hf, batch: SequenceBatch) -> torch.Tensor:
    """[B, L] float64 response logprobs from transformers' bf16 logits, 0 outside."""
    ids, mask, L = batch.input_ids, batch.attention_mask, batch.response_length
    P = ids.shape[1] - L
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    z = hf(ids, attention_mask=mask, position_ids=pos).logits[:, P - 1:-1].double()
    return torch.log_softmax(z, -1).gather(-1, ids[:, P:, None])[..., 0] * mask[:, P:]


def test_logprobs_and_gradients_match_transformers_bf16(folder):
    """Bounds of tests/backends/test_torch_backend_bf16.py (a 5% temperature error breaks
    them); the gradients are the bf16 parameters' own."""
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=BF16)
    batch = make_batch(1)
    a = actor(folder)
    lp, _ = a.logprobs(batch)
    m = batch.attention_mask[:, -batch.response_length:].bool()
    want = _hf_logprob(hf, batch)
    d = (lp.double() - want.detach()).abs()[m]
    assert float(d.max()) < 0.15 and float(d.mean()) < 0.05, (float(d.max()), float(d.mean()))
    a.forward_backward([batch], loss_fn)
    mask = batch.tensors["mask"].double()
    (-(want * batch.tensors["adv"].double() * mask).sum() / mask.sum()).backward()
    hf_grads = {n: p.grad.double() for n, p in hf.named_parameters()}
    got = dict(a.full_grads())
    assert {t.dtype for t in got.values()} == {BF16}
    num = sum(float((got[n].double() - g).pow(2).sum()) for n, g in hf_grads.items())
    den = sum(float(g.pow(2).sum()) for g in hf_grads.values())
    assert (num / den) ** 0.5 < 0.03


def test_checkpoint_resumes_bit_for_bit(folder, tmp_path):
    straight = actor(folder)
    straight.train_step([make_batch(0)], loss_fn)
    straight.save(str(tmp_path / "ckpt"))
    straight.train_step([make_batch(1)], loss_fn)
    resumed = actor(folder)
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.step == 1
    resumed.train_step([make_batch(1)], loss_fn)
    want, got = params(straight), params(resumed)
    assert all(torch.equal(got[n], want[n]) and got[n].dtype == BF16 for n in want)
    for p, q in zip(straight.model.parameters(), resumed.model.parameters()):
        s, r = straight.optimizer.state[p], resumed.optimizer.state[q]
        assert torch.equal(s["exp_avg"], r["exp_avg"]) and r["exp_avg"].dtype == BF16
        assert torch.equal(s["exp_avg_sq"], r["exp_avg_sq"])
    with pytest.raises(UserInputError, match="param_dtype: bf16"):
        actor(folder, param_dtype=None).load(str(tmp_path / "ckpt"))


def test_bf16_parameters_with_fp32_compute_are_refused(folder):
    with pytest.raises(UserInputError, match=r"critic\.parallel\.param_dtype='bf16'"):
        TorchBackend("critic", str(folder), device="cpu", dtype="fp32", param_dtype="bf16")


def test_each_role_reads_its_parallel_blocks_param_dtype():
    """The reference follows the actor's block, the critic and the PRM read their own; absent
    (or null) = None, today's fp32 parameters."""
    cfg = Config()
    cfg.trainer.device = "cpu"
    cfg.actor_rollout_ref.model.path = "/policy"
    assert backend_kwargs(role_settings("actor", cfg, None))[1]["param_dtype"] is None
    cfg.actor_rollout_ref.actor.parallel.param_dtype = "bf16"
    cfg.critic.parallel.param_dtype = "fp32"
    cfg.reward_model.parallel.param_dtype = "fp32"
    got = {r: backend_kwargs(role_settings(r, cfg, "/m"))[1]["param_dtype"]
           for r in ("actor", "ref", "critic", "prm")}
    assert got == {"actor": "bf16", "ref": "bf16", "critic": "fp32", "prm": "fp32"}


def test_verl_model_dtype_keys_and_the_megatron_refusal():
    """verl's fsdp_config.model_dtype lands on each trained role's parallel.param_dtype (the
    reference's is inert: it follows the actor); under strategy megatron the key is refused
    naming megatron.param_dtype."""
    from megarl.config import ConfigError
    from megarl.config.loader import resolve_config

    cfg = resolve_config("ppo", ["actor_rollout_ref.actor.fsdp_config.model_dtype=bfloat16",
                                 "critic.model.fsdp_config.model_dtype=fp32",
                                 "actor_rollout_ref.ref.fsdp_config.model_dtype=fp32"]).config
    assert cfg.actor_rollout_ref.actor.parallel.param_dtype == "bf16"
    assert cfg.critic.parallel.param_dtype == "fp32"
    with pytest.raises(ConfigError, match=r"actor\.megatron\.param_dtype"):
        resolve_config("grpo", ["actor_rollout_ref.actor.strategy=megatron",
                                "actor_rollout_ref.actor.parallel.param_dtype=bf16"])
