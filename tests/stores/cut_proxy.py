"""A TCP proxy in front of Redis that drops every connection once a byte budget is spent: the
store's connection dies at a chosen moment of what it sends (mid-command, between commands), or
of what Redis answers (``reply_left``: the command ran, its reply is lost)."""

from __future__ import annotations

import asyncio
import contextlib


class CutProxy:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.left: int | None = None  # bytes to forward towards Redis before every connection drops
        self.reply_left: int | None = None  # bytes to forward from Redis before every connection drops
        self.cuts = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        self.drop()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def drop(self) -> None:
        for w in list(self._writers):
            with contextlib.suppress(Exception):
                w.transport.abort()
        self._writers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.CancelledError, OSError):  # (the proxy closing under it)
            await self._pipe_both(reader, writer)

    async def _pipe_both(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(self.host, self.port)
        self._writers |= {writer, up_w}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, budget: str) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    left = getattr(self, budget)
                    if left is not None:
                        if len(data) >= left:
                            dst.write(data[:left])
                            setattr(self, budget, None)
                            self.cuts += 1
                            self.drop()
                            return
                        setattr(self, budget, left - len(data))
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(Exception):
                dst.transport.abort()

        await asyncio.gather(pipe(reader, up_w, "left"), pipe(up_r, writer, "reply_left"))
