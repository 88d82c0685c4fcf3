"""verl's example command lines (``lines.jsonl``, written by ``expand.py``) read by megarl's
config check, and the outcome table (``outcomes.json``).

Each line becomes the check's arguments as README "Coming from verl" says: the recipe is ``ppo``
when the line's ``algorithm.adv_estimator`` is ``gae`` (a critic), ``grpo`` otherwise;
``--config-path`` is dropped; ``--config-name=ppo_megatron_trainer`` becomes
``actor_rollout_ref.actor.strategy=megatron`` (``ppo_trainer``: nothing); one of the examples' own
config files is read as what it is, its keys put before the script's arguments (and its base
trainer config mapped the same way); hydra's ``+key=`` / ``++key=`` / ``~key`` are read by
megarl's override parser as hydra reads them. The check is ``resolve_config`` (validation, verl
key rules, notices), without the file-system checks of the preflight (the scripts' model and
data paths live on the machines they were written for).

    python tests/config/verl_corpus/corpus.py   # rewrite outcomes.json from today's outcomes
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from megarl.config.errors import ConfigError
from megarl.config.loader import resolve_config
from megarl.config.verl_compat import classify, verl_key_of

HERE = Path(__file__).resolve().parent
LINES = HERE / "lines.jsonl"
OUTCOMES = HERE / "outcomes.json"
# verl's asynchronous recipes (expand.py --set async)
ASYNC_LINES = HERE / "lines_async.jsonl"
ASYNC_OUTCOMES = HERE / "outcomes_async.json"
# what a recipe's entry point itself means, in megarl's keys: verl's one-step-off trainer
# samples each batch with the weights one step old (megarl: staleness_threshold=1)
ENTRY_MEANS = {"verl.experimental.one_step_off_policy.main_ppo":
               ["async_training.staleness_threshold=1"]}
_SELECT = re.compile(r"^\$\{oc\.select:([^,}]+)(?:,(.*))?\}$")
MEGATRON = "actor_rollout_ref.actor.strategy=megatron"
TRAINER_CONFIGS = {"ppo_trainer": [], "ppo_megatron_trainer": [MEGATRON]}


def read_lines(path: Path = LINES) -> tuple[dict, list[dict]]:
    """(header, lines) of the corpus (``path``: the main set or ``ASYNC_LINES``)."""
    rows = [json.loads(t) for t in path.read_text().splitlines() if t.strip()]
    return rows[0], rows[1:]


def _leaves(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out |= _leaves(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def _flat(tree: dict) -> list[str]:
    """``key=value`` of every leaf, a ``${oc.select:KEY,FALLBACK}`` value read as hydra reads
    it within the file: KEY's value there (a section: dropped, as its leaves are set), else
    FALLBACK."""
    leaves = _leaves(tree)
    out: list[str] = []
    for k, v in leaves.items():
        if isinstance(v, str) and (m := _SELECT.match(v)):
            ref = m.group(1).strip()
            if any(key.startswith(ref + ".") for key in leaves):
                continue
            v = leaves.get(ref, json.loads(m.group(2).strip().lower())
                           if m.group(2) and m.group(2).strip() else None)
        out.append(f"{k}={json.dumps(v)}")
    return out


def _trainer_config(name: str) -> list[str]:
    stem = name.strip("'\"").removesuffix(".yaml")
    if stem not in TRAINER_CONFIGS:
        raise ValueError(f"--config-name={name}: not one of verl's trainer configs")
    return TRAINER_CONFIGS[stem]


def command_line(line: dict) -> tuple[str, list[str]]:
    """(megarl recipe, overrides) of one corpus line."""
    entry: list[str] = []
    rest: list[str] = []
    for a in line["args"]:
        if a.startswith("--config-path"):
            continue
        if a.startswith("--config-name="):
            if "config" not in line:
                entry += _trainer_config(a.split("=", 1)[1])
            continue
        rest.append(a)
    entry += ENTRY_MEANS.get(line.get("entry", ""), [])
    if "config" in line:
        for base in line["config"]["extends"]:
            entry += _trainer_config(base)
        entry += _flat(line["config"]["keys"])
    args = entry + rest
    estimators = [a.split("=", 1)[1] for a in args
                  if a.lstrip("+").split("=", 1)[0] == "algorithm.adv_estimator"]
    recipe = "ppo" if estimators and estimators[-1] == "gae" else "grpo"
    return recipe, args


def problem_key(problem: str) -> str:
    """The dotted key a problem line names (its first word, before ``=`` / ``:``)."""
    return re.split(r"[=: \[]", problem.strip(), maxsplit=1)[0]


def outcome(line: dict) -> dict[str, Any]:
    """{recipe, outcome: accepted | rejected, problems: [one line each]} of one corpus line."""
    recipe, args = command_line(line)
    try:
        resolve_config(recipe, args)
        problems: list[str] = []
    except ConfigError as e:
        problems = [p.replace(str(HERE), "<corpus>") for p in e.problems]
    return {"recipe": recipe, "outcome": "rejected" if problems else "accepted",
            "problems": problems}


def line_id(line: dict) -> str:
    return f"{line['script']}#{line['index']}"


def outcomes(path: Path = LINES) -> dict[str, dict]:
    _, lines = read_lines(path)
    return {line_id(line): outcome(line) for line in lines}


def changed_lines(today: dict[str, dict], table: Path) -> list[str]:
    """The ids of the lines whose outcome differs from the committed ``table`` (or that only
    one of them has)."""
    kept = json.loads(table.read_text())
    return sorted(k for k in kept.keys() | today.keys() if kept.get(k) != today.get(k))


def not_built(key: str) -> str | None:
    """The reason megarl's verl key rules give for refusing ``key`` (a feature megarl states as
    not built), or None."""
    verdict = classify(key) or classify(verl_key_of(key) or key)
    return verdict.note if verdict is not None and verdict.status == "rejected" else None


if __name__ == "__main__":
    for lines_file, table in ((LINES, OUTCOMES), (ASYNC_LINES, ASYNC_OUTCOMES)):
        table.write_text(json.dumps(outcomes(lines_file), indent=1, sort_keys=True) + "\n")
        print(f"wrote {table}", file=sys.stderr)
