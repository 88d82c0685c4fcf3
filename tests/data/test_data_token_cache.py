"""The on-disk cache of prompt token ids (megarl.data.token_cache) behind RLDataset: a hit gives
the dataset the tokenizer would have given, anything that changes the ids changes the key, and
a bad file or an unwritable folder never stops a load."""

import logging
from pathlib import Path

import numpy as np
import pytest
from test_data_dataset import row

from megarl.data import RLDataset, load_tokenizer, prompt_cache, write_rows
from megarl.data import token_cache as tc

N = 1200  # over token_cache.MIN_ROWS

TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "evaluate an expression",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}]
# renders the tools, so a prompt with tools is another text than one without
TOOL_TEMPLATE = ("{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
                 "{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:")


def write_data(path: Path, n: int = N) -> str:
    """n distinct arithmetic prompts; every 50th one long (over 64 tokens)."""
    rows = [row(f"Compute: {i}+{(7 * i) % 100}" + (" and 1+1" * 12 if i % 50 == 0 else ""),
                str(i + (7 * i) % 100)) for i in range(n)]
    write_rows(rows, str(path))
    return str(path)


def files(cache: Path) -> list[Path]:
    """Everything under the cache folder (the token files and any leftover temporary)."""
    return sorted(p for p in cache.rglob("*") if p.is_file())


@pytest.fixture
def calls(monkeypatch, tok):
    """Counts calls of the tokenizer (every instance of its class)."""
    cls = type(tok)
    real = cls.__call__
    seen = []

    def spy(self, *args, **kwargs):
        seen.append(len(args[0]) if args else None)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, "__call__", spy)
    return seen


@pytest.fixture(autouse=True)
def _token_level_only(monkeypatch):
    """These tests are about the token ids' cache: the whole-file cache above it
    (megarl.data.prompt_cache, tests/data/test_data_prompt_cache.py) writes nothing here."""
    monkeypatch.setattr(prompt_cache, "MIN_ROWS", 10**9)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("MEGARL_CACHE_DIR", str(d))
    return d


def load(path, tok, **kw):
    kw.setdefault("truncation", "left")
    return RLDataset(path, tok, max_prompt_length=64, **kw)


def test_second_load_reads_the_cache_and_equals_the_uncached_dataset(tmp_path, tok, cache,
                                                                      calls, monkeypatch):
    """Cold load: the tokenizer runs once and one .npz is written (no temporary left). Warm
    load: the tokenizer is not called and every PromptItem (ids after truncation, text,
    index, ...) and count equals the cold load's and an uncached load's."""
    path = write_data(tmp_path / "d.parquet")
    cold = load(path, tok)
    assert calls == [N]
    (npz,) = files(cache)
    assert npz.parent == cache / "prompt_tokens" and npz.suffix == ".npz"
    warm = load(path, tok)
    assert calls == [N], "the warm load called the tokenizer"
    assert files(cache) == [npz]
    monkeypatch.setenv("MEGARL_CACHE_DIR", "off")
    plain = load(path, tok)
    assert calls == [N, N]
    assert warm.items == cold.items == plain.items
    assert warm.num_truncated == plain.num_truncated == N // 50
    assert all(type(t) is int for it in warm.items[:20] for t in it.prompt_ids)
    assert warm[1].prompt_ids == tok.encode(warm[1].prompt_text, add_special_tokens=False)


def test_a_tokenizer_loaded_again_hits_the_file_of_the_first(tmp_path, tok_dir, cache, calls):
    """The demo tokenizer (embedded://tokenizer is this folder) through load_tokenizer, as a
    run loads it: a second load of it in a new object (another rank, the next run) reads
    the first one's file; the ids equal its own tokenization."""
    path = write_data(tmp_path / "d.jsonl")
    first = load(path, load_tokenizer(tok_dir))
    again = load_tokenizer(tok_dir)
    second = load(path, again)
    assert len(calls) == 1 and len(files(cache)) == 1
    assert first.items == second.items
    assert second[7].prompt_ids == again.encode(second[7].prompt_text, add_special_tokens=False)


def _added_token(tok_dir):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok_dir)
    t.add_special_tokens({"additional_special_tokens": ["Compute:"]})
    return t


@pytest.mark.parametrize("change", ["chat_template", "tools", "no_template", "prompt_key",
                                    "added_token"])
def test_what_changes_the_ids_changes_the_key(tmp_path, tok, tok_dir, cache, calls, change):
    """Each change after a first load is a miss (the tokenizer runs, a second file appears),
    and the dataset equals the one an uncached load gives for that change. The added token
    ("Compute:" as one special token) leaves every text as it was: only the tokenizer's
    fingerprint tells the two apart."""
    path = tmp_path / "d.jsonl"
    base_kw = {"chat_template": TOOL_TEMPLATE} if change == "tools" else {}
    if change == "prompt_key":  # the same rows with a second message field, other content
        rows = [dict(row(f"Compute: {i}+1", str(i + 1)),
                     question=[{"role": "user", "content": f"What is {i}+1?"}])
                for i in range(N)]
        write_rows(rows, str(path))
        path = str(path)
    else:
        path = write_data(path)
    first = load(path, tok, **base_kw)
    other_tok, kw = tok, dict(base_kw)
    if change == "chat_template":
        kw["chat_template"] = TOOL_TEMPLATE
    elif change == "tools":
        kw["tools"] = TOOLS
    elif change == "no_template":
        kw["apply_chat_template"] = False
    elif change == "prompt_key":
        kw["prompt_key"] = "question"
    else:
        other_tok = _added_token(tok_dir)
    second = load(path, other_tok, **kw)
    assert len(calls) == 2, "a changed input hit the first file"
    assert len(files(cache)) == 2
    assert second.items != first.items
    i = 3
    full = other_tok.encode(second[i].prompt_text, add_special_tokens=False)
    assert second[i].prompt_ids == full[-64:]  # truncation="left"
    if change == "added_token":
        assert second[i].prompt_text == first[i].prompt_text
        assert other_tok.convert_tokens_to_ids("Compute:") in second[i].prompt_ids


