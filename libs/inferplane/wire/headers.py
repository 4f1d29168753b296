"""The edge's header contract: every HTTP/gRPC metadata name that crosses a service boundary on
the data path, defined once. Auth, the router (endpoint picker), the replica process, the edge's
Envoy configuration (and its Lua filters, through `inferplane.edge`) and the orchestrator import
these names; nothing else spells them.

Names are lower-case (gRPC metadata keys and HTTP/2 header names are). Every name under
`TRUSTED_PREFIX` is trusted by the services behind the edge: the edge strips any copy a client
sends before auth's Check adds its own (an `x-inferplane-*` header a client sent never reaches
a service).

Groups:

- the auth verdict: what auth's ext_authz `Check` adds to a request it allows;
- the request id: Envoy's (`REQUEST_ID`) and the client's own, given back under another name;
- the endpoint picker (Gateway API Inference Extension, protocol v1.0): the ordered endpoint
  list, the subset hint, the served endpoint a gateway reports, and the picker's own headers;
- served-by: the replica that answered (a response header, never a request header);
- regions: the region whose edge served (a response header the region's edge adds);
- internal: the shared secret internal callers present to auth's usage endpoint.

The summary trailers a replica ends every response with are defined beside their codec in
`inferplane.wire._summary` (`SUMMARY_KEYS`).
"""

from __future__ import annotations

from typing import Final

TRUSTED_PREFIX: Final = "x-inferplane-"
"""Headers only the edge (after auth's Check) may set; a client's own copies are removed."""

# --- the client's API key (read by auth's ext_authz Check, removed before any upstream) ---------
AUTHORIZATION: Final = "authorization"
"""`Authorization: Bearer KEY`: OpenAI's convention for the API key."""
API_KEY: Final = "x-api-key"
"""`x-api-key: KEY`: Anthropic's convention for the API key (Claude Code, the anthropic SDK)."""
CLIENT_KEY_HEADERS: Final[tuple[str, ...]] = (AUTHORIZATION, API_KEY)
"""Every header that may carry the client's key: none reaches a service behind the edge."""

# --- auth verdict (ext_authz Check → upstream request headers) ---------------------------------
TENANT: Final = "x-inferplane-tenant"
"""The calling key's tenant."""
KEY_ID: Final = "x-inferplane-key-id"
"""The calling API key's id (never its secret): the fair-share flow, the ledger's key."""
SCOPES: Final = "x-inferplane-scopes"
"""The key's scopes, comma-separated."""
ALLOWED_MODELS: Final = "x-inferplane-allowed-models"
"""The models the key may call, comma-separated; absent = every model."""
TIER: Final = "x-inferplane-tier"
"""The key's priority tier (the admission queue's class)."""

AUTH_VERDICT: Final[tuple[str, ...]] = (TENANT, KEY_ID, SCOPES, ALLOWED_MODELS, TIER)
"""Every header of auth's verdict, in the order Check writes them."""

# --- request id -------------------------------------------------------------------------------
REQUEST_ID: Final = "x-request-id"
"""Envoy's request id (always Envoy's own: a client's is moved to `CLIENT_REQUEST_ID`)."""
CLIENT_REQUEST_ID: Final = "x-client-request-id"
"""A client's own `x-request-id`, passed on and given back under this name."""

# --- endpoint picker ---------------------------------------------------------------------------
PICK_NAMESPACE: Final = "envoy.lb"
"""Dynamic-metadata namespace of the picker's answer (Gateway API Inference Extension)."""
DESTINATION_ENDPOINT: Final = "x-gateway-destination-endpoint"
"""The picked endpoints, `host:port` in order (metadata key and, for a gateway, header)."""
DESTINATION_ENDPOINT_SERVED: Final = "x-gateway-destination-endpoint-served"
"""The endpoint that served, as a gateway reports it (protocol v1.0)."""
DESTINATION_ENDPOINT_SUBSET: Final = "x-gateway-destination-endpoint-subset"
"""A gateway's hint: the endpoints the picker may choose among."""
PICKER: Final = "x-inferplane-picker"
"""Request header the picker adds: the `host:port` of its `inferplane.router.v1.OutcomeService`,
where the serving replica reports the request's summary (the trailers alone can be lost when a
client closes right after `data: [DONE]`)."""
SIBLINGS: Final = "x-inferplane-siblings"
"""Request header the picker adds: the replicas of the pick (primary and fallbacks, from the
routing table) a replica may move a stream to when its engine dies mid-way (issue 31), in
`inferplane.wire.siblings`' format."""
REPLICA_ADDRESS: Final = "x-inferplane-replica-address"
"""Request header the picker adds in gateway mode: the picked replica process's address, which
the node-local Envoy dials (and refuses when it is not on its node)."""
ENVOY_MAX_RETRIES: Final = "x-envoy-max-retries"
"""Envoy's own header: the picker sets it to the number of fallback endpoints it listed."""
PICKER_NAMESPACE: Final = "inferplane.picker"
"""Dynamic-metadata namespace the picker writes for the edge's later filters and access log:
`PICKER_AUTHENTICATED` (the picker authenticated the request's key; the picker guard refuses a
request without it) and `PICKER_MODEL` (the model the request was routed as, or
`UNKNOWN_MODEL`: bounded label cardinality)."""
PICKER_AUTHENTICATED: Final = "authenticated"
"""Key under `PICKER_NAMESPACE`: true once the picker authenticated the request."""
PICKER_MODEL: Final = "model"
"""Key under `PICKER_NAMESPACE`: the routed model name (a served model), else `UNKNOWN_MODEL`."""
UNKNOWN_MODEL: Final = "(unknown model)"
"""What metrics, usage reports and the console show for a model name that names no served
model: the client's text stays data (request records), never a label or a group."""

# --- LoRA adapters (picker → replica request headers; issue 29) ------------------------------
ADAPTER: Final = "x-inferplane-adapter"
"""Request header the picker adds when the request's model names a LoRA adapter: the adapter's
catalogue name. The replica serves the request with that adapter (loading it on a miss)."""
ADAPTER_SOURCE: Final = "x-inferplane-adapter-source"
"""Request header the picker adds with `ADAPTER`: the adapter's source folder from the
catalogue; the replica refuses one outside its allow-listed root (`ReplicaSpec.lora_root`)."""

# --- releases (client → picker request header; issue 30) ---------------------------------------
REVISION: Final = "inferplane-revision"
"""Request header an operator sends to pin a request to one profile revision of the model
(the performance gate reaches a candidate that takes no live traffic this way). The picker
honours it only for a key with the `admin` scope (else 403 in the API's shape) and picks among
that revision's endpoints only; no such endpoint: 503. The picker removes it before the
replica. Not under `TRUSTED_PREFIX`: a client sends it, and the edge strips every client copy
of a trusted header before the picker could read it (its authority is the key's scope)."""
SERVED_REVISION: Final = "x-inferplane-revision-served"
"""Response header (initial metadata): the profile revision of the replica that answered."""

# --- served-by (response) ----------------------------------------------------------------------
SERVED_BY: Final = "x-inferplane-replica"
"""Response header (initial metadata) and summary trailer: the replica that answered."""

# --- regions (response; issue 31) -----------------------------------------------------------
SERVED_REGION: Final = "x-inferplane-region"
"""Response header a region's edge adds to every response it sends (its `EdgeConfig.region`):
the region that served the request (behind the global tier, the home region or a fallback)."""

# --- internal ----------------------------------------------------------------------------------
INTERNAL_TOKEN: Final = "x-inferplane-internal-token"
"""The shared secret the router presents to auth's internal usage endpoint."""
