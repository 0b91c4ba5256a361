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
    from omni_runtime.spec import DRAIN_TIMEOUT_S, ConnectorKind

    parser = sub.add_parser(
        "serve", help="serve a model folder or a pipeline YAML locally: one process per stage plus the router"
    )
    parser.add_argument("target", help="a model folder, or a local pipeline file (.yaml)")
    parser.add_argument("--pipeline", default=None, help="registry pipeline name (default: from the model)")
    parser.add_argument("--served-model-name", default=None, help="model id clients use")
    parser.add_argument("--host", default="127.0.0.1", help="address every process binds (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="router port (default: a free port)")
    parser.add_argument(
        "--connector",
        choices=[k.value for k in ConnectorKind],
        default=None,
        help="default connector of every edge (default: the file's, else shm)",
    )
    parser.add_argument(
        "--replicas", action="append", default=[], metavar="STAGE=N", help="replicas of a stage (repeatable)"
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        help="file holding the API key clients must send as 'Authorization: Bearer <key>' (re-read when it "
        "changes; default: no key)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=DRAIN_TIMEOUT_S,
        help=f"seconds running requests get to finish when serve stops (default {DRAIN_TIMEOUT_S:g})",
    )
    parser.add_argument("--run-dir", default=None, help="folder for resolved.json and logs (default: a temp dir)")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    parser.add_argument(
        "--shm-pool-bytes",
        type=int,
        default=64 * 1024**2,
        help="idle shm bytes each stage keeps for reuse (0: unlink when released)",
    )
    parser.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    """`omnikube serve`: prepare the run (exit 2 on a bad spec), start it, restart what dies until Ctrl-C or
    SIGTERM, then stop everything (exit 0; 1 when it could not start or crash-looped)."""
    import signal
    import time

    from omni_runtime.local.run import LocalRun
    from omni_runtime.local.spec import load_local_spec
    from omni_runtime.local.supervisor import Supervisor
    from omni_runtime.spec import SpecError

    replicas = {}
    for item in args.replicas:
        name, _, count = item.partition("=")
        if not count.isdigit() or int(count) < 1:
            print(f"--replicas {item!r}: use STAGE=N with N >= 1", file=sys.stderr)
            return 2
        replicas[name] = int(count)
    try:
        spec = load_local_spec(args.target, pipeline=args.pipeline)
        run = LocalRun.prepare(
            spec,
            run_dir=args.run_dir,
            host=args.host,
            port=args.port,
            connector=args.connector,
            replicas=replicas,
            served_model_name=args.served_model_name,
            shm_pool_bytes=args.shm_pool_bytes,
            api_key_file=args.api_key_file,
            drain_timeout_s=args.drain_timeout,
        )
    except SpecError as err:
        print(f"omnikube serve: {err}", file=sys.stderr)
        return 2
    supervisor = Supervisor(run)
    stop: dict[str, int | None] = {"signal": None}

    def on_signal(signum: int, _frame: object) -> None:
        # Only a flag, polled at safe points: raising from here could cut an import in half (numpy's,
        # in `sweep`), and the orderly stop that follows would then fail to import it again
        stop["signal"] = signum

    def stop_requested() -> bool:
        return stop["signal"] is not None

    # SIGINT too, explicitly: a process started in the background by a non-interactive shell (nohup, `&` in
    # a script or CI job) inherits SIGINT ignored, and Python then never calls a handler for it
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    topology = run.resolved.topology
    stages = " -> ".join(topology.topological_order())
    print(f"omnikube serve: pipeline {topology.name} ({stages}); run folder {run.run_dir}", flush=True)
    try:
        supervisor.start(ready_timeout_s=args.ready_timeout, stop_requested=stop_requested)
        print(f"OpenAI endpoint: {run.endpoint}", flush=True)
        print(f"model: {run.resolved.served_model_name}; press Ctrl-C to stop", flush=True)
        while not stop_requested():
            for name in supervisor.restart_dead():
                print(f"omnikube serve: {name} exited; restarted it (logs in {run.run_dir})", file=sys.stderr)
            time.sleep(0.5)  # a signal cuts it short (PEP 475 resumes it, so at most 0.5 s late)
        print("omnikube serve: stopping", flush=True)
        return 0
    except KeyboardInterrupt:  # from `start`, which polls `stop_requested`
        print("omnikube serve: stopping", flush=True)
        return 0
    except (RuntimeError, TimeoutError) as err:
        print(f"omnikube serve: {err}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the orderly stop short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        supervisor.stop()
        print("omnikube serve: stopped", flush=True)


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
