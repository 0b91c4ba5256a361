"""CUDA-graph replay of a compiled denoiser's step (engine arg `cuda_graphs`): `GraphedForward`.

`accel` wraps each denoiser's `forward` in one when the stage asks for it; see `accel`'s docstring for
when it pays (the CPU's launch work per step, against a memory pool per input shape).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

__all__ = ["GraphedForward"]

log = logging.getLogger(__name__)


class GraphedForward:
    """A denoiser's `forward` that replays a CUDA graph per input signature (keyword tensors' shapes, dtypes and
    devices, and the other arguments' values). The first call of a signature runs as is (compiling, tuning);
    the second captures (after one warm-up run on a side stream) and every later one copies its tensors into the
    graph's static inputs and replays: no Python and no launches per kernel. Outputs are cloned, so a caller may
    hold one step's output across the next (CFG calls the denoiser twice per step). Anything it cannot key
    (positional tensors, nested containers, tensors off the GPU, `return_dict=True`) runs as is; a failed capture
    turns the graphs off for good (logged), and the stage keeps running compiled."""

    MAX_GRAPHS = 4

    def __init__(self, stage: str, forward: Callable[..., Any]) -> None:
        self.stage = stage
        self.forward = forward
        self.graphs: collections.OrderedDict[tuple[Any, ...], tuple[Any, dict[str, Any], tuple[Any, ...]]] = (
            collections.OrderedDict()
        )
        self.seen: set[tuple[Any, ...]] = set()
        self.broken = False
        self.replays = 0

    @staticmethod
    def _key(kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
        import torch

        if kwargs.get("return_dict", True) is not False:
            return None
        key: list[Any] = []
        for name in sorted(kwargs):
            value = kwargs[name]
            if isinstance(value, torch.Tensor):
                if value.device.type != "cuda":
                    return None
                key.append((name, tuple(value.shape), value.dtype, value.device))
            elif value is None or isinstance(value, (bool, int, float, str)):
                key.append((name, value))
            elif isinstance(value, dict) and not value:
                key.append((name, "{}"))
            else:
                return None
        return tuple(key)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        key = None if self.broken or args or not torch.is_inference_mode_enabled() else self._key(kwargs)
        if key is None:
            return self.forward(*args, **kwargs)
        entry = self.graphs.get(key)
        if entry is None:
            if key not in self.seen:
                if len(self.seen) > 4096:  # bounded: a long-lived stage sees many request shapes
                    self.seen.clear()
                self.seen.add(key)
                return self.forward(**kwargs)
            entry = self._capture(key, kwargs)
            if entry is None:
                return self.forward(**kwargs)
        self.graphs.move_to_end(key)
        graph, static, outputs = entry
        for name, tensor in static.items():
            tensor.copy_(kwargs[name])
        graph.replay()
        self.replays += 1
        return tuple(o.clone() for o in outputs)

    def _capture(self, key: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        import torch

        static = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        plain = {k: v for k, v in kwargs.items() if k not in static}
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.forward(**static, **plain)  # allocations and library handles on the capture's side
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                outputs = self.forward(**static, **plain)
        except Exception as err:  # capture is best effort: the compiled forward still runs
            self.broken = True
            log.warning("stage %s: CUDA graph capture failed, running without graphs: %s", self.stage, err)
            return None
        if not isinstance(outputs, tuple) or not all(isinstance(o, torch.Tensor) for o in outputs):
            self.broken = True
            log.warning("stage %s: the denoiser returned %s, not tensors: no CUDA graphs", self.stage, type(outputs))
            return None
        while len(self.graphs) >= self.MAX_GRAPHS:
            self.graphs.popitem(last=False)  # its memory pool goes with it
        self.graphs[key] = (graph, static, outputs)
        log.info("stage %s: captured a CUDA graph of the denoiser step (%d kept)", self.stage, len(self.graphs))
        return self.graphs[key]
