-- inferplane edge: picks the streaming gRPC method (request path).
--
-- The transcoder selects the gRPC method from verb + path before it sees the body, and the
-- openai client sends identical headers for stream and non-stream calls, so the body's
-- top-level "stream" decides. json_to_metadata, placed just before this filter, has parsed the
-- body and stored `stream` (a bool, PROTOBUF_VALUE) in the edge's dynamic-metadata namespace
-- (NAMESPACE, filled in by inferplane.edge: METADATA_NAMESPACE); `"stream": true` moves the
-- request to the internal path bound to the Stream*Events method (stream google.api.HttpBody:
-- the service writes exact SSE bytes). The rewrite must happen here, before the transcoder: a
-- route's prefix_rewrite runs after the transcoder chose the method and would call the unary
-- one.
--
-- The internal paths are reachable only through this rewrite: a client asking for them
-- directly gets a 404 (shaped by local_reply_config), so nobody can skip the routing rule.

local NAMESPACE = "__METADATA_NAMESPACE__"
local STREAM_PATHS = {
  ["/v1/chat/completions"] = "/internal/events/v1/chat/completions",
  ["/v1/completions"] = "/internal/events/v1/completions",
}

function envoy_on_request(handle)
  local headers = handle:headers()
  local path = headers:get(":path") or ""
  local base, query = path:match("^([^?#]*)(.*)$")
  if base == "/internal" or base:sub(1, 10) == "/internal/" then
    handle:respond({ [":status"] = "404" }, "not found")
    return
  end
  local target = STREAM_PATHS[base]
  if target == nil or headers:get(":method") ~= "POST" then
    return
  end
  local metadata = handle:streamInfo():dynamicMetadata():get(NAMESPACE)
  if metadata ~= nil and metadata["stream"] == true then
    headers:replace(":path", target .. query)
  end
end
