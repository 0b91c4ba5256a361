"""`omnikube`: one command line for the runtime and the operator.

Runtime subcommands live here. Subcommands of other parts (the operator's `operator`, `render`, `crds`)
arrive through the `omnikube.commands` entry-point group, so the runtime never imports the operator and
an image that lacks a part simply lacks its subcommands.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from importlib.metadata import entry_points

__all__ = ["main", "Command"]

log = logging.getLogger(__name__)

Command = Callable[[argparse._SubParsersAction], None]
"""A plugin registers its subparsers; each subparser sets `func(args) -> int` as its default."""


def _pipelines_command(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("pipelines", help="list the built-in pipeline topologies")
    parser.set_defaults(func=_list_pipelines)


def _list_pipelines(args: argparse.Namespace) -> int:
    from omni_runtime.registry import load_registry

    for name, spec in sorted(load_registry().items()):
        stages = " -> ".join(spec.topological_order())
        print(f"{name:24} {stages:40} {spec.description}")
    return 0


BUILTIN_COMMANDS: list[Command] = [_pipelines_command]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnikube", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in BUILTIN_COMMANDS:
        register(sub)
    for ep in entry_points(group="omnikube.commands"):
        try:
            ep.load()(sub)
        except ImportError as exc:  # a part installed without its extra: say so instead of crashing
            log.debug("subcommand plugin %s unavailable: %s", ep.name, exc)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
