"""RLDataset: file formats, chat template, overlong prompts, malformed rows."""

import json
import logging

import pytest

from megarl.data import BadRowError, RLDataset, write_rows


def row(q="1+2", gt="3", source="arith", **extra):
    r = {
        "data_source": source,
        "prompt": [{"role": "user", "content": q}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gt},
        "extra_info": {"split": "train", "index": 0},
    }
    r.update(extra)
    return r


def chatml(content):
    """The ChatML text the demo template must produce, written out by hand."""
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


ROWS = [row("Compute: 12+30", "42"), row("What is 7-5?", "2", "other"), row("99+1", "100")]


@pytest.mark.parametrize("ext", ["parquet", "jsonl", "json"])
def test_loads_each_format(tmp_path, tok, ext):
    path = str(tmp_path / f"d.{ext}")
    write_rows(ROWS, path)
    ds = RLDataset(path, tok, max_prompt_length=64)
    assert len(ds) == 3
    for i, r in enumerate(ROWS):
        item = ds[i]
        content = r["prompt"][0]["content"]
        assert item.prompt_ids == tok.encode(chatml(content), add_special_tokens=False)
        assert tok.decode(item.prompt_ids) == chatml(content)
        assert item.raw_prompt == r["prompt"]
        assert item.data_source == r["data_source"]
        assert item.ground_truth == r["reward_model"]["ground_truth"]
        assert item.extra_info["split"] == "train"
        assert item.index == i


def test_index_runs_across_files_and_counts_filtered_rows(tmp_path, tok):
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")
    write_rows(ROWS[:2], a)
    write_rows([row("x" * 300, "1"), ROWS[2]], b)
    ds = RLDataset([a, b], tok, max_prompt_length=64, truncation="filter")
    assert [it.index for it in ds] == [0, 1, 3]  # row 2 (b's first) filtered
    assert ds.num_filtered == 1


def test_numeric_ground_truth_becomes_string(tmp_path, tok):
    path = str(tmp_path / "d.jsonl")
    write_rows([row(gt=42), row(gt=2.5)], path)
    ds = RLDataset(path, tok, 64)
    assert [it.ground_truth for it in ds] == ["42", "2.5"]


def test_config_chat_template_and_no_template(tmp_path, tok):
    path = str(tmp_path / "d.jsonl")
    write_rows([row("5+5")], path)
    template = "{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:"
    ds = RLDataset(path, tok, 64, chat_template=template)
    assert tok.decode(ds[0].prompt_ids) == "Q: 5+5\nA:"
    raw = RLDataset(path, tok, 64, apply_chat_template=False)
    assert raw[0].prompt_ids == tok.encode("5+5", add_special_tokens=False)


def test_tokenizer_without_template_is_a_clear_error(tmp_path, tok_dir):
    from transformers import AutoTokenizer

    bare = AutoTokenizer.from_pretrained(tok_dir)
    bare.chat_template = None
    path = str(tmp_path / "d.jsonl")
    write_rows([row()], path)
    with pytest.raises(ValueError, match="chat_template"):
        RLDataset(path, bare, 64)


def test_overlong_error_filter_and_truncation(tmp_path, tok, caplog):
    long_q = "1+" * 40 + "1"  # 81 digit/op tokens
    path = str(tmp_path / "d.jsonl")
    write_rows([row("2+2", "4"), row(long_q, "41")], path)
    full = tok.encode(chatml(long_q), add_special_tokens=False)
    limit = 50
    with pytest.raises(ValueError, match=rf"d.jsonl: row 1: prompt is {len(full)} tokens"):
        RLDataset(path, tok, limit)
    with caplog.at_level(logging.WARNING):
        ds = RLDataset(path, tok, limit, truncation="filter")
    assert len(ds) == 1 and ds.num_filtered == 1
    assert "filtered 1 prompts" in caplog.text
    left = RLDataset(path, tok, limit, truncation="left")
    assert left[1].prompt_ids == full[-limit:]
    right = RLDataset(path, tok, limit, truncation="right")
    assert right[1].prompt_ids == full[:limit]


