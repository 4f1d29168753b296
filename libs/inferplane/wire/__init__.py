"""OpenAI JSON ⇄ inferplane.inference.v1 messages, and OpenAI's SSE framing.

The edge's transcoder parses request bodies into protos; internal code sometimes needs the
request back as OpenAI JSON (the renderer takes dicts), and the router writes streamed chunks
as exact SSE bytes (`data: {json}\\n\\n`, then `data: [DONE]\\n\\n`). Two proto JSON-mapping
quirks are undone here: int64 fields print as strings, and numbers inside
`google.protobuf.Struct` come back as floats (`0` → `0.0`: Struct holds every number as a
`double`, google/protobuf/struct.proto).
The audio routes' multipart/form-data bodies pass the edge unparsed; `read_form` reads them.
"""

from inferplane.wire._codec import (
    SSE_DONE,
    chat_completion_to_dict,
    chat_request_from_dict,
    chat_request_to_dict,
    chunk_to_json,
    completion_chunk_to_json,
    completion_request_from_dict,
    completion_request_to_dict,
    completion_to_dict,
    error_body,
    restore_ints,
    sse_error,
    sse_event,
)
from inferplane.wire._multipart import (
    MAX_AUDIO_FILE_BYTES,
    Form,
    FormError,
    FormFile,
    read_form,
)
from inferplane.wire._summary import SUMMARY_KEYS, ResponseSummary

__all__ = [
    "MAX_AUDIO_FILE_BYTES",
    "SSE_DONE",
    "SUMMARY_KEYS",
    "Form",
    "FormError",
    "FormFile",
    "ResponseSummary",
    "chat_completion_to_dict",
    "chat_request_from_dict",
    "chat_request_to_dict",
    "chunk_to_json",
    "completion_chunk_to_json",
    "completion_request_from_dict",
    "completion_request_to_dict",
    "completion_to_dict",
    "error_body",
    "read_form",
    "restore_ints",
    "sse_error",
    "sse_event",
]
