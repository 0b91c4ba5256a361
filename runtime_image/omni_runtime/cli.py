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

__all__ = ["Command", "build_parser", "main"]

log = logging.getLogger(__name__)

Command = Callable[[argparse._SubParsersAction], None]
"""A plugin registers its subparsers; each subparser sets `func(args) -> int` as its default."""


def _pipelines_command(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("pipelines", help="list the built-in pipeline topologies")
    parser.set_defaults(func=_list_pipelines)


def _list_pipelines(args: argparse.Namespace) -> int:
    from omni_runtime.registry import load_registry

    rows = [(name, " -> ".join(spec.topological_order()), spec.description) for name, spec in load_registry().items()]
    width = max((len(name) for name, _, _ in rows), default=0)
    for name, stages, description in sorted(rows):
        print(f"{name:{width}}  {stages:32} {description}")
    return 0


def _stage_command(sub: argparse._SubParsersAction) -> None:
    from omni_runtime.stage.settings import StageSettings

    parser = sub.add_parser("stage", help="run one stage server (engine + protocol socket + probes)")
    StageSettings.add_arguments(parser)  # every flag comes from the settings model
    parser.set_defaults(func=_run_stage)


def _run_stage(args: argparse.Namespace) -> int:
    from omni_runtime.stage.settings import StageSettings, apply_stage_env_defaults

    apply_stage_env_defaults()  # before the engine modules are imported
    from omni_runtime.stage.main import run
    from omni_runtime.wire.auth import PipelineKey

    settings = StageSettings.from_args(args)
    try:
        key = PipelineKey.from_file(settings.pipeline_key_file)
    except ValueError as err:
        print(f"omnikube stage: --pipeline-key-file: {err}", file=sys.stderr)
        return 2
    return run(settings, key=key)


def _router_command(sub: argparse._SubParsersAction) -> None:
    from omni_runtime.router.settings import RouterSettings

    parser = sub.add_parser("router", help="run the OpenAI-compatible router (holds no model)")
    RouterSettings.add_arguments(parser)  # every flag comes from the settings model
    parser.set_defaults(func=_run_router)


def _run_router(args: argparse.Namespace) -> int:
    from omni_runtime.router.auth import ApiKeyError
    from omni_runtime.router.main import run
    from omni_runtime.router.settings import RouterSettings
    from omni_runtime.wire.auth import PipelineKey

    settings = RouterSettings.from_args(args)
    try:
        key = PipelineKey.from_file(settings.pipeline_key_file)
    except ValueError as err:
        print(f"omnikube router: --pipeline-key-file: {err}", file=sys.stderr)
        return 2
    try:
        return run(settings, key=key, log_level="debug" if args.verbose else "info")
    except ApiKeyError as err:
        print(f"omnikube router: {err}", file=sys.stderr)
        return 2


def _serve_command(sub: argparse._SubParsersAction) -> None:
    from omni_runtime.local.run import add_serve_arguments

    parser = sub.add_parser(
        "serve", help="serve a model folder or a pipeline YAML locally: one process per stage plus the router"
    )
    add_serve_arguments(parser)
    parser.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from omni_runtime.local.run import serve_from_args

    return serve_from_args(args)


BUILTIN_COMMANDS: list[Command] = [_pipelines_command, _stage_command, _router_command, _serve_command]


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
