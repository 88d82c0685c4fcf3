"""The whole-file cache behind RLDataset (megarl.data.prompt_cache): a hit renders and tokenizes
nothing and gives exactly what an uncached load gives (items, counts, warnings); every input
the load depends on changes the key; what JSON cannot carry, or a template that reads the
clock, is never cached; a bad file is a miss."""

import json
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_data_dataset import row
from test_data_token_cache import TOOL_TEMPLATE, TOOLS, write_data

from megarl.data import RLDataset, load_tokenizer, write_rows
from megarl.data import dataset as dataset_module
from megarl.data import prompt_cache as pc

N = 1200  # over prompt_cache.MIN_ROWS


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("MEGARL_CACHE_DIR", str(d))
    return d


@pytest.fixture
def renders(monkeypatch):
    """Counts the prompts RLDataset renders through the chat template."""
    seen = []
    real = dataset_module.render_prompt

    def spy(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dataset_module, "render_prompt", spy)
    return seen


def file_entries(cache: Path) -> list[Path]:
    return sorted((cache / pc.SUBDIR).glob("*")) if (cache / pc.SUBDIR).exists() else []


def load(path, tok, **kw):
    kw.setdefault("truncation", "left")
    kw.setdefault("max_prompt_length", 64)
    return RLDataset(path, tok, **kw)


def uncached(monkeypatch, path, tok, **kw):
    with monkeypatch.context() as m:
        m.setenv("MEGARL_CACHE_DIR", "off")
        return load(path, tok, **kw)


def with_bad_rows(path: Path) -> str:
    """N good rows, every 100th row malformed (no ground truth), every 50th over 64 tokens."""
    write_data(path)
    lines = path.read_text().splitlines()
    for i in range(0, N, 100):
        bad = json.loads(lines[i])
        del bad["reward_model"]["ground_truth"]
        lines[i] = json.dumps(bad)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_hit_renders_nothing_and_equals_the_uncached_load(tmp_path, tok, cache, renders,
                                                            monkeypatch, caplog):
    """Cold: every good row rendered once, one file written. Warm: nothing rendered, the same
    items (ids after truncation, text, fields, index), counts and warnings as an uncached
    load, with the cache file untouched."""
    path = with_bad_rows(tmp_path / "d.jsonl")
    kw = {"on_bad_row": "skip"}
    cold = load(path, tok, **kw)
    good = N - N // 100
    assert len(renders) == good
    (entry,) = file_entries(cache)
    stamp = entry.stat().st_mtime_ns
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megarl.data.dataset"):
        warm = load(path, tok, **kw)
    assert len(renders) == good, "the warm load rendered prompts"
    warm_log = [r.getMessage() for r in caplog.records]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megarl.data.dataset"):
        plain = uncached(monkeypatch, path, tok, **kw)
    assert [r.getMessage() for r in caplog.records] == warm_log
    assert any("skipped 12 malformed rows" in m for m in warm_log), warm_log
    assert warm.items == cold.items == plain.items
    for name in ("num_bad_rows", "num_filtered", "num_truncated"):
        assert getattr(warm, name) == getattr(plain, name), name
    assert warm.num_bad_rows == N // 100 and warm.num_truncated > 0
    assert entry.stat().st_mtime_ns == stamp and file_entries(cache) == [entry]
    assert all(type(t) is int for it in warm.items[:20] for t in it.prompt_ids)
    assert warm[5].prompt_ids == tok.encode(warm[5].prompt_text, add_special_tokens=False)[-64:]


def _special_token(tok_dir):
    t = load_tokenizer(tok_dir)
    t.add_special_tokens({"additional_special_tokens": ["Compute:"]})
    return t


def _other_template(tok_dir):
    t = load_tokenizer(tok_dir)
    t.chat_template = TOOL_TEMPLATE
    return t


