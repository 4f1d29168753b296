"""vLLM's KV events → the replica's KV blocks by content hash (issue 29).

vLLM's scheduler publishes what its prefix cache holds as `KVEventBatch`es over ZeroMQ
(`vllm/distributed/kv_events.py`): `BlockStored` (engine block hashes, the parent's engine hash,
the blocks' token ids, block size, LoRA name), `BlockRemoved` (engine hashes) and
`AllBlocksCleared`. Engine hashes are seeded per process (unless `PYTHONHASHSEED` is fixed), so
no router can recompute them: `KvBlockIndex` keeps engine hash → content hash
(`inferplane.kvblocks.chain`: the block's token ids, its adapter, its parent's content hash) and
hands the state stream content hashes only.

- `KvBlockIndex`: the translation and the set of cached blocks (bounded: at most `capacity`
  entries, the engine's block count; past it the oldest entry is dropped and reported removed),
  the delta since the last `take_delta` (netted: a block stored then evicted in one interval is
  in neither list), `snapshot` for a new watcher. A block whose parent is unknown (its
  translation was never seen or was dropped), whose size is not the index's block size, or
  whose hash depends on more than its tokens and adapter (multimodal inputs, a cache salt,
  prompt embeddings: vLLM's per-block `extra_keys`) is skipped and counted: a router can only
  claim a prefix it can hash from token ids. With several KV cache groups (hybrid models) a
  block counts as cached while any group holds it. Pure, no I/O.
- `decode_batch`: a batch's msgpack payload → `(ts, events)`, with msgspec against vLLM's own
  `KVEventBatch` when vLLM is already imported in this process (inproc), else plain msgpack
  (`msgspec.msgpack`; vLLM's events are tagged maps, `{"type": "BlockStored", ...}`).
- `KvEventSubscriber`: the replica's ZeroMQ SUB socket. vLLM's publisher *connects* to a
  `tcp://host:port` endpoint (it binds only wildcard, ipc and inproc ones), so the subscriber
  binds `tcp://127.0.0.1:<port 0>` first and hands the engine that endpoint
  (`engine_kv_events_args`): the events never leave loopback, and no port is guessed. A gap in
  the publisher's sequence numbers is filled from its replay socket (a ROUTER the engine binds on
  another loopback port); when the replay cannot fill it, the index is cleared (`reset`: the
  router forgets this replica's blocks rather than keep ones that may be gone).

Cost (`bench/replica_state_stream.py`, medians on a shared 2-core machine): translating one
stored 128-token block ~7 µs (its token ids hashed once: BLAKE2b over `4 × block_size` bytes);
decoding a batch of 8 stored blocks ~18 µs (plain msgpack); removal and clearing are dictionary
operations.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import structlog

from inferplane import kvblocks

log = structlog.get_logger("inferplane.replica.engines.kv_events")

LOOPBACK = "127.0.0.1"
REPLAY_TIMEOUT_SECONDS = 1.0
_END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclasses.dataclass(frozen=True, slots=True)
class Stored:
    """vLLM's `BlockStored`, the fields the index uses (`extra_keys`: one entry per block or
    None; `group` is the KV cache group)."""

    block_hashes: Sequence[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: Sequence[int]
    block_size: int
    lora_name: str | None = None
    extra_keys: Sequence[Sequence[Any] | None] | None = None
    group: int = 0
    medium: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Removed:
    """vLLM's `BlockRemoved`."""

    block_hashes: Sequence[bytes | int]
    group: int = 0
    medium: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Cleared:
    """vLLM's `AllBlocksCleared` (a prefix-cache reset)."""


Event = Stored | Removed | Cleared

#: The medium of the engine's own KV cache in vLLM's events (offloading tiers report others).
PRIMARY_MEDIA = (None, "GPU")


@dataclasses.dataclass(slots=True)
class KvDelta:
    """What changed since the previous `take_delta`: `reset` (drop everything known first),
    then `stored` and `removed`, each adapter → content hashes in order."""

    reset: bool = False
    stored: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    removed: dict[str, list[int]] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.reset or bool(self.stored) or bool(self.removed)


@dataclasses.dataclass(slots=True)
class KvIndexCounters:
    """What the index could not translate (cumulative): blocks under an unknown parent, blocks
    whose hash covers more than tokens and adapter, blocks of another size, entries dropped
    over capacity, sequence gaps the replay did not fill."""

    unknown_parent: int = 0
    untranslatable: int = 0
    other_block_size: int = 0
    over_capacity: int = 0
    lost: int = 0


