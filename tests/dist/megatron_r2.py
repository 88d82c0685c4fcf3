"""Worker (2 ranks): R2 routing replay of the megatron backend (tests/megatron/r2_testlib.py)
at TP=2 with sequence parallelism (each rank routes half of each sequence), at DP=2 (each
rank routes half of the rows) and on an interleaved pipeline of 2 stages x 2 chunks (each
stage routes its own layers); megatron's parallel_state is rebuilt between them.

usage: torchrun --standalone --nproc_per_node=2 tests/dist/megatron_r2.py ROOT RESULTS
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))

import mcore_testlib as lib  # noqa: E402
import moe_testlib as ml  # noqa: E402
import r2_testlib as r2  # noqa: E402

LAYOUTS = {"tp2_sp": ("qwen3_moe_kv2", {"tp": 2, "sp": True}), "dp2": ("qwen3_moe", {}),
           "pp2_vpp2": ("qwen3_moe_4l", {"pp": 2, "vpp": 2})}


def main():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.utils import dist as mdist

    lib.worker_setup()
    root, results = Path(sys.argv[1]), Path(sys.argv[2])
    res = {}
    for layout, (name, kw) in LAYOUTS.items():
        path = ml.moe_model(root, name)
        res[layout] = r2.r2_checks(path, **kw)
        ps.destroy_model_parallel()
    if dist.get_rank() == 0:
        results.write_text(json.dumps(res, indent=1))
    dist.barrier()
    mdist.destroy()


if __name__ == "__main__":
    main()
