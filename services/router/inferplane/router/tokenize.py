"""The prompt's token ids as the engine sees them, for `precise_prefix` (issue 29).

The replicas announce their cached KV blocks as content hashes of token ids
(`inferplane.kvblocks.chain`), so to score a request the router needs its prompt's token
ids: a chat request rendered as the replica renders it (`inferplane.chat.render_chat`, the
same normalisation and template) and tokenized with the model's tokenizer; a text completion's
prompt tokenized as the replica does (the tokenizer's special tokens unless
`add_special_tokens` is false), or its token ids as given. `PromptTokens.annotate` adds the
hashes to `RequestFeatures` (`kv_hashes`, `kv_block_size`, and the exact `prompt_tokens`)
before admission; the policy then only reads them.

- The tokenizer is the route's `tokenizer` (the deployment's `model_source`, a local folder,
  offline), loaded lazily on the first request that needs it, in a worker thread; requests
  arriving meanwhile get no hashes (the policy falls back to the approximate table). At most
  `max_tokenizers` are kept (least recently used first out).
- The chat family (thinking keyword, history tool-call ids: `inferplane.chat`) is the
  deployment's parser's; the routing table does not carry the parser name, so it is read from
  the tokenizer's vocabulary: the first family whose own marker token it holds
  (`FAMILY_MARKERS`), else the generic family. A wrong guess costs hits, never correctness.
- The block size is the engine's, from the replicas' state streams (`EngineStates`); with no
  fresh state for the route nothing is tokenized (nothing could match).
- Work is capped: only the first `max_tokens` tokens are hashed (whole blocks); the template
  is rendered whole, but only the first `max_tokens × 8` characters are tokenized when that
  yields enough tokens (BPE merges never reach far across a cut: the blocks before the last
  are the full text's).
- It runs in a worker thread (`executor`, one thread by default), never on the event loop:
  the template and BPE cost milliseconds for long prompts (bench/kv_routing.py prints the
  router's CPU per request).

A request the renderer refuses gets no hashes (the replica answers the client's 400).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.chat import ChatFamily, ChatRenderError, chat_family, render_chat
from inferplane.kvblocks import chain
from inferplane.router.engine_state import EngineStates
from inferplane.router.features import RequestFeatures
from inferplane.router.routes import ModelRoute
from inferplane.wire import chat_request_to_dict, completion_request_to_dict

log = structlog.get_logger("inferplane.router.tokenize")

POLICY = "precise_prefix"
#: (a marker token of the family's own format, parser name), checked in order.
FAMILY_MARKERS: tuple[tuple[str, str], ...] = (
    ("<|tool_calls_section_begin|>", "kimi_k2"),
    ("<|channel|>", "gpt_oss"),
    ("<｜tool▁calls▁begin｜>", "deepseek_v31"),  # DeepSeek's full-width bars
    ("<arg_key>", "glm45"),
    ("<tool_call>", "qwen3"),
)
#: Characters tokenized per wanted token before falling back to the whole text.
CHARS_PER_TOKEN_CAP = 8
#: Extra tokens past the last wanted one, so a cut's BPE effects stay out of hashed blocks.
_MARGIN = 16
#: After a failed load, the route is not tried again for this long (seconds).
RETRY_LOAD_SECONDS = 60.0


def guess_family(vocab: Mapping[str, int]) -> ChatFamily:
    """The chat family whose marker token `vocab` holds first (`FAMILY_MARKERS`), else the
    generic one."""
    for marker, parser in FAMILY_MARKERS:
        if marker in vocab:
            return chat_family(parser)
    return chat_family("")


@dataclasses.dataclass(frozen=True, slots=True)
class Tokenizer:
    """A loaded tokenizer and the chat family it renders with."""

    tokenizer: Any
    family: ChatFamily


def load_tokenizer(path: str) -> Tokenizer:
    """Loads the tokenizer of a model folder, offline (blocking: call it in a thread).

    Raises:
        OSError, ValueError: no readable tokenizer there.
        ImportError: transformers is not installed.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return Tokenizer(tokenizer, guess_family(tokenizer.get_vocab()))


