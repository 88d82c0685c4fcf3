"""`ProcessRolloutEngine`: the torch engine in a spawned process, fed through the shared weight
ring. Reference: the in-process `TorchRolloutEngine` holding the same weights (the child runs
the same code on the same weights with one thread, so the outputs are equal token for token
and bit for bit in their logprobs)."""

from __future__ import annotations

import os
import re

import pytest
import torch
from rollout_helpers import prompts_of

from megarl.models import load_model
from megarl.rollout.build import EngineSpec, engine_spec
from megarl.rollout.process import EngineProcessError, ProcessRolloutEngine
from megarl.rollout.protocol import SamplingParams
from megarl.rollout.torch import TorchRolloutEngine
from megarl.trainer.settings import rollout_settings


def _perturbed(state: dict[str, torch.Tensor], scale: float, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in state.items()}


def _spec(path, **settings) -> EngineSpec:
    """Our engine on the CPU, fp32, as the child builds it (no sleep offload)."""
    return EngineSpec("torch", {"path": str(path), "dtype": "fp32", "device": "cpu",
                                "tokenizer": None, "offload_weights_on_sleep": False,
                                **settings})


def _same(a, b) -> None:
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b):
        assert torch.equal(x.logprobs, y.logprobs)


@pytest.fixture()
def setup(tiny_folder):
    torch.set_num_threads(1)
    path = tiny_folder("qwen2")
    base = {k: v.clone() for k, v in load_model(path, head="lm").state_dict().items()}
    ref = TorchRolloutEngine.from_pretrained(path, tokenizer=None, max_num_seqs=4)
    proc = ProcessRolloutEngine(_spec(path, max_num_seqs=4), slots=2)
    yield path, base, ref, proc
    proc.close()


@pytest.mark.e2e  # starts an engine process
def test_versions_are_picked_up_at_submit_and_stamped(setup):
    """Each request uses the version that was newest when it was submitted, even when newer
    versions are published while it waits in the queue (two slots: v1 and v2 both published
    behind the request on v0 would need a third slot, so the publish of v2 waits for v0's
    load). Planted: the child loading the other ring slot than the one named gives other
    tokens than the reference for the v0 request; stamping the loaded version + 1 fails the
    version check ({1} != {0})."""
    path, base, ref, proc = setup
    prompts = prompts_of([5, 9, 3], seed=1)
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=7)
    states = [base, _perturbed(base, 0.05, 1), _perturbed(base, 0.05, 2)]

    proc.update_weights(states[0].items())
    r0 = proc.submit(prompts, sp, prompt_keys=[4, 5, 6])
    proc.update_weights(states[1].items())
    r1 = proc.submit(prompts, sp, prompt_keys=[4, 5, 6])
    proc.update_weights(states[2].items())  # the slot of v0 is reused once v0 is loaded
    r2 = proc.submit(prompts, sp, prompt_keys=[4, 5, 6])
    outs = [proc.result(r) for r in (r0, r1, r2)]
    for v, (state, out) in enumerate(zip(states, outs)):
        ref.update_weights(state.items())
        _same(out, ref.generate(prompts, sp, prompt_keys=[4, 5, 6]))
        assert {c.policy_version for c in out} == {v}
    # the versions really differ in what they generate (the check above can tell them apart)
    assert [c.token_ids for c in outs[0]] != [c.token_ids for c in outs[1]]
    # the engine's timeline: one span per request, in order, each version loaded then used
    spans = list(proc.spans)
    assert [(sp.request, sp.version) for sp in spans] == [(r0, 0), (r1, 1), (r2, 2)]
    for a, b in zip(spans, spans[1:]):
        assert a.start <= a.generate < a.end <= b.start


@pytest.mark.e2e  # starts an engine process
def test_prefetch_is_collected_by_the_matching_generate(setup):
    """A prefetched request is returned by a generate call with the same arguments (and stays
    on the version it was submitted with); any other call runs on the newest version. The
    checkpoint form (export / import) round-trips the prefetched results exactly."""
    path, base, ref, proc = setup
    prompts = prompts_of([4, 6], seed=2)
    sp = SamplingParams(n=3, temperature=0.9, max_new_tokens=10, seed=11)
    proc.update_weights(base.items())
    key = proc.prefetch(prompts, sp, [0, 1])
    assert proc.prefetch(prompts, sp, [0, 1]) == key and len(proc.pending()) == 1  # once
    new = _perturbed(base, 0.05, 3)
    proc.update_weights(new.items())
    saved = proc.export_prefetched()
    other = proc.generate(prompts, sp, [0, 2])  # not the prefetched keys: newest weights
    assert {c.policy_version for c in other} == {1}
    got = proc.generate(prompts, sp, [0, 1])
    assert {c.policy_version for c in got} == {0}
    ref.update_weights(base.items())
    _same(got, ref.generate(prompts, sp, [0, 1]))
    assert proc.pending() == []

    proc.import_prefetched(saved)
    again = proc.generate(prompts, sp, [0, 1])
    _same(again, got)
    assert [c.policy_version for c in again] == [c.policy_version for c in got]


