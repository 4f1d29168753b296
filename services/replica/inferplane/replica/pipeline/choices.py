"""Several choices of one request (`n` > 1): their generations run at once, their steps merged.

OpenAI's `n` asks for n independent completions of the same prompt. Each is its own engine
request (the engine's prefix cache serves the shared prompt after the first prefill), with the
seed + i when the request is seeded so that choices differ yet repeat; `merged_steps` yields
their steps as they come, tagged with the choice index. With one choice it is the generation's
own iteration, no task or queue (the single-choice path costs what it cost before).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

from inferplane.replica.pipeline.generate import Generation, Step

# Steps buffered per choice before a fast choice waits for the client (back-pressure).
_QUEUE_PER_CHOICE = 8


async def merged_steps(gens: Sequence[Generation]) -> AsyncIterator[tuple[int, Step]]:
    """`(choice index, step)` of every generation in `gens` (index = position), each choice's
    steps in order, choices interleaved as they arrive.

    Raises:
        InferplaneError: the first choice's failure (`Generation.steps`); the others are then
            cancelled, which aborts them in the engine. Closing the iteration cancels them too.
    """
    if len(gens) == 1:
        async with aclosing(gens[0].steps()) as steps:
            async for step in steps:
                yield 0, step
        return
    queue: asyncio.Queue[tuple[int, Step | BaseException | None]] = asyncio.Queue(
        _QUEUE_PER_CHOICE * len(gens)
    )

    async def pump(index: int, gen: Generation) -> None:
        try:
            async with aclosing(gen.steps()) as steps:
                async for step in steps:
                    await queue.put((index, step))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await queue.put((index, exc))
            return
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, gen)) for i, gen in enumerate(gens)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def seed_of_choice(seed: int | None, index: int) -> int | None:
    """The seed of choice `index`: the request's seed + index (None stays None), so that
    seeded choices differ from each other and repeat from one request to the next."""
    return None if seed is None else seed + index
