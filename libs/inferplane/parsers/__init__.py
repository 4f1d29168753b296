"""inferplane.parsers: reasoning + tool-call parsing, validation and decoding constraints.

Pure Python (no grpc, no torch). The replica process calls it on the hot token path::

    parser = build_parser("kimi_k2", vocab=tokenizer.get_vocab())
    s = parser.start(thinking=True)             # tool_calls=False: tool_choice "none"
    d = s.feed("text delta", token_ids=[...])   # -> Delta
    d = s.finish()
    res = s.result()                            # -> ParseResult, the whole response
    n = s.reasoning_tokens                      # ids fed while in reasoning
    res = parser.parse(full_text, thinking=True)  # -> ParseResult
    s = parser.start(thinking=True, tools=request["tools"])  # names resolved, args coerced

Formats (``default_registry().names``): ``kimi_k2``, ``qwen3`` (hermes-style JSON calls),
``deepseek_v31``, ``glm45`` (key/value calls), ``gpt_oss`` (OpenAI's harmony: channels routed
by their header). ``PlainSession()`` has the same surface for
output with no format (all content, verbatim).
"""

from inferplane.parsers._answer import answer_excludes, unenforced_keyword
from inferplane.parsers._arguments import ToolSet
from inferplane.parsers._config import (
    Action,
    ArgumentsFormat,
    EngineConfig,
    Sink,
    Transition,
)
from inferplane.parsers._constrain import (
    Constraint,
    build_json_constraint,
    build_tool_constraint,
)
from inferplane.parsers._deepseek_v31 import DEEPSEEK_V31_MARKERS, deepseek_v31_config
from inferplane.parsers._errors import (
    ConstraintError,
    InvalidToolCallError,
    ParserError,
    UnknownParserError,
)
from inferplane.parsers._glm45 import GLM45_MARKERS, glm45_config
from inferplane.parsers._gpt_oss import GPT_OSS_MARKERS, gpt_oss_config
from inferplane.parsers._kimi_k2 import (
    KIMI_K2_MARKER_VARIANTS,
    KIMI_K2_MARKERS,
    kimi_k2_config,
    split_kimi_header,
)
from inferplane.parsers._parser import Parser
from inferplane.parsers._plain import PlainSession
from inferplane.parsers._qwen3 import QWEN3_MARKERS, qwen3_config
from inferplane.parsers._registry import ParserRegistry, build_parser, default_registry
from inferplane.parsers._session import Session
from inferplane.parsers._syntax import CallSyntax
from inferplane.parsers._types import Delta, ParseResult, ToolCall, ToolCallDelta
from inferplane.parsers._validate import (
    ToolCallVerdict,
    ToolValidator,
    VerdictReason,
    validate_tool_calls,
)

__all__ = [
    "DEEPSEEK_V31_MARKERS",
    "GLM45_MARKERS",
    "GPT_OSS_MARKERS",
    "KIMI_K2_MARKERS",
    "KIMI_K2_MARKER_VARIANTS",
    "QWEN3_MARKERS",
    "Action",
    "ArgumentsFormat",
    "CallSyntax",
    "Constraint",
    "ConstraintError",
    "Delta",
    "EngineConfig",
    "InvalidToolCallError",
    "ParseResult",
    "Parser",
    "ParserError",
    "ParserRegistry",
    "PlainSession",
    "Session",
    "Sink",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallVerdict",
    "ToolSet",
    "ToolValidator",
    "Transition",
    "UnknownParserError",
    "VerdictReason",
    "answer_excludes",
    "build_json_constraint",
    "build_parser",
    "build_tool_constraint",
    "deepseek_v31_config",
    "default_registry",
    "glm45_config",
    "gpt_oss_config",
    "kimi_k2_config",
    "qwen3_config",
    "split_kimi_header",
    "unenforced_keyword",
    "validate_tool_calls",
]
