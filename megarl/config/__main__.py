"""``python -m megarl.config show CONFIG [key=value ...]``: print the resolved config as YAML.
``python -m megarl.config check CONFIG [key=value ...]``: validate only.
``python -m megarl.config list``: the recipe names in configs/.
Exit status 0 when the config is valid, 2 with the problems on stderr when it is not."""

from __future__ import annotations

import argparse
import sys

from megarl.config.errors import ConfigError
from megarl.config.loader import available_configs, load_config, to_yaml


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.config", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, text in (("show", "print the resolved config as YAML"), ("check", "validate the config")):
        p = sub.add_parser(name, help=text)
        p.add_argument("config", help="a recipe name in configs/ (e.g. pure_prm_vr) or a YAML path")
        p.add_argument("overrides", nargs="*", help="key=value overrides, as in verl")
    sub.add_parser("list", help="list the recipes in configs/")
    args = parser.parse_args(argv)
    if args.cmd == "list":
        print("\n".join(available_configs()))
        return 0
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"config error ({args.config}):\n{err}", file=sys.stderr)
        return 2
    if args.cmd == "show":
        sys.stdout.write(to_yaml(cfg))
    else:
        print(f"{args.config}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
