"""The edges between stages: what each edge's payload is (`payloads`) and the processor that turns one stage's
output into the next stage's input (`edges`).

Below the engines and the wire (import-linter's layers): it imports only the spec, so engines, the stage
server and the router may all read the payload kinds."""

from omni_runtime.processors.edges import (
    PROCESSORS,
    Processor,
    ProcessorContext,
    ProcessorError,
    apply_processor,
    ar_text_to_prompt,
    dit_to_vae,
    identity,
    talker_to_code2wav,
    thinker_to_talker,
)

__all__ = [
    "PROCESSORS",
    "Processor",
    "ProcessorContext",
    "ProcessorError",
    "apply_processor",
    "ar_text_to_prompt",
    "dit_to_vae",
    "identity",
    "talker_to_code2wav",
    "thinker_to_talker",
]