@pytest.mark.e2e  # starts an engine process
def test_engine_errors_surface_in_the_trainer(setup):
    """A failure inside the child comes back as EngineProcessError with its traceback (a bad
    prompt id here), not as a hang."""
    path, base, ref, proc = setup
    proc.update_weights(base.items())
    with pytest.raises(EngineProcessError, match="token ids outside"):
        proc.generate([[1, 10**6]], SamplingParams(max_new_tokens=3, seed=0))


@pytest.mark.e2e  # starts an engine process
def test_the_ring_holds_the_engines_dtype_and_the_engine_gets_the_same_bits(tiny_folder):
    """A bf16 engine fed fp32 master weights (the torch backend's mixed precision): the ring
    holds every floating tensor in bf16, half the bytes of the fp32 stream, and the engine
    generates exactly what an in-process bf16 engine that rounds the fp32 weights itself
    generates (the same cast, so the same bits), for the first publish and a later one.
    Before: the ring held fp32 (twice the host memory and copy time)."""
    torch.set_num_threads(1)
    path = tiny_folder("qwen2")
    base = {k: v.clone() for k, v in load_model(path, head="lm").state_dict().items()}
    assert {v.dtype for v in base.values()} == {torch.float32}
    fp32_bytes = sum(v.numel() * 4 for v in base.values())
    ref = TorchRolloutEngine.from_pretrained(path, dtype=torch.bfloat16, tokenizer=None,
                                             max_num_seqs=4)
    proc = ProcessRolloutEngine(_spec(path, dtype="bf16", max_num_seqs=4), slots=2)
    try:
        prompts = prompts_of([5, 7], seed=4)
        sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=3)
        for state in (base, _perturbed(base, 0.05, 5)):
            proc.update_weights(state.items())
            ref.update_weights(state.items())
            _same(proc.generate(prompts, sp, [1, 2]), ref.generate(prompts, sp, [1, 2]))
        layout = proc._ring.layout
        assert {p.dtype for p in layout.places} == {"bfloat16"}
        assert sum(p.nbytes for p in layout.places) == fp32_bytes // 2
    finally:
        proc.close()


@pytest.mark.parametrize("overrides, field", [
    (["actor_rollout_ref.rollout.name=sglang"], "actor_rollout_ref.rollout.name=torch or vllm"),
    (["actor_rollout_ref.rollout.name=vllm",
      "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2"],
     "actor_rollout_ref.rollout.tensor_model_parallel_size=2"),
])
def test_engine_process_refuses_what_it_cannot_host(overrides, field):
    """Asynchronous rollout hosts megarl's engine or a vLLM engine of one process per training
    rank: SGLang, and a vLLM engine spanning ranks, are refused before anything starts, with
    the key to change. Planted: dropping the TP check starts an engine process asked for TP 2 (no error)."""
    from megarl.config.loader import resolve_config
    from megarl.errors import UserInputError
    from megarl.trainer.parts import run_engine

    cfg = resolve_config("grpo", ["async_training.staleness_threshold=1", *overrides]).config
    with pytest.raises(UserInputError, match=re.escape(field)):
        run_engine(cfg, "unused", "cpu")


