"""The field guard's tables: which JSON body keys each REST route accepts, derived from the
descriptor set (proto names and json_names, recursively through message fields), and their
rendering into the Lua filter."""

from __future__ import annotations

from types import ModuleType

import pytest
from google.api import annotations_pb2, http_pb2
from google.protobuf import descriptor_pb2, struct_pb2
from google.protobuf.descriptor import Descriptor

import inferplane.edge as edge
from inferplane.api.auth.v1 import auth_pb2
from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.edge import BodyRoute, EdgeConfig, Endpoint, Nested, known_request_fields

INFERENCE = "inferplane.inference.v1"
KNOWN = known_request_fields(edge.load_descriptor_set(), edge.DEFAULT_SERVICES)


def _names(message: Descriptor) -> set[str]:
    return {f.name for f in message.fields} | {f.json_name for f in message.fields}


def test_every_field_of_the_chat_request_is_known_by_both_json_names() -> None:
    """Derived from the descriptors, not listed: every field of the generated
    ChatCompletionRequest, under its proto name and its json_name, and nothing else."""
    keys = KNOWN.keys(f"{INFERENCE}.ChatCompletionRequest")
    assert keys == _names(pb.ChatCompletionRequest.DESCRIPTOR)
    assert {"max_tokens", "maxTokens", "temperature", "stream_options"} <= keys
    assert "temprature" not in keys and "MaxTokens" not in keys


def test_vllm_extensions_the_protos_carry_are_known() -> None:
    for message in ("ChatCompletionRequest", "CompletionRequest"):
        keys = KNOWN.keys(f"{INFERENCE}.{message}")
        assert {"top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens"} <= keys
    assert "chat_template_kwargs" in KNOWN.keys(f"{INFERENCE}.ChatCompletionRequest")


def test_nested_messages_are_checked_and_free_form_values_are_not() -> None:
    chat = KNOWN.messages[f"{INFERENCE}.ChatCompletionRequest"]
    assert chat["messages"] == chat["messages"] == Nested(f"{INFERENCE}.ChatMessage")
    assert chat["tools"] == Nested(f"{INFERENCE}.Tool")
    assert chat["stream_options"] == chat["streamOptions"] == Nested(f"{INFERENCE}.StreamOptions")
    # Struct / Value fields: the transcoder keeps every key, so none is checked.
    for free in ("response_format", "metadata", "chat_template_kwargs", "stop", "tool_choice"):
        assert chat[free] is None, free
    message = KNOWN.messages[f"{INFERENCE}.ChatMessage"]
    assert set(message) == _names(pb.ChatMessage.DESCRIPTOR)
    assert message["content"] is None
    assert message["tool_calls"] == Nested(f"{INFERENCE}.ToolCall")
    assert KNOWN.messages[f"{INFERENCE}.ToolCall"]["function"] == Nested(
        f"{INFERENCE}.FunctionCall"
    )
    function = KNOWN.messages[f"{INFERENCE}.Tool"]["function"]
    assert function == Nested(f"{INFERENCE}.FunctionDefinition")
    assert KNOWN.messages[function.message]["parameters"] is None
    # Responses: typed at the top level; the polymorphic values (input, tools, text, ...) free.
    responses = KNOWN.messages[f"{INFERENCE}.ResponseRequest"]
    assert set(responses) >= {"input", "instructions", "previous_response_id", "prompt_cache_key"}
    for free in ("input", "tools", "tool_choice", "text", "reasoning", "client_metadata"):
        assert responses[free] is None, free
    # Anthropic Messages: typed where the shape is fixed; system, content, tools free.
    messages = KNOWN.messages[f"{INFERENCE}.MessagesRequest"]
    assert messages["thinking"] == Nested(f"{INFERENCE}.AnthropicThinking")
    assert messages["tool_choice"] == Nested(f"{INFERENCE}.AnthropicToolChoice")
    assert messages["messages"] == Nested(f"{INFERENCE}.AnthropicMessage")
    for free in ("system", "tools", "context_management"):
        assert messages[free] is None, free
    assert KNOWN.messages[f"{INFERENCE}.AnthropicMessage"]["content"] is None
    api_key = KNOWN.messages["inferplane.auth.v1.ApiKey"]
    assert set(api_key) == _names(auth_pb2.ApiKey.DESCRIPTOR)
    assert api_key["limits"] == Nested("inferplane.auth.v1.Limits")
    assert api_key["expire_time"] is None  # Timestamp: its JSON is a string