CHANGES = {  # name -> (keyword changes, tokenizer change)
    "file_bytes": ({}, None),
    "prompt_key": ({"prompt_key": "question"}, None),
    "max_prompt_length": ({"max_prompt_length": 32}, None),
    "truncation": ({"truncation": "right"}, None),
    "filter_overlong": ({"filter_overlong_prompts": True}, None),
    "no_template": ({"apply_chat_template": False}, None),
    "chat_template": ({"chat_template": TOOL_TEMPLATE}, None),
    "tools": ({"chat_template": TOOL_TEMPLATE, "tools": TOOLS}, None),
    "template_kwargs": ({"chat_template": "{{ flag }}{% for m in messages %}{{ m['content'] }}"
                                          "{% endfor %}", "chat_template_kwargs": {"flag": "Y"}},
                        None),
    "on_bad_row": ({"on_bad_row": "skip"}, None),
    "tokenizer_template": ({}, _other_template),
    "special_token": ({}, _special_token),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_what_changes_the_load_changes_the_key(tmp_path, tok, tok_dir, cache, renders,
                                               monkeypatch, change):
    """A first load, then the same files with one input changed: a miss (prompts rendered
    again, a second file) that equals an uncached load with that change."""
    path = tmp_path / "d.jsonl"
    rows = [dict(row(f"Compute: {i}+1" + (" and 1+1" * 12 if i % 50 == 0 else ""),
                     str(i + 1)), question=[{"role": "user", "content": f"What is {i}+1?"}])
            for i in range(N)]
    write_rows(rows, str(path))
    base = {"chat_template": "{{ flag }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
            "chat_template_kwargs": {"flag": "X"}} if change == "template_kwargs" else {}
    base = {"chat_template": TOOL_TEMPLATE} if change == "tools" else base
    first = load(str(path), tok, **base)
    kw, tok_change = CHANGES[change]
    other = tok_change(tok_dir) if tok_change else tok
    if change == "file_bytes":
        rows[7] = dict(rows[7], data_source="another_source")
        write_rows(rows, str(path))
    n_rendered = len(renders)
    second = load(str(path), other, **{**base, **kw})
    assert len(renders) == 2 * n_rendered, "a changed input hit the first file"
    assert len(file_entries(cache)) == 2
    assert second.items == uncached(monkeypatch, str(path), other, **{**base, **kw}).items
    if change in ("special_token", "on_bad_row"):  # the same texts (and rows): only the key
        assert [it.prompt_text for it in second.items] == [it.prompt_text for it in first.items]
    else:
        assert second.items != first.items


def test_a_template_that_reads_the_clock_is_never_cached(tmp_path, tok, cache, renders):
    path = write_data(tmp_path / "d.jsonl")
    template = ("{{ strftime_now('%Y') }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    load(path, tok, chat_template=template)
    load(path, tok, chat_template=template)
    assert len(renders) == 2 * N and file_entries(cache) == []


def test_rows_that_json_would_change_are_not_cached(tmp_path, tok, cache, renders):
    """A parquet map column comes back from pyarrow as a list of tuples, which JSON would
    turn into lists: such a load is not written, and both loads give the tuples."""
    base = [row(f"Compute: {i}+1", str(i + 1)) for i in range(N)]
    table = pa.Table.from_pylist(base)
    maps = pa.array([[("k", i)] for i in range(N)], type=pa.map_(pa.string(), pa.int64()))
    extra = pa.StructArray.from_arrays([maps], names=["tags"])
    table = table.set_column(table.schema.get_field_index("extra_info"), "extra_info", extra)
    path = str(tmp_path / "d.parquet")
    pq.write_table(table, path)
    a = load(path, tok)
    b = load(path, tok)
    assert a.items[3].extra_info == {"tags": [("k", 3)]}
    assert a.items == b.items and len(renders) == 2 * N and file_entries(cache) == []


def test_fewer_than_min_rows_are_not_written(tmp_path, tok, cache, renders):
    path = write_data(tmp_path / "d.jsonl", pc.MIN_ROWS - 1)
    load(path, tok)
    load(path, tok)
    assert len(renders) == 2 * (pc.MIN_ROWS - 1) and file_entries(cache) == []


def _torn(p: Path):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _rows_not_json(p: Path):
    with np.load(p) as f:
        arrays = dict(f)
    arrays["rows"] = np.frombuffer(b"[[1, 2", dtype=np.uint8)
    with p.open("wb") as f:
        np.savez(f, **arrays)


def _one_row_short(p: Path):
    with np.load(p) as f:
        arrays = dict(f)
    rows = json.loads(arrays["rows"].tobytes())
    arrays["rows"] = np.frombuffer(json.dumps(rows[:-1]).encode(), dtype=np.uint8)
    with p.open("wb") as f:
        np.savez(f, **arrays)


@pytest.mark.parametrize("damage", [_torn, _rows_not_json, _one_row_short],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_bad_file_is_a_miss_and_is_rewritten(tmp_path, tok, cache, renders, damage):
    path = write_data(tmp_path / "d.parquet")
    good = load(path, tok)
    (entry,) = file_entries(cache)
    damage(entry)
    again = load(path, tok)
    assert len(renders) == 2 * N and again.items == good.items
    third = load(path, tok)
    assert len(renders) == 2 * N, "the rewritten file was not read"
    assert third.items == good.items and file_entries(cache) == [entry]


def test_a_missing_file_is_still_named(tmp_path, tok, cache):
    with pytest.raises(FileNotFoundError, match="data file not found"):
        load(str(tmp_path / "nope.parquet"), tok)
