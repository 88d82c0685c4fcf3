"""``python -m megarl.config show CONFIG [key=value ...]``: print the resolved config as YAML.
``python -m megarl.config show --sources CONFIG [key=value ...]``: print where each value that
differs from the schema default came from (schema default, recipe, demo overlay, own file,
override): the report ``launch/train.py`` prints at start.
``python -m megarl.config check CONFIG [key=value ...]``: validate only.
``python -m megarl.config list``: the recipe names in configs/.
``--demo on|off`` forces the embedded demo's overlay (default auto: on iff the policy is the
embedded one). Exit status 0 when the config is valid, 2 with the problems on stderr when not."""

from __future__ import annotations

import argparse
import sys

from megarl.config.errors import ConfigError
from megarl.config.loader import available_configs, resolve_config, to_yaml

DEMO_CHOICES = {"auto": None, "on": True, "off": False}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.config", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, text in (("show", "print the resolved config as YAML"), ("check", "validate the config")):
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
        resolved = resolve_config(args.config, args.overrides, DEMO_CHOICES[args.demo])
    except ConfigError as err:
        print(f"config error ({args.config}):\n{err}", file=sys.stderr)
        return 2
    if args.cmd == "show" and args.sources:
        print(resolved.report())
    elif args.cmd == "show":
        sys.stdout.write(to_yaml(resolved.config))
    else:
        print(f"{args.config}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
