"""What a routing policy may know about a request, extracted once per request (no rendering).

The router does not render chat templates (the node-agent does), so prefix affinity works on
a stand-in for the rendered prompt: the request's tools (which K2.5's template declares first)
then its messages, each serialized deterministically, concatenated in order. That byte stream
is prefix-stable across the turns of a conversation: turn n+1 starts with turn n's bytes.
It is hashed in fixed-size blocks, chained (block i's hash covers blocks 0..i), the way an
engine's prefix cache keys KV blocks (vLLM automatic prefix caching), so "the longest block
hash we have seen" is "the longest prompt prefix some replica has cached".

Deterministic protobuf bytes stand in for canonical JSON: for one schema they are canonical
(fields in number order, map keys sorted) and 10–50x cheaper to produce than JSON.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Mapping

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.wire import headers

SESSION_HEADER = "x-session-id"
# Admission weight by key tier (fair share of the queue's grants while flows compete, see
# admission.py); an unknown tier gets less than standard.
TIER_WEIGHT: Mapping[str, float] = {"priority": 8.0, "standard": 1.0}
UNKNOWN_TIER_WEIGHT = 0.5
# Rough bytes per token of serialized chat (English text in BPE vocabularies: ~4 bytes).
BYTES_PER_TOKEN = 4
_SEP = b"\x1e"  # record separator between messages: keeps concatenation unambiguous


@dataclasses.dataclass(frozen=True, slots=True)
class RequestFeatures:
    """A request as the policies see it.

    Attributes:
        prefix_blocks: chained 64-bit hashes of the full `block_bytes` blocks of the prompt
            stand-in, in order (at most `max_blocks`); a partial last block is not hashed (an
            engine caches only full KV blocks either).
        root: 64-bit hash of the conversation root (tools, system turns and the first user
            turn, at most `max_blocks` blocks): the same for every turn of one conversation.
        session: 64-bit hash of `x-session-id` (else the request's `user`), or None.
        prompt_tokens: estimated prompt tokens (bytes / 4), for queued-token accounting.
        flow: the admission queue's fair-share flow: the API key id (`x-inferplane-key-id`),
            "" for requests without a key (one flow per weight).
        weight: the flow's weight in the admission queue, from `x-inferplane-tier`
            (`TIER_WEIGHT`; > 0).
        kv_hashes: content hashes of the full KV blocks of the prompt's token ids as the
            engine sees them (`inferplane.kvblocks.chain`, at most the tokenizer step's max
            blocks), for `precise_prefix`; () when the router did not tokenize the request
            (no tokenizer for the route, or another policy). Filled by `router.tokenize`.
        kv_block_size: the tokens per block `kv_hashes` were cut at (0 with no hashes).
        adapter: the LoRA adapter the route names (its catalogue name), "" for the base model
            (issue 29). `prefix_blocks` and `root` are salted with it (`adapter_salt`): KV
            computed under one adapter is never reused by another, so their prefixes never
            share an entry of the approximate table; the base's hashes are unsalted.
    """

    prefix_blocks: tuple[int, ...] = ()
    root: int | None = None
    session: int | None = None
    prompt_tokens: int = 0
    flow: str = ""
    weight: float = 1.0
    kv_hashes: tuple[int, ...] = ()
    kv_block_size: int = 0
    adapter: str = ""


def adapter_salt(adapter: str) -> bytes:
    """What a LoRA adapter's prefix hashes start from (b"" for the base model): its name and a
    unit separator, which no serialized request begins with."""
    return adapter.encode() + b"\x1f" if adapter else b""


def hash64(data: bytes) -> int:
    """A stable 64-bit hash (BLAKE2b-64): the same in every router process, unlike hash()."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def block_hashes(
    data: bytes, block_bytes: int, max_blocks: int, salt: bytes = b""
) -> tuple[int, ...]:
    """Chained hashes of the full `block_bytes` blocks of `data` (hash i covers `salt` and
    blocks 0..i)."""
    full = min(len(data) // block_bytes, max_blocks)
    if full == 0:
        return ()
    h = hashlib.blake2b(salt, digest_size=8)
    out = []
    for i in range(full):
        h.update(data[i * block_bytes : (i + 1) * block_bytes])
        out.append(int.from_bytes(h.copy().digest(), "big"))
    return tuple(out)


def _weight(metadata: Mapping[str, str]) -> float:
    return TIER_WEIGHT.get(metadata.get(headers.TIER, "standard"), UNKNOWN_TIER_WEIGHT)


def _session(metadata: Mapping[str, str], user: str) -> int | None:
    key = metadata.get(SESSION_HEADER) or user
    return hash64(key.encode()) if key else None


@dataclasses.dataclass(frozen=True, slots=True)
class FeatureExtractor:
    """Builds `RequestFeatures` from typed requests; `block_bytes` ~ 64 tokens by default."""

    block_bytes: int = 256
    max_blocks: int = 128

    def _features(
        self,
        parts: Iterable[bytes],
        root_parts: int,
        metadata: Mapping[str, str],
        user: str,
        adapter: str,
    ) -> RequestFeatures:
        chunks = [p + _SEP for p in parts]
        data = b"".join(chunks)
        root_bytes = b"".join(chunks[:root_parts])[: self.block_bytes * self.max_blocks]
        salt = adapter_salt(adapter)
        return RequestFeatures(
            prefix_blocks=block_hashes(data, self.block_bytes, self.max_blocks, salt),
            root=hash64(salt + root_bytes) if root_bytes else None,
            session=_session(metadata, user),
            prompt_tokens=len(data) // BYTES_PER_TOKEN,
            flow=metadata.get(headers.KEY_ID, ""),
            weight=_weight(metadata),
            adapter=adapter,
        )

    def chat(
        self, request: pb.ChatCompletionRequest, metadata: Mapping[str, str], adapter: str = ""
    ) -> RequestFeatures:
        """Features of a chat request: tools, then messages; root = through the first user turn;
        `adapter`: the route's LoRA adapter ("" = the base model)."""
        parts = [t.SerializeToString(deterministic=True) for t in request.tools]
        root = len(parts)
        first_user_seen = False
        for message in request.messages:
            parts.append(message.SerializeToString(deterministic=True))
            if not first_user_seen:
                root = len(parts)
                first_user_seen = message.role == "user"
        return self._features(parts, root, metadata, request.user, adapter)

    def completion(
        self, request: pb.CompletionRequest, metadata: Mapping[str, str], adapter: str = ""
    ) -> RequestFeatures:
        """Features of a text completion: its prompt; root = its first block."""
        data = request.prompt.SerializeToString(deterministic=True)
        return self._features([data], 1, metadata, request.user, adapter)

    def speech(self, audio_bytes: int, metadata: Mapping[str, str]) -> RequestFeatures:
        """Features of a transcription or translation: like an embedding, no prefix blocks
        and no root (the encoder input is audio, never a shared prompt), so the policies
        choose by load; `prompt_tokens` stands for the upload's size (`audio_bytes`)."""
        return RequestFeatures(
            prefix_blocks=(),
            root=None,
            session=_session(metadata, ""),
            prompt_tokens=audio_bytes // BYTES_PER_TOKEN,
            flow=metadata.get(headers.KEY_ID, ""),
            weight=_weight(metadata),
        )

    def embedding(
        self, request: pb.EmbeddingRequest, metadata: Mapping[str, str]
    ) -> RequestFeatures:
        """Features of an embeddings request: no prefix blocks and no conversation root (an
        embedding reuses no KV cache, so affinity buys nothing); its size, flow and weight."""
        data = request.input.SerializeToString(deterministic=True)
        return RequestFeatures(
            prefix_blocks=(),
            root=None,
            session=_session(metadata, request.user),
            prompt_tokens=len(data) // BYTES_PER_TOKEN,
            flow=metadata.get(headers.KEY_ID, ""),
            weight=_weight(metadata),
        )
