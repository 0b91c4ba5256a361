"""The operator's `omnikube` subcommands (`operator`, `render`, `crds`), registered through the
`omnikube.commands` entry point so the runtime's CLI never imports the operator."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    op = sub.add_parser("operator", help="run the Kubernetes operator")
    op.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        help="namespace to watch (repeatable); default: all namespaces",
    )
    op.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    op.add_argument("--model-cache", type=Path, help="model cache readable here, to resolve spec.pipeline")
    op.add_argument(
        "--pipelines-dir",
        type=Path,
        action="append",
        default=[],
        help="extra folder of pipeline topologies (repeatable)",
    )
    op.add_argument("--workers", type=int, default=8, help="concurrent reconciles (default: %(default)s)")
    op.add_argument(
        "--resync-seconds", type=float, default=300.0, help="re-check every object this often (default: %(default)s)"
    )
    op.add_argument("--no-leader-election", action="store_true", help="act without holding the Lease")
    op.add_argument("--lease-namespace", help="namespace of the leader Lease (default: $POD_NAMESPACE)")
    op.add_argument(
        "--lease-name",
        default="omnikube-operator",
        help="name of the leader Lease; one per operator installation (default: %(default)s)",
    )
    op.add_argument("--liveness-port", type=int, help="serve kopf's /healthz on this port")
    op.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    op.add_argument(
        "--no-capacity-check",
        action="store_true",
        help="do not count free accelerators before a rollout makes a new generation (no listing of nodes and "
        "pods; the chart's capacityCheck.enabled=false): a generation that does not fit then waits Pending until "
        "rollout.progressDeadlineSeconds fails it",
    )
    op.set_defaults(func=_run_operator)

    render = sub.add_parser("render", help="print every object the operator would create, as YAML")
    render.add_argument("-f", "--filename", type=Path, required=True, help="file with OmniPipeline(s)")
    render.add_argument(
        "--no-owner-references",
        action="store_true",
        help="leave out owner references (to apply the objects without the operator)",
    )
    render.add_argument("--pipelines-dir", type=Path, action="append", default=[])
    render.set_defaults(func=_render)

    crds = sub.add_parser("crds", help="print the CustomResourceDefinitions as YAML")
    crds.set_defaults(func=_crds)


def _run_operator(args: argparse.Namespace) -> int:
    from omni_operator.runner import OperatorConfig, run_operator

    config = OperatorConfig(
        namespaces=args.namespace,
        kubeconfig=args.kubeconfig,
        model_root=args.model_cache,
        pipelines_dirs=args.pipelines_dir,
        workers=args.workers,
        resync_seconds=args.resync_seconds,
        leader_election=not args.no_leader_election,
        liveness_port=args.liveness_port,
        metrics_port=args.metrics_port,
        lease_name=args.lease_name,
        capacity_check=not args.no_capacity_check,
    )
    if args.lease_namespace:
        config.lease_namespace = args.lease_namespace
    asyncio.run(run_operator(config))
    return 0


def _render(args: argparse.Namespace) -> int:
    from omni_operator.render import RenderError, render_file
    from omni_runtime.registry import load_registry

    try:
        sys.stdout.write(
            render_file(args.filename, load_registry(args.pipelines_dir), owner_references=not args.no_owner_references)
        )
    except (RenderError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _crds(args: argparse.Namespace) -> int:
    from omni_operator.crdgen import crds_yaml

    sys.stdout.write(crds_yaml())
    return 0
