"""The router as Envoy's endpoint picker: `envoy.service.ext_proc.v3.ExternalProcessor`.

Data path (docs/architecture.md): Envoy relays every token; the router decides once per
request where it goes, following the Gateway API Inference Extension's endpoint-picker
protocol, and learns from the response trailers how it ended. One ext_proc stream is one HTTP
request; with the edge's processing mode (request headers SEND, request body BUFFERED,
response headers SEND, response trailers SEND, everything else SKIP/NONE) it carries:

1. `request_headers` (the client's REST `:path`, e.g. `/v1/chat/completions?beta=true`, and
   its `Authorization` / `x-api-key`) → the key authenticated against the router's key table
   (`inferplane.router.keys.KeyTable`) before any body is read: auth's verdict headers
   (`x-inferplane-tenant`, `-key-id`, `-scopes`, `-allowed-models`, `-tier`) set, the key
   and forged `x-inferplane-*` headers removed, the picker's mark
   (`inferplane.picker`/`authenticated`) set; or an immediate 401 / 403 / 503 in the API's
   error shape, a 404 for a path that is no generation method, a 400 when no body follows.
2. `request_body` (the client's body as it came: JSON, or an audio upload's multipart bytes)
   → the typed request (`codec.decode_request`, the proto3 JSON mapping the transcoder
   applies; the top-level `"stream": true` chooses the streamed method), then the routing
   decision (route and aliases, the key's allow-list, features, admission with its queue,
   policy, breakers), answered as `dynamic_metadata["envoy.lb"]["x-gateway-destination-endpoint"]
   = "primary,fallback,..."` plus `x-envoy-max-retries: len(list)-1` (Envoy's retries walk
   down the list and never beyond it, as measured on Envoy 1.40) and the routed model
   (`inferplane.picker`/`model`, or `(unknown model)`), or as an `ImmediateResponse`
   in the API's error shape (`immediate_response`). While the request waits in the admission
   queue, one `override_message_timeout` keeps Envoy from timing the message out.
3. `response_headers` and `response_trailers` → the `ResponseSummary` keys removed (no client
   sees internal topology); their `grpc-status`, OpenAI error code and summary are recorded.
   The endpoint that served is the one the summary's replica id names (or Envoy's `-served`
   metadata, when a gateway writes it).
4. The stream's end (or the trailers, or a trailers-only response) → exactly once: the slot
   released, breakers fed, one usage report (keyed requests), one telemetry record.

The picker never raises out of `Process`: a malformed message is answered with an immediate
400 (or 500 for a bug) in OpenAI's shape and logged.

Modules, by job: `codec` (reading and writing ext_proc messages), `director` (route → admit →
pick, without ext_proc), `state` (the per-request `Exchange` and its `Phase`), `conclusion`
(the exactly-once end, usage, orphan reports), `gateway` (gateway mode), `server` (the
servicer, `EndpointPicker`).
"""

from inferplane.router.picker.codec import (
    METHODS,
    ROUTES,
    SERVICE_NAME,
    SUBSET_NAMESPACE,
    Method,
    decode_body,
    decode_request,
    form_model,
    gateway_pick_response,
    immediate_response,
    parse_json_request,
    pick_response,
    typed_request,
)
from inferplane.router.picker.director import Decision, Director, RequestFacts, Routed
from inferplane.router.picker.gateway import GatewayMode, GatewayProcessor
from inferplane.router.picker.server import EndpointPicker, PickerSettings
from inferplane.router.picker.state import Exchange, Phase

__all__ = [
    "METHODS",
    "ROUTES",
    "SERVICE_NAME",
    "SUBSET_NAMESPACE",
    "Decision",
    "Director",
    "EndpointPicker",
    "Exchange",
    "GatewayMode",
    "GatewayProcessor",
    "Method",
    "Phase",
    "PickerSettings",
    "RequestFacts",
    "Routed",
    "decode_body",
    "decode_request",
    "form_model",
    "gateway_pick_response",
    "immediate_response",
    "parse_json_request",
    "pick_response",
    "typed_request",
]