def _truncated(p: Path):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _garbage(p: Path):
    p.write_bytes(b"not a zip file" * 100)


def _empty(p: Path):
    p.write_bytes(b"")


def _rewrite(p: Path, **arrays):
    with p.open("wb") as f:
        np.savez(f, **arrays)


def _arrays(p: Path):
    with np.load(p) as f:
        return f["ids"], f["offsets"]


def _offsets_one_row_short(p: Path):
    ids, offsets = _arrays(p)
    _rewrite(p, ids=ids, offsets=offsets[:-1])


def _offsets_past_the_ids(p: Path):
    ids, offsets = _arrays(p)
    _rewrite(p, ids=ids[:-5], offsets=offsets)


def _wrong_dtype(p: Path):
    ids, offsets = _arrays(p)
    _rewrite(p, ids=ids.astype(np.float64), offsets=offsets)


def _pickled_object(p: Path):
    _, offsets = _arrays(p)
    _rewrite(p, ids=np.array([{"x": 1}], dtype=object), offsets=offsets)


@pytest.mark.parametrize("damage", [_truncated, _garbage, _empty, _offsets_one_row_short,
                                    _offsets_past_the_ids, _wrong_dtype, _pickled_object],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_bad_file_is_a_miss_and_is_rewritten(tmp_path, tok, cache, calls, damage):
    """A torn, foreign or inconsistent file: the load recomputes (no error), gives the right
    dataset, and rewrites the file, which the next load reads."""
    path = write_data(tmp_path / "d.parquet")
    good = load(path, tok)
    (npz,) = files(cache)
    damage(npz)
    again = load(path, tok)
    assert len(calls) == 2
    assert again.items == good.items
    assert files(cache) == [npz]
    third = load(path, tok)
    assert len(calls) == 2, "the rewritten file was not read"
    assert third.items == good.items


@pytest.mark.parametrize("n, cached", [(tc.MIN_ROWS - 1, False), (tc.MIN_ROWS, True)])
def test_only_files_of_min_rows_or_more_are_cached(tmp_path, tok, cache, calls, n, cached):
    path = write_data(tmp_path / "d.jsonl", n)
    a = load(path, tok)
    b = load(path, tok)
    assert a.items == b.items
    assert len(files(cache)) == (1 if cached else 0)
    assert len(calls) == (1 if cached else 2)


@pytest.mark.parametrize("value", ["off", ""])
def test_off_writes_nothing(tmp_path, tok, calls, monkeypatch, value):
    """MEGARL_CACHE_DIR=off (or empty): no file anywhere, not even in the default folders."""
    monkeypatch.setenv("MEGARL_CACHE_DIR", value)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(tmp_path)  # nor under a folder named by the value
    path = write_data(tmp_path / "d.parquet")
    load(path, tok)
    load(path, tok)
    assert len(calls) == 2
    assert files(tmp_path) == [Path(path)]


@pytest.mark.parametrize("xdg", [True, False])
def test_default_folder(tmp_path, monkeypatch, xdg):
    monkeypatch.delenv("MEGARL_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    if xdg:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        assert tc.cache_dir() == tmp_path / "xdg" / "megarl" / "prompt_tokens"
    else:
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        assert tc.cache_dir() == tmp_path / "home" / ".cache" / "megarl" / "prompt_tokens"


def test_an_unwritable_folder_logs_once_and_the_load_goes_on(tmp_path, tok, calls,
                                                             monkeypatch, caplog):
    """The cache folder under a plain file (unwritable even for root): every load works and
    tokenizes, one warning in all."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("MEGARL_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(tc, "_write_warned", False)
    path = write_data(tmp_path / "d.parquet")
    with caplog.at_level(logging.DEBUG, logger="megarl.data.token_cache"):
        a = load(path, tok)
        b = load(path, tok)
    assert a.items == b.items and len(calls) == 2
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "MEGARL_CACHE_DIR" in warnings[0].getMessage()


def test_a_tokenizer_without_backend_is_not_cached(cache):
    """A slow tokenizer (no ``backend_tokenizer``) is called every time; nothing is written."""

    class Slow:
        n = 0

        def __call__(self, texts, add_special_tokens=True):
            Slow.n += 1
            return {"input_ids": [[len(t), int(add_special_tokens)] for t in texts]}

    texts = [f"t{i}" for i in range(N)]
    assert tc.token_ids(Slow(), texts) == [[len(t), 0] for t in texts]
    assert tc.token_ids(Slow(), texts) == [[len(t), 0] for t in texts]
    assert Slow.n == 2 and not cache.exists()


def test_the_key_reads_every_text_whole(tok):
    """Texts are length-prefixed (no join that two splits of one string share), and the
    add_special_tokens flag and the tokenizer count."""
    fp = tc.tokenizer_fingerprint(tok)
    key = tc.cache_key(fp, ["ab", "c"], False)
    assert key != tc.cache_key(fp, ["a", "bc"], False)
    assert key != tc.cache_key(fp, ["ab\x00c"], False)
    assert key != tc.cache_key(fp, ["ab", "c"], True)
    assert key != tc.cache_key(fp + b"x", ["ab", "c"], False)
    assert key == tc.cache_key(tc.tokenizer_fingerprint(tok), ["ab", "c"], False)
