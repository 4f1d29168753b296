"""A prompt whose size alone proves it cannot fit the model's context, refused before it is
tokenized (issue 31 part 5).

The rule: a tokenizer turns text into tokens each of which stands for at most `L` bytes of
the text it reads (`TokenBound.bytes_per_token`). A prompt whose text is `B` bytes therefore
has at least `B / L` tokens, and when `B > max_model_len × L` it has more tokens than the
whole context holds: it can never be served, whatever the output length. Counting bytes
costs one pass over the request's strings; tokenizing an 8 MiB body costs the replica's CPU
for seconds (the issue measured 19 s for ~10 MiB).

`L` comes from the tokenizer itself (`token_bound`, read once from its `tokenizer.json`, or
from a tiktoken vocabulary such as Kimi's `tiktoken.model`: `tiktoken_bound`):
the longest token in bytes (vocabulary and added tokens; a byte-level BPE token is one byte
per character, any other token its UTF-8 length, an upper bound of what it decodes to),
times 4 when the tokenizer normalizes Unicode (NFC/NFKC/NFD/NFKD, lowercase: one character
becomes one of at least a quarter of its bytes, measured over every code point; NFKC maps
U+1D400 `𝐀`, 4 bytes, to `A`). The rule only holds when every byte of the text becomes part
of some token; a tokenizer that can drop text or swallow a run of it into one unknown token
has no bound (`None`: nothing is refused):

- models: BPE that reads bytes (a `ByteLevel` pre-tokenizer or `byte_fallback`), Unigram with
  `byte_fallback`; not WordPiece, WordLevel, or BPE/Unigram with an unknown token instead.
- normalizers: Unicode forms, lowercase, `Prepend`, `Replace` to a non-empty string; not
  `Strip`, `StripAccents`, `BertNormalizer`, SentencePiece's `Precompiled` (may collapse
  whitespace) or a `Replace` that deletes.
- pre-tokenizers: `ByteLevel`, `Metaspace`, `Split` that keeps what it matches, `Digits`,
  `Punctuation`, `UnicodeScripts`; not the whitespace-dropping ones.

What is counted (`prompt_text_bytes`) is only text the prompt is sure to contain verbatim:
the `system`, `developer` and `user` messages' text (a string, or the text parts), each
stripped of leading and trailing whitespace (chat templates often `trim` it); an assistant
turn's text is not counted (templates may drop earlier reasoning from it), nor tools or
images (they only add tokens). A text completion's prompt counts whole; token ids count as
tokens, exactly.
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.runtime import InvalidArgumentError

#: OpenAI's code for a prompt over the context (kvfit's refusal uses the same).
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
#: The largest shrink of a text's UTF-8 bytes by a Unicode normalization or lowercasing.
NORMALIZATION_FACTOR = 4
#: Roles whose text every chat template renders verbatim (up to surrounding whitespace).
COUNTED_ROLES = frozenset({"system", "developer", "user"})
_TEXT_PART_TYPES = frozenset({"text", "input_text"})

_NORMALIZERS_KEEPING = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend"})
_NORMALIZERS_SHRINKING = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})
_PRE_TOKENIZERS_KEEPING = frozenset(
    {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts"}
)


@dataclasses.dataclass(frozen=True, slots=True)
class TokenBound:
    """The most bytes of prompt text one token of a tokenizer can stand for.

    Attributes:
        longest_token_bytes: the longest token in bytes (vocabulary and added tokens).
        normalization_factor: `NORMALIZATION_FACTOR` when the tokenizer normalizes Unicode,
            else 1.
    """

    longest_token_bytes: int
    normalization_factor: int = 1

    @property
    def bytes_per_token(self) -> int:
        """`L`: prompt text bytes per token at most."""
        return self.longest_token_bytes * self.normalization_factor

    def limit_bytes(self, max_model_len: int) -> int:
        """The prompt text bytes above which no prompt fits `max_model_len` tokens."""
        return max_model_len * self.bytes_per_token


def _components(node: Mapping[str, Any] | None, key: str) -> Iterator[Mapping[str, Any]]:
    """The leaves of a normalizer or pre-tokenizer (a `Sequence` holds them under `key`)."""
    if not node:
        return
    if node.get("type") == "Sequence":
        for child in node.get(key) or ():
            yield from _components(child, key)
    else:
        yield node


def _keeps_text(tokenizer: Mapping[str, Any]) -> tuple[bool, bool]:
    """(whether every byte of the text reaches some token, whether it is normalized)."""
    normalized = False
    for norm in _components(tokenizer.get("normalizer"), "normalizers"):
        kind = norm.get("type")
        if kind == "Replace" and norm.get("content"):
            continue
        if kind not in _NORMALIZERS_KEEPING:
            return False, False
        normalized = normalized or kind in _NORMALIZERS_SHRINKING
    for pre in _components(tokenizer.get("pre_tokenizer"), "pretokenizers"):
        kind = pre.get("type")
        if kind not in _PRE_TOKENIZERS_KEEPING:
            return False, False
        if kind == "Split" and str(pre.get("behavior", "")).lower() == "removed":
            return False, False
    return True, normalized


def _byte_level(tokenizer: Mapping[str, Any]) -> bool:
    return any(
        p.get("type") == "ByteLevel"
        for p in _components(tokenizer.get("pre_tokenizer"), "pretokenizers")
    )


def token_bound_of(tokenizer: Mapping[str, Any]) -> TokenBound | None:
    """The bound of a parsed `tokenizer.json`, or None when it has none (module docstring)."""
    model = tokenizer.get("model") or {}
    kind = model.get("type")
    byte_level = _byte_level(tokenizer)
    pieces: Iterable[str]
    if kind == "BPE" and (byte_level or model.get("byte_fallback")):
        pieces = (model.get("vocab") or {}).keys()
    elif kind == "Unigram" and model.get("byte_fallback"):
        pieces = (str(entry[0]) for entry in model.get("vocab") or ())
    else:
        return None
    keeps, normalized = _keeps_text(tokenizer)
    if not keeps:
        return None
    # A byte-level token is one byte per character (GPT-2's byte-to-unicode table).
    longest = max((len(p) if byte_level else len(p.encode()) for p in pieces), default=0)
    for added in tokenizer.get("added_tokens") or ():
        longest = max(longest, len(str(added.get("content", "")).encode()))
    if longest <= 0:
        return None
    return TokenBound(longest, NORMALIZATION_FACTOR if normalized else 1)


#: A tiktoken vocabulary (Kimi's `tiktoken.model`): one `base64(token bytes) rank` per line.
TIKTOKEN_FILE = "tiktoken.model"


def tiktoken_bound(folder: Path) -> TokenBound | None:
    """The bound of a tiktoken tokenizer (`TIKTOKEN_FILE`, byte-level BPE: every byte is a
    token, nothing is normalized or dropped): its longest token, or a special token of
    `tokenizer_config.json`'s `added_tokens_decoder` when longer; None without the file."""
    try:
        lines = (folder / TIKTOKEN_FILE).read_bytes().splitlines()
        longest = max((len(base64.b64decode(line.split()[0])) for line in lines if line), default=0)
    except (OSError, ValueError, IndexError):
        return None
    try:
        config = json.loads((folder / "tokenizer_config.json").read_bytes())
    except (OSError, ValueError):
        config = {}
    added = config.get("added_tokens_decoder") if isinstance(config, dict) else None
    for token in (added or {}).values():
        if isinstance(token, dict):
            longest = max(longest, len(str(token.get("content", "")).encode()))
    return TokenBound(longest) if longest > 0 else None


