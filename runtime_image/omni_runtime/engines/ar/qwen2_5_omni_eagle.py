"""vLLM's Qwen2.5-Omni thinker, declared `SupportsEagle3` (registered by `vllm_plugins.register`).

Imported only inside vLLM processes that load a Qwen2.5-Omni checkpoint. `SupportsEagle3`'s default
`set_aux_hidden_state_layers` finds the thinker's `language_model.model` (a Qwen2Model, which is an
`EagleModelMixin`) and makes its forward return the layers asked beside the last hidden state.
"""

from __future__ import annotations

from vllm.model_executor.models.interfaces import SupportsEagle3
from vllm.model_executor.models.qwen2_5_omni_thinker import Qwen2_5OmniThinkerForConditionalGeneration

__all__ = ["Qwen2_5OmniThinkerWithAuxStates"]


class Qwen2_5OmniThinkerWithAuxStates(Qwen2_5OmniThinkerForConditionalGeneration, SupportsEagle3):
    """The same thinker; only the interface flag differs."""
