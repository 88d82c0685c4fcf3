"""Methods added to every vLLM worker (``worker_extension_cls``), called through
``LLM.collective_rpc``. vLLM imports this module by its qualified name inside its workers."""

from __future__ import annotations

import torch


class MegarlWorkerExtension:
    """Mixed into vLLM's worker class: ``self.model_runner``, ``self.model_config`` and
    ``self.device`` are the worker's."""

    def megarl_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """Load one bucket of (HF name, full tensor) through the model's own ``load_weights``
        (which shards for the engine's TP and fuses q/k/v, gate/up). Returns tensors loaded."""
        device = getattr(self, "device", None)
        named = [(n, t.to(device, non_blocking=True) if device is not None else t)
                 for n, t in weights]
        self.model_runner.model.load_weights(weights=named)
        return len(named)

    def megarl_finish_weights(self) -> None:
        """After the last bucket: vLLM's post-load processing (repacking for quantized or
        fused kernels), as its own loader does."""
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        process_weights_after_loading(self.model_runner.model, self.model_config, self.device)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
