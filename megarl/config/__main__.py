"""Inspect and check a config before a run.

- ``python -m megarl.config show CONFIG [key=value ...]``: print the resolved config as YAML.
- ``python -m megarl.config show --sources CONFIG [key=value ...]``: print the layers applied and
  where each value that differs from the schema default came from (the report
  ``launch/train.py`` prints at start).
- ``python -m megarl.config check CONFIG [key=value ...]``: the preflight: the layers applied
  (recipe, demo overlay, own files, overrides), the same validation and notices as the training
  run's start, and its path checks (model, tokenizer, data and reward files exist or are hub
  ids that download or are cached, the run directory is writable); one line per problem, each
  naming its key.
- ``python -m megarl.config list``: the recipe names in configs/.

``--demo on|off`` forces the embedded demo's overlay (default auto: on iff the policy is the
embedded one). ``show`` prints what resolved even when the config has problems, then the
problems. Exit status 0 when the config is valid, 2 with the problems on stderr when not."""

from __future__ import annotations

import argparse
import sys

from megarl.config.errors import ConfigError
from megarl.config.loader import available_configs, resolve_config, to_yaml

DEMO_CHOICES = {"auto": None, "on": True, "off": False}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.config", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, text in (("show", "print the resolved config as YAML (also when it has problems)"),
                       ("check", "the preflight: validation, notices and path checks of a run's "
                                 "start, one line per problem")):
        p = sub.add_parser(name, help=text)
        p.add_argument("config", help="a recipe name in configs/ (e.g. pure_prm_vr) or a YAML path")
        p.add_argument("overrides", nargs="*", help="key=value overrides, as in verl")
        p.add_argument("--demo", choices=list(DEMO_CHOICES), default="auto",
                       help="the embedded demo's overlay (configs/demo/): auto = iff the policy "
                            "is embedded:// or unset")
        if name == "show":
            p.add_argument("--sources", action="store_true",
                           help="print where each non-default value came from instead of YAML")
    sub.add_parser("list", help="list the recipes in configs/")
    args = parser.parse_args(argv)
    if args.cmd == "list":
        print("\n".join(available_configs()))
        return 0
    try:
        resolved, problems = resolve_config(args.config, args.overrides, DEMO_CHOICES[args.demo]), []
    except ConfigError as err:
        resolved, problems = err.resolved, list(err.problems)
    if args.cmd == "show":
        if resolved is not None:
            print(resolved.report() if args.sources else to_yaml(resolved.config), end="\n" if args.sources else "")
        if problems:
            print(f"config error ({args.config}): {len(problems)} problem(s):", file=sys.stderr)
            print("\n".join(problems), file=sys.stderr)
        return 2 if problems else 0
    return _check(args.config, resolved, problems)


def _check(name: str, resolved, problems: list[str]) -> int:
    """The preflight (module doc): the layers, the notices, then one line per problem."""
    from megarl.config.notices import startup_notices
    from megarl.config.preflight import path_problems

    if resolved is not None:
        print(f"{name}: layers applied, later wins: {' < '.join(resolved.layers)}")
        print(f"demo overlay: {'applied' if resolved.demo else 'not applied'} "
              f"({resolved.demo_reason})")
        notices = list(resolved.notices)
        try:
            notices += startup_notices(resolved.config, resolved.sources)
        except Exception:  # noqa: BLE001 - a config with problems may not fill every notice
            pass
        for line in notices:
            print(f"notice: {line}")
        problems = problems + [p for p in path_problems(resolved.config, resolved.sources)
                               if p.split(":", 1)[0] not in {q.split(":", 1)[0] for q in problems}]
    if problems:
        print("\n".join(problems), file=sys.stderr)
        print(f"{name}: {len(problems)} problem(s)", file=sys.stderr)
        return 2
    print(f"{name}: ok")
    return 0

if __name__ == "__main__":
    sys.exit(main())
