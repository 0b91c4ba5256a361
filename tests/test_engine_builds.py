"""Two engines of one process never build their models at the same moment (`engines.common.one_build_at_a_time`).

`omnikube serve` starts every stage of a pipeline in one process. diffusers' and transformers' loaders build
modules under accelerate's `init_empty_weights`, which patches `nn.Module.register_parameter` for every thread;
a model built in another thread meanwhile got its parameters on the meta device, and the stage failed to load
with "Cannot copy out of meta tensor" (seen in CI: GLM-Image's AR and DiT loading side by side)."""

from __future__ import annotations

import threading

import pytest
import torch
from accelerate import init_empty_weights

from omni_runtime.engines.common import one_build_at_a_time


def test_a_model_built_while_another_loads_under_empty_weights_gets_real_parameters() -> None:
    inside = threading.Event()

    @one_build_at_a_time
    def diffusers_like_load() -> None:
        with init_empty_weights():
            inside.set()
            # Long enough for the other build to run inside the patch if nothing held it back.
            threading.Event().wait(0.5)

    @one_build_at_a_time
    def talker_like_build() -> torch.nn.Linear:
        return torch.nn.Linear(4, 4)

    loader = threading.Thread(target=diffusers_like_load)
    loader.start()
    assert inside.wait(10)
    built = talker_like_build()
    loader.join()
    assert not built.weight.is_meta
    assert torch.isfinite(built.weight).all()


def test_a_build_that_raises_lets_the_next_one_run() -> None:
    @one_build_at_a_time
    def broken() -> None:
        raise OSError("no weights here")

    with pytest.raises(OSError, match="no weights"):
        broken()
    done = threading.Event()
    threading.Thread(target=one_build_at_a_time(done.set)).start()
    assert done.wait(10)
