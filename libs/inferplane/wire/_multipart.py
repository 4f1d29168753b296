"""OpenAI's multipart/form-data request bodies (`POST /v1/audio/transcriptions`, `/translations`).

The edge passes these bodies through unparsed (the transcoder's `google.api.HttpBody`): the
endpoint picker reads the `model` field from them and the replica reads the whole form. Both
parse with `python-multipart` (Starlette's and FastAPI's parser, as vLLM's own audio routes),
in one pass over the body, bounded: a file part over `max_file_bytes` stops the parse with a
`FormError` whose `too_large` is set (the edge answers 413, as OpenAI does over 25 MB).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

#: OpenAI's limit on an uploaded audio file (https://platform.openai.com/docs/guides/speech-to-text:
#: "File uploads are currently limited to 25 MB"), read as MiB.
MAX_AUDIO_FILE_BYTES = 25 * 1024 * 1024
#: The largest non-file field kept (a `prompt` is at most a few hundred tokens).
MAX_FIELD_BYTES = 64 * 1024


class FormError(ValueError):
    """A body that is not a readable multipart form, or a part over its limit.

    Attributes:
        param: the form field at fault ("file", a field name) or None for the body itself.
        too_large: a part is over its limit (HTTP 413 rather than 400).
    """

    def __init__(self, message: str, *, param: str | None = None, too_large: bool = False):
        super().__init__(message)
        self.param = param
        self.too_large = too_large


@dataclasses.dataclass(frozen=True, slots=True)
class FormFile:
    """One uploaded file part: `filename` as the client named it ("" when absent), its
    declared `content_type` ("" when absent) and its bytes (empty when not kept)."""

    filename: str
    content_type: str
    data: bytes
    size: int


@dataclasses.dataclass(frozen=True, slots=True)
class Form:
    """A parsed form: every text field's values in order (`timestamp_granularities[]` may
    repeat) and the file parts by field name."""

    fields: Mapping[str, tuple[str, ...]]
    files: Mapping[str, FormFile]

    def get(self, name: str, default: str | None = None) -> str | None:
        """The last value of text field `name`, or `default` when absent."""
        values = self.fields.get(name)
        return values[-1] if values else default


def boundary_of(content_type: str) -> bytes:
    """The boundary of a `multipart/form-data; boundary=...` content type.

    Raises:
        FormError: another content type, or no boundary.
    """
    kind, options = parse_options_header(content_type)
    if kind != b"multipart/form-data":
        raise FormError(
            f"the request body must be multipart/form-data, not {content_type or 'empty'!r}"
        )
    boundary = options.get(b"boundary", b"")
    if not boundary:
        raise FormError("the multipart/form-data content type has no boundary")
    return boundary


def _mb(size: int) -> str:
    return f"{size / (1024 * 1024):g} MB ({size} bytes)"


class _Collector:
    __slots__ = (
        "_chunks",
        "_field",
        "_filename",
        "_headers",
        "_is_file",
        "_keep_files",
        "_max_field",
        "_max_file",
        "_name",
        "_only",
        "_size",
        "_type",
        "_value",
        "fields",
        "files",
    )

    def __init__(
        self, *, keep_files: bool, max_file: int, max_field: int, only: frozenset[str] | None
    ) -> None:
        self.fields: dict[str, list[str]] = {}
        self.files: dict[str, FormFile] = {}
        self._headers: dict[str, str] = {}
        self._field = bytearray()
        self._value = bytearray()
        self._name = ""
        self._filename: str | None = None
        self._type = ""
        self._size = 0
        self._chunks: list[bytes] = []
        self._is_file = False
        self._keep_files = keep_files
        self._max_file = max_file
        self._max_field = max_field
        self._only = only

    def on_part_begin(self) -> None:
        self._headers = {}
        self._chunks = []
        self._size = 0

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._field += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def on_header_end(self) -> None:
        self._headers[self._field.decode("latin-1").lower()] = self._value.decode("utf-8")
        self._field.clear()
        self._value.clear()

    def on_headers_finished(self) -> None:
        disposition, options = parse_options_header(self._headers.get("content-disposition", ""))
        if disposition != b"form-data" or b"name" not in options:
            raise FormError("a multipart part has no form-data name")
        self._name = options[b"name"].decode("utf-8", "replace")
        filename = options.get(b"filename")
        self._filename = filename.decode("utf-8", "replace") if filename is not None else None
        self._type = self._headers.get("content-type", "")
        self._is_file = self._filename is not None

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        self._size += end - start
        if self._is_file:
            if self._size > self._max_file:
                raise FormError(
                    f"the file is larger than the limit of {_mb(self._max_file)}",
                    param=self._name,
                    too_large=True,
                )
            if self._keep_files:
                self._chunks.append(data[start:end])
            return
        if self._size > self._max_field:
            raise FormError(
                f"the form field {self._name!r} is over {self._max_field} bytes",
                param=self._name,
                too_large=True,
            )
        if self._only is None or self._name in self._only:
            self._chunks.append(data[start:end])

    def on_part_end(self) -> None:
        if self._is_file:
            self.files[self._name] = FormFile(
                filename=self._filename or "",
                content_type=self._type,
                data=b"".join(self._chunks),
                size=self._size,
            )
        elif self._only is None or self._name in self._only:
            try:
                value = b"".join(self._chunks).decode("utf-8")
            except UnicodeDecodeError:
                raise FormError(
                    f"the form field {self._name!r} is not UTF-8 text", param=self._name
                ) from None
            self.fields.setdefault(self._name, []).append(value)


def read_form(
    content_type: str,
    body: bytes,
    *,
    max_file_bytes: int = MAX_AUDIO_FILE_BYTES,
    max_field_bytes: int = MAX_FIELD_BYTES,
    keep_files: bool = True,
    only: frozenset[str] | None = None,
) -> Form:
    """Parses a multipart/form-data `body` whose `Content-Type` header is `content_type`.

    `keep_files=False` measures file parts without copying them (the picker only needs
    `model`); `only` keeps just those text fields. A file part is one with a `filename`.

    Raises:
        FormError: not multipart/form-data, no boundary, a malformed or truncated body, a part
            without a name, a text field that is not UTF-8 (400), or a file over
            `max_file_bytes` / a field over `max_field_bytes` (`too_large`: 413).
    """
    boundary = boundary_of(content_type)
    collector = _Collector(
        keep_files=keep_files, max_file=max_file_bytes, max_field=max_field_bytes, only=only
    )
    callbacks = {
        name: getattr(collector, name)
        for name in (
            "on_part_begin",
            "on_part_data",
            "on_part_end",
            "on_header_field",
            "on_header_value",
            "on_header_end",
            "on_headers_finished",
        )
    }
    ended: list[bool] = []
    callbacks["on_end"] = lambda: ended.append(True)
    parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
    try:
        parser.write(body)
        parser.finalize()
    except FormError:
        raise
    except MultipartParseError as exc:
        raise FormError(f"the multipart/form-data body is malformed: {exc}") from None
    if not ended:
        raise FormError("the multipart/form-data body is truncated (no closing boundary)")
    return Form(
        fields={k: tuple(v) for k, v in collector.fields.items()},
        files=dict(collector.files),
    )
