"""Engine increments that are already buffered go out together (issue 16 B, coalescing).

The pipeline pulls engine output lazily: grpc.aio asks for the next message only once the
previous one is written. With `inproc`, vLLM's output collector merges the DELTA outputs the
consumer has not taken yet, and the HTTP transport merges what one socket read returned, so
a busy writer already gets fewer, fuller increments. vLLM's gRPC stream hands them over one
message per read; `CoalescingEngine` reads ahead in a task and merges what arrived meanwhile.
A consumer that keeps up still gets every increment at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from array import array
from collections.abc import AsyncIterator, Sequence

from inferplane.replica.engines.base import EngineClient, EngineOutput, SamplingParams


def merge_outputs(outputs: Sequence[EngineOutput]) -> EngineOutput:
    """One increment standing for consecutive `outputs`: their token ids in order, the last
    one's counts (cumulative), finish and matched stop."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    ids: list[int] = []
    for out in outputs:
        ids.extend(out.token_ids)
    return EngineOutput(
        token_ids=tuple(ids),
        finished=last.finished,
        finish_reason=last.finish_reason,
        prompt_tokens=max(o.prompt_tokens for o in outputs),
        cached_tokens=max(o.cached_tokens for o in outputs),
        completion_tokens=last.completion_tokens,
        matched_stop=last.matched_stop,
    )


class CoalescingEngine:
    """An `EngineClient` that merges the increments `inner` delivered while the consumer was
    busy (see the module docstring). Errors surface after the increments before them."""

    def __init__(self, inner: EngineClient) -> None:
        self.inner = inner

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[EngineOutput]:
        buffered: list[EngineOutput] = []
        arrived = asyncio.Event()
        ended: list[BaseException | None] = []  # [error or None] once the inner stream ended

        async def read_ahead() -> None:
            try:
                async for out in self.inner.generate(request_id, prompt_token_ids, params):
                    buffered.append(out)
                    arrived.set()
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # handed to the consumer, in order
                ended.append(exc)
            else:
                ended.append(None)
            finally:
                arrived.set()

        reader = asyncio.get_running_loop().create_task(read_ahead())
        try:
            while True:
                if not buffered and not ended:
                    await arrived.wait()
                arrived.clear()
                if buffered:
                    outputs = buffered[:]
                    buffered.clear()
                    yield merge_outputs(outputs)
                    continue
                if ended:
                    if ended[0] is not None:
                        raise ended[0]
                    return
        finally:
            if not reader.done():
                # Closing the inner stream mid-way aborts the request (EngineClient contract).
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader

    async def embed(
        self, request_id: str, inputs: Sequence[Sequence[int]], *, dimensions: int | None = None
    ) -> list[array[float]]:
        return await self.inner.embed(request_id, inputs, dimensions=dimensions)

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    async def healthy(self) -> bool:
        return await self.inner.healthy()

    async def close(self) -> None:
        await self.inner.close()
