"""The GPU check's numeric steps: the Triton kernels and the training backends against
float64 references (bench/gpu_check.py runs them)."""

from __future__ import annotations

from pathlib import Path

from gpu_check_lib import Sizes, load_hf, model_dir, require


def _kernel_inputs(T: int, H: int, V: int, dtype, device, seed: int, scale: float = 3.0):
    """hidden [T, H], weight [V, H] (logit std about ``scale``), labels [T] (0 and V-1 used),
    loss weights a, b [T]: drawn in float64 on ``device``, then cast."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    f64 = dict(dtype=torch.float64, device=device, generator=g)
    hidden = torch.randn(T, H, **f64)
    weight = torch.randn(V, H, **f64) * (scale / H**0.5)
    labels = torch.randint(0, V, (T,), device=device, generator=g)
    labels[0], labels[-1] = 0, V - 1
    a, b = torch.randn(T, **f64).float(), torch.randn(T, **f64).float()
    return hidden.to(dtype), weight.to(dtype), labels, a, b


def _f64_logprob_entropy(h, w, labels, temperature):
    import torch

    logp = torch.log_softmax(h.double() @ w.double().t() / temperature, dim=-1)
    return logp.gather(1, labels[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


def _errors(got: dict, want: dict) -> dict:
    """max |got - want| per name; gradients relative to the reference's largest element."""
    out = {}
    for k, w in want.items():
        d = float((got[k].double() - w.double()).abs().max())
        out[k] = d / max(float(w.abs().max()), 1e-30) if k in ("dh", "dw") else d
    return out


def _kernel_case(mk, impl, h, w, labels, a, b, temperature):
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    lp, ent = mk.linear_logprob_entropy(h, w, labels, temperature, impl=impl)
    ((lp * a).sum() + (ent * b).sum()).backward()
    return {"logprob": lp.detach(), "entropy": ent.detach(), "dh": h.grad, "dw": w.grad}


def step_kernels(sizes: Sizes, out: Path) -> dict:
    """Triton (compiled; the interpreter in the dry run) and torch against float64."""
    import torch

    import megarl_kernels as mk
    from megarl import algos

    device = torch.device(sizes.device)
    bounds = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-5, 1.6e-2)}  # tests/kernels
    rows, failures = [], []
    for T, H, V in sizes.kernel_shapes:
        for dtype in (torch.float32, torch.bfloat16):
            for temperature in (1.0, 0.6):
                h, w, labels, a, b = _kernel_inputs(T, H, V, dtype, device, seed=T + V)
                hr = h.double().requires_grad_()
                wr = w.double().requires_grad_()
                lp, ent = _f64_logprob_entropy(hr, wr, labels, temperature)
                ((lp * a.double()).sum() + (ent * b.double()).sum()).backward()
                want = {"logprob": lp.detach(), "entropy": ent.detach(), "dh": hr.grad,
                        "dw": wr.grad}
                del lp, ent, hr, wr
                errs = {impl: _errors(_kernel_case(mk, impl, h, w, labels, a, b, temperature),
                                      want) for impl in ("triton", "torch")}
                fwd_tol, grad_tol = bounds[dtype]
                # the logsumexp of V fp32 terms: sqrt(V) roundings of the largest |logprob|
                fwd_tol = max(fwd_tol, V**0.5 * 2.0**-24 * float(want["logprob"].abs().max()))
                row = {"T": T, "H": H, "V": V, "dtype": str(dtype).removeprefix("torch."),
                       "temperature": temperature, "triton": errs["triton"],
                       "torch": errs["torch"]}
                for k, e in errs["triton"].items():
                    bound = max(fwd_tol if k in ("logprob", "entropy") else grad_tol,
                                2 * errs["torch"][k])
                    row.setdefault("bound", {})[k] = bound
                    if not e <= bound:
                        failures.append(f"{k} T={T} V={V} {row['dtype']} t={temperature}: "
                                        f"{e:.3e} > {bound:.3e}")
                rows.append(row)
                del want, h, w
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        rows.append(_fused_losses_case(mk, algos, T, H, V, device, failures))
    require(not failures, "; ".join(failures), {"cases": rows})
    return {"cases": rows}


