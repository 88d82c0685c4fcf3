"""Worker of tests/rollout/test_rollout_reshard_dist.py: the weight stream of a trained backend
(torch or megatron, TP=2 or PP=2 on gloo, or a world of one), bucketed by
`megarl.rollout.reshard`, checked against the trainer itself.

    torchrun --standalone --nproc_per_node=2 tests/dist/rollout_reshard_worker.py \
        BACKEND LAYOUTS MODELS_JSON OUT_JSON

BACKEND torch | megatron; LAYOUTS a comma list of tp2 | pp2 | ep2 (megatron, MoE) | one; MODELS_JSON {layout: HF
folder}. Results are keyed "<layout>.<check>".

Per run: one optimizer step with a large LR (so the weights differ from the folder), then
- ``hf_logprob_err``: the bucketed stream loaded into a transformers model (float64) gives the
  trainer's ``logprobs`` on a ragged batch (``hf_logits_err``: and its logits, where the
  backend exposes them: megatron);
- ``engine_logprob_err``: a `TorchRolloutEngine` built from the untrained folder, updated from
  the stream, generates; the trainer's ``logprobs`` of those completions equal the engine's
  (`logprob_diff_metrics`, T = 0.8);
- ``shared_engine_err`` (torch, world of one): an engine wrapping ``backend.model`` itself;
- ``peak_bytes.<B>``: the most bytes of streamed tensors alive at once while a consumer drops
  every bucket at once, for two bucket sizes B (tracked with weakref finalizers), with
  ``max_bucket_bytes`` (the largest bucket handed out), ``max_tensor_bytes``, and
  ``stream_peak_bytes``: the same with every tensor in a bucket of its own, i.e. what the
  backend's export holds by itself (torch: one tensor; megatron: one layer).
Rank 0 writes the JSON (floats: max over ranks).
"""

from __future__ import annotations

import json
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: logprob_reference

from megarl.backends.protocol import SequenceBatch  # noqa: E402
from logprob_reference import completions_to_batch  # noqa: E402

from megarl.algos.rollout_correction import METRIC_MAX, logprob_diff_metrics  # noqa: E402
from megarl.rollout.protocol import SamplingParams  # noqa: E402
from megarl.rollout.reshard import tensor_bytes, weight_buckets  # noqa: E402
from megarl.rollout.torch import TorchRolloutEngine  # noqa: E402
from megarl.utils import dist as mdist  # noqa: E402

BUCKETS = (40_000, 400_000)  # the peak-memory pair (tests/rollout/test_rollout_reshard_dist.py)
ENGINE_BUCKET = 200_000


def make_batch(seed: int = 0, b: int = 4, p: int = 6, r: int = 5) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (b, p + r), generator=g)
    mask = torch.ones(b, p + r, dtype=torch.long)
    for i in range(b):
        mask[i, : int(torch.randint(0, p - 1, (1,), generator=g))] = 0
        mask[i, p + int(torch.randint(1, r + 1, (1,), generator=g)) :] = 0
    return SequenceBatch(ids * mask, mask, r)


def pg_loss(outputs, mb, n_tokens: float):
    m = mb.response_mask.to(outputs.logprob.device).float()
    return -(outputs.logprob * m).sum() / n_tokens, {}


def build(backend: str, layout: str, path: str):
    kw = {"tp2": {"tp": 2}, "pp2": {"pp": 2}, "ep2": {"ep": 2}, "one": {}}[layout]
    if backend == "torch":
        from megarl.backends.torch import TorchBackend

        return TorchBackend("actor", path, optim={"lr": 5e-2, "grad_clip": None,
                                                   "weight_decay": 0.0},
                            device="cpu", **kw)
    from megarl.backends.megatron import MegatronBackend

    return MegatronBackend("actor", path, optim={"lr": 5e-2, "grad_clip": 0.0,
                                                        "weight_decay": 0.0}, **kw)


