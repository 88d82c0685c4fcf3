"""``python -m megarl.config check`` is the preflight of a run, and ``show`` prints what resolved
even when the config has problems (megarl/config/__main__.py, megarl/config/preflight.py); the
Hub download decision up to its boundary (megarl/utils/hub.py: no network here).

Before: ``check grpo actor_rollout_ref.actor.fsdp_config.param_offload=True`` printed only
``grpo: ok`` (no layers, the inert-key notice only in the training run); a data path that does
not exist passed; ``show --sources pure_prm_vr actor_rollout_ref.model.path=...`` exited 2
printing no sources; ``--help`` showed RST markup (````show````)."""

from __future__ import annotations

import os

import pytest

from megarl.config.__main__ import main
from megarl.utils import hub

OFFLOAD = "actor_rollout_ref.actor.fsdp_config.param_offload=True"


def _run(capsys, *argv: str) -> tuple[int, list[str], list[str]]:
    code = main(list(argv))
    cap = capsys.readouterr()
    return code, cap.out.splitlines(), cap.err.splitlines()


def test_check_says_the_layers_and_the_notices_of_the_run(capsys):
    code, out, err = _run(capsys, "check", "grpo", OFFLOAD)
    assert code == 0 and not err
    assert out[0] == ("grpo: layers applied, later wins: schema defaults < recipe base < recipe "
                      "grpo < demo overlay demo/base < demo overlay demo/grpo < overrides")
    assert out[1].startswith("demo overlay: applied (actor_rollout_ref.model.path is not set")
    assert any(line.startswith(f"notice: {OFFLOAD} (from override") for line in out)
    assert out[-1] == "grpo: ok"


def test_check_finds_missing_files_and_names_their_keys(capsys, tmp_path):
    code, out, err = _run(capsys, "check", "grpo", f"data.train_files={tmp_path}/no.parquet",
                          f"custom_reward_function.path={tmp_path}/no.py")
    assert code == 2
    assert err == [
        f"data.train_files: no file '{tmp_path}/no.parquet' (from override data.train_files="
        f"{tmp_path}/no.parquet); give .parquet, .jsonl or .json files of verl's rows (prompt, "
        "reward_model, ...)",
        f"custom_reward_function.path: no file '{tmp_path}/no.py' (from override "
        f"custom_reward_function.path={tmp_path}/no.py)",
        "grpo: 2 problem(s)"]


def test_check_model_folder_and_run_directory(capsys, tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "file").write_text("")
    data = tmp_path / "train.parquet"
    data.write_text("")
    code, out, err = _run(capsys, "check", "grpo", f"actor_rollout_ref.model.path={tmp_path}/model",
                          f"data.train_files={data}", "data.val_files=null",
                          f"trainer.default_local_dir={tmp_path}/file/run")
    assert code == 2
    assert out[1].startswith("demo overlay: not applied (actor_rollout_ref.model.path is ")
    assert err[0].startswith(f"actor_rollout_ref.model.path: no config.json in '{tmp_path}/model'")
    assert err[1].startswith(f"trainer.default_local_dir: '{tmp_path}/file' is not a folder")


def test_an_uncached_hub_id_offline_says_how_to_download(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    code, _, err = _run(capsys, "check", "grpo", "actor_rollout_ref.model.path=nobody/no-model-xyz")
    assert code == 2
    line = next(x for x in err if x.startswith("actor_rollout_ref.model.path:"))
    assert "'nobody/no-model-xyz' is a hub id that is not in the local HF cache" in line
    assert "unset HF_HUB_OFFLINE" in line
    for var in hub.OFFLINE_VARS:  # downloads on: the id is left to the download
        monkeypatch.setenv(var, "0")
    _, _, err = _run(capsys, "check", "grpo", "actor_rollout_ref.model.path=nobody/no-model-xyz")
    assert not any(x.startswith("actor_rollout_ref.model.path:") for x in err)


def test_show_prints_what_resolved_then_the_problems(capsys):
    code, out, err = _run(capsys, "show", "--sources", "pure_prm_vr",
                          "actor_rollout_ref.model.path=/some/model")
    assert code == 2
    assert out[0].startswith("config pure_prm_vr: layers, later wins: schema defaults < ")
    assert any(line.strip().startswith("actor_rollout_ref.model.path") for line in out)
    assert err[0] == "config error (pure_prm_vr): 2 problem(s):"
    assert err[1].startswith("data.train_files: required")
    code, out, _ = _run(capsys, "show", "pure_prm_vr", "actor_rollout_ref.model.path=/some/model")
    assert code == 2 and "    path: /some/model" in out


def test_help_has_no_markup(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "``" not in capsys.readouterr().out


def test_hub_offline_decision(monkeypatch):
    """Downloads stay on for a run that reads a hub id, unless the user set HF_HUB_OFFLINE;
    a run on the embedded demo or local folders goes offline. Before: launch/train.py and
    load_tokenizer set HF_HUB_OFFLINE=1 always (a hub id never downloaded)."""
    for var in hub.OFFLINE_VARS:
        monkeypatch.delenv(var, raising=False)
    assert hub.is_hub_id("Qwen/Qwen2.5-7B-Instruct")
    assert not any(hub.is_hub_id(p) for p in ("embedded://policy", "/abs/x", "./a/b", "a/b/c"))
    assert hub.decide_offline(["Qwen/Qwen2.5-7B-Instruct", "embedded://prm"]) is False
    assert "HF_HUB_OFFLINE" not in os.environ
    assert hub.decide_offline(["embedded://policy", None]) is True
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    for var in hub.OFFLINE_VARS:
        monkeypatch.setenv(var, "0")
    assert hub.decide_offline(["embedded://policy"]) is False  # the user's value is kept
