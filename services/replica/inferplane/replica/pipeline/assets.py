"""What the pipeline needs per model, loaded once per model source and shared by requests.

A replica's `ReplicaSpec` names a local model folder (`model_source`) and parser names; the
tokenizer (chat template, vocab, fast `tokenizers` backend for incremental decoding), the
compiled parser and the end-of-sequence ids come from that folder, offline; the parser name
also picks the chat family the renderer prepares requests for. An `embed`
replica's assets are its tokenizer, context length and Matryoshka dimensions only (no parser,
no chat template).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.chat import ChatFamily, UnknownChatFamilyError, chat_family
from inferplane.parsers import Parser, ParserError, build_parser
from inferplane.promptsize import TokenBound, token_bound_of
from inferplane.replica_contract import Task, replica_task
from inferplane.runtime import UnavailableError

log = structlog.get_logger("inferplane.replica.pipeline")


@dataclasses.dataclass(frozen=True, slots=True)
class ModelAssets:
    """Everything about one model that requests share (read-only after loading).

    Attributes:
        model_source: the folder the assets came from (the cache key).
        tokenizer: the Hugging Face tokenizer (`apply_chat_template`, `encode`, `decode`).
        backend: its fast `tokenizers.Tokenizer`, used by `DecodeStream` (incremental decoding).
        parser: the compiled reasoning + tool-call parser, or None when the spec names none
            (then all output is content).
        chat_family: how requests are prepared for the model's chat template (thinking
            keyword, history tool-call ids and arguments): `chat_family(parser name)`.
        eos_token_ids: ids that end generation: the tokenizer's eos plus
            `generation_config.json`'s `eos_token_id` (int or list), as vLLM merges them.
        max_model_len: context length in tokens (prompt + completion).
        vocab_size: number of token ids (valid ids are `0 .. vocab_size - 1`).
        marker_texts: the texts a response must never show: every added token of the
            tokenizer (special tokens and the chat template's markers, special or not) and
            the parser's markers. A constrained JSON answer's strings exclude them
            (`inferplane.parsers.build_json_constraint(markers=...)`).
        matryoshka_dimensions: the embedding sizes the model may be cut to (OpenAI's
            `dimensions`), from config.json as vLLM reads it (`ModelConfig.is_matryoshka`):
            its `matryoshka_dimensions`, or every size from 1 to `hidden_size` when it only
            says `is_matryoshka: true`; empty for other models (and for generate replicas).
        sampling_defaults: `generation_config.json`'s sampling parameters (`temperature`,
            `top_p`, `top_k`, `min_p`, `repetition_penalty`, `presence_penalty`,
            `frequency_penalty`), which a request that omits one gets instead of the engine's
            neutral value: vLLM's `--generation-config auto` (`get_diff_sampling_param`), the
            same on every transport. A value outside the request's own range is left out.
            A spec's `sampling_defaults` (its deployment profile's) win over these field by
            field (`ModelAssetsCache.get`).
        token_bound: the most prompt text bytes one token stands for (`inferplane.promptsize`,
            from the tokenizer's own JSON), or None when the tokenizer has no such bound: a
            prompt over `max_model_len` times it is refused before it is rendered.
    """

    model_source: str
    tokenizer: Any
    backend: Any
    parser: Parser | None
    chat_family: ChatFamily
    eos_token_ids: frozenset[int]
    max_model_len: int
    vocab_size: int
    matryoshka_dimensions: tuple[int, ...] = ()
    marker_texts: tuple[str, ...] = ()
    sampling_defaults: tuple[tuple[str, float | int], ...] = ()
    token_bound: TokenBound | None = None


def parser_name(spec: nodeagent_pb2.ReplicaSpec) -> str | None:
    """The one parser name of a spec: `reasoning_parser` and `tool_parser` name the same
    combined parser in `inferplane.parsers` ("kimi_k2"); either may be empty. None for an
    `embed` spec (nothing is generated, so nothing is parsed).

    Raises:
        UnavailableError: the two names differ (a deployment error: the library has no
            separate reasoning and tool parsers to combine).
    """
    if spec.task == Task.EMBED:
        return None
    names = {n for n in (spec.reasoning_parser, spec.tool_parser) if n}
    if len(names) > 1:
        raise UnavailableError(
            f"replica of '{spec.served_model_name}' names two parsers ({', '.join(sorted(names))});"
            " inferplane's parsers handle reasoning and tool calls together: name one",
            code="bad_replica_config",
        )
    return names.pop() if names else None


def load_model_assets(spec: nodeagent_pb2.ReplicaSpec) -> ModelAssets:
    """Loads a model's assets from its local folder, offline (blocking: call it in a thread).

    Raises:
        UnavailableError: the folder, tokenizer or parser cannot be loaded.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    source = spec.model_source
    folder = Path(source)
    try:
        embed = replica_task(spec) == Task.EMBED
    except ValueError as exc:
        raise UnavailableError(str(exc), code="bad_replica_config") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UnavailableError(
            f"cannot load the tokenizer of '{spec.served_model_name}'", code="model_unavailable"
        ) from exc
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise UnavailableError(
            f"'{spec.served_model_name}' has no fast tokenizer (tokenizer.json)",
            code="model_unavailable",
        )
    name = parser_name(spec)
    added = _added_texts(tokenizer)
    try:
        # The tokenizer's other added tokens (chat markers: <|im_assistant|>) are never shown.
        parser = build_parser(name, vocab=tokenizer.get_vocab(), drop=added) if name else None
        family = chat_family(name)
    except (ParserError, UnknownChatFamilyError) as exc:
        raise UnavailableError(str(exc), code="bad_replica_config") from exc
    eos: set[int] = set()
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    generation = _read_json(folder / "generation_config.json")
    configured = generation.get("eos_token_id")
    if isinstance(configured, int):
        eos.add(configured)
    elif isinstance(configured, list):
        eos.update(int(i) for i in configured)
    config = _read_json(folder / "config.json")
    max_len = int(spec.max_model_len) or int(config.get("max_position_embeddings", 0))
    if max_len <= 0:
        max_len = int(getattr(tokenizer, "model_max_length", 0) or 0)
    if max_len <= 0 or max_len > 1 << 31:
        raise UnavailableError(
            f"'{spec.served_model_name}' has no max_model_len", code="bad_replica_config"
        )
    if embed and (backend.truncation is not None or backend.padding is not None):
        # Embeddings tokenize with the backend directly: a truncation or padding that
        # tokenizer.json switches on would cut or pad inputs silently (transformers resets
        # them on every call; vLLM refuses a too-long input instead).
        backend = copy.deepcopy(backend)
        backend.no_truncation()
        backend.no_padding()
    return ModelAssets(
        model_source=source,
        tokenizer=tokenizer,
        backend=backend,
        parser=parser,
        chat_family=family,
        eos_token_ids=frozenset(eos),
        max_model_len=max_len,
        vocab_size=int(backend.get_vocab_size(with_added_tokens=True)),
        matryoshka_dimensions=_matryoshka_dimensions(config) if embed else (),
        marker_texts=marker_texts(added, parser),
        token_bound=token_bound_of(json.loads(backend.to_str())),
        sampling_defaults=() if embed else sampling_defaults(generation),
    )


# generation_config.json's sampling keys vLLM applies to a request that omits them
# (`ModelConfig.get_diff_sampling_param`; its `max_new_tokens` is not taken: a request's
# default maximum is the context left), with the ranges a request may set (`requests._sampling`).
_SAMPLING_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "repetition_penalty": (0.0, 2.0),
}


