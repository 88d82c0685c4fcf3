"""``megarl-launch --dry-run`` on a config that runs the embedded CPU demo (no model named, so
configs/demo/ applies): with no size given it starts the demo's own world, one node of 2 ranks
(what ``make demo`` = ``python -m megarl.demo.run`` starts); with sizes given it says that the
tiny demo runs on that world. Every dry run says where the sizes came from."""

from __future__ import annotations

import inspect
import re

from launch import multinode

ENV = {"OMP_NUM_THREADS": "1"}  # no SLURM allocation
COMMON = ["--python", "python", "--workdir", "/repo", "--run-id", "r1", "--run-dir", "runs/r1"]


def dry(argv: list[str], capsys, environ: dict[str, str] = ENV) -> tuple[list[str], str]:
    rc = multinode.main(["--dry-run", *argv, *COMMON], dict(environ))
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out.splitlines(), err


def test_demo_world_is_what_make_demo_runs():
    """The reference: megarl.demo.run's --nproc default, read from its source."""
    from megarl.demo import run

    default = re.search(r'"--nproc", type=int, default=(\d+)', inspect.getsource(run.main))
    assert default and int(default[1]) == multinode.DEMO_NPROC == 2


def test_demo_without_sizes_runs_its_two_rank_world(capsys):
    """Planted: the old default of 1 rank (or a 16-rank world) fails the command line check;
    dropping the demo line fails the message check."""
    lines, err = dry(["--config", "grpo"], capsys)
    assert len(lines) == 1
    assert " --standalone --nnodes=1 --nproc-per-node=2 " in lines[0]
    assert " launch.nnodes=1 launch.nproc_per_node=2 " in lines[0]
    assert "world of 2 rank(s): 1 local node (no --hosts, --hostfile, --nnodes or SLURM " \
           "allocation), 2 ranks per node, the embedded demo's world" in err
    assert ("config 'grpo' runs the embedded CPU demo (actor_rollout_ref.model.path is not set): "
            "a tiny policy made for 1 node x 2 CPU ranks") in err
    assert "this job runs it on" not in err


def test_demo_on_a_given_world_says_so(capsys):
    lines, err = dry(["--config", "grpo", "--nnodes", "2", "--nproc-per-node", "8"], capsys)
    assert len(lines) == 2 and all("--nproc-per-node=8 " in line for line in lines)
    assert "world of 16 rank(s): 2 local node(s) from --nnodes, 8 rank(s) per node from " \
           "--nproc-per-node" in err
    assert "this job runs it on 2 node(s) x 8 rank(s) as given" in err
    lines, err = dry(["--config", "grpo"], capsys, {**ENV, "SLURM_JOB_NODELIST": "n[1-16]"})
    assert len(lines) == 16
    assert "16 node(s) from the SLURM allocation (SLURM_JOB_NODELIST), 1 rank per node " \
           "(the default" in err
    assert "this job runs it on 16 node(s) x 1 rank(s) as given" in err


def test_a_real_model_keeps_the_default_of_one_rank(capsys, tmp_path):
    """A config naming a model is not the demo: one rank per node unless asked, no demo line."""
    mine = tmp_path / "real.yaml"
    mine.write_text("extends: grpo\nactor_rollout_ref: {model: {path: org/model}}\n"
                    "data: {train_files: t.parquet}\n")
    lines, err = dry(["--config", str(mine)], capsys)
    assert len(lines) == 1 and "--nproc-per-node=1 " in lines[0]
    assert "1 rank per node (the default; --nproc-per-node sets it" in err
    assert "embedded CPU demo" not in err