def token_bound(folder: str | Path) -> TokenBound | None:
    """The bound of the tokenizer in model folder `folder` (its `tokenizer.json`, else its
    `TIKTOKEN_FILE`); None when there is neither or it has no bound. Reads and parses the
    file (tens of MB for a large vocabulary: call it once per folder, off the event loop)."""
    path = Path(folder) / "tokenizer.json"
    try:
        with path.open("rb") as f:
            parsed = json.load(f)
    except FileNotFoundError:
        return tiktoken_bound(Path(folder))
    except (OSError, ValueError):
        return None
    return token_bound_of(parsed) if isinstance(parsed, dict) else None


def _utf8_bytes(text: str) -> int:
    """`text`'s UTF-8 length; ASCII text (CPython knows it without a scan) is not encoded."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _stripped_bytes(text: str) -> int:
    return _utf8_bytes(text.strip())


def _content_bytes(content: Any) -> int:
    """UTF-8 bytes of a message's text: a string content, or its text parts (a `Value`)."""
    kind = content.WhichOneof("kind")
    if kind == "string_value":
        return _stripped_bytes(content.string_value)
    if kind != "list_value":
        return 0
    total = 0
    for part in content.list_value.values:
        if part.WhichOneof("kind") != "struct_value":
            continue
        fields = part.struct_value.fields
        if fields.get("type") is None or fields["type"].string_value not in _TEXT_PART_TYPES:
            continue
        text = fields.get("text")
        if text is not None and text.WhichOneof("kind") == "string_value":
            total += _stripped_bytes(text.string_value)
    return total


