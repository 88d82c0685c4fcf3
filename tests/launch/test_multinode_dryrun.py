"""``megarl-launch --dry-run``: the exact command lines for 1, 2 and 4 nodes (written out here
by hand), SLURM allocations, run-folder rules, and every error message (exit 2, one line, no
traceback). The configs come from tests/launch/ (MEGARL_CONFIG_DIR), so the recipes in configs/
can change without touching these strings.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from launch import multinode
from launch.hosts import LaunchError

REPO = Path(__file__).resolve().parents[2]
HERE = REPO / "tests/launch"
COMMON = ["--python", "python", "--workdir", "/repo", "--run-id", "r1", "--run-dir", "runs/r1"]
ENV = {"OMP_NUM_THREADS": "1"}  # the launcher's environment: no SLURM, no NCCL settings
DEFAULTS = "NCCL_DEBUG=WARN OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1"


@pytest.fixture(autouse=True)
def _test_configs(monkeypatch):
    monkeypatch.setenv("MEGARL_CONFIG_DIR", str(HERE))


def dry(argv: list[str], capsys, environ: dict[str, str] | None = None) -> list[str]:
    rc = multinode.main(["--dry-run", *argv], dict(ENV if environ is None else environ))
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out.splitlines()


def error(argv: list[str], capsys, environ: dict[str, str] | None = None) -> str:
    rc = multinode.main(argv, dict(ENV if environ is None else environ))
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert lines[-1].startswith("megarl-launch: error: ") and "Traceback" not in err, err
    return lines[-1][len("megarl-launch: error: "):]


# ---- commands --------------------------------------------------------------------------------

def test_one_node_is_standalone(capsys):
    lines = dry(["--nproc-per-node", "2", "--config", "hello", *COMMON, "trainer.total_training_steps=2"],
                capsys)
    assert lines == [
        f"cd /repo && env {DEFAULTS} python -m torch.distributed.run --standalone --nnodes=1 "
        "--nproc-per-node=2 --max-restarts=0 launch/train.py --config hello "
        "trainer.total_training_steps=2 launch.nnodes=1 launch.nproc_per_node=2 "
        "trainer.default_local_dir=/repo/runs/r1 >> /repo/runs/r1/logs/node0.log 2>&1"
    ]


def test_two_local_nodes_gloo(capsys):
    lines = dry(["--mode", "local", "--hosts", "127.0.0.1,127.0.0.1", "--backend", "gloo",
                 "--socket-ifname", "lo", "--omp-threads", "4", "--config", "hello", *COMMON], capsys)
    assert lines == [
        "cd /repo && env GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1 python -m "
        "torch.distributed.run --nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29500 "
        "--rdzv-id=r1 --rdzv-conf=is_host=1 --nproc-per-node=1 --max-restarts=0 launch/train.py "
        "--config hello launch.nnodes=2 launch.nproc_per_node=1 launch.backend=gloo "
        "trainer.default_local_dir=/repo/runs/r1 >> /repo/runs/r1/logs/node0.log 2>&1",
        "cd /repo && env GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1 python -m "
        "torch.distributed.run --nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29500 "
        "--rdzv-id=r1 --rdzv-conf=is_host=0 --nproc-per-node=1 --max-restarts=0 launch/train.py "
        "--config hello launch.nnodes=2 launch.nproc_per_node=1 launch.backend=gloo "
        "trainer.default_local_dir=/repo/runs/r1 >> /repo/runs/r1/logs/node1.log 2>&1",
    ]
    # --nnodes 2 without hosts means the same two local nodes
    assert dry(["--mode", "local", "--nnodes", "2", "--backend", "gloo", "--socket-ifname", "lo",
                "--omp-threads", "4", "--config", "hello", *COMMON], capsys) == lines


def test_four_ssh_nodes_nccl(capsys):
    lines = dry(["--hosts", "node[01-04]", "--nproc-per-node", "2", "--backend", "nccl",
                 "--socket-ifname", "ib0", "--rdzv-port", "29400", "--log-dir", "/shared/logs",
                 "--env", "HF_HOME=/data/hf", "--config", "hello", *COMMON], capsys)
    inner = ("env HF_HOME=/data/hf NCCL_DEBUG=WARN NCCL_SOCKET_IFNAME=ib0 OMP_NUM_THREADS=1 "
             "PYTHONUNBUFFERED=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1 python -m torch.distributed.run "
             "--nnodes=4 --rdzv-backend=c10d --rdzv-endpoint=node01:29400 --rdzv-id=r1 "
             "--rdzv-conf=is_host={h} --nproc-per-node=2 --max-restarts=0 launch/train.py --config "
             "hello launch.nnodes=4 launch.nproc_per_node=2 launch.backend=nccl "
             "trainer.default_local_dir=/repo/runs/r1")
    assert lines == [
        f"ssh -o BatchMode=yes -tt node0{i + 1} 'cd /repo && {inner.format(h=int(i == 0))}' "
        f">> /shared/logs/node{i}.log 2>&1"
        for i in range(4)
    ]


def test_four_nodes_from_a_slurm_allocation(capsys):
    environ = {**ENV, "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08,10],gpu12",
               "SLURM_CPUS_PER_TASK": "16", "NCCL_DEBUG": "INFO"}
    lines = dry(["--nproc-per-node", "2", "--config", "hello", "--python", "python", "--workdir",
                 "/repo", "--run-dir", "runs/r1", "trainer.experiment_name=big run"], capsys, environ)
    hosts = ["gpu07", "gpu08", "gpu10", "gpu12"]
    assert lines == [
        f"srun --nodes=1 --ntasks=1 --nodelist={host} --chdir=/repo --cpus-per-task=16 env "
        "NCCL_DEBUG=INFO OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1 "
        "python -m torch.distributed.run --nnodes=4 --rdzv-backend=c10d "
        f"--rdzv-endpoint=gpu07:29500 --rdzv-id=4242 --rdzv-conf=is_host={int(i == 0)} "
        "--nproc-per-node=2 --max-restarts=0 launch/train.py --config hello "
        "'trainer.experiment_name=big run' launch.nnodes=4 launch.nproc_per_node=2 "
        f"trainer.default_local_dir=/repo/runs/r1 >> /repo/runs/r1/logs/node{i}.log 2>&1"
        for i, host in enumerate(hosts)
    ]
    # --nnodes takes the first nodes of a larger allocation
    two = dry(["--nnodes", "2", "--config", "hello", *COMMON], capsys, environ)
    assert [ln.split()[3] for ln in two] == ["--nodelist=gpu07", "--nodelist=gpu08"]


def test_hostfile_and_rdzv_host(tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# our nodes\nalpha slots=8\n\nbeta  # the second one\n")
    lines = dry(["--hostfile", str(hostfile), "--mode", "ssh", "--rdzv-host", "10.0.0.1",
                 "--config", "hello", *COMMON], capsys)
    assert [ln.split()[4] for ln in lines] == ["alpha", "beta"]
    assert all("--rdzv-endpoint=10.0.0.1:29500" in ln for ln in lines)


def test_run_dir_rules(capsys):
    base = ["--nnodes", "1", "--config", "hello", "--python", "python", "--workdir", "/repo",
            "--run-id", "r1"]
    # default: the config's trainer.default_local_dir (runs/${project}/${experiment}), resolved
    (line,) = dry(base, capsys)
    assert line.endswith("trainer.default_local_dir=/repo/runs/launch_tests/hello >> "
                         "/repo/runs/launch_tests/hello/logs/node0.log 2>&1")
    # the user's own override stays as written and decides the log folder
    (line,) = dry([*base, "trainer.default_local_dir=out/x"], capsys)
    assert line.endswith("--config hello trainer.default_local_dir=out/x launch.nnodes=1 "
                         "launch.nproc_per_node=1 >> /repo/out/x/logs/node0.log 2>&1")
    # a config given as a path that the workdir cannot see is passed as an absolute path
    (line,) = dry(["--nnodes", "1", "--config", str(HERE / "hello.yaml"), *COMMON[:4]], capsys)
    assert f"--config {HERE / 'hello.yaml'} " in line


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_", "TORCH_NCCL"))}
    return {**env, "OMP_NUM_THREADS": "1", "MEGARL_CONFIG_DIR": str(HERE)}


def test_the_script_and_the_module_print_the_same(tmp_path):
    argv = ["--dry-run", "--mode", "local", "--nnodes", "2", "--config", "hello", *COMMON]
    # the script path works from any folder; -m needs the package importable (installed or cwd)
    script = subprocess.run([sys.executable, str(REPO / "launch/multinode.py"), *argv], cwd=tmp_path,
                            env=_clean_env(), capture_output=True, text=True, timeout=60)
    module = subprocess.run([sys.executable, "-m", "launch.multinode", *argv], cwd=REPO,
                            env=_clean_env(), capture_output=True, text=True, timeout=60)
    assert script.returncode == module.returncode == 0, script.stderr + module.stderr
    assert script.stdout == module.stdout and len(script.stdout.splitlines()) == 2
    assert "TP=1 PP=1 DP=2 world=2" in script.stderr


def test_without_megarl_config_the_yaml_fallback_gives_the_same_answers(tmp_path):
    """megarl.config missing (import fails): dry run and layout check still work."""
    stub = ("import sys; sys.modules['megarl.config'] = None; sys.path.insert(0, sys.argv.pop(1)); "
            "from launch.multinode import main; sys.exit(main())")
    env = _clean_env()

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", stub, str(REPO), *argv], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)

    argv = ["--dry-run", "--mode", "local", "--nnodes", "2", "--config", "hello", *COMMON]
    fallback = run(*argv)
    full = subprocess.run([sys.executable, str(REPO / "launch/multinode.py"), *argv], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    assert fallback.returncode == 0, fallback.stderr
    assert fallback.stdout == full.stdout
    bad = run("--dry-run", "--hosts", "a,b,c", "--config", "hello",
              "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "TP=2 x PP=1 = 2 ranks per model replica" in bad.stderr
    missing = run("--dry-run", "--config", "nope")
    assert missing.returncode == 2 and "available: hello;" in missing.stderr


# ---- errors ----------------------------------------------------------------------------------

def test_missing_config_lists_the_available_ones(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert error(["--dry-run", "--config", "nope"], capsys) == (
        f"config 'nope' not found (looked in {tmp_path} and {HERE}); available: hello; "
        "pass one of these names or a YAML path to --config")


@pytest.mark.parametrize(
    "nodes, override, expected",
    [
        (["--hosts", "a,b,c"], "actor_rollout_ref.actor.parallel.tensor_model_parallel_size=2",
         "TP=2 x PP=1 = 2 ranks per model replica, but 3 node(s) x 1 proc(s) per node = world size "
         "3 is not a multiple of 2 (DP would be 1.5)"),
        (["--nnodes", "2", "--nproc-per-node", "3"],
         "actor_rollout_ref.actor.parallel.pipeline_model_parallel_size=4",
         "TP=1 x PP=4 = 4 ranks per model replica, but 2 node(s) x 3 proc(s) per node = world size "
         "6 is not a multiple of 4 (DP would be 1.5)"),
        (["--nnodes", "2"], "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
         "TP=4 x PP=1 = 4 ranks per model replica, but 2 node(s) x 1 proc(s) per node = world size "
         "2 is not a multiple of 4 (DP would be 0.5)"),
    ],
)
def test_layout_that_does_not_fit(nodes, override, expected, capsys):
    msg = error(["--dry-run", "--mode", "local" if "--nnodes" in nodes else "ssh", *nodes,
                 "--config", "hello", override], capsys)
    tp = "actor_rollout_ref.actor.parallel.tensor_model_parallel_size"
    pp = "actor_rollout_ref.actor.parallel.pipeline_model_parallel_size"
    k = int(expected.split(" = ")[1].split()[0])
    assert msg == (f"parallel layout does not fit: {expected}; use a node count and --nproc-per-node "
                   f"whose product is a multiple of {k}, or change {tp} / {pp}")


def test_layout_that_fits_is_reported(capsys):
    rc = multinode.main(["--dry-run", "--nnodes", "2", "--nproc-per-node", "2", "--config", "hello",
                         *COMMON, "actor_rollout_ref.actor.parallel.tensor_model_parallel_size=2"], ENV)
    assert rc == 0
    assert "TP=2 PP=1 DP=2 world=4 (2 node(s) x 2)" in capsys.readouterr().err


def test_other_config_problems_are_reported_in_one_line(capsys):
    msg = error(["--dry-run", "--hosts", "a,b,c", "--config", "hello"], capsys)
    assert msg.startswith("config 'hello' is invalid for 3 node(s) x 1 proc(s): data.train_batch_size:")


def test_rendezvous_host_that_does_not_resolve(capsys):
    msg = error(["--mode", "ssh", "--hosts", "nohost.invalid,b", "--config", "hello", *COMMON], capsys)
    assert msg.startswith("rendezvous host 'nohost.invalid' does not resolve (")
    assert msg.endswith("); fix --hosts / the hostfile or pass --rdzv-host with a reachable name or IP")


class _FakeSocket:
    def __init__(self, exc: OSError):
        self.exc = exc

    def __call__(self, *args):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False

    def settimeout(self, t):
        pass

    def connect(self, addr):
        raise self.exc


@pytest.mark.parametrize("exc, why", [(TimeoutError("timed out"), "timed out"),
                                      (OSError(errno.EHOSTUNREACH, "No route to host"), "No route to host")])
def test_unreachable_rendezvous_host(monkeypatch, exc, why):
    monkeypatch.setattr(multinode.socket, "getaddrinfo",
                        lambda *a, **k: [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.2.3", 29500))])
    monkeypatch.setattr(multinode.socket, "socket", _FakeSocket(exc))
    with pytest.raises(LaunchError) as e:
        multinode.preflight("node01", 29500, 2.0)
    assert str(e.value) == (
        f"rendezvous host node01 port 29500 is unreachable from here ({why} after 2s); check that "
        "the host is up and that TCP 29500 is open between the nodes, pass --rdzv-host/--rdzv-port, "
        "or skip with --no-preflight")


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--mode", "srun", "--hosts", "a,b"],
         "--mode srun must run inside a SLURM allocation (sbatch or salloc); SLURM_JOB_ID is not "
         "set; use --mode ssh or --mode local"),
        (["--mode", "srun", "--hosts", "a,a", "--dry-run"],
         "--mode srun runs one step per node, but hosts repeat (a,a); list each node once or use "
         "--mode local"),
        (["--mode", "local", "--hosts", "127.0.0.1,gpu7", "--dry-run"],
         "--mode local starts every node on this machine, but host 'gpu7' is not this machine; use "
         "--mode ssh (or srun inside SLURM)"),
        (["--mode", "ssh", "--dry-run"],
         "--mode ssh needs nodes: pass --hosts a,b or --hostfile FILE, or run inside a SLURM "
         "allocation (sbatch/salloc)"),
        (["--hosts", "a,b", "--hostfile", "h", "--dry-run"], "give --hosts or --hostfile, not both"),
        (["--hosts", "a,b", "--nnodes", "3", "--dry-run"],
         "--nnodes 3 but 2 host(s) given (a,b); drop --nnodes or list 3 hosts"),
        (["--hostfile", "/nonexistent/hosts", "--dry-run"],
         "hostfile '/nonexistent/hosts' does not exist; pass a file with one host per line"),
        (["--nnodes", "2", "--mode", "local", "--script", "nope.py", "--workdir", str(REPO)],
         f"nope.py not found in {REPO}; pass --script PATH (relative to --workdir) or --workdir REPO"),
        (["--nnodes", "1", "--env", "1X=2", "--dry-run"],
         "--env '1X=2' is not KEY=VALUE; write e.g. --env HF_HOME=/data/hf"),
        (["--nproc-per-node", "0", "--dry-run"], "--nproc-per-node must be >= 1, got 0"),
    ],
)
def test_usage_errors(argv, expected, capsys):
    common = COMMON[:2] + COMMON[4:] if "--workdir" in argv else COMMON
    assert error([*argv, "--config", "hello", *common], capsys) == expected


def test_slurm_allocation_too_small(capsys):
    environ = {**ENV, "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]"}
    assert error(["--dry-run", "--nnodes", "4", "--config", "hello", *COMMON], capsys, environ) == (
        "--nnodes 4 but the SLURM allocation has 2 node(s) (n[1-2]); request more nodes or lower --nnodes")