def sampling_defaults(
    generation: dict[str, Any], source: str = "generation_config"
) -> tuple[tuple[str, float | int], ...]:
    """The sampling defaults of a `generation_config.json` (`ModelAssets.sampling_defaults`),
    or of a spec's `sampling_defaults` (`source` "spec", `spec_sampling_defaults`): numbers
    within a request's range only (`top_p` and `repetition_penalty` above 0, `top_k` an
    integer of at least -1); anything else is logged and left out."""
    found: list[tuple[str, float | int]] = []
    for name, value in generation.items():
        if name == "top_k":
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= -1
        elif name in _SAMPLING_RANGES:
            lo, hi = _SAMPLING_RANGES[name]
            ok = (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value)
                and lo <= value <= hi
                and not (value == lo and name in ("top_p", "repetition_penalty"))
            )
        else:
            continue
        if ok:
            found.append((name, value))
        else:
            log.warning(f"{source}_sampling_ignored", parameter=name, value=value)
    return tuple(sorted(found))


def spec_sampling_defaults(spec: nodeagent_pb2.ReplicaSpec) -> tuple[tuple[str, float | int], ...]:
    """The sampling defaults the spec sets (its deployment profile's, vLLM's
    `--override-generation-config`): the set fields of `spec.sampling_defaults`, checked as
    `sampling_defaults` checks generation_config's. Empty when the spec sets none."""
    if not spec.HasField("sampling_defaults"):
        return ()
    message = spec.sampling_defaults
    values = {f.name: v for f, v in message.ListFields()}
    return sampling_defaults(values, source="spec")


def with_spec_sampling(
    assets: ModelAssets, overrides: tuple[tuple[str, float | int], ...]
) -> ModelAssets:
    """`assets` whose `sampling_defaults` are the model's with `overrides` (the spec's) winning
    field by field: spec > generation_config > the engine's neutral value (a request's own
    value wins over all: `requests._sampling`). Empty `overrides`: `assets` as they are."""
    if not overrides:
        return assets
    merged = dict(assets.sampling_defaults)
    merged.update(overrides)
    return dataclasses.replace(assets, sampling_defaults=tuple(sorted(merged.items())))