_Key = tuple[int, bytes | int]  # (KV cache group, engine block hash)
_Block = tuple[str, int]  # (adapter, content hash)


class KvBlockIndex:
    """Engine block hash → content hash, and the blocks the engine holds (see the module doc).

    Args:
        capacity: at most this many engine blocks are remembered (the engine's KV block count;
            0: not known yet, `set_capacity` later). Past it the oldest is dropped (reported
            removed): the map never outgrows the engine it mirrors.
        block_size: tokens per block (0: the first stored event's).
    """

    def __init__(self, capacity: int = 0, block_size: int = 0) -> None:
        self._capacity = capacity
        self.block_size = block_size
        self._by_key: dict[_Key, _Block] = {}
        self._refs: dict[_Block, int] = {}
        self._stored: dict[_Block, None] = {}
        self._removed: dict[_Block, None] = {}
        self._reset = False
        self.counters = KvIndexCounters()

    def __len__(self) -> int:
        return len(self._by_key)

    def set_capacity(self, capacity: int) -> None:
        """Bounds the index to `capacity` engine blocks (dropping the oldest over it)."""
        self._capacity = capacity
        self._trim()

    def apply(self, events: Iterable[Event]) -> None:
        """Applies one batch's events in order."""
        for event in events:
            if isinstance(event, Stored):
                self._store(event)
            elif isinstance(event, Removed):
                if event.medium in PRIMARY_MEDIA:
                    for engine_hash in event.block_hashes:
                        self._remove((event.group, engine_hash))
            elif isinstance(event, Cleared):
                self.clear()

    def clear(self) -> None:
        """Forgets every block: the next delta is a `reset` (vLLM's AllBlocksCleared, or events
        lost)."""
        self._by_key.clear()
        self._refs.clear()
        self._stored.clear()
        self._removed.clear()
        self._reset = True

    def lost(self) -> None:
        """Events were lost (a sequence gap the replay did not fill): clear, counted."""
        self.counters.lost += 1
        self.clear()

    def take_delta(self) -> KvDelta:
        """The changes since the previous call (netted), and forgets them."""
        delta = KvDelta(reset=self._reset)
        for adapter, content in self._stored:
            delta.stored.setdefault(adapter, []).append(content)
        for adapter, content in self._removed:
            delta.removed.setdefault(adapter, []).append(content)
        self._stored.clear()
        self._removed.clear()
        self._reset = False
        return delta

    def drop_delta(self) -> None:
        """Forgets the pending changes (nobody watches: a new watcher starts from `snapshot`)."""
        self.take_delta()

    def snapshot(self) -> dict[str, list[int]]:
        """Every cached block now: adapter → content hashes (oldest first)."""
        out: dict[str, list[int]] = {}
        for adapter, content in self._refs:
            out.setdefault(adapter, []).append(content)
        return out

    # -- internals -----------------------------------------------------------------------------

    def _store(self, event: Stored) -> None:
        if event.medium not in PRIMARY_MEDIA:
            return
        hashes = event.block_hashes
        size = event.block_size
        if not self.block_size:
            self.block_size = size
        if size != self.block_size:
            self.counters.other_block_size += len(hashes)
            return
        adapter = event.lora_name or ""
        group = event.group
        if event.parent_block_hash is None:
            parent = kvblocks.ROOT
        else:
            known = self._by_key.get((group, event.parent_block_hash))
            if known is None:
                self.counters.unknown_parent += len(hashes)
                return
            parent = known[1]
        tokens = event.token_ids
        extra = event.extra_keys
        own_keys = 1 if event.lora_name else 0  # vLLM's extra keys start with the LoRA name
        for i, engine_hash in enumerate(hashes):
            if extra is not None and i < len(extra):
                keys = extra[i]
                if keys is not None and len(keys) > own_keys:
                    # Multimodal, cache salt or prompt embeddings: not a function of token ids.
                    self.counters.untranslatable += len(hashes) - i
                    return
            block = tokens[i * size : (i + 1) * size]
            if len(block) != size:
                self.counters.untranslatable += len(hashes) - i
                return
            content = kvblocks.chain(block, size, adapter, parent)[0]
            self._add((group, engine_hash), (adapter, content))
            parent = content
        self._trim()

    def _add(self, key: _Key, block: _Block) -> None:
        old = self._by_key.get(key)
        if old is not None:
            if old == block:
                return  # a prefix-cache hit reported again (vLLM's emit_cached_block_events)
            self._remove(key)
        self._by_key[key] = block
        refs = self._refs.get(block, 0)
        self._refs[block] = refs + 1
        if refs == 0:
            if block in self._removed:
                del self._removed[block]
            else:
                self._stored[block] = None

    def _remove(self, key: _Key) -> None:
        block = self._by_key.pop(key, None)
        if block is None:
            return
        refs = self._refs[block] - 1
        if refs:
            self._refs[block] = refs
            return
        del self._refs[block]
        if block in self._stored:
            del self._stored[block]
        else:
            self._removed[block] = None

    def _trim(self) -> None:
        if not self._capacity:
            return
        while len(self._by_key) > self._capacity:
            oldest = next(iter(self._by_key))
            self.counters.over_capacity += 1
            self._remove(oldest)


