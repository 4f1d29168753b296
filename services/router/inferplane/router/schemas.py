"""The JSON schemas a chat request carries, checked before admission.

A schema that is not a JSON schema (`tools[i].function.parameters`,
`response_format.json_schema.schema`) is the client's error: it gets a 400 naming the
parameter here, before it takes a slot or reaches a replica, where a decoding constraint built
from it would fail in the engine (a replica failure to the breakers, and a 503 for everyone
else once they opened). The replica still checks what only the engine's constraint backend can
tell (a schema it cannot compile) and answers 400 too.

Agents send the same tools every turn, so verdicts are cached by the schema's bytes (a
bounded LRU): a repeated schema costs one deterministic serialization.
"""

from __future__ import annotations

import collections
from typing import Any

import jsonschema
from google.protobuf import json_format, struct_pb2
from jsonschema.exceptions import SchemaError

from inferplane.runtime import InvalidArgumentError

__all__ = ["SchemaCheck"]


class SchemaCheck:
    """Checks the schemas of chat requests against the JSON Schema meta-schemas (the draft a
    schema's `$schema` names, else 2020-12), with a bounded cache of verdicts.

    Args:
        cache_size: schemas whose verdict is remembered (least recently used dropped first).
    """

    def __init__(self, cache_size: int = 4096) -> None:
        self._size = cache_size
        self._verdicts: collections.OrderedDict[bytes, str] = collections.OrderedDict()

    def check_chat(self, request: Any) -> None:
        """Raises when a schema of `request` (a `ChatCompletionRequest`) is not a JSON schema.

        Raises:
            InvalidArgumentError: (HTTP 400) naming the parameter; code
                `invalid_function_parameters` or `invalid_json_schema`.
        """
        for i, tool in enumerate(request.tools):
            if tool.function.HasField("parameters"):
                error = self._verdict(tool.function.parameters)
                if error:
                    raise InvalidArgumentError(
                        f"Invalid schema for function '{tool.function.name}': {error}",
                        param=f"tools[{i}].function.parameters",
                        code="invalid_function_parameters",
                    )
        if request.HasField("response_format"):
            fmt = request.response_format.fields
            if fmt.get("type", struct_pb2.Value()).string_value != "json_schema":
                return
            spec = fmt.get("json_schema")
            schema = spec.struct_value.fields.get("schema") if spec is not None else None
            if schema is None or schema.WhichOneof("kind") == "null_value":
                return  # the replica answers for a missing schema
            if schema.WhichOneof("kind") != "struct_value":
                raise InvalidArgumentError(
                    "Invalid schema for response_format: a JSON schema must be an object",
                    param="response_format.json_schema.schema",
                    code="invalid_json_schema",
                )
            error = self._verdict(schema.struct_value)
            if error:
                raise InvalidArgumentError(
                    f"Invalid schema for response_format: {error}",
                    param="response_format.json_schema.schema",
                    code="invalid_json_schema",
                )

    def _verdict(self, schema: struct_pb2.Struct) -> str:
        """ "" when `schema` is a JSON schema, else why not (cached)."""
        key = schema.SerializeToString(deterministic=True)
        verdict = self._verdicts.get(key)
        if verdict is not None:
            self._verdicts.move_to_end(key)
            return verdict
        value = json_format.MessageToDict(schema)
        cls = jsonschema.validators.validator_for(value, default=jsonschema.Draft202012Validator)
        try:
            cls.check_schema(value)
            verdict = ""
        except SchemaError as exc:
            path = "/".join(str(p) for p in exc.absolute_path)
            verdict = f"{exc.message}" + (f" (at /{path})" if path else "")
        self._verdicts[key] = verdict
        if len(self._verdicts) > self._size:
            self._verdicts.popitem(last=False)
        return verdict
