-- inferplane edge: fail closed when the endpoint picker gave no pick (request path).
--
-- ext_proc runs with failure_mode_allow: true, because with false a picker that dies resets
-- every stream in flight (measured on Envoy 1.40: a picker killed mid-way through 2 s streams
-- reset all of them with gRPC INTERNAL; with true they all finished). The price is that a
-- request the picker never answered (picker down, timed out) would be sent by the cluster's
-- fallback policy to any replica, unrouted and unadmitted. This guard runs right after
-- ext_proc and turns such a request away with a shaped 503 instead; a request the picker
-- refused never gets here (ext_proc answered it directly).
--
-- NAMESPACE and KEY are the endpoint picker protocol's (Gateway API Inference Extension):
-- the dynamic-metadata namespace and key of the picker's ordered endpoint list, filled in
-- from inferplane.wire.headers when the edge's configuration is built.

local NAMESPACE = "__PICK_NAMESPACE__"
local KEY = "__PICK_KEY__"
local MESSAGE = "The endpoint picker is unavailable; please retry."
local BODY = '{"error":{"message":"' .. MESSAGE .. '",'
  .. '"type":"server_error","param":null,"code":"picker_unavailable"}}'
-- Anthropic's paths: Anthropic's 529 overloaded_error instead of OpenAI's 503. The request's
-- `:path` is the gRPC method's by now (the transcoder ran); error_shaper.lua, the first filter,
-- marked an Anthropic request in the edge's dynamic metadata (EDGE_NAMESPACE / ANTHROPIC_KEY).
local EDGE_NAMESPACE = "__METADATA_NAMESPACE__"
local ANTHROPIC_KEY = "__ANTHROPIC_MARK__"
local ANTHROPIC_BODY = '{"type":"error","error":{"type":"overloaded_error","message":"'
  .. MESSAGE .. '"}}'

function envoy_on_request(handle)
  local lb = handle:streamInfo():dynamicMetadata():get(NAMESPACE)
  if lb == nil or lb[KEY] == nil or lb[KEY] == "" then
    local marks = handle:streamInfo():dynamicMetadata():get(EDGE_NAMESPACE)
    if marks ~= nil and marks[ANTHROPIC_KEY] == true then
      handle:respond({ [":status"] = "__ANTHROPIC_OVERLOADED__",
        ["content-type"] = "application/json", ["retry-after"] = "1" }, ANTHROPIC_BODY)
      return
    end
    handle:respond({ [":status"] = "503", ["content-type"] = "application/json",
      ["retry-after"] = "1" }, BODY)
  end
end
