"""Admission by predicted KV fit (issue 29, item 5): send a request only where its KV fits.

A slot cap (`max_num_seqs`) counts requests, not their size: a 100k-token agent context can be
admitted to a replica whose KV cache is nearly full, and the engine then preempts running
sequences (it frees their blocks and recomputes them later). Here each request is sized in KV
blocks and compared with what its replica's engine reports through the replica state stream
(`engine_state.EngineStates`: `block_size`, `total_kv_blocks`, `free_kv_blocks`).

**Sizing** (`demand_of`): prompt tokens + output tokens.
- Prompt: `features.prompt_tokens`, exact when the router tokenized the prompt (routes of the
  `precise_prefix` policy: `tokenize.PromptTokens`, `features.kv_block_size > 0`), else
  estimated from the serialized request's bytes at `bytes_per_token`
  (`kv_fit_bytes_per_token`, 4 by default, `features.BYTES_PER_TOKEN`): English prose runs
  3.5-4.5 bytes per token in large BPE vocabularies (within about ±15 %), but a small
  vocabulary makes more tokens (kimi-tiny's 2,048-token BPE: 2.0 bytes per token for prose,
  1.5 for a list of short words, 1.0 for digits: measured with its tokenizer), which 4 would
  undercount by half; the chat template's tokens are not counted. Set the setting to the
  fleet's tokenizers.
- Output: `max_completion_tokens`, else `max_tokens` (chat, Messages, Responses: what the
  replica honours); a text completion without one: 16 (OpenAI's default, as the replica's
  pipeline applies). A chat request without one may run to the end of the context, which
  would reserve a whole `max_model_len` sequence for every such request; it reserves
  `min(max_model_len - prompt, default_output_tokens)` instead (`kv_fit_default_output_tokens`,
  4,096): a prediction, documented as one. Embeddings: the prompt only. Speech: not sized
  (an encoder's input, not a KV-cached prompt): slots only.

**Fit** (`KvFit.fits`), for replica r whose fresh report S was received at t_S:

    blocks(q) <= S.free - pending(r),  and never when blocks(q) > S.total

    pending(r) = sum over this router's requests in flight on r of all their blocks,
                 less the prompt blocks of the oldest of them admitted before t_S - report_lag,
                 at most S.running of them

A request the report cannot show (admitted after it, or within `report_lag` before it: the
request's trip to the engine) reserves every block it may take. One the report shows running
holds its prompt's blocks in the report's count already, and reserves only what it may still
add, its output's blocks; the engine runs at most `S.running` requests, so at most that many
of this router's oldest get the credit (a request still in the engine's queue, or not there
yet on a loaded machine, holds nothing: without that bound, measured, a request that had not
reached the engine 0.25 s after its admission on a box at load 30 let a second one in, and the
engine preempted). This is conservative on the output (the whole `max_tokens` until the
request ends), on shared prefixes (counted once per request; the engine stores them once) and
while a finished request's blocks are still in the last report; it undercounts a running
request whose prompt is prefilled in chunks (only the chunks done are allocated), and other
routers' requests (their growth is not reserved, and their running requests may take credit
meant for this router's). Unknown capacity (no fresh report, block size or total 0) admits by
slots only, as before this stream existed.

**Where it does not fit**: the policy's choice must fit, else the first of its next
`candidates` (the policy's fallback order) that can take a request and fits, else the request
waits in the deployment's fair queue (re-checked when a slot frees and when a report arrives:
`Admission.engine_changed`), and after the queue timeout gets 429 `kv_cache_full`
(`KV_CACHE_FULL`) with Retry-After, counted among the queue's refusals under that reason. A
decision looks at most `1 + candidates` replicas (O(candidates × log n) with the policies'
indexes), never all of them. A request larger than every replica's whole KV cache can never
fit: 400 `context_length_exceeded` at once. The largest KV cache of each deployment is kept
up to date by every engine report (`observe`, O(1)); when the replica holding it reports a
smaller cache, or the table changes, it is rebuilt from the reports that follow (each replica
reports at least every second), and until then no request is refused as too large: it waits,
and gets the 429 if it never fits. vLLM's start-up check guarantees a KV cache holds one
`max_model_len` sequence, and a request is sized at most `max_model_len` tokens (a prompt +
max_tokens beyond the context is left to the replica, whose 400 says so in the API's own
words), so this refuses only where a replica's cache is smaller than the context.

No I/O; everything runs on the event loop thread.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.kvblocks import blocks_needed
from inferplane.router.engine_state import EngineState, EngineStates
from inferplane.router.features import BYTES_PER_TOKEN, RequestFeatures
from inferplane.router.replicas import ReplicaKey, ReplicaSet
from inferplane.router.routes import ModelRoute
from inferplane.runtime import InvalidArgumentError, ResourceExhaustedError

#: The 429's error code, and the queue refusal reason of its metric.
KV_CACHE_FULL = "kv_cache_full"
#: OpenAI's code for a request longer than the context (the replica's own 400 uses it too).
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
#: A text completion's output without `max_tokens`: OpenAI's default, as the replica applies.
COMPLETION_DEFAULT_MAX_TOKENS = 16
#: A chat request's output reservation without a limit, at most (`kv_fit_default_output_tokens`).
DEFAULT_OUTPUT_TOKENS = 4096


def kv_cache_full(model: str, waited: float, retry_after: float) -> ResourceExhaustedError:
    """The 429 of a request that waited `waited` seconds for KV room on no replica."""
    return ResourceExhaustedError(
        f"The model '{model}' has no replica with room in its KV cache for this request "
        f"(within {waited:g} s). Please retry after a short wait.",
        retry_after_seconds=retry_after,
        code=KV_CACHE_FULL,
        reason="KV_CACHE_FULL",
    )


@dataclasses.dataclass(slots=True)
class KvDemand:
    """One request's predicted KV size, in tokens (blocks depend on the replica's block size).

    Attributes:
        prompt_tokens: the prompt's tokens (exact or estimated: `exact`).
        output_tokens: the most tokens it may generate (see the module docstring's rule).
        exact: the prompt count came from the router's tokenizer.
        refused: its last fit check found room nowhere (it waits for KV, not for a slot).
    """

    prompt_tokens: int
    output_tokens: int
    exact: bool = False
    refused: bool = False

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    def blocks(self, block_size: int) -> int:
        return blocks_needed(self.tokens, block_size)


def _output_limit(request: Any) -> int | None:
    """`max_completion_tokens`, else `max_tokens`, of a chat or completion request (None:
    neither set)."""
    fields = request.DESCRIPTOR.fields_by_name
    for name in ("max_completion_tokens", "max_tokens"):
        if name in fields and request.HasField(name):
            return int(getattr(request, name))
    return None


def demand_of(
    request: Any,
    features: RequestFeatures,
    route: ModelRoute,
    *,
    default_output_tokens: int,
    bytes_per_token: float = BYTES_PER_TOKEN,
) -> KvDemand | None:
    """The KV demand of a typed request (`RequestFacts.request`), or None for one that is not
    sized (an audio upload): see the module docstring for the rule.

    Args:
        request: a `ChatCompletionRequest` (also a Messages or Responses request converted to
            one), `CompletionRequest`, `EmbeddingRequest`, or anything else (not sized).
        features: its features (`prompt_tokens`; exact when `kv_block_size` is set).
        route: its route (`max_model_len`, 0 when unknown).
        default_output_tokens: a chat request's output reservation without a limit, at most.
        bytes_per_token: the estimate's bytes per token when the prompt was not tokenized
            (`features.prompt_tokens` counts `features.BYTES_PER_TOKEN`).
    """
    exact = features.kv_block_size > 0
    prompt = max(0, features.prompt_tokens)
    if not exact and bytes_per_token != BYTES_PER_TOKEN:
        prompt = math.ceil(prompt * BYTES_PER_TOKEN / bytes_per_token)
    if isinstance(request, pb.EmbeddingRequest):
        return KvDemand(prompt, 0, exact)
    if isinstance(request, pb.ChatCompletionRequest | pb.CompletionRequest):
        limit = _output_limit(request)
        if limit is None:
            default = (
                default_output_tokens
                if isinstance(request, pb.ChatCompletionRequest)
                else COMPLETION_DEFAULT_MAX_TOKENS
            )
            rest = route.max_model_len - prompt if route.max_model_len else default
            limit = max(0, min(rest, default))
        if route.max_model_len:
            # A sequence never holds more than the context: a longer prompt + max_tokens is
            # the replica's 400 (its context-length message, in the API's shape), not a size
            # for the KV cache.
            prompt = min(prompt, route.max_model_len)
            limit = min(limit, route.max_model_len - prompt)
        return KvDemand(prompt, limit, exact)
    return None


@dataclasses.dataclass(eq=False, slots=True)
class Reservation:
    """One admitted request's KV reservation on one replica, until `release`."""

    ledger: _Ledger
    demand: KvDemand
    admitted: float
    prompt_blocks: int = 0
    blocks: int = 0
    released: bool = False

    def release(self) -> None:
        """The request ended: its blocks are no longer reserved (idempotent)."""
        if not self.released:
            self.released = True
            self.ledger.remove(self)


class _Ledger:
    """This router's reservations on one replica, in admission order, and the sum of all their
    blocks at `block_size`. O(1) per reservation and release; a check walks at most as many
    as the engine runs (`pending`)."""

    __slots__ = ("block_size", "live", "total_sum")

    def __init__(self) -> None:
        self.block_size = 0
        self.live: dict[Reservation, None] = {}  # insertion order = admission order
        self.total_sum = 0

    def resize(self, block_size: int) -> None:
        """Recounts every reservation at `block_size` (the engine's, when first or newly known)."""
        self.block_size = block_size
        self.total_sum = 0
        for r in self.live:
            self._size(r)

    def _size(self, r: Reservation) -> None:
        if self.block_size > 0:
            r.blocks = r.demand.blocks(self.block_size)
            r.prompt_blocks = blocks_needed(r.demand.prompt_tokens, self.block_size)
        else:
            r.blocks = r.prompt_blocks = 0
        self.total_sum += r.blocks

    def add(self, r: Reservation) -> None:
        self.live[r] = None
        self._size(r)

    def remove(self, r: Reservation) -> None:
        if r in self.live:
            del self.live[r]
            self.total_sum -= r.blocks

    def pending(self, cutoff: float, running: int) -> int:
        """Blocks still to come (module docstring): all of every reservation, less the prompt
        blocks of the oldest ones the report reflects, admitted by `cutoff` and at most as
        many as the engine runs (`running`). O(min(running, reservations))."""
        credit = 0
        for r in self.live:  # oldest first
            if running <= 0 or r.admitted > cutoff:
                break  # the rest came later: the report cannot show them yet
            credit += r.prompt_blocks
            running -= 1
        return self.total_sum - credit


class KvFit:
    """Reservations and the fit rule over `EngineStates` (the module docstring's rule).

    Args:
        engines: the replicas' engine states (filled by the replica state watch).
        clock: monotonic seconds, the clock `EngineStates` stamps reports with.
        report_lag_seconds: how long before a report a request must have been admitted for
            the report to reflect its prompt's blocks.
        candidates: replicas after the policy's choice a decision may look at.
        default_output_tokens: a chat request's output reservation without a limit, at most.
        bytes_per_token: the prompt estimate's bytes per token (`demand_of`).
    """

    def __init__(
        self,
        engines: EngineStates,
        clock: Callable[[], float],
        *,
        report_lag_seconds: float = 0.25,
        candidates: int = 4,
        default_output_tokens: int = DEFAULT_OUTPUT_TOKENS,
        bytes_per_token: float = BYTES_PER_TOKEN,
    ) -> None:
        self.engines = engines
        self.default_output_tokens = default_output_tokens
        self.bytes_per_token = bytes_per_token
        self._clock = clock
        self._lag = report_lag_seconds
        self.candidates = candidates
        self._ledgers: dict[str, _Ledger] = {}
        # Deployment → its largest reported KV cache: (tokens, total blocks, block size, the
        # replica id reporting it).
        self._largest: dict[str, tuple[int, int, int, str]] = {}

    def demand(self, request: Any, features: RequestFeatures, route: ModelRoute) -> KvDemand | None:
        """`demand_of` with this router's default output reservation and bytes per token."""
        return demand_of(
            request,
            features,
            route,
            default_output_tokens=self.default_output_tokens,
            bytes_per_token=self.bytes_per_token,
        )

    def _ledger(self, replica_id: str) -> _Ledger:
        ledger = self._ledgers.get(replica_id)
        if ledger is None:
            ledger = self._ledgers[replica_id] = _Ledger()
        return ledger

    def _known(self, replica_id: str) -> EngineState | None:
        state = self.engines.get(replica_id)
        if state is None or state.block_size <= 0 or state.total_kv_blocks <= 0:
            return None
        return state

    def free_blocks(self, replica_id: str) -> int | None:
        """The blocks a new request may take on the replica now (its report's free blocks less
        this router's pending reservations), None when its capacity is unknown."""
        state = self._known(replica_id)
        if state is None:
            return None
        ledger = self._ledger(replica_id)
        if ledger.block_size != state.block_size:
            ledger.resize(state.block_size)
        cutoff = state.received - self._lag
        return state.free_kv_blocks - ledger.pending(cutoff, state.running_requests)

    def fits(self, replica_id: str, demand: KvDemand) -> bool:
        """Whether `demand` fits the replica now (True when its capacity is unknown)."""
        state = self._known(replica_id)
        if state is None:
            return True
        need = demand.blocks(state.block_size)
        if need > state.total_kv_blocks:
            return False
        free = self.free_blocks(replica_id)
        return free is None or need <= free

    def place(
        self,
        replicas: ReplicaSet,
        chosen: int,
        alternatives: Callable[[int], Sequence[int]],
        demand: KvDemand,
        exclude: frozenset[ReplicaKey],
    ) -> int | None:
        """`chosen` if `demand` fits it, else the first of `alternatives(candidates)` (the
        policy's fallback order) that can take a request now, is not excluded and fits; None:
        nowhere now (`demand.refused` is set)."""
        ids = replicas.endpoints
        if self.fits(ids[chosen].replica_id, demand):
            demand.refused = False
            return chosen
        for i in alternatives(self.candidates):
            if (
                i != chosen
                and replicas.can_take(i)
                and replicas.keys[i] not in exclude
                and self.fits(ids[i].replica_id, demand)
            ):
                demand.refused = False
                return i
        demand.refused = True
        return None

    def reserve(self, replica_id: str, demand: KvDemand) -> Reservation:
        """Records an admitted request's reservation on the replica (until its release)."""
        ledger = self._ledger(replica_id)
        state = self._known(replica_id)
        if state is not None and ledger.block_size != state.block_size:
            ledger.resize(state.block_size)
        reservation = Reservation(ledger, demand, self._clock())
        ledger.add(reservation)
        return reservation

    def observe(self, deployment: str, replica_id: str) -> None:
        """A replica of `deployment` reported (`Admission.engine_changed`): keeps the
        deployment's largest KV cache current. O(1)."""
        state = self._known(replica_id)
        tokens = 0 if state is None else state.total_kv_blocks * state.block_size
        largest = self._largest.get(deployment)
        if largest is None or tokens > largest[0]:
            if state is not None:
                self._largest[deployment] = (
                    tokens,
                    state.total_kv_blocks,
                    state.block_size,
                    replica_id,
                )
        elif largest[3] == replica_id and tokens < largest[0]:
            del self._largest[deployment]  # rebuilt from the next reports

    def check_size(self, route: ModelRoute, replicas: ReplicaSet, demand: KvDemand) -> None:
        """Refuses a request larger than the largest KV cache the deployment's replicas report
        (`observe`; none known yet: never refused).

        Raises:
            InvalidArgumentError: 400 `context_length_exceeded`, with the numbers.
        """
        largest = self._largest.get(replicas.deployment)
        if largest is None:
            return
        capacity, total, block, _ = largest
        if demand.blocks(block) <= total:
            return
        kind = "" if demand.exact else "about "
        raise InvalidArgumentError(
            f"This request needs {kind}{demand.tokens} tokens of KV cache ({kind}"
            f"{demand.prompt_tokens} in the prompt, {demand.output_tokens} in the completion), "
            f"more than any replica of the model '{route.model}' holds ({capacity} tokens). "
            "Please reduce the length of the messages or the completion (max_tokens).",
            param="max_tokens",
            code=CONTEXT_LENGTH_EXCEEDED,
        )

    def forget(self, live: set[str]) -> None:
        """Drops the ledgers of replicas that left the table and hold no reservation."""
        for replica_id in [r for r, ledger in self._ledgers.items() if r not in live]:
            if not self._ledgers[replica_id].live:
                del self._ledgers[replica_id]
        self._largest.clear()
