"""LoRA adapters in a replica (issue 29): which adapter a request runs with, and which ones the
engine holds now.

The endpoint picker names the adapter in the request's headers (`inferplane.wire.headers`:
`ADAPTER`, the catalogue name; `ADAPTER_SOURCE`, its folder). `AdapterRegistry.resolve` checks
them against the replica's spec and returns an `Adapter`: the catalogue name, a stable integer
id per (name, folder) inside this process (vLLM's `lora_int_id`: the engine caches adapters by
it, so a folder that changes under the same name gets a new id) and the resolved folder. The
pipeline hands it to the engine with the request (`SamplingParams.adapter`): `inproc` passes
vLLM a `LoRARequest(name, id, path)`, which vLLM loads on a miss; `http-completions` loads it
into the child server once (`POST /v1/load_lora_adapter`, allowed by
`RUNTIME_LORA_UPDATING`) and names it as the model. vLLM keeps at most `max_loras` adapters
(`max_cpu_loras` = `max_loras`) and evicts the least recently used to load another.

Refusals (`inferplane.runtime.FailedPreconditionError`, HTTP 400, `param` "model", codes from
`inferplane.lora`): LoRA off on this replica or a task other than text generation
(`lora_disabled`), a transport that cannot serve adapters (`adapter_transport_unsupported`),
a source outside `ReplicaSpec.lora_root` after resolving symlinks and `..`
(`adapter_source_not_allowed`), no readable `adapter_config.json` (`adapter_unreadable`), a
rank above `max_lora_rank` (`adapter_rank_too_large`); a malformed header is
INVALID_ARGUMENT `invalid_adapter`.

`loaded()` is what the replica's state stream reports to routers (`loaded_adapters`): on
`inproc` the adapters vLLM's engine holds (`AsyncLLM.list_loras`, read again after each
request with an adapter started and ended); on `http-completions` the `max_loras` most
recently used ones (the set vLLM's LRU cache holds when every load succeeds).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import re
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path
from typing import Final

import structlog

from inferplane import lora
from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.lora import AdapterError
from inferplane.replica_contract import (
    LORA_TRANSPORTS,
    Task,
    replica_task,
    resolve_transport,
)
from inferplane.runtime import FailedPreconditionError, InvalidArgumentError

log = structlog.get_logger("inferplane.replica.engines.lora")

RUNTIME_LORA_UPDATING: Final = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
"""vLLM's switch for `POST /v1/load_lora_adapter` on its HTTP server: the launcher sets it for
an engine started with `--enable-lora`."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,254}")
"""An adapter name the replica passes to vLLM (catalogue names: `{base}:{adapter}` and the like;
no whitespace or control characters)."""

