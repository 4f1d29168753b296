"""A small, honest model of an engine's KV cache for the fake engines (issue 29): the replica's
`ScriptedEngine` and `fake_http_engine` run their generations through it, so a replica on a
fake engine reports KV capacity, the engine's queue and preemptions as vLLM would.

The rules (vLLM's scheduler, simplified; no prefix sharing):
- the cache has `total_kv_blocks` blocks of `block_size` tokens; a running request holds
  `ceil((prompt + generated) / block_size)` blocks (`inferplane.kvblocks.blocks_needed`);
- a request waits (FIFO, `waiting_requests`) until its prompt's blocks are free, and runs then;
- a running request that needs one more block for its next token and finds none free preempts
  the request admitted last (its blocks are freed, it goes back to the head of the queue, and
  resumes, recomputing, when its blocks are free again): `preemptions_total` + 1;
- a request that could never fit (`prompt + max_tokens` over the whole cache) is refused at
  once (`ValueError`), as vLLM refuses a context longer than its cache holds.
"""

from __future__ import annotations

import asyncio
import dataclasses

from inferplane import kvblocks


@dataclasses.dataclass(slots=True)
class _Sequence:
    rid: str
    tokens: int  # prompt + generated so far
    held: int = 0
    running: bool = False
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


class FakeKvCache:
    """The KV cache model (see the module doc). Single event loop, no threads.

    Args:
        total_kv_blocks: blocks in all (> 0).
        block_size: tokens per block (> 0).
    """

    def __init__(self, total_kv_blocks: int, block_size: int = 16) -> None:
        if total_kv_blocks <= 0 or block_size <= 0:
            raise ValueError("total_kv_blocks and block_size must be positive")
        self.total_kv_blocks = total_kv_blocks
        self.block_size = block_size
        self.preemptions_total = 0
        self._free = total_kv_blocks
        self._running: dict[str, _Sequence] = {}  # in admission order
        self._waiting: list[_Sequence] = []

    @property
    def free_kv_blocks(self) -> int:
        return self._free

    @property
    def running_requests(self) -> int:
        return len(self._running)

    @property
    def waiting_requests(self) -> int:
        return len(self._waiting)

    def _need(self, tokens: int) -> int:
        return kvblocks.blocks_needed(tokens, self.block_size)

    async def start(self, rid: str, prompt_tokens: int, max_tokens: int) -> None:
        """Queues a request and returns once it runs (its prompt's blocks held).

        Raises:
            ValueError: `prompt_tokens + max_tokens` can never fit in the cache.
        """
        if self._need(prompt_tokens + max_tokens) > self.total_kv_blocks:
            raise ValueError(
                f"a context of {prompt_tokens + max_tokens} tokens exceeds the KV cache "
                f"({self.total_kv_blocks} blocks of {self.block_size} tokens)"
            )
        seq = _Sequence(rid, prompt_tokens)
        self._waiting.append(seq)
        self._schedule()
        await self._until_running(seq)

    async def step(self, rid: str) -> None:
        """Makes room for `rid`'s next token (preempting the last admitted other request when
        no block is free), waiting first when `rid` itself was preempted."""
        seq = self._seq(rid)
        await self._until_running(seq)
        need = self._need(seq.tokens + 1)
        while need > seq.held:
            if self._free:
                self._free -= 1
                seq.held += 1
                continue
            victim = next((s for s in reversed(self._running.values()) if s is not seq), None)
            if victim is None:  # cannot happen: `start` refused what could not fit alone
                raise RuntimeError(f"request {rid} does not fit in the KV cache")
            self._preempt(victim)
        seq.tokens += 1

    def finish(self, rid: str) -> None:
        """The request ended (finished, aborted or failed): its blocks are freed."""
        seq = self._running.pop(rid, None)
        if seq is None:
            for i, waiting in enumerate(self._waiting):
                if waiting.rid == rid:
                    del self._waiting[i]
                    break
            self._schedule()
            return
        self._free += seq.held
        seq.held = 0
        self._schedule()

    def _seq(self, rid: str) -> _Sequence:
        seq = self._running.get(rid)
        if seq is not None:
            return seq
        for waiting in self._waiting:
            if waiting.rid == rid:
                return waiting
        raise KeyError(rid)

    def _preempt(self, victim: _Sequence) -> None:
        del self._running[victim.rid]
        self._free += victim.held
        victim.held = 0
        victim.running = False
        victim.wake.clear()
        self._waiting.insert(0, victim)
        self.preemptions_total += 1

    def _schedule(self) -> None:
        while self._waiting:
            head = self._waiting[0]
            need = self._need(head.tokens)
            if need > self._free:
                return
            self._waiting.pop(0)
            self._free -= need
            head.held = need
            head.running = True
            self._running[head.rid] = head
            head.wake.set()

    async def _until_running(self, seq: _Sequence) -> None:
        while not seq.running:
            try:
                await seq.wake.wait()
            except asyncio.CancelledError:
                self.finish(seq.rid)
                raise