def _chat_body(request: pb.ChatCompletionRequest, family: ChatFamily) -> dict[str, Any]:
    """The body the replica renders (the steps of its `plan_chat` that change the prompt):
    `reasoning` → `reasoning_content`, `reasoning_effort` → the thinking keyword, tools only
    when they may be called."""
    body = chat_request_to_dict(request)
    for message in body.get("messages") or ():
        if isinstance(message, dict) and "reasoning" in message:
            message.setdefault("reasoning_content", message.pop("reasoning"))
    effort = body.get("reasoning_effort")
    if effort is not None and family.thinking_kwarg is not None:
        kwargs = body.setdefault("chat_template_kwargs", {})
        if isinstance(kwargs, dict):
            kwargs.setdefault(family.thinking_kwarg, effort != "none")
    if body.get("tool_choice") == "none" or not body.get("tools"):
        body.pop("tools", None)
    return body


def _encode_capped(tokenizer: Any, text: str, want: int, special: bool) -> tuple[list[int], int]:
    """(the first ≥ `want` token ids of `text`, an estimate of its whole length in tokens)."""
    cap = want * CHARS_PER_TOKEN_CAP
    if len(text) > cap:
        ids = tokenizer.encode(text[:cap], add_special_tokens=special)
        if len(ids) >= want + _MARGIN:
            return ids[:want], int(len(ids) * len(text) / cap)
    ids = tokenizer.encode(text, add_special_tokens=special)
    return ids[:want], len(ids)


class _CappedEncode:
    """A tokenizer whose `encode` stops after the wanted tokens (`_encode_capped`), so
    `render_chat` renders exactly as on the replica but encodes only what is hashed."""

    def __init__(self, tokenizer: Any, want: int) -> None:
        self._tokenizer = tokenizer
        self._want = want
        self.total = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def encode(self, text: str, add_special_tokens: bool = True, **_: Any) -> list[int]:
        ids, self.total = _encode_capped(self._tokenizer, text, self._want, add_special_tokens)
        return ids


