"""Applying an edge's input processor to the upstream outputs a stage received.

The processors live in `omni_runtime.processors` (one per name in `spec.INPUT_PROCESSORS`); they take
one upstream stage's outputs by role (`primary`, companions). A stage fed by several upstream stages
runs the processor once per upstream stage and merges the results (later stages win on equal keys).
"""

from __future__ import annotations

from typing import Any

from omni_runtime.spec import PipelineSpec
from omni_runtime.wire.protocol import Input

__all__ = ["owned", "process_inputs"]


def process_inputs(
    name: str,
    loaded: list[tuple[Input, dict[str, Any]]],
    topology: PipelineSpec,
    *,
    request_id: str,
    request: dict[str, Any] | None = None,
    target: str | None = None,
) -> dict[str, Any]:
    """The engine input of stage `target` built from upstream outputs by the processor called `name` (a
    payload it refuses raises ProcessorError naming the edge)."""
    from omni_runtime.processors import ProcessorContext, apply_processor

    by_source: dict[str, dict[str, dict[str, Any]]] = {}
    for item, data in loaded:
        by_source.setdefault(item.source, {})[item.role] = data
    context = ProcessorContext(request_id=request_id, request=dict(request or {}), target=target)
    out: dict[str, Any] = {}
    for source, outputs in by_source.items():
        out.update(apply_processor(name, topology.stage(source), outputs, context))
    return out


def owned(value: Any) -> Any:
    """`value` with every tensor, array and buffer copied, so nothing in it still points into a
    connector's memory (an shm segment) once that payload is released."""
    import sys

    import numpy as np

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, memoryview | bytearray):
        return bytes(value)
    if isinstance(value, dict):
        return {k: owned(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(owned(v) for v in value)
    return value
