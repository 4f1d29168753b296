"""`Link`: a TCP forwarder on loopback that a test can cut and restore, a network cut between
two services (the regions tests: services/auth/tests/test_regions.py, test_region_shares.py)."""

from __future__ import annotations

import asyncio
import contextlib

from inferplane.testing.loop import LoopThread


class Link:
    """A TCP forwarder on loopback to a port set later (`target`); `cut()` aborts every
    connection and refuses new ones until `restore()`: a network cut between two regions."""

    def __init__(self, loop: LoopThread) -> None:
        self.loop = loop
        self.target: int | None = None
        self.up = True
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._server: asyncio.Server | None = None
        self.port = loop.run(self._start())

    async def _start(self) -> int:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.up or self.target is None:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.transport.abort()
            return
        pair = (writer, up_writer)
        self._pairs.add(pair)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, ConnectionError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._pairs.discard(pair)

    def cut(self) -> None:
        async def _cut() -> None:
            self.up = False
            for a, b in list(self._pairs):
                a.transport.abort()
                b.transport.abort()

        self.loop.run(_cut())

    def restore(self) -> None:
        self.up = True

    def close(self) -> None:
        async def _close() -> None:
            self.cut()
            if self._server is not None:
                self._server.close()

        self.loop.run(_close())
