"""Test-wide settings. These must run before any project import.

- TRITON_INTERPRET=1 so the Triton kernels run (and are tested) on CPU; it has to be set
  before a kernel module is imported, because `@triton.jit` reads it at decoration time.
- One thread per process: with 2 shared cores, default OpenMP threading is ~25x slower.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