def _fused_losses_case(mk, algos, T, H, V, device, failures: list[str]) -> dict:
    """fused_ppo_loss and fused_pacs_loss (Triton, bf16 inputs) against megarl.algos composed
    with float64 full-logits logprobs of the same bf16-rounded inputs: loss and gradients."""
    import torch

    h, w, labels, a, _ = _kernel_inputs(T, H, V, torch.bfloat16, device, seed=7 + T)
    B = max(4, T // 64) // 2 * 2
    seq = torch.arange(T, device=device) * B // T  # B responses of about T/B tokens
    groups = torch.arange(B, device=device) // 2  # pairs: one right and one wrong response
    scores = (torch.arange(B, device=device) % 2).float()
    with torch.no_grad():
        lp0, _ = _f64_logprob_entropy(h, w, labels, 1.0)
    gen = torch.Generator(device=device).manual_seed(3)
    old = (lp0 + 0.3 * torch.randn(T, dtype=torch.float64, device=device, generator=gen)).float()
    res = {"loss": "fused_ppo / fused_pacs", "T": T, "V": V}
    lengths = torch.bincount(seq, minlength=B)
    mask = torch.arange(int(lengths.max()), device=device)[None] < lengths[:, None]
    col = torch.arange(T, device=device) - torch.cumsum(lengths, 0)[seq] + lengths[seq]

    def pad(x):
        return torch.zeros(mask.shape, dtype=x.dtype, device=device).index_put((seq, col), x)

    def ref(kind):
        hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
        lp, ent = _f64_logprob_entropy(hr, wr, labels, 1.0)
        if kind == "ppo":
            loss, _ = algos.policy_loss("vanilla", logprob=pad(lp), old_logprob=pad(old.double()),
                                        advantages=pad(a.double()), response_mask=mask,
                                        agg_mode="token-mean")
            loss = loss - 0.01 * algos.agg_loss(pad(ent), mask, "token-mean")
        else:
            loss, _ = algos.pacs_loss(logprob=pad(lp), old_logprob=pad(old.double()),
                                      response_mask=mask, scores=scores, group_index=groups,
                                      beta=1.0, reward_method="1", adv_estimator="rloo",
                                      weight_mode="question")
        loss.backward()
        return float(loss), hr.grad, wr.grad

    def fused(kind):
        hf, wf = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        if kind == "ppo":
            loss, _ = mk.fused_ppo_loss(hf, wf, labels, old, a, loss_scale=1.0 / T,
                                        entropy_coeff=0.01, impl="triton")
        else:
            loss, _ = mk.fused_pacs_loss(hf, wf, labels, old, seq, groups, scores, beta=1.0,
                                         reward_method="1", adv_estimator="rloo",
                                         weight_mode="question", impl="triton")
        loss.backward()
        return float(loss), hf.grad, wf.grad

    for kind in ("ppo", "pacs"):
        (rl, rdh, rdw), (fl, fdh, fdw) = ref(kind), fused(kind)
        if not float(rdh.abs().max()) > 0:
            failures.append(f"fused {kind}: the float64 reference has no gradient (degenerate case)")
        errs = {"loss_rel": abs(fl - rl) / max(abs(rl), 1e-12),
                **_errors({"dh": fdh, "dw": fdw}, {"dh": rdh, "dw": rdw})}
        res[kind] = errs
        for k, e in errs.items():
            bound = 1e-3 if k == "loss_rel" else 1.6e-2  # bf16 inputs, fp32 accumulation
            if not e <= bound:
                failures.append(f"fused {kind} {k} T={T} V={V}: {e:.3e} > {bound:.1e}")
    return res


def _batch(sizes: Sizes, vocab: int, seed: int = 0):
    """8 left-padded prompts with right-padded responses (ragged), token ids in [3, vocab)."""
    import torch

    from megarl.backends.protocol import SequenceBatch

    B, P, L = 8, 32, max(8, sizes.response_len // 2)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, P + L), generator=g)
    mask = torch.ones(B, P + L, dtype=torch.long)
    for i in range(B):
        mask[i, : int(torch.randint(0, P // 2, (1,), generator=g))] = 0
        mask[i, P + int(torch.randint(L // 2, L + 1, (1,), generator=g)):] = 0
    return SequenceBatch(ids * mask, mask, L)


def _hf_logprobs(model, batch, device):
    import torch

    mask = batch.attention_mask.to(device)
    ids = batch.input_ids.to(device)
    P = ids.shape[1] - batch.response_length
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask,
                       position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    logp = torch.log_softmax(logits[:, P - 1: -1].double(), -1)
    return logp.gather(-1, batch.response_ids.to(device)[..., None])[..., 0].cpu()


def step_megatron_vs_hf(sizes: Sizes, out: Path) -> dict:
    """Mean / max |logprob - float64 transformers| over the response tokens, for transformers
    in the run dtype, megatron and the torch backend (the backends must be within twice
    transformers' own error, or 0.02)."""
    import torch

    from megarl.backends.megatron import MegatronBackend, parallel
    from megarl.backends.torch import TorchBackend
    from megarl.utils.dist import init_distributed, resolve_device

    device = torch.device(sizes.device)
    path = model_dir(out)
    batch = _batch(sizes, sizes.model["vocab_size"])
    resp = batch.response_mask.bool()
    run_dtype = torch.bfloat16 if sizes.dtype == "bf16" else torch.float32
    ref = _hf_logprobs(load_hf(path, torch.float64, device), batch, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()

    def err(lp):
        d = (lp.double().cpu() - ref)[resp].abs()
        return {"mean": float(d.mean()), "max": float(d.max())}

    res = {"transformers": err(_hf_logprobs(load_hf(path, run_dtype, device), batch, device))}
    init_distributed(resolve_device(sizes.device))
    parallel.ensure_model_parallel(1, 1, seed=1)
    for name, make in (("megatron", lambda: MegatronBackend("ref", str(path), dtype=sizes.dtype)),
                       ("torch", lambda: TorchBackend("ref", str(path), dtype=sizes.dtype,
                                                      device=device))):
        backend = make()
        res[name] = err(backend.logprobs(batch, temperature=1.0)[0])
        del backend
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bound = max(2 * res["transformers"]["mean"], 0.02 if sizes.dtype == "bf16" else 1e-5)
    res["bound_mean"] = bound
    for name in ("megatron", "torch"):
        require(res[name]["mean"] <= bound,
                f"{name} mean |logprob - float64| {res[name]['mean']:.3g} > {bound:.3g}")
    return res
