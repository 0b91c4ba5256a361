"""The stage's PNG encoder (`omni_runtime.engines.diffusion.png`): pieces deflated on several threads make
one valid PNG.

Every PNG is read back with Pillow (which checks each chunk's CRC) and its zlib stream with `zlib.decompress`
(which checks the Adler-32): the pixels must be the image's, exactly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from omni_runtime.engines.diffusion import png as PNG


def _photo_like(h: int, w: int, channels: int, seed: int = 0) -> np.ndarray:
    """Smooth gradients with a little grain: what a diffusion model draws, for compression figures."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    waves = [np.sin(xx * 7 + yy * 3 + c) for c in range(channels)]
    image = (np.stack(waves, -1) * 0.45 + 0.5) * 255 + rng.normal(0, 2, (h, w, channels))
    return image.clip(0, 255).astype(np.uint8)


def _encode(image: Image.Image, piece_bytes: int = PNG.PIECE_BYTES, level: int = 1) -> bytes:
    async def run() -> bytes:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            return await PNG.encode(image, pool, level, piece_bytes)

    return asyncio.run(run())


def _idat(data: bytes) -> bytes:
    """The concatenated IDAT payloads of a PNG file: its zlib stream."""
    pos, out = 8, b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        if data[pos + 4 : pos + 8] == b"IDAT":
            out += data[pos + 8 : pos + 8 + length]
        pos += 12 + length
    return out


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA"])
@pytest.mark.parametrize(
    ("width", "height", "piece_bytes"), [(1, 1, 7), (7, 3, 5), (640, 480, 4096), (1024, 1024, None)]
)
def test_pieces_make_a_png_with_the_images_exact_pixels(mode: str, width: int, height: int, piece_bytes: int | None):
    """Pieces far smaller than a row, cut mid-row, and the default size: Pillow reads the same pixels back, and
    the stream's Adler-32 (combined from the pieces') is the one zlib computes."""
    pixels = _photo_like(height, width, len(mode), seed=width)
    image = Image.fromarray(pixels.squeeze(-1) if mode == "L" else pixels, mode)
    data = _encode(image, piece_bytes or PNG.PIECE_BYTES)
    with Image.open(io.BytesIO(data)) as back:
        back.load()
        assert back.mode == mode and back.size == (width, height)
        assert np.array_equal(np.asarray(back), np.asarray(image))
    zlib.decompress(_idat(data))  # raises on a wrong Adler-32


def test_a_mode_it_does_not_write_goes_to_pillow():
    """Palette and 16-bit images: Pillow's own encoder, the same colours back (Pillow may renumber a palette)."""
    palette = Image.fromarray(_photo_like(17, 33, 3)).convert("P")
    for image in (palette, Image.fromarray(np.arange(33 * 17, dtype=np.uint16).reshape(17, 33))):
        assert PNG.plan(image) is None
        with Image.open(io.BytesIO(_encode(image))) as back:
            if image.mode == "P":
                assert back.convert("RGB") == image.convert("RGB")
            else:
                assert back.tobytes() == image.tobytes()


def test_the_pieces_compress_about_as_one_stream_does():
    """Each piece is primed with the 32 KiB before it, so cutting costs almost no size: within 3% of the same
    filtered bytes deflated in one piece, and no larger than Pillow's file at its default level (6)."""
    image = Image.fromarray(_photo_like(1024, 1024, 3))
    pieces = len(_encode(image))
    whole = len(_encode(image, piece_bytes=1 << 30))
    assert pieces <= 1.03 * whole, (pieces, whole)
    assert pieces <= 1.01 * len(PNG.encode_pillow(image, 6))


def test_flat_areas_compress_to_little():
    """A flat image with a few shapes: the run-length strategy still makes a small file (well under 1/20 of the
    raw pixels)."""
    pixels = np.full((512, 512, 3), 235, np.uint8)
    pixels[100:300, 50:400] = (200, 30, 30)
    pixels[350:500, 200:260] = (10, 90, 200)
    data = _encode(Image.fromarray(pixels))
    assert len(data) < pixels.nbytes / 20, len(data)


@pytest.mark.parametrize("sizes", [(0, 5), (5, 0), (1, 1), (65521, 3), (70000, 200000), (1000, 65520)])
def test_adler32_combine_matches_zlib(sizes: tuple[int, int]):
    rng = np.random.default_rng(sum(sizes))
    a, b = (rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes)
    assert PNG.adler32_combine(zlib.adler32(a), zlib.adler32(b), len(b)) == zlib.adler32(a + b)


def test_an_image_no_png_can_hold_fails_with_pillows_reason():
    """A 32-bit float image (mode F) has no PNG form: the encode raises Pillow's error naming the mode, which the
    engine turns into the batch's error (it never returns a broken file)."""
    with pytest.raises(OSError, match="mode F"):
        _encode(Image.new("F", (8, 8), 0.5))