def prompt_ids(loaded: Tokenizer, request: Any, max_tokens: int) -> tuple[list[int], int] | None:
    """(the first `max_tokens` prompt token ids as the replica would compute them, the whole
    prompt's tokens) of a chat or text completion request, or None when it has no prompt the
    router can compute (the renderer refused it, or an unsupported prompt form)."""
    tokenizer = loaded.tokenizer
    if isinstance(request, pb.ChatCompletionRequest):
        capped = _CappedEncode(tokenizer, max_tokens)
        try:
            body = _chat_body(request, loaded.family)
            ids = render_chat(body, capped, family=loaded.family).token_ids
        except (ChatRenderError, RuntimeError, ValueError, TypeError, KeyError):
            return None
        # harmony builds its ids without `encode`: capped here.
        return ids[:max_tokens], max(capped.total, len(ids))
    if isinstance(request, pb.CompletionRequest):
        body = completion_request_to_dict(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            special = body.get("add_special_tokens") is not False
            return _encode_capped(tokenizer, prompt, max_tokens, special)
        if isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
            return [int(i) for i in prompt[:max_tokens]], len(prompt)
    return None


class PromptTokens:
    """Adds a request's KV block hashes to its features (module docstring).

    Args:
        states: the replicas' engine states (the block size comes from there).
        default_policy: the router's default policy (a route naming none uses it).
        max_tokens: tokens hashed at most per request (whole blocks of them).
        max_tokenizers: tokenizers kept loaded at most.
        executor: where rendering, tokenizing and loading run (one thread by default).
        loader: loads a tokenizer folder (tests inject one).
        clock: monotonic seconds.

    Attributes:
        tokenized / skipped: requests given hashes / needing them but not given any.
        seconds: total seconds spent rendering, tokenizing and hashing (worker thread).
    """

    def __init__(
        self,
        states: EngineStates,
        *,
        default_policy: str = "",
        max_tokens: int = 32_768,
        max_tokenizers: int = 4,
        executor: concurrent.futures.Executor | None = None,
        loader: Callable[[str], Tokenizer] = load_tokenizer,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._states = states
        self._default = default_policy
        self._max_tokens = max_tokens
        self._max_loaded = max(1, max_tokenizers)
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="router-tokenize"
        )
        self._owns_executor = executor is None
        self._loader = loader
        self._clock = clock
        self._loaded: collections.OrderedDict[str, Tokenizer] = collections.OrderedDict()
        self._loading: dict[str, asyncio.Future[Tokenizer]] = {}
        self._failed: dict[str, float] = {}
        self.tokenized = 0
        self.skipped = 0
        self.seconds = 0.0

    def wants(self, route: ModelRoute) -> bool:
        """The route is routed by `precise_prefix` and has a tokenizer."""
        return bool(route.tokenizer) and (route.routing_policy or self._default) == POLICY

    def block_size(self, route: ModelRoute) -> int:
        """The engine's block size from a fresh state of one of the route's first replicas
        (0: none known)."""
        for endpoint in route.endpoints[:16]:
            state = self._states.get(endpoint.replica_id)
            if state is not None and state.block_size > 0:
                return state.block_size
        return 0

    async def annotate(
        self, route: ModelRoute, request: Any, features: RequestFeatures
    ) -> RequestFeatures:
        """`features` with `kv_hashes`, `kv_block_size` and the exact `prompt_tokens` of
        `request` (a typed chat or text completion request), or unchanged when the route is
        not `precise_prefix`, its tokenizer is not loaded yet (its load starts), no block
        size is known, or the prompt cannot be computed. Never raises for a bad request."""
        if not self.wants(route) or not isinstance(
            request, pb.ChatCompletionRequest | pb.CompletionRequest
        ):
            return features
        block = self.block_size(route)
        loaded = self._tokenizer(route.tokenizer)
        if block <= 0 or loaded is None:
            self.skipped += 1
            return features
        adapter = route.adapter  # blocks computed under an adapter are hashed with its name
        want = (self._max_tokens // block) * block
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(
            self._executor, self._hash, loaded, request, want, block, adapter
        )
        if result is None:
            self.skipped += 1
            return features
        hashes, total, spent = result
        self.seconds += spent
        self.tokenized += 1
        return dataclasses.replace(
            features, kv_hashes=hashes, kv_block_size=block, prompt_tokens=total
        )

    @staticmethod
    def _hash(
        loaded: Tokenizer, request: Any, want: int, block: int, adapter: str
    ) -> tuple[tuple[int, ...], int, float] | None:
        started = time.thread_time()
        computed = prompt_ids(loaded, request, want)
        if computed is None:
            return None
        ids, total = computed
        hashes = tuple(chain(ids, block, adapter))
        return hashes, total, time.thread_time() - started

    def _tokenizer(self, path: str) -> Tokenizer | None:
        loaded = self._loaded.get(path)
        if loaded is not None:
            self._loaded.move_to_end(path)
            return loaded
        if path in self._loading:
            return None
        failed = self._failed.get(path)
        if failed is not None and self._clock() - failed < RETRY_LOAD_SECONDS:
            return None
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, self._loader, path)
        self._loading[path] = future
        future.add_done_callback(lambda f: self._loaded_cb(path, f))
        return None

    def _loaded_cb(self, path: str, future: asyncio.Future[Tokenizer]) -> None:
        self._loading.pop(path, None)
        if future.cancelled():
            return
        exc = future.exception()
        if exc is not None:
            self._failed[path] = self._clock()
            log.warning("tokenizer_unavailable", path=path, error=str(exc))
            return
        self._failed.pop(path, None)
        self._loaded[path] = future.result()
        log.info("tokenizer_loaded", path=path, family=future.result().family.name)
        while len(self._loaded) > self._max_loaded:
            self._loaded.popitem(last=False)

    async def ready(self, route: ModelRoute) -> bool:
        """Loads the route's tokenizer now if it is not (tests and warm-up); True once loaded."""
        if not route.tokenizer:
            return False
        if self._tokenizer(route.tokenizer) is not None:
            return True
        future = self._loading.get(route.tokenizer)
        if future is not None:
            try:
                await asyncio.shield(future)
            except Exception:  # logged by the done callback
                return False
            await asyncio.sleep(0)  # the done callback runs
        return route.tokenizer in self._loaded

    def close(self) -> None:
        """Stops the worker thread (when this object made it)."""
        if self._owns_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)
