"""Generation engines behind one protocol (`megarl.rollout.protocol.RolloutEngine`).

- `megarl.rollout.torch.TorchRolloutEngine`: megarl's own model in plain PyTorch (CPU or GPU),
  slot KV cache, continuous batching, batch-independent seeded sampling.
- `megarl.rollout.vllm.VLLMEngine`, `megarl.rollout.sglang.SGLangEngine`: colocated GPU engines
  (optional packages, imported only when built).
- `megarl.rollout.reshard`: a backend's ``export_weights()`` stream in bounded buckets for
  ``engine.update_weights`` and HF export.
- `megarl.rollout.sampling`: the sampler (temperature / top-k / top-p by inverse CDF with one
  counter-hash uniform per token).
"""

from megarl.rollout.protocol import Completion, RolloutEngine, SamplingParams

__all__ = ["Completion", "RolloutEngine", "SamplingParams"]
