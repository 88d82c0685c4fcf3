"""python -m megarl.data.prepare on small GSM8K / MATH-like files."""

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.data import RLDataset
from megarl.data.prepare import DEFAULT_INSTRUCTION, last_boxed, main

GSM = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
    {"question": "A farm sells 1,200 eggs a day. How many?", "answer": "so\n####  1,200 "},
]
MATH = [
    {"problem": "Find $x$ if $2x=1$.", "solution": "So $x=\\boxed{\\frac{1}{2}}$."},
    {"problem": "Simplify $\\{1\\}$.", "solution": "We get \\boxed{1} then \\boxed{\\{1, 2\\}}."},
    {"problem": "What is 2+2?", "solution": "It is 4.", "answer": "4"},
]


def read(path):
    return pq.read_table(path).to_pylist()


def test_gsm8k_jsonl_to_parquet_via_cli(tmp_path, tok):
    src = tmp_path / "gsm.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in GSM) + "\n")
    out = tmp_path / "out" / "train.parquet"
    proc = subprocess.run(
        [sys.executable, "-m", "megarl.data.prepare", "--input", str(src), "--output", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "wrote 2 rows" in proc.stdout
    rows = read(out)
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["7", "1200"]
    assert rows[0]["data_source"] == "openai/gsm8k"
    assert rows[0]["prompt"] == [
        {"role": "user", "content": GSM[0]["question"] + "\n\n" + DEFAULT_INSTRUCTION}
    ]
    assert rows[1]["extra_info"]["index"] == 1 and rows[1]["extra_info"]["split"] == "train"
    # the output is a valid RLDataset file
    ds = RLDataset(str(out), tok, max_prompt_length=512)
    assert len(ds) == 2 and ds[1].ground_truth == "1200"


@pytest.mark.parametrize("ext", ["json", "parquet"])
def test_math_files(tmp_path, ext):
    src = tmp_path / f"math.{ext}"
    if ext == "json":
        src.write_text(json.dumps(MATH))
    else:
        pq.write_table(pa.Table.from_pylist(
            [{"problem": r["problem"], "solution": r["solution"]} for r in MATH[:2]]), src)
    out = tmp_path / "m.jsonl"
    assert main(["--input", str(src), "--output", str(out), "--split", "test",
                 "--instruction", "", "--data-source", "math"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    gts = [r["reward_model"]["ground_truth"] for r in rows]
    assert gts == ["\\frac{1}{2}", "\\{1, 2\\}", "4"][: len(rows)]
    assert rows[0]["prompt"][0]["content"] == MATH[0]["problem"]
    assert all(r["data_source"] == "math" and r["extra_info"]["split"] == "test" for r in rows)


def test_last_boxed():
    assert last_boxed("a \\boxed{1} b \\boxed{x^{2}+1}") == "x^{2}+1"
    assert last_boxed("\\fbox{3}") == "3"
    assert last_boxed("\\boxed 5") == "5"
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed{unclosed") is None


def test_bad_rows_error_and_skip(tmp_path, capsys):
    src = tmp_path / "gsm.jsonl"
    rows = GSM + [{"question": "q", "answer": "no marker"}, {"question": "q"}]
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "o.parquet"
    assert main(["--input", str(src), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "gsm.jsonl: row 2: field 'answer'" in err and "####" in err
    assert main(["--input", str(src), "--output", str(out), "--on-bad-row", "skip"]) == 0
    assert "2 malformed rows skipped" in capsys.readouterr().out
    assert len(read(out)) == 2


def test_math_without_box_is_bad(tmp_path, capsys):
    src = tmp_path / "m.jsonl"
    src.write_text(json.dumps({"problem": "p", "solution": "no answer here"}) + "\n")
    assert main(["--input", str(src), "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "row 0: field 'solution'" in capsys.readouterr().err