def test_every_route_with_a_body_is_covered() -> None:
    """The transcoded JSON POST/PATCH routes of both services (the internal streaming paths
    too: the stream router moves requests there before the guard runs); GET and DELETE
    routes have no body and are absent, and so are the audio routes, whose body is the
    client's multipart bytes (a google.api.HttpBody the transcoder does not parse)."""
    chat, completion = f"{INFERENCE}.ChatCompletionRequest", f"{INFERENCE}.CompletionRequest"
    assert set(KNOWN.routes) == {
        BodyRoute("POST", "/v1/chat/completions", chat),
        BodyRoute("POST", "/internal/events/v1/chat/completions", chat),
        BodyRoute("POST", "/v1/completions", completion),
        BodyRoute("POST", "/internal/events/v1/completions", completion),
        BodyRoute("POST", "/v1/embeddings", f"{INFERENCE}.EmbeddingRequest"),
        BodyRoute("POST", "/v1/responses", f"{INFERENCE}.ResponseRequest"),
        BodyRoute("POST", "/v1/messages", f"{INFERENCE}.MessagesRequest"),
        BodyRoute("POST", "/v1/messages/count_tokens", f"{INFERENCE}.MessagesRequest"),
        BodyRoute("POST", "/v1/admin/api-keys", "inferplane.auth.v1.ApiKey"),
        BodyRoute("PATCH", "/v1/admin/{api_key.name=api-keys/*}", "inferplane.auth.v1.ApiKey"),
        BodyRoute(
            "POST", "/v1/admin/{name=api-keys/*}:revoke", "inferplane.auth.v1.RevokeApiKeyRequest"
        ),
        BodyRoute(
            "POST", "/v1/admin/{name=api-keys/*}:rotate", "inferplane.auth.v1.RotateApiKeyRequest"
        ),
    }


@pytest.mark.parametrize(
    ("template", "pattern"),
    [
        ("/v1/chat/completions", "^/v1/chat/completions$"),
        ("/v1/admin/{name=api-keys/*}:revoke", "^/v1/admin/api%-keys/[^/]+:revoke$"),
        ("/v1/{parent}/things", "^/v1/[^/]+/things$"),
        ("/v1/models/{model=**}", "^/v1/models/.*$"),
        ("/v1/*/x.y/**", "^/v1/[^/]+/x%.y/.*$"),
    ],
)
def test_path_templates_become_anchored_lua_patterns(template: str, pattern: str) -> None:
    assert edge.template_lua_pattern(template) == pattern


@pytest.mark.parametrize("template", ["v1/x", "/v1/{name", "/v1/name}"])
def test_malformed_path_templates_are_rejected(template: str) -> None:
    with pytest.raises(ValueError, match="path template"):
        edge.template_lua_pattern(template)


def _file(module: ModuleType) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(proto)
    return proto


def _field(
    message: descriptor_pb2.DescriptorProto, name: str, number: int, **kwargs: object
) -> None:
    T = descriptor_pb2.FieldDescriptorProto
    kwargs.setdefault("type", T.TYPE_STRING)
    kwargs.setdefault("label", T.LABEL_OPTIONAL)
    message.field.add(name=name, number=number, **kwargs)  # type: ignore[arg-type]


def _rule(method: descriptor_pb2.MethodDescriptorProto, **kwargs: object) -> http_pb2.HttpRule:
    rule: http_pb2.HttpRule = method.options.Extensions[annotations_pb2.http]
    for key, value in kwargs.items():
        if key == "custom":
            rule.custom.CopyFrom(value)
        else:
            setattr(rule, key, value)
    return rule


def _synthetic_set(*, body: str = "thing") -> bytes:
    """demo.v1.DemoService: Create (POST body `thing`, plus a PUT binding), Get (no body),
    Act (custom verb ACT, body "*"), Rename (body is a string field)."""
    T = descriptor_pb2.FieldDescriptorProto
    demo = descriptor_pb2.FileDescriptorProto(
        name="demo/v1/demo.proto",
        package="demo.v1",
        syntax="proto3",
        dependency=["google/api/annotations.proto", "google/protobuf/struct.proto"],
    )
    inner = demo.message_type.add(name="Inner")
    _field(inner, "deep_value", 1)
    thing = demo.message_type.add(name="Thing")
    _field(thing, "name", 1)
    _field(thing, "display_name", 2)
    _field(thing, "renamed", 3, json_name="customName")
    _field(thing, "inner", 4, type=T.TYPE_MESSAGE, type_name=".demo.v1.Inner")
    _field(
        thing, "many", 5, type=T.TYPE_MESSAGE, type_name=".demo.v1.Inner", label=T.LABEL_REPEATED
    )
    _field(thing, "free", 6, type=T.TYPE_MESSAGE, type_name=".google.protobuf.Struct")
    entry = thing.nested_type.add(name="ByKeyEntry")
    entry.options.map_entry = True
    _field(entry, "key", 1)
    _field(entry, "value", 2, type=T.TYPE_MESSAGE, type_name=".demo.v1.Inner")
    _field(thing, "by_key", 7, type=T.TYPE_MESSAGE, type_name=".demo.v1.Thing.ByKeyEntry",
           label=T.LABEL_REPEATED)  # fmt: skip
    labels = thing.nested_type.add(name="LabelsEntry")
    labels.options.map_entry = True
    _field(labels, "key", 1)
    _field(labels, "value", 2)
    _field(thing, "labels", 8, type=T.TYPE_MESSAGE, type_name=".demo.v1.Thing.LabelsEntry",
           label=T.LABEL_REPEATED)  # fmt: skip
    request = demo.message_type.add(name="ThingRequest")
    _field(request, "thing", 1, type=T.TYPE_MESSAGE, type_name=".demo.v1.Thing")
    _field(request, "validate_only", 2, type=T.TYPE_BOOL)
    service = demo.service.add(name="DemoService")
    create = service.method.add(
        name="Create", input_type=".demo.v1.ThingRequest", output_type=".demo.v1.Thing"
    )
    rule = _rule(create, post="/v1/things", body=body)
    rule.additional_bindings.add(put="/v1/{thing.name=things/*}", body="thing")
    get = service.method.add(
        name="Get", input_type=".demo.v1.ThingRequest", output_type=".demo.v1.Thing"
    )
    _rule(get, get="/v1/{thing.name=things/*}")
    act = service.method.add(
        name="Act", input_type=".demo.v1.ThingRequest", output_type=".demo.v1.Thing"
    )
    _rule(act, custom=http_pb2.CustomHttpPattern(kind="act", path="/v1/things:act"), body="*")
    service.method.add(  # no http option: not transcoded
        name="Internal", input_type=".demo.v1.ThingRequest", output_type=".demo.v1.Thing"
    )
    files = [_file(m) for m in (descriptor_pb2, http_pb2, annotations_pb2, struct_pb2)]
    return descriptor_pb2.FileDescriptorSet(file=[*files, demo]).SerializeToString()


