"""vLLM plugins of omnikube, loaded in every vLLM process through the `vllm.general_plugins` entry point.

vLLM's engine core is a spawned process, so registering a model in the stage process is not enough:
vLLM calls `load_general_plugins()` in each of its processes, which runs every `vllm.general_plugins`
entry point (ours: `omnikube = omni_runtime.engines.ar.vllm_plugins:register`, in pyproject.toml; an
editable install must be re-installed to pick it up).

`register` makes vLLM's Qwen2.5-Omni thinker `SupportsEagle3` (same class, same weights, same
outputs), which the hidden-state route (`extract_hidden_states`, see `hidden_states`) needs: vLLM
refuses it otherwise ("Model does not support EAGLE3 interface"). Its language model (a Qwen2Model)
already captures auxiliary hidden states; only the interface flag was missing. Registered lazily by
name, so the model module is imported only by a process that loads that architecture.

It also fixes, on a CPU build without Triton's CPU backend, vLLM's C++ stand-in for the rejection
sampler's `expand_kernel` (`vllm.utils.cpu_triton_utils._expand_kernel_impl`, see `expand_kernel`),
which the hidden-state route reaches on every sampled (temperature > 0) request.

And on a CPU with AMX it asks Linux for the AMX tile state (`request_amx_tiles`), which vLLM's CPU
attention uses without asking for it.
"""

from __future__ import annotations

import logging

import torch

__all__ = [
    "ENTRY_POINT",
    "EXPAND_FIX_VLLM_VERSION",
    "QWEN2_5_OMNI_ARCHITECTURES",
    "WRAPPER",
    "entry_point_installed",
    "expand_kernel",
    "install_cpu_expand_fix",
    "register",
    "request_amx_tiles",
]

log = logging.getLogger(__name__)

ENTRY_POINT = "omnikube"
"""Our name in the `vllm.general_plugins` entry-point group."""

QWEN2_5_OMNI_ARCHITECTURES = ("Qwen2_5OmniModel", "Qwen2_5OmniForConditionalGeneration")
"""The architecture names vLLM maps to its Qwen2.5-Omni thinker."""

WRAPPER = "omni_runtime.engines.ar.qwen2_5_omni_eagle:Qwen2_5OmniThinkerWithAuxStates"

EXPAND_FIX_VLLM_VERSION = "0.32.0"
"""The vLLM whose CPU `_expand_kernel_impl` is broken and replaced by `expand_kernel`."""


def register() -> None:
    """Register the Eagle3-capable Qwen2.5-Omni thinker under the architectures vLLM maps to it, and
    on CPU without Triton replace vLLM's broken expand stand-in (`install_cpu_expand_fix`)."""
    from vllm import ModelRegistry

    for arch in QWEN2_5_OMNI_ARCHITECTURES:
        ModelRegistry.register_model(arch, WRAPPER)
    install_cpu_expand_fix()
    request_amx_tiles()


def request_amx_tiles() -> bool:
    """Ask Linux for this process's AMX tile state when the CPU has AMX; True when it is granted.

    Why: vLLM's CPU attention (`cpu_attn._get_attn_isa`) runs its AMX kernel for bfloat16 whenever
    torch reports AMX tiles, but never asks for them, and Linux (>= 5.16) hands a process the tile
    state only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`). torch's oneDNN
    asks only once it picks AMX for a matmul of its own, which a small model's matmuls never do, so
    the first attention call dies of SIGILL and the stage reports that vLLM's EngineCore "exited
    unexpectedly". The permission is per process and this runs in each vLLM process (the plugin
    entry point), before any forward. A CPU without AMX is left as it is.
    """
    if not torch.cpu._is_amx_tile_supported():
        return False
    granted = bool(torch._C._cpu._init_amx())
    if not granted:
        log.warning("the CPU has AMX but Linux refused its tile state; vLLM's bfloat16 CPU attention will fail")
    return granted


def expand_kernel(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: float,
    replace_to: float,
    MAX_NUM_TOKENS: int | None = None,  # noqa: N803 -- the Triton kernel's parameter name
) -> None:
    """Pure-torch `vllm.v1.sample.rejection_sampler.expand_kernel`: `output[cu[i-1]:cu[i]] = input_val[i]`,
    with `replace_from` values written as `replace_to`.

    Why it exists: vLLM 0.32's CPU stand-in (`cpu_triton_utils._expand_kernel_impl`) converts `output`
    to int64 -- a copy for the float32 temperatures and top_p and the int32 top_k it is given -- and never
    copies the result back, and truncates the float input (temperature 0.4 becomes 0). The expanded
    tensors stay uninitialised memory, so the first sampled request of a speculative-decoding engine (our
    hidden-state route) kills vLLM's EngineCore (`index ... is out of bounds` in top-k/top-p). Greedy
    batches never call it (`apply_sampling_constraints` returns early when all are greedy).
    Delete it when the vLLM pinned here expands correctly (tests/test_hidden_states.py checks both).
    """
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()].copy_(expanded)


def install_cpu_expand_fix() -> bool:
    """Point vLLM's CPU kernel stand-ins at `expand_kernel` when this process runs vLLM on CPU without
    Triton; whether it did. vLLM registers the stand-ins after loading plugins (`WorkerWrapperBase.
    init_worker`), reading them from `vllm.utils.cpu_triton_utils` then, so replacing the module
    attribute here is enough.

    Raises RuntimeError on another vLLM version: its stand-in may be fixed or changed, check and update."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON or not current_platform.is_cpu():
        return False
    import vllm
    from vllm.utils import cpu_triton_utils

    if vllm.__version__ != EXPAND_FIX_VLLM_VERSION or not hasattr(cpu_triton_utils, "_expand_kernel_impl"):
        raise RuntimeError(
            f"omnikube replaces vLLM {EXPAND_FIX_VLLM_VERSION}'s CPU expand_kernel stand-in "
            f"(vllm.utils.cpu_triton_utils._expand_kernel_impl), but this is vLLM {vllm.__version__}; "
            "check whether its stand-in still drops the result (tests/test_hidden_states.py), then update "
            "or delete omni_runtime.engines.ar.vllm_plugins.install_cpu_expand_fix"
        )
    cpu_triton_utils._expand_kernel_impl = expand_kernel
    log.debug("vLLM's CPU expand_kernel stand-in replaced by %s.expand_kernel", __name__)
    return True


def entry_point_installed() -> bool:
    """Whether this installation exposes `register` to vLLM (the package metadata has the entry point)."""
    from importlib.metadata import entry_points

    return any(ep.name == ENTRY_POINT for ep in entry_points(group="vllm.general_plugins"))
