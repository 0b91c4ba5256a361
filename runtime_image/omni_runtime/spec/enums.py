"""Closed vocabularies shared by the pipeline spec, the CRDs and the runtime."""

from __future__ import annotations

from enum import Enum

__all__ = [
    "CONTEXT_ONLY_PROCESSORS",
    "GRID_DECIDING_PROCESSORS",
    "INPUT_PROCESSORS",
    "Modality",
    "MooncakeMode",
    "MooncakeProtocol",
    "StageKind",
]


class StageKind(str, Enum):
    """Which engine family runs a stage."""

    AR = "ar"
    """Autoregressive language model on vLLM (thinker, talker, prompt enhancer)."""
    DIFFUSION = "diffusion"
    """Diffusion pipeline on diffusers (DiT + VAE)."""
    GENERATION = "generation"
    """Non-autoregressive module run chunk by chunk (codec-to-waveform, VAE decode)."""


class MooncakeProtocol(str, Enum):
    """Transport Mooncake's transfer engine uses between pods."""

    TCP = "tcp"
    RDMA = "rdma"


class MooncakeMode(str, Enum):
    """How the `mooncake` connector moves a payload between pods."""

    P2P = "p2p"
    """Transfer Engine peer to peer: the consumer reads straight from the producer's registered memory
    (one transfer, no master round trip); only the metadata server is needed."""
    STORE = "store"
    """Mooncake Store: each payload is an object placed by the master (two master round trips per put,
    one per get and per release); objects may live in any stage's segment."""


class Modality(str, Enum):
    """Kinds of data a stage consumes or produces."""

    TEXT = "text"
    IMAGE = "image"
    AUDIO = "audio"
    VIDEO = "video"
    HIDDEN = "hidden"
    """Internal tensors (hidden states, codec tokens, latents): never returned to a client."""


INPUT_PROCESSORS: dict[str, str] = {
    "identity": "Pass the upstream output through unchanged.",
    "ar_text_to_prompt": "Use the upstream AR stage's generated text as the downstream prompt "
    "(prompt enhancer -> diffusion), keeping CFG companions paired.",
    "thinker_to_talker": "Feed the thinker's hidden states and tokens to the talker (Qwen-Omni).",
    "talker_to_code2wav": "Feed the talker's codec tokens to the code-to-waveform module in chunks.",
    "dit_to_vae": "Feed diffusion latents to a separate VAE decode stage.",
    "ar_kv_to_bagel": "Hand the AR stage's KV cache of the primary context and of each CFG companion to BAGEL's "
    "generation stage (AR -> DiT over KV).",
    "glm_ar_to_dit": "Hand GLM-Image's AR image tokens (upsampled to the DiT's grid) to its DiT as prior tokens, "
    "with the prompt and, for i2i, the input picture (AR -> DiT over tokens).",
}
"""Named transforms applied to an upstream output before the downstream stage sees it.

The runtime registers one implementation per name; a test checks the two lists agree."""

CONTEXT_ONLY_PROCESSORS: frozenset[str] = frozenset({"ar_kv_to_bagel"})
"""Input processors that read only the upstream AR stage's context (its KV cache after prefill), never text it
generates: a request whose every planned edge out of an AR stage has one of these runs that stage's prefill
alone (`Submit.context_only`)."""

GRID_DECIDING_PROCESSORS: frozenset[str] = frozenset({"glm_ar_to_dit"})
"""Input processors whose source (a generation stage) decides the image's token grid, so the DiT draws the size the
source chose (GLM-Image's AR samples the grid of VQ codes): the router gives that source the request's image
`seed`, `width` and `height`."""