def test_tables_follow_whatever_the_descriptor_set_says() -> None:
    """A made-up service: bodies named by field, `*`, custom verbs and additional bindings;
    custom json_names; nested, repeated and map-of-message fields; Struct and scalar maps."""
    known = known_request_fields(_synthetic_set(), ["demo.v1.DemoService"])
    assert known.routes == (
        BodyRoute("POST", "/v1/things", "demo.v1.Thing"),
        BodyRoute("PUT", "/v1/{thing.name=things/*}", "demo.v1.Thing"),
        BodyRoute("ACT", "/v1/things:act", "demo.v1.ThingRequest"),
    )
    assert dict(known.messages["demo.v1.Thing"]) == {
        "name": None,
        "display_name": None,
        "displayName": None,
        "renamed": None,
        "customName": None,  # json_name as declared, not the default "renamed"
        "inner": Nested("demo.v1.Inner"),
        "many": Nested("demo.v1.Inner"),
        "free": None,
        "by_key": Nested("demo.v1.Inner", map=True),
        "byKey": Nested("demo.v1.Inner", map=True),
        "labels": None,
    }
    assert known.keys("demo.v1.Inner") == {"deep_value", "deepValue"}
    assert known.keys("demo.v1.ThingRequest") == {
        "thing",
        "validate_only",
        "validateOnly",
    }
    lua = edge.render_lua_tables(known)
    assert '{"POST", "^/v1/things$", 1},  -- POST /v1/things' in lua
    assert '{"PUT", "^/v1/things/[^/]+$", 1},' in lua
    assert '{"ACT", "^/v1/things:act$", 3},' in lua
    assert 'TYPES[2] = {["deep_value"]=0, ["deepValue"]=0}  -- demo.v1.Inner' in lua
    assert '["inner"]=2, ["many"]=2, ["free"]=0, ["by_key"]=-2, ["byKey"]=-2, ["labels"]=0}' in lua
    assert lua == edge.render_lua_tables(
        known_request_fields(_synthetic_set(), ["demo.v1.DemoService"])
    )


def test_descriptor_errors_name_the_culprit() -> None:
    with pytest.raises(KeyError, match=r"demo\.v1\.Missing"):
        known_request_fields(_synthetic_set(), ["demo.v1.Missing"])
    with pytest.raises(ValueError, match=r"body 'nope' is not a field of demo\.v1\.ThingRequest"):
        known_request_fields(_synthetic_set(body="nope"), ["demo.v1.DemoService"])
    with pytest.raises(KeyError):
        KNOWN.keys("demo.v1.Thing")


def test_a_scalar_body_has_nothing_to_check() -> None:
    known = known_request_fields(_synthetic_set(body="validate_only"), ["demo.v1.DemoService"])
    assert [r.template for r in known.routes] == ["/v1/{thing.name=things/*}", "/v1/things:act"]


def test_the_bootstrap_carries_the_generated_tables() -> None:
    config = EdgeConfig(
        router_endpoints=(Endpoint("127.0.0.1", 7001),), auth_endpoint="127.0.0.1:7002"
    )
    (guard,) = [f for f in edge.build_http_filters(config) if f["name"] == "inferplane.field_guard"]
    source = guard["typed_config"]["default_source_code"]["inline_string"]
    assert "__FIELD_TABLES__" in edge.lua_source("field_guard")
    assert "__FIELD_TABLES__" not in source
    assert edge.render_lua_tables(KNOWN) in source
    names = [f["name"] for f in edge.build_http_filters(config)]
    assert names.index("inferplane.stream_router") < names.index("inferplane.field_guard")
    assert names.index("inferplane.field_guard") + 1 == names.index(
        "envoy.filters.http.grpc_json_transcoder"
    )