def hf_float64(state: dict[str, torch.Tensor], path: str):
    """transformers' model of ``path``'s config holding ``state`` (HF names), float64, eval.
    The state goes through a folder and ``from_pretrained``, which maps per-expert checkpoint
    names onto transformers' fused expert parameters (``load_state_dict`` would not) and ties
    an lm_head the stream leaves out; every model parameter must come from ``state``."""
    import shutil
    import tempfile

    import transformers
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(Path(path) / "config.json", tmp)
        save_file({k: v.contiguous() for k, v in state.items()},
                  str(Path(tmp) / "model.safetensors"))
        # eager experts: transformers' default grouped_mm MoE kernel has no float64
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            tmp, dtype=torch.float64, experts_implementation="eager",
            output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def hf_logprobs(
    state: dict[str, torch.Tensor], path: str, batch: SequenceBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob [B, L], logits [B, L, V]) of the response columns, float64, masked."""
    model = hf_float64(state, path)
    p = batch.input_ids.shape[1] - batch.response_length
    pos = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=pos).logits[:, p - 1 : -1]
    lp = torch.log_softmax(logits, -1).gather(-1, batch.response_ids[..., None])[..., 0]
    return lp * batch.response_mask, logits * batch.response_mask[..., None]


def peak_live_bytes(backend, bucket: int) -> tuple[int, int, int]:
    """(peak bytes alive, largest tensor, largest bucket) over one pass of the bucketed stream
    whose consumer keeps nothing (as an engine copying each bucket in). Every tensor is
    counted from the moment export_weights yields it until it is freed."""
    live = [0, 0]  # current, peak
    biggest = [0, 0]

    def gone(n: int) -> None:
        live[0] -= n

    def tracked(stream):
        for name, t in stream:
            n = tensor_bytes(t)
            live[0] += n
            live[1] = max(live[1], live[0])
            biggest[0] = max(biggest[0], n)
            weakref.finalize(t, gone, n)
            yield name, t
            del t

    for b in weight_buckets(tracked(backend.export_weights()), bucket):
        live[1] = max(live[1], live[0])
        biggest[1] = max(biggest[1], sum(tensor_bytes(t) for _, t in b))
        del b
    return live[1], biggest[0], biggest[1]


def run(backend_name: str, layout: str, model_dir: str) -> dict[str, object]:
    res: dict[str, object] = {}
    be = build(backend_name, layout, model_dir)
    batch = make_batch()
    n = float(batch.response_mask.sum())
    be.train_step([batch.select(slice(0, 2)), batch.select(slice(2, 4))],
                  lambda o, mb: pg_loss(o, mb, n))
    trained, _ = be.logprobs(batch)

    state = {}
    for bucket in weight_buckets(be.export_weights(), BUCKETS[0]):
        state.update({k: v.clone() for k, v in bucket})
    ref_lp, ref_logits = hf_logprobs(state, model_dir, batch)
    res["hf_logprob_err"] = float((ref_lp - trained.double()).abs().max())
    if hasattr(be, "logits"):  # megatron exposes the trainer's logits too
        res["hf_logits_err"] = float((ref_logits - be.logits(batch).double()).abs().max())
    res["changed"] = float((trained - be_untrained_logprobs(model_dir, batch)).abs().max())

    engine = TorchRolloutEngine.from_pretrained(model_dir, max_num_seqs=4)
    engine.update_weights(weight_buckets(be.export_weights(), ENGINE_BUCKET))
    prompts = [[1, 5, 9, 14], [1, 30, 31], [1, 77, 78, 79, 80, 81]]
    sp = SamplingParams(n=2, max_new_tokens=6, temperature=0.8, seed=7, ignore_eos=True)
    cb, engine_lp = completions_to_batch(prompts, engine.generate(prompts, sp))
    old, _ = be.logprobs(cb, temperature=0.8)
    res["engine_logprob_err"] = logprob_diff_metrics(engine_lp, old.float(),
                                                     cb.response_mask)[METRIC_MAX]
    if backend_name == "torch" and layout == "one":
        shared = TorchRolloutEngine(be.model, max_num_seqs=4)  # the trainer's model itself
        cb, engine_lp = completions_to_batch(prompts, shared.generate(prompts, sp))
        old, _ = be.logprobs(cb, temperature=0.8)
        res["shared_engine_err"] = logprob_diff_metrics(engine_lp, old.float(),
                                                        cb.response_mask)[METRIC_MAX]

    # what the backend's own stream holds (each tensor its own bucket), then with buckets
    res["stream_peak_bytes"], res["max_tensor_bytes"], _ = peak_live_bytes(be, 1)
    for b in BUCKETS:
        res[f"peak_bytes.{b}"], _, res[f"max_bucket_bytes.{b}"] = peak_live_bytes(be, b)
    res["total_bytes"] = sum(tensor_bytes(v) for v in state.values())
    return res


def main() -> None:
    backend_name, layouts, models, out = sys.argv[1:5]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    models = json.loads(models)
    res: dict[str, object] = {}
    for layout in layouts.split(","):
        res.update({f"{layout}.{k}": v for k, v in run(backend_name, layout,
                                                       models[layout]).items()})
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, res)
    if dist.get_rank() == 0:
        merged = {k: max(p[k] for p in parts) for k in parts[0]}
        Path(out).write_text(json.dumps(merged))
    dist.barrier()
    mdist.destroy()


def be_untrained_logprobs(model_dir: str, batch: SequenceBatch) -> torch.Tensor:
    """Logprobs of the untrained folder (single process, megarl's model): the step moved them."""
    from megarl.models import load_model

    model = load_model(model_dir)
    p = batch.input_ids.shape[1] - batch.response_length
    with torch.no_grad():
        logits = model(batch.input_ids, attention_mask=batch.attention_mask)[:, p - 1 : -1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, batch.response_ids[..., None])[..., 0]
    return lp * batch.response_mask


if __name__ == "__main__":
    main()