@pytest.mark.parametrize("truncation", ["error", "left", "right"])
def test_filter_overlong_prompts_drops_before_truncation(tmp_path, tok, truncation):
    """verl's data.filter_overlong_prompts: an over-long prompt is dropped at load (counted),
    whatever data.truncation says; the short one is kept unchanged."""
    path = str(tmp_path / "d.jsonl")
    write_rows([row("2+2", "4"), row("1+" * 40 + "1", "41")], path)
    ds = RLDataset(path, tok, 50, truncation=truncation, filter_overlong_prompts=True)
    assert len(ds) == 1 and ds.num_filtered == 1 and ds.num_truncated == 0
    assert ds[0].prompt_ids == tok.encode(chatml("2+2"), add_special_tokens=False)


BAD = [
    ("missing prompt", lambda r: r.pop("prompt"), "prompt"),
    ("prompt is a string", lambda r: r.update(prompt="1+2"), "prompt"),
    ("empty prompt", lambda r: r.update(prompt=[]), "prompt"),
    ("message not a dict", lambda r: r.update(prompt=["hi"]), "prompt[0]"),
    ("bad role", lambda r: r.update(prompt=[{"role": "bot", "content": "x"}]), "prompt[0].role"),
    ("content not str", lambda r: r.update(prompt=[{"role": "user", "content": 5}]),
     "prompt[0].content"),
    ("missing reward_model", lambda r: r.pop("reward_model"), "reward_model"),
    ("reward_model not dict", lambda r: r.update(reward_model="3"), "reward_model"),
    ("missing ground_truth", lambda r: r["reward_model"].pop("ground_truth"),
     "reward_model.ground_truth"),
    ("ground_truth wrong type", lambda r: r["reward_model"].update(ground_truth={"a": 1}),
     "reward_model.ground_truth"),
    ("missing data_source", lambda r: r.pop("data_source"), "data_source"),
    ("extra_info not dict", lambda r: r.update(extra_info=[1]), "extra_info"),
    ("ability not str", lambda r: r.update(ability=3), "ability"),
]


@pytest.mark.parametrize("name,mutate,field", BAD, ids=[b[0] for b in BAD])
def test_bad_row_error_names_file_row_and_field(tmp_path, tok, name, mutate, field):
    bad = row()
    mutate(bad)
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [row(), row(), bad]) + "\n")
    with pytest.raises(BadRowError) as e:
        RLDataset(str(path), tok, 64)
    msg = str(e.value)
    assert str(path) in msg and "row 2" in msg and f"'{field}'" in msg
    assert e.value.row == 2 and e.value.field == field


def test_bad_rows_skipped_and_counted(tmp_path, tok, caplog):
    rows = [row("1+1", "2")]
    for _, mutate, _ in BAD:
        r = row()
        mutate(r)
        rows.append(r)
    path = tmp_path / "d.jsonl"
    lines = [json.dumps(r) for r in rows] + ["{not json", json.dumps(row("3+3", "6"))]
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING):
        ds = RLDataset(str(path), tok, 64, on_bad_row="skip")
    assert ds.num_bad_rows == len(BAD) + 1
    assert [it.ground_truth for it in ds] == ["2", "6"]
    assert [it.index for it in ds] == [0, len(BAD) + 2]
    assert f"skipped {len(BAD) + 1} malformed rows" in caplog.text


def test_invalid_json_line_errors_with_line(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(row()) + "\n\n{oops\n")
    with pytest.raises(BadRowError, match=r"row 1: field '<json>': line 3 is not valid JSON"):
        RLDataset(str(path), tok, 64)


def test_missing_file_and_unknown_extension(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        RLDataset(str(tmp_path / "nope.parquet"), tok, 64)
    p = tmp_path / "d.csv"
    p.write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown data file type"):
        RLDataset(str(p), tok, 64)
