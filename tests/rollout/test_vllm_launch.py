"""How a vLLM engine is started (`megarl.rollout.vllm.launch`): executor choice and memory
sizing, pure functions checked by hand-computed values (no vLLM needed)."""

from __future__ import annotations

import pytest
import torch

from megarl.rollout.memory import kv_bytes_for, kv_bytes_per_token
from megarl.rollout.vllm.launch import cpu_shm_ident, executor_backend, memory_kwargs

CFG = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128,
       "num_hidden_layers": 3}
GIB = 2**30


def test_executor_world_of_one_and_torchrun():
    # the trainer's world of one sets no RANK: in-process executor (no KeyError on RANK)
    assert executor_backend(1, {}) == "uni"
    assert executor_backend(1, {"RANK": "1", "LOCAL_RANK": "1"}) == "external_launcher"
    assert executor_backend(2, {"RANK": "0", "LOCAL_RANK": "0"}) == "external_launcher"
    with pytest.raises(ValueError, match="torchrun --nproc_per_node 2"):
        executor_backend(2, {})


def test_cpu_shm_named_after_the_job():
    a = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    b = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29501"}
    assert cpu_shm_ident("external_launcher", a) != cpu_shm_ident("external_launcher", b)
    assert cpu_shm_ident("external_launcher", a) == cpu_shm_ident("external_launcher", dict(a))
    assert cpu_shm_ident("uni", a) is None  # vLLM's own: a free tcp port of its own


def test_kv_bytes():
    # K and V x 3 layers x 2 KV heads x head_dim 32 x 4 bytes
    assert kv_bytes_per_token(CFG, torch.float32) == 2 * 3 * 2 * 32 * 4
    assert kv_bytes_per_token(CFG, torch.bfloat16, tp_size=2) == 2 * 3 * 1 * 32 * 2
    assert kv_bytes_per_token(CFG, torch.float32, tp_size=4) == 2 * 3 * 1 * 32 * 4  # replicated
    assert kv_bytes_per_token({**CFG, "head_dim": 48}, torch.float32) == 2 * 3 * 2 * 48 * 4
    # 10 sequences of 200 tokens -> 2 blocks of 128 each
    assert kv_bytes_for(CFG, torch.float32, 10, 200) == 10 * 256 * 1536


def test_cpu_kv_cache_sized_by_need_and_capped_by_free():
    need = kv_bytes_for(CFG, torch.float32, 64, 256)
    kw, note = memory_kwargs(0.5, torch.device("cpu"), CFG, torch.float32, 64, 256,
                             free_total=(8 * GIB, 16 * GIB))
    assert kw == {"kv_cache_memory_bytes": need} and "capped" not in note
    tight = int(0.001 * 8 * GIB)
    kw, note = memory_kwargs(0.001, torch.device("cpu"), CFG, torch.float32, 1024, 4096,
                             free_total=(8 * GIB, 16 * GIB))
    assert kw == {"kv_cache_memory_bytes": tight} and "capped" in note
    one = kv_bytes_for(CFG, torch.float32, 1, 4096)  # never below one whole sequence
    kw, _ = memory_kwargs(1e-6, torch.device("cpu"), CFG, torch.float32, 8, 4096,
                          free_total=(8 * GIB, 16 * GIB))
    assert kw == {"kv_cache_memory_bytes": one}


def test_gpu_share_lowered_to_what_is_free():
    cuda = torch.device("cuda", 0)
    kw, note = memory_kwargs(0.5, cuda, CFG, torch.bfloat16, 64, 256,
                             free_total=(70 * GIB, 80 * GIB))
    assert kw == {"gpu_memory_utilization": 0.5} and "lowered" not in note
    kw, note = memory_kwargs(0.5, cuda, CFG, torch.bfloat16, 64, 256,
                             free_total=(20 * GIB, 80 * GIB))
    assert kw["gpu_memory_utilization"] == pytest.approx(0.25 - 0.02) and "lowered" in note
    with pytest.raises(RuntimeError, match="free memory before the engine starts"):
        memory_kwargs(0.5, cuda, CFG, torch.bfloat16, 64, 256, free_total=(GIB, 80 * GIB))
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        memory_kwargs(0.0, cuda, CFG, torch.bfloat16, 64, 256, free_total=(GIB, 80 * GIB))