# -- decoding ----------------------------------------------------------------------------------


def _from_vllm(event: Any) -> Event | None:
    name = type(event).__name__
    if name == "BlockStored":
        return Stored(
            block_hashes=event.block_hashes,
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_name=event.lora_name,
            extra_keys=event.extra_keys,
            group=event.group_idx or 0,
            medium=event.medium,
        )
    if name == "BlockRemoved":
        return Removed(event.block_hashes, event.group_idx or 0, event.medium)
    if name == "AllBlocksCleared":
        return Cleared()
    return None


def _from_map(event: Any) -> Event | None:
    if not isinstance(event, dict):
        return None
    kind = event.get("type")
    if kind == "BlockStored":
        return Stored(
            block_hashes=event["block_hashes"],
            parent_block_hash=event.get("parent_block_hash"),
            token_ids=event["token_ids"],
            block_size=event["block_size"],
            lora_name=event.get("lora_name"),
            extra_keys=event.get("extra_keys"),
            group=event.get("group_idx") or 0,
            medium=event.get("medium"),
        )
    if kind == "BlockRemoved":
        return Removed(event["block_hashes"], event.get("group_idx") or 0, event.get("medium"))
    if kind == "AllBlocksCleared":
        return Cleared()
    return None


class BatchDecoder:
    """Decodes vLLM's `KVEventBatch` payloads (see the module doc); unknown event types are
    skipped.

    Args:
        use_vllm: decode against vLLM's own classes (None: when vLLM is already imported).
    """

    def __init__(self, use_vllm: bool | None = None) -> None:
        import msgspec

        if use_vllm is None:
            use_vllm = "vllm.distributed.kv_events" in sys.modules or "vllm.config" in sys.modules
        self._typed: Any = None
        if use_vllm:
            with contextlib.suppress(ImportError):
                from vllm.distributed.kv_events import KVEventBatch

                self._typed = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._plain = msgspec.msgpack.Decoder()

    @property
    def typed(self) -> bool:
        """Decoding against vLLM's classes."""
        return self._typed is not None

    def decode(self, payload: bytes) -> tuple[float, list[Event]]:
        """`(ts, events)` of one batch.

        Raises:
            ValueError: not a KV event batch (msgspec's DecodeError or ValidationError are
                ValueErrors).
        """
        if self._typed is not None:
            batch = self._typed.decode(payload)
            events = [e for e in map(_from_vllm, batch.events) if e is not None]
            return float(batch.ts), events
        raw = self._plain.decode(payload)
        if not isinstance(raw, list | tuple) or len(raw) < 2 or not isinstance(raw[1], list):
            raise ValueError("not a KV event batch")
        return float(raw[0]), [e for e in map(_from_map, raw[1]) if e is not None]


# -- the engine's arguments ----------------------------------------------------------------------


def engine_kv_events_args(endpoint: str, replay_endpoint: str | None) -> list[str]:
    """vLLM engine arguments that publish KV events to `endpoint` (the subscriber's bound
    loopback socket) with prefix caching on."""
    config: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
    }
    if replay_endpoint:
        config["replay_endpoint"] = replay_endpoint
    return ["--enable-prefix-caching", "--kv-events-config", json.dumps(config)]


def prefix_caching_off(argv: Sequence[str]) -> bool:
    """The engine arguments turn prefix caching off (KV events would say nothing)."""
    return "--no-enable-prefix-caching" in argv


