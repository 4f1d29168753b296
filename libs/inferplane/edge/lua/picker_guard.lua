-- inferplane edge: fail closed when the endpoint picker gave no pick or did not authenticate
-- the request (request path).
--
-- ext_proc runs with failure_mode_allow: true, because with false a picker that dies resets
-- every stream in flight (measured on Envoy 1.40: a picker killed mid-way through 2 s streams
-- reset all of them with gRPC INTERNAL; with true they all finished). The price is that a
-- request the picker never answered (picker down, timed out) would be sent by the cluster's
-- fallback policy to any replica, unrouted and unadmitted. This guard runs right after
-- ext_proc and turns such a request away with a shaped 503 instead; a request the picker
-- refused never gets here (ext_proc answered it directly). The picker is also the only
-- authenticator of the routes it runs on (ext_authz is off there): a request it did not mark
-- authenticated (PICKER_NAMESPACE / AUTHENTICATED: true, set with its answer to the request
-- headers) is refused the same way, so a dead, restarting or misconfigured picker never lets
-- a request through unauthenticated.
--
-- NAMESPACE and KEY are the endpoint picker protocol's (Gateway API Inference Extension):
-- the dynamic-metadata namespace and key of the picker's ordered endpoint list, filled in
-- from inferplane.wire.headers when the edge's configuration is built.

local NAMESPACE = "__PICK_NAMESPACE__"
local KEY = "__PICK_KEY__"
local PICKER_NAMESPACE = "__PICKER_NAMESPACE__"
local AUTHENTICATED = "__PICKER_AUTHENTICATED__"
local MESSAGE = "The endpoint picker is unavailable; please retry."
local BODY = '{"error":{"message":"' .. MESSAGE .. '",'
  .. '"type":"server_error","param":null,"code":"picker_unavailable"}}'
-- Anthropic's paths: Anthropic's 529 overloaded_error instead of OpenAI's 503. error_shaper.lua,
-- the first filter, marked an Anthropic request in the edge's dynamic metadata
-- (EDGE_NAMESPACE / ANTHROPIC_KEY).
local EDGE_NAMESPACE = "__METADATA_NAMESPACE__"
local ANTHROPIC_KEY = "__ANTHROPIC_MARK__"
local ANTHROPIC_BODY = '{"type":"error","error":{"type":"overloaded_error","message":"'
  .. MESSAGE .. '"}}'

function envoy_on_request(handle)
  local metadata = handle:streamInfo():dynamicMetadata()
  local lb = metadata:get(NAMESPACE)
  local picker = metadata:get(PICKER_NAMESPACE)
  local picked = lb ~= nil and lb[KEY] ~= nil and lb[KEY] ~= ""
  if not picked or picker == nil or picker[AUTHENTICATED] ~= true then
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