def prompt_text_bytes(request: Any) -> tuple[int, int]:
    """(text bytes the prompt surely contains, token ids it surely holds) of a
    `ChatCompletionRequest` or `CompletionRequest` (module docstring); (0, 0) for another
    request. A completion with several prompts gives its largest (each is served alone)."""
    if isinstance(request, pb.ChatCompletionRequest):
        counted = (m for m in request.messages if m.role in COUNTED_ROLES)
        return sum(_content_bytes(m.content) for m in counted), 0
    if isinstance(request, pb.CompletionRequest):
        prompt = request.prompt
        kind = prompt.WhichOneof("kind")
        if kind == "string_value":
            return _utf8_bytes(prompt.string_value), 0
        if kind != "list_value":
            return 0, 0
        values = prompt.list_value.values
        if values and all(v.WhichOneof("kind") == "number_value" for v in values):
            return 0, len(values)
        longest_text = longest_ids = 0
        for value in values:
            inner = value.WhichOneof("kind")
            if inner == "string_value":
                size = _utf8_bytes(value.string_value)
                longest_text = max(longest_text, size)
            elif inner == "list_value":
                longest_ids = max(longest_ids, len(value.list_value.values))
        return longest_text, longest_ids
    return 0, 0


def check_prompt_size(request: Any, max_model_len: int, bound: TokenBound | None) -> None:
    """Refuses a request whose prompt cannot fit `max_model_len` tokens by its size alone.

    Args:
        request: a `ChatCompletionRequest` or `CompletionRequest` (others pass).
        max_model_len: the model's context in tokens (0: unknown, nothing is refused).
        bound: the tokenizer's `TokenBound` (None: no bound, only token ids are checked).

    Raises:
        InvalidArgumentError: 400 `context_length_exceeded` (param `messages` or `prompt`).
    """
    if max_model_len <= 0:
        return
    text_bytes, token_ids = prompt_text_bytes(request)
    param = "messages" if isinstance(request, pb.ChatCompletionRequest) else "prompt"
    if token_ids > max_model_len:
        raise InvalidArgumentError(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{token_ids} tokens.",
            param=param,
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    if bound is None or text_bytes <= bound.limit_bytes(max_model_len):
        return
    raise InvalidArgumentError(
        f"This model's maximum context length is {max_model_len} tokens; the prompt's "
        f"{text_bytes} bytes of text are at least {-(-text_bytes // bound.bytes_per_token)} "
        f"tokens (a token stands for at most {bound.bytes_per_token} bytes). Please reduce "
        "the length of the messages or prompt.",
        param=param,
        code=CONTEXT_LENGTH_EXCEEDED,
    )


class TokenBounds:
    """Each tokenizer folder's `TokenBound`, computed once per folder in a worker thread.

    `get` never blocks: the first call for a folder starts the computation and answers None
    (no bound yet: the request is not checked), later calls the result. A folder without a
    readable or bounded tokenizer stays None. Not thread-safe: call it from one thread (the
    event loop).
    """

    def __init__(
        self,
        loader: Callable[[str], TokenBound | None] = token_bound,
        executor: concurrent.futures.Executor | None = None,
    ) -> None:
        self._loader = loader
        self._executor = executor
        self._futures: dict[str, concurrent.futures.Future[TokenBound | None]] = {}

    def get(self, folder: str) -> TokenBound | None:
        """The bound of `folder`'s tokenizer, or None (unknown yet, none there, or "")."""
        if not folder:
            return None
        future = self._futures.get(folder)
        if future is None:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="token-bound"
                )
            future = self._futures[folder] = self._executor.submit(self._loader, folder)
        if not future.done() or future.exception() is not None:
            return None
        return future.result()
