"""`python -m conversion` on mixture-of-experts models: HF -> megatron written at EP=2 (2 gloo
processes; experts 2 and 3 saved by the second rank) -> HF is bit-exact for every tensor, the
folder loads in transformers, and `verify` passes; one perturbed expert weight makes `verify`
fail (planted: +1e-2 on one entry of expert 3's fc2 in layer 1 moves the logits by 3.9e-3,
measured, against a tolerance of 1e-5; the good checkpoint: 1.8e-6)."""

import json
import subprocess
import sys

import mcore_testlib as lib
import moe_testlib as ml
import pytest
import torch

from conversion.__main__ import main
from megarl.models.hf_io import load_hf_state_dict


def _assert_same_tensors(a_dir, b_dir):
    a, b = load_hf_state_dict(a_dir), load_hf_state_dict(b_dir)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.dist
def test_ep2_roundtrip_is_bit_exact_and_verify_catches_a_perturbed_expert(
    tmp_path, mcore_dist, capsys
):
    hf = ml.moe_model(tmp_path / "zoo", "qwen2_moe")  # shared expert + gate
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    proc = subprocess.run(
        [sys.executable, "-m", "conversion", "hf-to-megatron", "--hf", str(hf), "--out",
         str(ckpt), "--ep", "2"],
        cwd=lib.REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "EP=2" in proc.stdout
    meta = json.loads((ckpt / "megarl_meta.json").read_text())
    assert (meta["ep"], meta["tp"], meta["has_optimizer"]) == (2, 1, False)

    assert main(["megatron-to-hf", "--ckpt", str(ckpt), "--out", str(back)]) == 0
    _assert_same_tensors(hf, back)
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(back)
    assert model.config.architectures == ["Qwen2MoeForCausalLM"]

    capsys.readouterr()
    assert main(["verify", "--hf", str(hf), "--ckpt", str(ckpt)]) == 0
    assert "max abs diff" in capsys.readouterr().out

    from megarl.backends.megatron import MegatronBackend

    bad = MegatronBackend.from_checkpoint(str(ckpt))
    with torch.no_grad():
        bad.chunks[0].decoder.layers[1].mlp.experts.local_experts[3].linear_fc2.weight[3, 5] += 1e-2
    bad.save(str(tmp_path / "bad"))
    assert main(["verify", "--hf", str(hf), "--ckpt", str(tmp_path / "bad")]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_roundtrip_mixed_dense_and_sparse_layers(tmp_path, mcore_dist):
    hf = ml.moe_model(tmp_path / "zoo", "qwen3_moe_mixed")  # dense layer 0, 8 experts
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    assert main(["hf-to-megatron", "--hf", str(hf), "--out", str(ckpt)]) == 0
    assert main(["megatron-to-hf", "--ckpt", str(ckpt), "--out", str(back)]) == 0
    _assert_same_tensors(hf, back)
    config = json.loads((back / "config.json").read_text())
    experts = config.get("num_experts", config.get("num_local_experts"))  # transformers 4 / 5
    assert config["mlp_only_layers"] == [0] and experts == 8
    assert main(["verify", "--hf", str(hf), "--ckpt", str(ckpt)]) == 0
