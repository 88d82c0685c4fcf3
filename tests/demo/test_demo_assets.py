"""Asset build (tiny settings), resolve_uri, the file lock, and transformers loading the result."""

import json
import os
import subprocess
import sys
from dataclasses import asdict

import pyarrow.parquet as pq
import pytest
import torch

from megarl.demo.assets import BuildConfig, build_all, ensure, is_built, resolve_uri

# threads=1: on 2 shared cores a 2-thread build of even these sizes takes ~10x longer
TINY = BuildConfig(n_train=64, n_val=16, n_sft=64, n_dev=0, sft_max_steps=2, sft_batch=8,
                   prm_steps=2, prm_batch=8, n_prm_train=32, n_prm_eval=16, threads=1,
                   n_tools_sft=16, n_tools_dev=0, tools_max_steps=2, tools_batch=4)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("assets")
    build_all(path, TINY, log=lambda s: None)
    return path


def test_resolve_uri(root):
    for name in ("policy", "policy_tools", "critic", "prm", "tokenizer"):
        assert resolve_uri(f"embedded://{name}", root) == str(root / name)
    for f in ("train", "val", "sft"):
        path = resolve_uri(f"embedded://arith/{f}.parquet", root)
        assert path == str(root / "arith" / f"{f}.parquet") and os.path.isfile(path)
    assert resolve_uri("/some/plain/path.parquet", root) == "/some/plain/path.parquet"
    with pytest.raises(ValueError, match="unknown embedded asset"):
        resolve_uri("embedded://nope", root)


def test_env_var_sets_the_root(root, monkeypatch):
    monkeypatch.setenv("MEGARL_ASSETS", str(root))
    assert resolve_uri("embedded://prm") == str(root / "prm")


def test_datasets_disjoint_and_in_row_format(root):
    rows = {f: pq.read_table(root / "arith" / f"{f}.parquet").to_pylist()
            for f in ("train", "val", "sft")}
    val = {r["prompt"][0]["content"] for r in rows["val"]}
    assert len(val) == TINY.n_val
    assert not val & {r["prompt"][0]["content"] for r in rows["train"] + rows["sft"]}
    assert all(r["extra_info"]["num_ops"] == 3 for r in rows["train"] + rows["val"])
    assert all(r["response"].endswith("\\boxed{" + r["reward_model"]["ground_truth"] + "}")
               for r in rows["sft"])
    from megarl.data import RLDataset, load_tokenizer

    ds = RLDataset(str(root / "arith" / "val.parquet"), load_tokenizer(str(root / "tokenizer")),
                   max_prompt_length=32)
    assert len(ds) == TINY.n_val and ds[0].data_source == "arith"


def test_transformers_loads_the_models(root):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from megarl.models import load_model

    ids = torch.tensor([[1, 5, 9, 12, 40, 41, 2]])
    ours = load_model(root / "policy", head="lm")
    hf = AutoModelForCausalLM.from_pretrained(root / "policy").eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)
    critic = AutoModelForTokenClassification.from_pretrained(root / "critic").eval()
    assert critic.config.num_labels == 1
    with torch.no_grad():
        assert torch.count_nonzero(critic(ids).logits) == 0  # zero score head
        # the critic body is the policy body
        body = hf.model(ids).last_hidden_state
        torch.testing.assert_close(critic.model(ids).last_hidden_state, body)
    prm = AutoModelForTokenClassification.from_pretrained(root / "prm")
    assert prm.config.num_labels == 2
    meta = json.loads((root / "prm" / "metadata.json").read_text())
    assert 0.0 <= meta["eval_corrupted"]["step_accuracy"] <= 1.0
    pol = json.loads((root / "policy" / "metadata.json").read_text())
    assert pol["sft"]["steps"] == TINY.sft_max_steps and "val_accuracy" in pol
    tools = AutoModelForCausalLM.from_pretrained(root / "policy_tools").eval()
    assert tools.config.to_dict()["vocab_size"] == hf.config.vocab_size
    meta = json.loads((root / "policy_tools" / "metadata.json").read_text())
    assert meta["sft"]["steps"] == TINY.tools_max_steps and meta["val_problems"] == TINY.n_val
    assert 0.0 <= meta["val_accuracy"] <= 1.0 and 0.0 <= meta["val_tool_share"] <= 1.0


