"""A TCP/unix byte relay shared by the runner and the pod agent.

The agent runs with `python -E -s -S`, so this module must not import anything outside the standard library.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

__all__ = ["relay"]

Connect = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, connect: Connect) -> None:
    """Open the upstream with `connect()` and copy bytes both ways until either side closes; a client
    whose upstream cannot be reached is disconnected."""
    try:
        up_reader, up_writer = await connect()
    except OSError:
        writer.close()
        return
    await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer), return_exceptions=True)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()