def _added_texts(tokenizer: Any) -> tuple[str, ...]:
    """The texts of the tokenizer's added tokens (`added_tokens_decoder`: special tokens and
    chat markers), whitespace-only ones left out (they are not markers)."""
    texts = {str(t.content) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    return tuple(sorted(t for t in texts if t and not t.isspace()))


def marker_texts(added: tuple[str, ...], parser: Parser | None) -> tuple[str, ...]:
    """The texts no response may show (`ModelAssets.marker_texts`), sorted: the tokenizer's
    added tokens and the parser's markers (variants such as Kimi's `◁think▷` are plain text
    to a tokenizer without them, and are left out)."""
    texts = set(added)
    if parser is not None:
        texts.update(parser.config.terminals.values())
    return tuple(sorted(texts))


def _matryoshka_dimensions(config: dict[str, Any]) -> tuple[int, ...]:
    """The sizes an embedding may be cut to, as vLLM 0.32 reads config.json
    (vllm/config/model.py `is_matryoshka`, `matryoshka_dimensions`;
    vllm/pooling_params.py checks a request's `dimensions` against them)."""
    listed = config.get("matryoshka_dimensions")
    if isinstance(listed, list) and listed:
        return tuple(sorted({int(d) for d in listed}))
    if config.get("is_matryoshka"):
        return tuple(range(1, int(config.get("hidden_size", 0)) + 1))
    return ()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


Loader = Callable[[nodeagent_pb2.ReplicaSpec], ModelAssets]


class ModelAssetsCache:
    """Model assets per (model_source, parser), loaded on first use in a worker thread.

    Concurrent first requests for one model wait for a single load; a failed load is not
    cached (the next request tries again, e.g. after the folder was fixed).

    Args:
        loader: builds the assets of a spec (default `load_model_assets`; tests pass fakes).
        on_loaded: called on the event loop after each successful load; the service passes
            `inferplane.runtime.freeze_heap`, so the tokenizer and the libraries its first load
            imported (transformers, torch: ~370k objects) leave the collector's scans.
    """

    def __init__(
        self, loader: Loader = load_model_assets, on_loaded: Callable[[], object] = lambda: None
    ) -> None:
        self._loader = loader
        self._on_loaded = on_loaded
        self._assets: dict[tuple[str, str | None], ModelAssets] = {}
        self._loading: dict[tuple[str, str | None], asyncio.Future[ModelAssets]] = {}
        self._derived: dict[
            tuple[int, tuple[tuple[str, float | int], ...]], tuple[ModelAssets, ModelAssets]
        ] = {}

    async def get(self, spec: nodeagent_pb2.ReplicaSpec) -> ModelAssets:
        """The assets of `spec`'s model (loads them once), with the spec's sampling defaults
        over the model's generation_config ones when it sets any (`with_spec_sampling`).

        Raises:
            UnavailableError: loading failed.
        """
        assets = await self._model(spec)
        overrides = spec_sampling_defaults(spec)
        if not overrides:
            return assets
        # The spec's sampling defaults over the model's (one replica process may serve specs
        # of one model with different profiles): derived once per model assets and overrides.
        derived = self._derived.get((id(assets), overrides))
        if derived is None or derived[0] is not assets:
            derived = (assets, with_spec_sampling(assets, overrides))
            self._derived[(id(assets), overrides)] = derived
        return derived[1]

    async def _model(self, spec: nodeagent_pb2.ReplicaSpec) -> ModelAssets:
        key = (spec.model_source, parser_name(spec))
        assets = self._assets.get(key)
        if assets is not None:
            return assets
        pending = self._loading.get(key)
        if pending is None:
            pending = asyncio.ensure_future(asyncio.to_thread(self._loader, spec))
            self._loading[key] = pending
            pending.add_done_callback(lambda f: self._done(key, f))
        # shield: one cancelled request must not cancel the load the others wait for.
        return await asyncio.shield(pending)

    def _done(self, key: tuple[str, str | None], future: asyncio.Future[ModelAssets]) -> None:
        self._loading.pop(key, None)
        if not future.cancelled() and future.exception() is None:
            self._assets[key] = future.result()
            log.info("model_assets_loaded", model_source=key[0], parser=key[1])
            self._on_loaded()
        elif not future.cancelled():
            log.warning("model_assets_failed", model_source=key[0], error=str(future.exception()))

    def put(self, assets: ModelAssets, parser: str | None) -> None:
        """Pre-loads assets (start-up warm-up, tests)."""
        self._assets[(assets.model_source, parser)] = assets