def test_second_call_reuses_and_stale_dependents_rebuild(root):
    before = {c: json.loads((root / c / "metadata.json").read_text())["build_id"]
              for c in ("tokenizer", "arith", "policy", "critic", "prm")}
    ensure("prm", root, TINY)
    after = {c: json.loads((root / c / "metadata.json").read_text())["build_id"] for c in before}
    assert after == before
    # a rebuilt policy makes critic and prm stale (they were built from the old one)
    ensure("policy", root, TINY, force=True)
    assert not is_built("critic", root) and not is_built("prm", root)
    assert not is_built("policy_tools", root)
    assert is_built("tokenizer", root)


BUILD = """
import json, sys
from megarl.demo.assets import BuildConfig, ensure
cfg = BuildConfig(**json.loads(sys.argv[2]))
path = ensure("tokenizer", sys.argv[1], cfg)
print(json.load(open(path / "metadata.json"))["build_id"])
"""


def test_two_processes_build_once(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, str(tmp_path), json.dumps(asdict(TINY))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    ids = [o[0].strip() for o in outs]
    assert ids[0] == ids[1] and len(ids[0]) == 32  # both see the same, single build
    assert sorted(os.listdir(tmp_path)) == [".build.lock", "tokenizer"]  # no staging left behind


HASH_BUILD = """
import hashlib, json, sys
import torch
from megarl.demo.assets import BuildConfig, ensure
before = torch.get_num_threads()
path = ensure("prm", sys.argv[1], BuildConfig(**json.loads(sys.argv[2]))).parent
print(json.dumps({
    "caller_threads": [before, torch.get_num_threads()],
    "recorded": {c: json.load(open(path / c / "metadata.json"))["build_threads"]
                 for c in ("policy", "prm")},
    "policy_threads": json.load(open(path / "policy" / "metadata.json"))["threads"],
    "sha256": {c: hashlib.sha256((path / c / "model.safetensors").read_bytes()).hexdigest()
               for c in ("policy", "prm")},
}))
"""


@pytest.mark.e2e
def test_build_ignores_the_callers_thread_count(tmp_path):
    """The learning tests train from the same assets however pytest is started: the build runs
    with BuildConfig.threads torch threads (default 2, as make demo), not with the caller's
    OMP_NUM_THREADS (a plain pytest runs with 1). Built here under OMP_NUM_THREADS=2 and =1 with
    threads=1 (a 2-thread build of even tiny sizes is ~10x slower on 2 shared cores): the SFT
    policy ran with 1 thread in both, the weights are identical, and the caller's setting is
    restored. Planted bug: the build not setting its threads -> the OMP_NUM_THREADS=2 build
    records 2 threads and this fails."""
    cfg = json.dumps(asdict(TINY))
    outs = {}
    for omp in ("2", "1"):
        env = dict(os.environ, OMP_NUM_THREADS=omp, MKL_NUM_THREADS=omp)
        env.pop("MEGARL_ASSETS_THREADS", None)
        r = subprocess.run([sys.executable, "-c", HASH_BUILD, str(tmp_path / omp), cfg], env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        outs[omp] = json.loads(r.stdout.strip().splitlines()[-1])
    for omp, out in outs.items():
        assert out["caller_threads"] == [int(omp), int(omp)], out
        assert out["policy_threads"] == 1 and out["recorded"] == {"policy": 1, "prm": 1}, out
    assert outs["1"]["sha256"] == outs["2"]["sha256"]


def test_default_build_threads_and_a_mismatch_rebuilds(root, monkeypatch):
    """BuildConfig() builds with 2 threads (as make demo), or $MEGARL_ASSETS_THREADS; asked for
    another thread count, a policy or PRM is not taken as built (its dependents follow), while a
    training run resolving embedded:// (no config) takes any present build."""
    from megarl.demo.assets import default_threads

    monkeypatch.delenv("MEGARL_ASSETS_THREADS", raising=False)
    assert BuildConfig().threads == default_threads() == 2
    monkeypatch.setenv("MEGARL_ASSETS_THREADS", "3")
    assert BuildConfig().threads == 3
    ensure("prm", root, TINY)  # an earlier test left it stale
    assert is_built("policy", root, threads=1) and is_built("prm", root, threads=1)
    assert not is_built("policy", root, threads=2) and not is_built("prm", root, threads=2)
    assert is_built("tokenizer", root, threads=2)  # no torch training: any thread count
    assert is_built("policy", root) and resolve_uri("embedded://policy", root) == str(root / "policy")
    with pytest.raises(ValueError, match="MEGARL_ASSETS_THREADS"):
        ensure("policy", root, BuildConfig(threads=0), force=True)
