"""Checkpoint conversion between HF folders and megarl's megatron checkpoints.

    python -m conversion hf-to-megatron --hf DIR --out DIR --tp N --pp M [--role actor|critic|prm]
    python -m conversion megatron-to-hf --ckpt DIR --out DIR [--dtype bf16|fp32]
    python -m conversion verify --hf DIR --ckpt DIR [--tol 1e-5]

(``megarl-convert`` is the same command.) The tool reuses the megatron backend: its HF weight
mapping (QKV packing with GQA grouping, gate/up fusion, tied embeddings, Qwen2 biases, Qwen3 q/k
norms, critic/PRM ``score`` heads) and its ``export_weights`` stream, and ``megarl.models.hf_io``
for the HF side. See ``conversion.cli`` for the layout decision (why ``--tp/--pp``).
"""
