"""The request-body fields the transcoder understands, derived from the descriptor set.

Envoy's grpc_json_transcoder drops JSON body keys its request message does not define, with
no option to reject them (its `request_validation_options` cover methods, query parameters and
binding collisions only; envoyproxy/envoy#46623). OpenAI answers such a key with a 400
"Unrecognized request argument supplied: X", so a typo (`"temprature"`) must not be served as
if it were absent. `known_request_fields` reads, for every REST route with a body, which keys
the transcoder accepts at each level of the body, and `render_lua_tables` writes them into
`lua/field_guard.lua`, which checks each body before the transcoder sees it.

Which names count: a field's proto name and its `json_name` (lowerCamelCase), and nothing
else — measured on Envoy 1.40: `max_tokens` and `maxTokens` set the field, while `MaxTokens`,
`max-tokens`, `MAX_TOKENS` and `maxtokens` are dropped. Inside a message-typed field the same
rule applies recursively (each chat message, `tools[].function`, `stream_options`, ...). A
field whose type has its own JSON form (`google.protobuf.Struct`, `Value`, `ListValue`,
`Timestamp`, `FieldMask`, wrappers, ...) takes any content: the transcoder keeps all of it
(`response_format`, `metadata`, `tools[].function.parameters`, message `content`), so it is
not checked.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from google.api import annotations_pb2, http_pb2
from google.protobuf import descriptor, descriptor_pb2, descriptor_pool

#: Message types in this package have a special JSON form; their content is not checked.
_OWN_JSON_PACKAGE = "google.protobuf"
#: Lua pattern magic characters (Lua 5.1 manual §5.4.1), escaped with `%` in literals.
_LUA_MAGIC = frozenset("^$()%.[]*+-?")


@dataclasses.dataclass(frozen=True, slots=True)
class Nested:
    """A message-typed field whose JSON object is checked in turn.

    Attributes:
        message: the full proto name of the nested message (`inferplane.inference.v1.ChatMessage`).
        map: the field is a `map<K, message>`: its keys are free, each value is a `message`.
    """

    message: str
    map: bool = False


#: A known JSON key: `None` for a value not checked further (scalars, enums, repeated scalars,
#: well-known types), or the `Nested` message its object (or each list element) must match.
FieldKind = Nested | None


@dataclasses.dataclass(frozen=True, slots=True)
class BodyRoute:
    """One REST binding with a request body.

    Attributes:
        method: the HTTP method, upper case (`POST`, `PATCH`, ...).
        template: the HttpRule path template (`/v1/admin/{name=api-keys/*}:revoke`).
        message: the full proto name of the message the JSON body is parsed into (the request
            message for `body: "*"`, else the type of the field `body` names).
    """

    method: str
    template: str
    message: str

    @property
    def lua_pattern(self) -> str:
        """`template` as an anchored Lua pattern over the path without its query string."""
        return template_lua_pattern(self.template)


@dataclasses.dataclass(frozen=True, slots=True)
class KnownFields:
    """What the transcoder accepts in request bodies.

    Attributes:
        messages: for each message reachable from a body (full proto name), its accepted JSON
            keys (proto name and json_name of every field) and what each holds.
        routes: the REST bindings that take a body, in descriptor order.
    """

    messages: Mapping[str, Mapping[str, FieldKind]]
    routes: tuple[BodyRoute, ...]

    def keys(self, message: str) -> frozenset[str]:
        """The JSON keys `message` accepts. Raises: KeyError for a message no body reaches."""
        return frozenset(self.messages[message])


def template_lua_pattern(template: str) -> str:
    """An HttpRule path template (google/api/http.proto grammar) as an anchored Lua pattern.

    `*` and a bare `{var}` match one path segment, `**` any number of them (slashes
    included), literals match themselves, a trailing `:verb` matches literally; e.g.
    `/v1/admin/{name=api-keys/*}:revoke` → `^/v1/admin/api%-keys/[^/]+:revoke$`.

    Raises: ValueError for a template that does not start with `/` or has unbalanced braces.
    """
    if not template.startswith("/"):
        raise ValueError(f"path template {template!r} does not start with '/'")
    out: list[str] = []
    i = 0
    while i < len(template):
        char = template[i]
        if char == "{":
            end = template.find("}", i)
            if end < 0:
                raise ValueError(f"path template {template!r} has an unclosed '{{'")
            _, eq, segments = template[i + 1 : end].partition("=")
            out.append(_segments_pattern(segments) if eq else "[^/]+")
            i = end + 1
        elif char == "}":
            raise ValueError(f"path template {template!r} has an unopened '}}'")
        elif template.startswith("**", i):
            out.append(".*")
            i += 2
        elif char == "*":
            out.append("[^/]+")
            i += 1
        else:
            out.append("%" + char if char in _LUA_MAGIC else char)
            i += 1
    return "^" + "".join(out) + "$"


def _segments_pattern(segments: str) -> str:
    parts = []
    for segment in segments.split("/"):
        if segment == "**":
            parts.append(".*")
        elif segment == "*":
            parts.append("[^/]+")
        else:
            parts.append("".join("%" + c if c in _LUA_MAGIC else c for c in segment))
    return "/".join(parts)


def _rule_bindings(rule: http_pb2.HttpRule) -> Iterable[http_pb2.HttpRule]:
    yield rule
    for extra in rule.additional_bindings:
        yield from _rule_bindings(extra)


def _verb_and_template(rule: http_pb2.HttpRule) -> tuple[str, str] | None:
    kind = rule.WhichOneof("pattern")
    if kind is None:
        return None
    if kind == "custom":
        return rule.custom.kind.upper(), rule.custom.path
    return kind.upper(), str(getattr(rule, kind))


def _http_rule(method: descriptor_pb2.MethodDescriptorProto) -> http_pb2.HttpRule | None:
    # Re-parsed: whether the option was parsed as the extension when the descriptor set was
    # read depends on what the process had imported then; annotations_pb2 is imported now.
    options = descriptor_pb2.MethodOptions.FromString(method.options.SerializeToString())
    if not options.HasExtension(annotations_pb2.http):
        return None
    rule: http_pb2.HttpRule = options.Extensions[annotations_pb2.http]
    return rule


#: A body of this type is the client's raw bytes (the transcoder parses nothing: multipart
#: audio uploads), so it has no keys to check.
_RAW_BODY = "google.api.HttpBody"


def _field_kind(field: descriptor.FieldDescriptor) -> FieldKind:
    if field.message_type is None:
        return None
    message = field.message_type
    if message.GetOptions().map_entry:
        value = message.fields_by_name["value"]
        inner = _field_kind(value)
        return Nested(inner.message, map=True) if inner is not None else None
    if message.file.package == _OWN_JSON_PACKAGE:
        return None
    return Nested(message.full_name)


def known_request_fields(descriptor_set: bytes, services: Iterable[str]) -> KnownFields:
    """The JSON body keys the transcoder accepts for `services`' REST bindings.

    Args:
        descriptor_set: a serialized `google.protobuf.FileDescriptorSet` with imports (what
            the transcoder is given).
        services: full service names (`inferplane.inference.v1.InferenceService`).

    Returns: every binding (`google.api.http` rule and its additional bindings) that has a
    `body`, and the accepted keys of every message reachable from those bodies through
    message-typed fields (see the module docstring for which names and types count).

    Raises: KeyError naming a service the set does not define; ValueError for a `body` that
    names no field of the request message.
    """
    files = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set).file
    pool = descriptor_pool.DescriptorPool()
    for file in files:
        pool.Add(file)
    protos = {
        f"{file.package}.{service.name}" if file.package else service.name: service
        for file in files
        for service in file.service
    }
    routes: list[BodyRoute] = []
    for service_name in services:
        if service_name not in protos:
            raise KeyError(f"service {service_name} is not in the descriptor set")
        service = pool.FindServiceByName(service_name)
        for method_proto in protos[service_name].method:
            rule = _http_rule(method_proto)
            if rule is None:
                continue
            request = service.methods_by_name[method_proto.name].input_type
            for binding in _rule_bindings(rule):
                pattern = _verb_and_template(binding)
                if pattern is None or not binding.body:
                    continue
                if binding.body == "*":
                    body_type = request.full_name
                else:
                    field = request.fields_by_name.get(binding.body)
                    if field is None:
                        raise ValueError(
                            f"{service_name}.{method_proto.name}: body {binding.body!r} is not "
                            f"a field of {request.full_name}"
                        )
                    kind = _field_kind(field)
                    if kind is None or kind.map:
                        continue  # the body is a scalar or free-form value: nothing to check
                    if kind.message == _RAW_BODY:
                        continue  # the client's bytes, passed through unparsed (audio uploads)
                    body_type = kind.message
                routes.append(BodyRoute(pattern[0], pattern[1], body_type))
    messages: dict[str, Mapping[str, FieldKind]] = {}
    pending = [route.message for route in routes]
    while pending:
        name = pending.pop()
        if name in messages:
            continue
        keys: dict[str, FieldKind] = {}
        for field in pool.FindMessageTypeByName(name).fields:
            kind = _field_kind(field)
            keys[field.name] = keys[field.json_name] = kind
            if kind is not None:
                pending.append(kind.message)
        messages[name] = MappingProxyType(keys)
    return KnownFields(MappingProxyType(messages), tuple(routes))


def render_lua_tables(known: KnownFields) -> str:
    """`known` as Lua source defining `TYPES` and `ROUTES` for `lua/field_guard.lua`.

    `TYPES[n]` maps each accepted key of message n to 0 (not checked further), n' (an
    object, or list of objects, of message n') or -n' (a map whose values are message n').
    `ROUTES` holds `{method, pattern, n}` per binding. Numbering follows the routes, then the
    fields in declaration order, so the output is the same for the same descriptor set.
    """
    order: dict[str, int] = {}

    def number(message: str) -> int:
        if message not in order:
            order[message] = len(order) + 1
            for kind in known.messages[message].values():
                if kind is not None:
                    number(kind.message)
        return order[message]

    route_lines = [
        f"  {{{json.dumps(r.method)}, {json.dumps(r.lua_pattern)}, {number(r.message)}}},"
        f"  -- {r.method} {r.template}"
        for r in known.routes
    ]
    type_lines = []
    for message, n in order.items():
        entries = []
        for key, kind in known.messages[message].items():
            value = 0 if kind is None else order[kind.message] * (-1 if kind.map else 1)
            entries.append(f"[{json.dumps(key)}]={value}")
        type_lines.append(f"TYPES[{n}] = {{{', '.join(entries)}}}  -- {message}")
    return "\n".join(
        [
            "-- Generated by inferplane.edge from the transcoder's descriptor set (_fields.py).",
            "local TYPES = {}",
            *type_lines,
            "local ROUTES = {",
            *route_lines,
            "}",
        ]
    )