# -- the subscriber ------------------------------------------------------------------------------


class KvEventSubscriber:
    """The replica's subscription to its engine's KV events, applied to `index` (module doc).

    Use: `bind()` (before the engine starts: its endpoints go into the engine's arguments,
    `engine_args()`), then `run()` as a task; `close()` at the end.

    Args:
        index: where the events go.
        on_change: called after each applied batch (the state stream's wake-up).
        decoder: batch decoder (default: `BatchDecoder()`, chosen at `run`).
        replay_port: the loopback port the engine's replay socket binds (0: no replay; a gap
            then clears the index).
    """

    def __init__(
        self,
        index: KvBlockIndex,
        *,
        on_change: Callable[[], object] = lambda: None,
        decoder: BatchDecoder | None = None,
        replay_port: int = 0,
    ) -> None:
        self.index = index
        self._on_change = on_change
        self._decoder = decoder
        self._replay_port = replay_port
        self._ctx: Any = None
        self._sub: Any = None
        self.endpoint = ""
        self._expected: int | None = None
        self.messages = 0
        self.batches = 0
        self.failed = False

    @property
    def replay_endpoint(self) -> str | None:
        return f"tcp://{LOOPBACK}:{self._replay_port}" if self._replay_port else None

    def bind(self) -> str:
        """Binds the SUB socket on loopback (an OS-chosen port); returns its endpoint."""
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.bind(f"tcp://{LOOPBACK}:0")
        self._sub = sub
        self.endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.endpoint

    def engine_args(self) -> list[str]:
        """The engine arguments that publish to this subscriber (`engine_kv_events_args`)."""
        return engine_kv_events_args(self.endpoint, self.replay_endpoint)

    async def run(self) -> None:
        """Receives and applies batches until cancelled or closed; a failure is logged, sets
        `failed` and ends the task (the stream then reports `kv_events` false)."""
        if self._decoder is None:
            self._decoder = BatchDecoder()
        log.info("kv_events_receiving", endpoint=self.endpoint, vllm_classes=self._decoder.typed)
        try:
            while True:
                frames = await self._sub.recv_multipart()
                self.messages += 1
                await self._handle(frames)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.failed = True
            log.exception("kv_events_subscriber_failed")

    async def _handle(self, frames: Sequence[bytes]) -> None:
        if len(frames) != 3:
            log.warning("kv_events_bad_message", frames=len(frames))
            return
        _topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        expected = self._expected
        if expected is not None and seq < expected:
            # The publisher restarted its numbering (a new engine): what we knew is stale.
            log.warning("kv_events_sequence_restarted", seq=seq, expected=expected)
            self.index.lost()
        elif seq > (expected or 0):
            await self._fill(expected or 0, seq)
        self._apply(payload)
        self._expected = seq + 1
        self._on_change()

    def _apply(self, payload: bytes) -> None:
        assert self._decoder is not None
        try:
            _ts, events = self._decoder.decode(payload)
        except ValueError as exc:
            log.warning("kv_events_undecodable", error=str(exc))
            self.index.lost()  # a batch we cannot read may have removed blocks
            return
        self.index.apply(events)
        self.batches += 1

    async def _fill(self, start: int, end: int) -> None:
        """Applies batches `start..end-1` from the engine's replay socket, or clears the index
        when they cannot all be had."""
        missed = await self._replay(start, end) if self._replay_port else None
        if missed is None or [s for s, _ in missed] != list(range(start, end)):
            log.warning("kv_events_gap", start=start, end=end, replayed=missed is not None)
            self.index.lost()
            return
        for _seq, payload in missed:
            self._apply(payload)

    async def _replay(self, start: int, end: int) -> list[tuple[int, bytes]] | None:
        import zmq

        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            async with asyncio.timeout(REPLAY_TIMEOUT_SECONDS):
                while True:
                    frames = await sock.recv_multipart()
                    if len(frames) != 4:
                        return None
                    _empty, _topic, seq_bytes, payload = frames
                    if seq_bytes == _END_SEQ:
                        return out
                    seq = int.from_bytes(seq_bytes, "big")
                    if start <= seq < end:
                        out.append((seq, payload))
        except (TimeoutError, zmq.ZMQError):
            return None
        finally:
            sock.close(0)

    def close(self) -> None:
        """Closes the sockets (idempotent)."""
        if self._sub is not None:
            self._sub.close(0)
            self._sub = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
