"""`python -m conversion`: HF -> megatron (written at TP=2 x PP=2 by 4 gloo processes, or in
this process) -> HF is bit-exact for every tensor and every role; `verify` passes on a good
checkpoint and fails on one with a single perturbed tensor; bad input gives one error line and
exit status 2."""

import json
import subprocess
import sys

import mcore_testlib as lib
import pytest
import torch
from safetensors.torch import load_file, save_file

from conversion.__main__ import main
from megarl.models.hf_io import load_hf_state_dict


def _assert_same_tensors(a_dir, b_dir):
    a, b = load_hf_state_dict(a_dir), load_hf_state_dict(b_dir)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.dist
def test_tp2_pp2_roundtrip_is_bit_exact_and_verify_catches_one_perturbed_tensor(
    conv_zoo, conv_dist, tmp_path, capsys
):
    hf = conv_zoo / "qwen2_bias"
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    proc = subprocess.run(
        [sys.executable, "-m", "conversion", "hf-to-megatron", "--hf", str(hf), "--out",
         str(ckpt), "--tp", "2", "--pp", "2"],
        cwd=lib.REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TP=2 PP=2" in proc.stdout
    meta = json.loads((ckpt / "megarl_meta.json").read_text())
    assert (meta["tp"], meta["pp"], meta["role"], meta["has_optimizer"]) == (2, 2, "actor", False)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # temp dirs gone

    assert main(["megatron-to-hf", "--ckpt", str(ckpt), "--out", str(back)]) == 0
    _assert_same_tensors(hf, back)
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(back)  # a loadable HF folder
    assert model.config.architectures == ["Qwen2ForCausalLM"]

    capsys.readouterr()
    assert main(["verify", "--hf", str(hf), "--ckpt", str(ckpt)]) == 0
    assert "max abs diff" in capsys.readouterr().out

    from megarl.backends.megatron import MegatronBackend

    bad = MegatronBackend.from_checkpoint(str(ckpt))
    with torch.no_grad():
        bad.chunks[0].decoder.layers[1].mlp.linear_fc2.weight[3, 5] += 1e-2
    bad.save(str(tmp_path / "bad"))
    assert main(["verify", "--hf", str(hf), "--ckpt", str(tmp_path / "bad")]) == 1
    assert "MISMATCH" in capsys.readouterr().out


@pytest.mark.parametrize(
    "name, role",
    [("llama_tied_gqa", "actor"), ("qwen2_critic", "critic"), ("qwen3_prm", "prm"),
     ("qwen3_sharded_bf16", "actor")],
)
def test_roundtrip_every_role_tied_sharded_and_bf16(conv_zoo, conv_dist, tmp_path, name, role):
    hf = conv_zoo / name
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    assert main(["hf-to-megatron", "--hf", str(hf), "--out", str(ckpt), "--role", role]) == 0
    assert main(["megatron-to-hf", "--ckpt", str(ckpt), "--out", str(back)]) == 0
    _assert_same_tensors(hf, back)
    config = json.loads((back / "config.json").read_text())
    source = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == source["architectures"]
    assert config.get("tie_word_embeddings", False) == source.get("tie_word_embeddings", False)
    assert main(["verify", "--hf", str(hf), "--ckpt", str(ckpt),
                 "--tol", "1e-5" if name != "qwen3_sharded_bf16" else "1e-4"]) == 0


def test_refuses_to_overwrite_and_names_missing_tensors(conv_zoo, conv_dist, tmp_path, capsys):
    hf = conv_zoo / "qwen2_bias"
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main(["hf-to-megatron", "--hf", str(hf), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megarl-convert: error:") and "--force" in err and "\n" not in err
    assert (out / "keep.txt").exists()
    assert main(["hf-to-megatron", "--hf", str(hf), "--out", str(out), "--force"]) == 0
    assert not (out / "keep.txt").exists() and (out / "megarl_meta.json").exists()

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((hf / "config.json").read_text())
    tensors = load_file(str(hf / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, str(broken / "model.safetensors"))
    capsys.readouterr()
    assert main(["hf-to-megatron", "--hf", str(broken), "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err.strip()
    assert "model.layers.1.self_attn.k_proj.bias" in err and "missing" in err
    assert "\n" not in err and not (tmp_path / "o2").exists()


def test_cli_errors_are_one_line_exit_2_without_traceback(tmp_path):
    for args in (
        ["hf-to-megatron", "--hf", str(tmp_path / "nope"), "--out", str(tmp_path / "o")],
        ["megatron-to-hf", "--ckpt", str(tmp_path), "--out", str(tmp_path / "o")],
        ["verify", "--hf", str(tmp_path), "--ckpt", str(tmp_path)],
        ["hf-to-megatron", "--hf", str(tmp_path), "--out", str(tmp_path / "o"), "--tp", "0"],
        ["frobnicate"],
    ):
        proc = subprocess.run([sys.executable, "-m", "conversion", *args], cwd=lib.REPO,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (args, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("megarl-convert: error:"), proc.stderr
        assert "Traceback" not in proc.stderr
