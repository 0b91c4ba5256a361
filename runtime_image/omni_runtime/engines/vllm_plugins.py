"""vLLM plugins of omnikube, loaded in every vLLM process through the `vllm.general_plugins` entry point.

vLLM's engine core is a spawned process, so registering a model in the stage process is not enough:
vLLM calls `load_general_plugins()` in each of its processes, which runs every `vllm.general_plugins`
entry point (ours: `omnikube = omni_runtime.engines.vllm_plugins:register`, in pyproject.toml; an
editable install must be re-installed to pick it up).

`register` makes vLLM's Qwen2.5-Omni thinker `SupportsEagle3` (same class, same weights, same
outputs), which the hidden-state route (`extract_hidden_states`, see `hidden_states`) needs: vLLM
refuses it otherwise ("Model does not support EAGLE3 interface"). Its language model (a Qwen2Model)
already captures auxiliary hidden states; only the interface flag was missing. Registered lazily by
name, so the model module is imported only by a process that loads that architecture.
"""

from __future__ import annotations

__all__ = ["ENTRY_POINT", "QWEN2_5_OMNI_ARCHITECTURES", "WRAPPER", "entry_point_installed", "register"]

ENTRY_POINT = "omnikube"
"""Our name in the `vllm.general_plugins` entry-point group."""

QWEN2_5_OMNI_ARCHITECTURES = ("Qwen2_5OmniModel", "Qwen2_5OmniForConditionalGeneration")
"""The architecture names vLLM maps to its Qwen2.5-Omni thinker."""

WRAPPER = "omni_runtime.engines.qwen2_5_omni_eagle:Qwen2_5OmniThinkerWithAuxStates"


def register() -> None:
    """Register the Eagle3-capable Qwen2.5-Omni thinker under the architectures vLLM maps to it."""
    from vllm import ModelRegistry

    for arch in QWEN2_5_OMNI_ARCHITECTURES:
        ModelRegistry.register_model(arch, WRAPPER)


def entry_point_installed() -> bool:
    """Whether this installation exposes `register` to vLLM (the package metadata has the entry point)."""
    from importlib.metadata import entry_points

    return any(ep.name == ENTRY_POINT for ep in entry_points(group="vllm.general_plugins"))
