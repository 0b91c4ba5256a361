"""The video side of the diffusion engine: frame-count and fps checks, and MP4 encoding.

A diffusers video pipeline (its `__call__` takes `num_frames`: Wan, LTX, HunyuanVideo...) returns
`frames` (videos x frames x height x width x 3, floats in [0, 1] with `output_type="np"`); the engine
turns each video into an MP4 file here, in its encoder thread pool, while the next batch runs on
the device.

Why PyAV: it is FFmpeg's libraries bound in-process (no `ffmpeg` executable to find, no pipe, no
temp file), maintained by the FFmpeg-adjacent PyAV project, already installed (vLLM's `[audio]`
extra decodes video parts with it), and its wheels bundle an FFmpeg built with libx264, so H.264
works the same on every machine. Encoding releases the GIL inside FFmpeg, so the event loop and the
device keep going. imageio-ffmpeg would spawn an `ffmpeg` process per video and pipe raw frames in.

Output of a video request: `{"video": mp4 bytes, "format": "mp4", "num_frames": int, "fps": int,
"width": int, "height": int}` (one entry per video in `videos` when a request asks for `n` > 1).
Progress while it runs (non-final outputs): `{"progress": {"steps_done": int, "steps": int}}`.
"""

from __future__ import annotations

import io
import logging
from typing import Any

from omni_runtime.engines.base import InvalidRequest
from omni_runtime.spec.engine_args import VideoArgs

__all__ = ["check_video_params", "encode_mp4", "is_video_pipeline"]

log = logging.getLogger(__name__)


def is_video_pipeline(call_params: set[str] | frozenset[str]) -> bool:
    """Whether a pipeline's `__call__` parameters are those of a video pipeline (it takes `num_frames`)."""
    return "num_frames" in call_params


def temporal_factor(pipe: Any) -> int:
    """How frames map to latent frames: `num_frames - 1` must be a multiple of it (4 for Wan's VAE)."""
    return int(getattr(pipe, "vae_scale_factor_temporal", 1) or 1)


def check_video_params(params: dict[str, Any], stage: str, args: VideoArgs, temporal: int) -> int:
    """Validate `num_frames` in `params` (left there) and pop `fps` (not a pipeline argument); the fps.

    `seconds` (popped too) sets `num_frames`, over a default the stage sets (the router sends one of the
    two, never both): seconds x fps, rounded to what the VAE makes (a multiple of `temporal`), plus the
    first frame."""
    fps = params.pop("fps", None)
    fps = args.default_fps if fps is None else fps
    if isinstance(fps, bool) or not isinstance(fps, int | float) or int(fps) != fps:
        raise InvalidRequest(f"fps must be an integer, not {fps!r}")
    if not 1 <= int(fps) <= args.max_fps:
        raise InvalidRequest(f"fps {fps} is out of range: stage {stage!r} encodes 1 to {args.max_fps} (max_fps)")
    seconds = params.pop("seconds", None)
    if seconds is not None:
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 < seconds <= 3600:
            raise InvalidRequest(f"seconds must be a number above 0 and at most 3600, not {seconds!r}")
        params["num_frames"] = max(1, round(seconds * int(fps) / temporal)) * temporal + 1
    frames = params.get("num_frames")
    if frames is not None:
        if isinstance(frames, bool) or not isinstance(frames, int | float) or int(frames) != frames:
            raise InvalidRequest(f"num_frames must be an integer, not {frames!r}")
        frames = int(frames)
        most = args.max_frames
        if not 1 <= frames <= most:
            raise InvalidRequest(
                f"num_frames {frames} is out of range: stage {stage!r} makes 1 to {most} frames (max_frames); "
                "ask for fewer frames or fewer seconds"
            )
        if temporal > 1 and (frames - 1) % temporal:
            lower = (frames - 1) // temporal * temporal + 1
            raise InvalidRequest(
                f"num_frames {frames} is not allowed: stage {stage!r} needs num_frames - 1 to be a multiple of "
                f"{temporal} (the VAE's temporal factor); use {lower} or {lower + temporal}"
            )
        params["num_frames"] = frames
    return int(fps)


def encode_mp4(frames: Any, fps: int) -> dict[str, Any]:
    """One video (frames x height x width x 3, floats in [0, 1] or uint8) as an H.264 MP4 at `fps`.

    yuv420p (what every player decodes) needs even sides; odd ones are cropped by one pixel.
    """
    import av
    import numpy as np

    array = np.asarray(frames)
    if array.dtype != np.uint8:
        array = (np.clip(array, 0.0, 1.0) * 255.0).round().astype(np.uint8)
    count, height, width = int(array.shape[0]), int(array.shape[1]) // 2 * 2, int(array.shape[2]) // 2 * 2
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=int(fps))
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18", "preset": "veryfast"}
        for frame in array[:, :height, :width]:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return {"video": buf.getvalue(), "format": "mp4", "num_frames": count, "fps": int(fps), "width": width,
            "height": height}  # fmt: skip
