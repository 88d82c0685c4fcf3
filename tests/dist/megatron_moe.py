"""Worker (2 ranks): the megatron backend on mixture-of-experts models against transformers
(float64) at the expert layouts two ranks allow, one after the other in this process
(megatron's parallel_state is rebuilt between them):

- ``ep2``: expert parallelism 2 (2 experts per rank; attention data-parallel over the 2 ranks);
- ``tp2_ep2``: TP=2 + SP for attention, experts split over EP=2 (expert TP 1);
- ``tp2_etp2``: TP=2 + SP, every expert split over expert-TP 2 (EP 1);
- ``pp2_vpp2``: interleaved pipeline 2 stages x 2 chunks, 4 layers (one dense), EP 1;
- ``ep2_pp2`` (only when named, 4 ranks): EP=2 x PP=2;
- ``cp2_ep2`` (only when named): context parallelism 2 with the experts split over the same
  2 ranks (EP=2), so each rank routes its half of every sequence; routing replay is not wired
  for CP and not checked there.

At each layout also the load-balancing loss (`moe_testlib.aux_checks`) and routing replay
(`moe_testlib.replay_checks`: random recorded experts, sequence slices under SP, layers over
stages and chunks). Then at EP=2: one AdamW
step with the distributed optimizer, a checkpoint, and the weights after the next step (the
uninterrupted run) for the EP=2 -> EP=1 resharding check of the test (2 ranks only).

usage: torchrun --standalone --nproc_per_node=2 tests/dist/megatron_moe.py ROOT RESULTS CKPT
       [LAYOUT,...]     (ep2_pp2: --nproc_per_node=4)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))

import mcore_testlib as lib  # noqa: E402
import moe_testlib as ml  # noqa: E402

LAYOUTS = {
    "ep2": {"ep": 2},
    "tp2_ep2": {"tp": 2, "sp": True, "ep": 2, "etp": 1},
    "tp2_etp2": {"tp": 2, "sp": True, "etp": 2},
    "pp2_vpp2": {"pp": 2, "vpp": 2},
    "ep2_pp2": {"ep": 2, "pp": 2},  # 4 ranks
    "cp2_ep2": {"cp": 2, "ep": 2},
}
NAMED_ONLY = ("ep2_pp2", "cp2_ep2")
MODELS = {"ep2": ("qwen3_moe", "qwen2_moe", "qwen3_moe_mixed"),
          "tp2_ep2": ("qwen3_moe_kv2", "qwen2_moe_kv2"),
          "tp2_etp2": ("qwen3_moe_kv2", "qwen2_moe_kv2"), "ep2_pp2": ("qwen3_moe", "qwen2_moe"),
          "pp2_vpp2": ("qwen3_moe_4l",), "cp2_ep2": ("qwen3_moe", "qwen2_moe")}


def reset_parallel_state() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def main():
    import torch.distributed as dist
    from safetensors.torch import save_file

    from megarl.backends.megatron import MegatronBackend
    from megarl.utils import dist as mdist

    lib.worker_setup()
    root, results, ckpt = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    only = [x for x in sys.argv[4].split(",") if x in LAYOUTS] if len(sys.argv) > 4 else [
        k for k in LAYOUTS if k not in NAMED_ONLY]
    res = {}
    for layout in only:
        for name in MODELS[layout]:
            ml.moe_checks(res, ml.moe_model(root, name), f"{layout}.{name}", **LAYOUTS[layout])
        first = MODELS[layout][0]
        ml.aux_checks(res, ml.moe_model(root, first), f"{layout}.{first}.aux", **LAYOUTS[layout])
        if "cp" not in LAYOUTS[layout]:
            ml.replay_checks(res, ml.moe_model(root, first), f"{layout}.{first}.replay",
                             **LAYOUTS[layout])
        reset_parallel_state()

    if dist.get_world_size() != 2 or len(sys.argv) > 4:
        if dist.get_rank() == 0:
            lib.write_results(results, res)
        dist.barrier()
        mdist.destroy()
        return
    # EP=2 checkpoint with the distributed optimizer (one step in), then the next step
    path = ml.moe_model(root, "qwen3_moe")
    be = MegatronBackend("actor", str(path), ep=2, optim=lib.RESHARD_OPTIM)
    res["ckpt.dp_size"] = be.dp_size
    batch = lib.make_batch(B=4, seed=1)
    mbs, n = ml.dp_share(batch, be)
    be.train_step(mbs, lambda o, mb: lib.pg_loss(o, mb, n / be.dp_size))
    res["ckpt.trained_logprob"] = be.logprobs(batch)[0].tolist()
    be.save(str(ckpt))
    after = ml.next_step(be)
    if dist.get_rank() == 0:
        save_file(after, str(lib.next_step_path(ckpt, "ep2")))
        lib.write_results(results, res)
    dist.barrier()
    mdist.destroy()


if __name__ == "__main__":
    main()
