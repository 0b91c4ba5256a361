"""The latencies of one request, observed as its final outputs arrive: TTFT, TTFP, TPOT, RTF and the
seconds of audio it produced (the seed's serving metric vocabulary)."""

from __future__ import annotations

import time

from omni_runtime.metrics import Router as M
from omni_runtime.router.orchestrator import StageEvent
from omni_runtime.wire.audio import audio_seconds

__all__ = ["RequestClock"]


class RequestClock:
    """TTFT, TTFP, TPOT, RTF and audio seconds for one request."""

    def __init__(self, pipeline: str, endpoint: str) -> None:
        self.pipeline = pipeline
        self.endpoint = endpoint
        self.start = time.monotonic()
        self.first_token: float | None = None
        self.first_packet: set[str] = set()
        self.audio_seconds = 0.0

    def saw(self, event: StageEvent) -> None:
        now = time.monotonic()
        data = event.data or {}
        if event.modality == "text":
            if self.first_token is None and data.get("text"):
                self.first_token = now
                M.ttft.labels(self.pipeline).observe(now - self.start)
            return
        seconds = audio_seconds(data)
        self.audio_seconds += seconds
        media = seconds > 0 if event.modality == "audio" else bool(data)
        if media and event.modality not in self.first_packet:
            self.first_packet.add(event.modality)
            M.ttfp.labels(self.pipeline, event.modality).observe(now - self.start)

    def done(self, completion_tokens: int) -> None:
        now = time.monotonic()
        if self.first_token is not None and completion_tokens > 1:
            M.tpot.labels(self.pipeline).observe((now - self.first_token) / (completion_tokens - 1))
        if self.audio_seconds > 0:
            M.audio_seconds.labels(self.pipeline, self.endpoint).inc(self.audio_seconds)
            M.rtf.labels(self.pipeline, self.endpoint).observe((now - self.start) / self.audio_seconds)
