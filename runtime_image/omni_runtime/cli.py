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

    rows = [(name, " -> ".join(spec.topological_order()), spec.description) for name, spec in load_registry().items()]
    width = max((len(name) for name, _, _ in rows), default=0)
    for name, stages, description in sorted(rows):
        print(f"{name:{width}}  {stages:32} {description}")
    return 0


def _stage_command(sub: argparse._SubParsersAction) -> None:
    from omni_runtime.spec import DRAIN_TIMEOUT_S, STAGE_HTTP_PORT, STAGE_PORT

    parser = sub.add_parser("stage", help="run one stage server (engine + protocol socket + probes)")
    parser.add_argument("--config", required=True, help="resolved pipeline JSON")
    parser.add_argument("--stage", required=True, help="stage name in the pipeline")
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=STAGE_PORT, help=f"protocol port (default {STAGE_PORT})")
    parser.add_argument(
        "--http-port",
        type=int,
        default=STAGE_HTTP_PORT,
        help=f"/healthz /readyz /metrics port (default {STAGE_HTTP_PORT})",
    )
    parser.add_argument(
        "--replica", default=None, help="replica name for metrics and shm segments (default: host name)"
    )
    parser.add_argument("--advertise-host", default="127.0.0.1", help="this pod's address for Mooncake transfers")
    parser.add_argument("--mooncake-master-host", default="127.0.0.1", help="host of the Mooncake master (router pod)")
    parser.add_argument(
        "--pipeline-key-file",
        required=True,
        help="the pipeline's key (32+ random bytes): only a router holding the same key is answered",
    )
    parser.add_argument(
        "--shm-pool-bytes",
        type=int,
        default=64 * 1024**2,
        help="idle shm bytes kept for reuse (0: unlink when released)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=DRAIN_TIMEOUT_S,
        help="seconds a SIGTERM lets running works finish before they fail with a retriable error "
        f"(default {DRAIN_TIMEOUT_S:g}; the operator derives it from terminationGracePeriodSeconds)",
    )
    parser.set_defaults(func=_run_stage)


def _run_stage(args: argparse.Namespace) -> int:
    import socket

    from omni_runtime.stage.auth import PipelineKey
    from omni_runtime.stage.connectors import ConnectorSettings
    from omni_runtime.stage.main import run

    try:
        key = PipelineKey.from_file(args.pipeline_key_file)
    except ValueError as err:
        print(f"omnikube stage: --pipeline-key-file: {err}", file=sys.stderr)
        return 2
    replica = args.replica or socket.gethostname()
    settings = ConnectorSettings(
        owner=f"{args.stage}-{replica}",
        shm_pool_bytes=args.shm_pool_bytes,
        mooncake_host=args.advertise_host,
        mooncake_master_host=args.mooncake_master_host,
    )
    return run(
        args.config, args.stage, host=args.host, port=args.port, http_port=args.http_port, replica=replica,
        connectors=settings, drain_timeout_s=args.drain_timeout, key=key,
    )  # fmt: skip


def _router_command(sub: argparse._SubParsersAction) -> None:
    from omni_runtime.spec import DRAIN_TIMEOUT_S, ROUTER_PORT

    parser = sub.add_parser("router", help="run the OpenAI-compatible router (holds no model)")
    parser.add_argument("--config", required=True, help="resolved pipeline JSON")
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=ROUTER_PORT, help=f"HTTP port (default {ROUTER_PORT})")
    parser.add_argument(
        "--kubeconfig", default=None, help="kubeconfig for EndpointSlice discovery (default: in-cluster)"
    )
    parser.add_argument(
        "--ping-timeout",
        type=float,
        default=10.0,
        help="seconds without a message before a stage replica counts as hung (default 10)",
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        help="file holding the key every /v1 request must send as 'Authorization: Bearer <key>'; re-read "
        "when it changes (a mounted Secret), so a rotated key needs no restart (default: no key)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=DRAIN_TIMEOUT_S,
        help="seconds a SIGTERM lets running requests finish before they fail with a retriable 503 "
        f"(default {DRAIN_TIMEOUT_S:g}; the operator derives it from terminationGracePeriodSeconds)",
    )
    parser.add_argument(
        "--pipeline-key-file",
        required=True,
        help="the pipeline's key (32+ random bytes) the stages hold; every stage message is authenticated with it",
    )
    parser.set_defaults(func=_run_router)


def _run_router(args: argparse.Namespace) -> int:
    from omni_runtime.router.auth import ApiKeyError
    from omni_runtime.router.main import run
    from omni_runtime.stage.auth import PipelineKey

    try:
        key = PipelineKey.from_file(args.pipeline_key_file)
    except ValueError as err:
        print(f"omnikube router: --pipeline-key-file: {err}", file=sys.stderr)
        return 2
    level = "debug" if args.verbose else "info"
    try:
        return run(
            args.config,
            host=args.host,
            port=args.port,
            kubeconfig=args.kubeconfig,
            log_level=level,
            ping_timeout_s=args.ping_timeout,
            api_key_file=args.api_key_file,
            drain_timeout_s=args.drain_timeout,
            key=key,
        )
    except ApiKeyError as err:
        print(f"omnikube router: {err}", file=sys.stderr)
        return 2


def _serve_command(sub: argparse._SubParsersAction) -> None:
    from omni_runtime.launcher import add_serve_arguments

    parser = sub.add_parser(
        "serve", help="serve a model folder or a pipeline YAML locally: one process per stage plus the router"
    )
    add_serve_arguments(parser)
    parser.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from omni_runtime.launcher import serve_from_args

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
