"""Schemas the engine will compile, checked with its own constraint backend first.

The router has already checked every schema of the request against the JSON Schema
meta-schema (`inferplane.router.schemas`). What only the engine's backend can tell is whether
it compiles one: xgrammar (vLLM's default structured-output backend) refuses valid JSON schemas
it does not support (a regex lookbehind, a `$ref` that resolves nowhere, a minimum above its
maximum). A schema it refuses is the client's error: a 400 naming the parameter here, instead
of a refusal from the engine that names none.

Without xgrammar in this process (a replica in front of a remote engine), nothing is checked
here: the engine's refusal still maps to a 400 (`EngineError.rejected`).
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterable, Mapping
from typing import Any

from inferplane.runtime import InvalidArgumentError

__all__ = ["check_compiles"]

_CACHE_SIZE = 1024
_verdicts: collections.OrderedDict[str, str] = collections.OrderedDict()


def _compile_error(text: str) -> str:
    """ "" when xgrammar compiles the schema `text` (or is not installed), else its error."""
    verdict = _verdicts.get(text)
    if verdict is not None:
        _verdicts.move_to_end(text)
        return verdict
    try:
        import xgrammar
    except ImportError:
        return ""
    try:
        xgrammar.Grammar.from_json_schema(text)
        verdict = ""
    except Exception as exc:  # xgrammar raises RuntimeError with its C++ message
        verdict = str(exc).strip().splitlines()[-1].split("] ", 1)[-1][:300] or type(exc).__name__
    _verdicts[text] = verdict
    if len(_verdicts) > _CACHE_SIZE:
        _verdicts.popitem(last=False)
    return verdict


def check_compiles(schemas: Iterable[tuple[str, Mapping[str, Any]]]) -> None:
    """Checks `(param, schema)` pairs that a decoding constraint will hold.

    Raises:
        InvalidArgumentError: (HTTP 400) a schema the backend cannot compile, naming `param`;
            code `invalid_function_parameters` for a tool's, else `invalid_json_schema`.
    """
    for param, schema in schemas:
        error = _compile_error(json.dumps(schema, sort_keys=True, ensure_ascii=False))
        if error:
            tool = param.startswith("tools[")
            raise InvalidArgumentError(
                f"Invalid schema for {'function parameters' if tool else 'response_format'}: "
                f"the decoding constraint backend cannot compile it: {error}",
                param=param,
                code="invalid_function_parameters" if tool else "invalid_json_schema",
            )