@pytest.mark.e2e  # starts an engine process
def test_routed_experts_come_back_from_the_engine_process(tiny_folder):
    """Routing replay with asynchronous rollout: the child's torch engine records each token's
    experts and they come back through the pipe (and through the prefetched-work checkpoint)
    equal to the in-process engine's on the same weights, with the tokens and logprobs.
    Planted: the spec not passing return_routed_experts to the child: routed_experts None."""
    torch.set_num_threads(1)
    path = tiny_folder("qwen3_moe")
    base = load_model(path, head="lm").state_dict()
    ref = TorchRolloutEngine.from_pretrained(path, tokenizer=None, max_num_seqs=4,
                                             return_routed_experts=True)
    proc = ProcessRolloutEngine(_spec(path, max_num_seqs=4, return_routed_experts=True),
                                slots=2)
    try:
        prompts = prompts_of([5, 9], seed=3)
        sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=5)
        proc.update_weights(base.items())
        proc.prefetch(prompts, sp, [0, 1])
        saved = proc.export_prefetched()
        got = proc.generate(prompts, sp, [0, 1])
        want = ref.generate(prompts, sp, prompt_keys=[0, 1])
        _same(got, want)
        for a, b in zip(got, want):
            assert a.routed_experts.dtype == torch.int16
            assert torch.equal(a.routed_experts, b.routed_experts)
        proc.import_prefetched(saved)
        for a, b in zip(proc.generate(prompts, sp, [0, 1]), want):
            assert torch.equal(a.routed_experts, b.routed_experts)
    finally:
        proc.close()


_WORLD = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
          "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "PATH": "/usr/bin"}


@pytest.mark.parametrize("device, visible, shown", [
    ("cuda:1", None, "1"),                     # no list: the index is the GPU
    ("cuda:1", "4,5,6,7", "5"),                # the trainer's cuda:1 is GPU 5
    ("cuda:3", "4, 5,6,7", "7"),
    ("cuda:1", "GPU-aaaa,GPU-bbbb", "GPU-bbbb"),  # UUIDs (and MIG ids) kept as written
])
def test_engine_process_sees_only_its_rank_gpu(device, visible, shown):
    """The engine process of the rank on cuda:k sees that GPU alone, as cuda:0 (vLLM's
    single-process executor takes the first visible device; megarl's engine is told cuda:0),
    and drops the trainer's world variables. Planted: the list not mapped (str(k) always)
    fails the listed cases; before the fix nothing was set, and every rank's engine took the
    node's first GPU."""
    from megarl.rollout.engine_process import engine_process_env

    environ = dict(_WORLD, **({} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}))
    changes, child_device = engine_process_env(device, environ)
    assert child_device == "cuda:0"
    assert changes["CUDA_VISIBLE_DEVICES"] == shown
    assert {k for k, v in changes.items() if v is None} == set(_WORLD) - {"PATH"}


def test_engine_process_env_on_cpu_and_out_of_range():
    """A CPU engine keeps the environment's devices (only the world variables go); a device
    the trainer's list does not hold is refused."""
    from megarl.rollout.engine_process import engine_process_env

    changes, child_device = engine_process_env("cpu", dict(_WORLD, CUDA_VISIBLE_DEVICES="2"))
    assert child_device == "cpu" and "CUDA_VISIBLE_DEVICES" not in changes
    with pytest.raises(ValueError, match="cuda:2"):
        engine_process_env("cuda:2", {"CUDA_VISIBLE_DEVICES": "0,1"})


def test_engine_process_applies_its_environment(monkeypatch):
    """`enter_engine_env` (the engine process's first step) sets what `engine_process_env`
    says in this process's environment and hands the engine its device."""
    from megarl.rollout.engine_process import enter_engine_env

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for k, v in _WORLD.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    spec = EngineSpec("torch", {}, device="cuda:1")
    assert enter_engine_env(spec) == "cuda:0"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "7"
    assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"} & set(os.environ)


@pytest.mark.parametrize("engine", ["torch", "vllm"])
def test_engine_spec_keeps_the_rank_device(monkeypatch, tiny_folder, engine):
    """The spec built for training rank k carries the rank's device cuda:k for both engines
    (the torch engine's KV budget is read there; vLLM's settings are stubbed: they need a
    GPU to size). Before the fix the vLLM spec carried no device ("cpu")."""
    import megarl.rollout.torch.engine as torch_engine
    from megarl.config.loader import resolve_config
    from megarl.rollout.vllm import VLLMEngine

    budget_on = []
    monkeypatch.setattr(torch_engine, "_cache_budget",
                        lambda device, fraction: budget_on.append(str(device)) or 2**30)
    monkeypatch.setattr(VLLMEngine, "engine_settings", staticmethod(
        lambda rollout, path, **kw: {"model_path": path, "tokenizer": None, "engine_kwargs": kw}))
    cfg = resolve_config("grpo", ["async_training.staleness_threshold=1",
                                  f"actor_rollout_ref.rollout.name={engine}"]).config
    spec = engine_spec(rollout_settings(cfg), str(tiny_folder("qwen2")),
                       torch.device("cuda", 3), own_process=True)
    assert spec.engine == engine and spec.device == "cuda:3"
    assert budget_on == (["cuda:3"] if engine == "torch" else [])
