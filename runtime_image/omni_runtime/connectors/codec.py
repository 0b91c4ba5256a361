"""Payload codec: msgpack for the structure, raw frames for tensors.

`encode_payload` returns a msgpack header plus a list of frames; each frame is a zero-copy
`memoryview` of one tensor's bytes (a copy only for non-contiguous or non-CPU tensors). Tensors
sit in the header as msgpack extension values carrying dtype, shape and frame index, so the same
encoding works for ZeroMQ multipart messages, shared-memory blocks and Mooncake objects.

`decode_payload` builds tensors as views of the frames it is given (no copy) when the frames are
writable; read-only frames (such as `bytes`) are copied so every tensor it returns is writable.

Top-level `bytes` values of 64 KiB or more also travel as frames, so large audio or image files
are not copied into the header.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

__all__ = ["ALIGN", "decode_payload", "encode_payload", "frame_offsets", "payload_nbytes", "size_class"]

ALIGN = 64
"""Frames placed in one buffer (shm block, Mooncake object) start at multiples of this."""

_EXT_TORCH = 1
_EXT_NUMPY = 2
_EXT_NUMPY_SCALAR = 3
_EXT_BYTES = 4
_OOB_BYTES_MIN = 64 * 1024
_MIN_CLASS = 64 * 1024

_meta_encoder = msgspec.msgpack.Encoder()
_meta_decoder = msgspec.msgpack.Decoder()


class _OutOfBand:
    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def encode_payload(payload: Mapping[str, Any]) -> tuple[bytes, list[memoryview]]:
    """Encode `payload` into a msgpack header and raw frames (one per tensor or large bytes value)."""
    if not isinstance(payload, Mapping):
        raise TypeError(f"payload must be a mapping of str to values, got {type(payload).__name__}")
    frames: list[memoryview] = []
    torch = sys.modules.get("torch")  # a tensor can only exist if torch was imported

    def enc_hook(obj: Any) -> Any:
        if torch is not None and isinstance(obj, torch.Tensor):
            return _torch_ext(obj, frames, torch)
        if isinstance(obj, np.ndarray):
            return _numpy_ext(obj, frames, _EXT_NUMPY)
        if isinstance(obj, np.generic):
            return _numpy_ext(np.asarray(obj), frames, _EXT_NUMPY_SCALAR)
        if isinstance(obj, _OutOfBand):
            frames.append(memoryview(obj.data).cast("B"))
            return msgspec.msgpack.Ext(_EXT_BYTES, _meta_encoder.encode(len(frames) - 1))
        raise TypeError(
            f"payload value of type {type(obj).__module__}.{type(obj).__qualname__} is not supported; "
            "use tensors, numpy arrays, bytes, str, int, float, bool, None, or lists/dicts of those"
        )

    top = {k: _OutOfBand(v) if type(v) is bytes and len(v) >= _OOB_BYTES_MIN else v for k, v in payload.items()}
    header = msgspec.msgpack.Encoder(enc_hook=enc_hook).encode(top)
    return header, frames


def decode_payload(header: bytes | memoryview, frames: Sequence[Any]) -> dict[str, Any]:
    """Rebuild the payload; tensors are views of writable `frames` (copies of read-only ones)."""

    def ext_hook(code: int, data: memoryview) -> Any:
        meta = _meta_decoder.decode(data)
        if code == _EXT_BYTES:
            return bytes(frames[meta])
        index, dtype, shape = meta
        if code == _EXT_TORCH:
            return _torch_from(frames[index], dtype, shape)
        if code in (_EXT_NUMPY, _EXT_NUMPY_SCALAR):
            array = _numpy_from(frames[index], dtype, shape)
            return array[()] if code == _EXT_NUMPY_SCALAR else array
        raise ValueError(f"payload header has unknown extension type {code}; encoder and decoder differ")

    return msgspec.msgpack.Decoder(ext_hook=ext_hook).decode(header)


def frame_offsets(layout: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of header and frames packed into one buffer, each aligned to ALIGN; and the total size.

    `layout` is the header length followed by each frame's length."""
    offsets = []
    end = 0
    for size in layout:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + size
    return offsets, end


def size_class(n: int) -> int:
    """Pooled buffer size for `n` bytes: 64 KiB at least, then 8 steps per power of two (at most
    12.5% slack), so buffers of nearby sizes are reused for each other."""
    if n <= _MIN_CLASS:
        return _MIN_CLASS
    step = max(1 << ((n - 1).bit_length() - 3), _MIN_CLASS)
    return -(-n // step) * step


def payload_nbytes(header: bytes, frames: Sequence[memoryview]) -> int:
    return len(header) + sum(f.nbytes for f in frames)


def _torch_ext(tensor: Any, frames: list[memoryview], torch: Any) -> msgspec.msgpack.Ext:
    t = tensor.detach()
    if t.layout is not torch.strided or t.is_quantized or t.is_nested:
        raise TypeError(f"only dense tensors can travel between stages, got layout {t.layout}")
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy()
    frames.append(memoryview(raw))
    dtype = str(t.dtype).removeprefix("torch.")
    return msgspec.msgpack.Ext(_EXT_TORCH, _meta_encoder.encode((len(frames) - 1, dtype, list(t.shape))))


def _numpy_ext(array: np.ndarray, frames: list[memoryview], code: int) -> msgspec.msgpack.Ext:
    if array.dtype.hasobject or array.dtype.fields is not None:
        raise TypeError(f"numpy arrays of dtype {array.dtype} cannot travel; use plain numeric dtypes")
    a = array if array.flags.c_contiguous else array.copy(order="C")  # (ascontiguousarray makes 0-d 1-d)
    frames.append(a.reshape(-1).view(np.uint8).data)
    return msgspec.msgpack.Ext(code, _meta_encoder.encode((len(frames) - 1, a.dtype.str, list(a.shape))))


def _writable(frame: Any) -> Any:
    view = memoryview(frame)
    return bytearray(view) if view.readonly else view


def _torch_from(frame: Any, dtype_name: str, shape: list[int]) -> Any:
    import torch

    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"payload has tensor dtype {dtype_name!r}, which this torch does not know")
    if memoryview(frame).nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(_writable(frame), dtype=dtype).reshape(shape)


def _numpy_from(frame: Any, dtype_str: str, shape: list[int]) -> np.ndarray:
    dtype = np.dtype(dtype_str)
    if memoryview(frame).nbytes == 0:
        return np.empty(shape, dtype=dtype)
    return np.frombuffer(_writable(frame), dtype=dtype).reshape(shape)