ListLoraIds = Callable[[], Awaitable[Collection[int]]]
"""The engine's own list of the adapter ids it holds (`InprocEngine.lora_ids`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Adapter:
    """One adapter as the engine runs it.

    Attributes:
        name: the catalogue name (vLLM's `lora_name`, the model name on `http-completions`).
        lora_id: vLLM's `lora_int_id`, ≥ 1, stable for (name, path) in this process.
        path: the adapter folder, resolved (no symlink, no `..`), under the replica's root.
        rank: its rank (`adapter_config.json`), at most the replica's `max_lora_rank`.
    """

    name: str
    lora_id: int
    path: str
    rank: int


class AdapterRegistry:
    """The replica's adapters: checks and ids (`resolve`), what the engine holds (`loaded`).

    Args:
        spec: the replica's spec (`max_loras`, `max_lora_rank`, `lora_root`, task, transport).
        transport: the replica process's transport (None: the spec's, `resolve_transport`).
    """

    def __init__(self, spec: nodeagent_pb2.ReplicaSpec, *, transport: str | None = None) -> None:
        self._max_loras = spec.max_loras
        self._max_rank = spec.max_lora_rank or lora.DEFAULT_MAX_LORA_RANK
        self._root = spec.lora_root
        try:
            self._task: str = replica_task(spec)
            self._transport: str = transport or resolve_transport(spec)
        except ValueError:  # the process refuses such a spec before any request
            self._task, self._transport = "", transport or ""
        self._ids: dict[tuple[str, str], Adapter] = {}
        self._next_id = itertools.count(1)
        self._recent: OrderedDict[str, None] = OrderedDict()  # used names, oldest first
        self._list_ids: ListLoraIds | None = None
        self._held: tuple[str, ...] = ()
        self._refreshing: asyncio.Task[None] | None = None
        self._stale = False

    @property
    def enabled(self) -> bool:
        """LoRA is on for this replica (`max_loras` > 0)."""
        return self._max_loras > 0

    def attach(self, list_ids: ListLoraIds | None) -> None:
        """The engine started: `list_ids` reads the ids of the adapters it holds (inproc);
        None: the engine cannot say (`loaded` falls back to the most recently used)."""
        self._list_ids = list_ids

    def resolve(self, name: str, source: str) -> Adapter:
        """The `Adapter` for the request headers `ADAPTER` = `name`, `ADAPTER_SOURCE` =
        `source` (reads `adapter_config.json` the first time a (name, folder) is seen).

        Raises:
            InvalidArgumentError: `invalid_adapter`: a name without a source or a name with
                characters vLLM cannot take.
            FailedPreconditionError: see the module docstring (LoRA off, transport, root,
                unreadable folder, rank).
        """
        if not _NAME.fullmatch(name) or not source:
            raise InvalidArgumentError(
                "the request's adapter headers are malformed (a name of letters, digits and "
                "._:@/- with its source folder is expected)",
                param="model",
                code=lora.INVALID_ADAPTER,
            )
        if not self.enabled or self._task != Task.GENERATE:
            raise _refused(
                f"this replica serves no LoRA adapters (max_loras is {self._max_loras}); "
                f"adapter {name!r} needs a deployment whose profile sets max_loras",
                lora.LORA_DISABLED,
            )
        if self._transport not in LORA_TRANSPORTS:
            raise _refused(
                f"the {self._transport} engine transport serves no LoRA adapters; use "
                + " or ".join(LORA_TRANSPORTS),
                lora.ADAPTER_TRANSPORT_UNSUPPORTED,
            )
        try:
            path = str(lora.source_under_root(source, self._root))
        except AdapterError as exc:
            raise _refused(str(exc), exc.code) from exc
        known = self._ids.get((name, path))
        if known is not None:
            return known
        try:
            rank = lora.adapter_rank(Path(path))
        except AdapterError as exc:
            raise _refused(f"adapter {name!r}: {exc}", exc.code) from exc
        if rank > self._max_rank:
            raise _refused(
                f"adapter {name!r} has rank {rank}, above this replica's max_lora_rank "
                f"{self._max_rank}",
                lora.ADAPTER_RANK_TOO_LARGE,
            )
        adapter = Adapter(name, next(self._next_id), path, rank)
        self._ids[(name, path)] = adapter
        return adapter

    def used(self, adapter: Adapter) -> None:
        """A request with `adapter` started or ended: it is the most recently used, and the
        engine's list is read again (in the background, coalesced)."""
        self._recent[adapter.name] = None
        self._recent.move_to_end(adapter.name)
        while len(self._recent) > max(self._max_loras, 1):
            self._recent.popitem(last=False)
        if self._list_ids is not None:
            self._refresh_soon()

    def loaded(self) -> tuple[str, ...]:
        """The catalogue names of the adapters the engine holds now, sorted (see the module
        docstring for what each transport knows)."""
        if self._list_ids is not None:
            return self._held
        return tuple(sorted(self._recent))

    async def refresh(self) -> None:
        """Reads the engine's list of held adapters now (inproc); a failure keeps the last."""
        if self._list_ids is None:
            return
        try:
            ids = set(await self._list_ids())
        except Exception:  # a dead engine: the replica reports that elsewhere
            log.debug("lora_list_failed", exc_info=True)
            return
        names = {a.name for a in self._ids.values() if a.lora_id in ids}
        self._held = tuple(sorted(names))

    def _refresh_soon(self) -> None:
        if self._refreshing is not None and not self._refreshing.done():
            self._stale = True  # read once more after the one in flight
            return
        self._refreshing = asyncio.ensure_future(self._refresh_until_fresh())

    async def _refresh_until_fresh(self) -> None:
        while True:
            self._stale = False
            await self.refresh()
            if not self._stale:
                return


def _refused(message: str, code: str) -> FailedPreconditionError:
    return FailedPreconditionError(message, param="model", code=code)
