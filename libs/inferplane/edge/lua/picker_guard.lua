-- inferplane edge: fail closed when the endpoint picker gave no pick (request path).
--
-- ext_proc runs with failure_mode_allow: true, because with false a picker that dies resets
-- every stream in flight (notes/envoy_ext_proc_probe.md, (v)). The price is that a request
-- the picker never answered (picker down, timed out) would be sent by the cluster's fallback
-- policy to any replica, unrouted and unadmitted. This guard runs right after ext_proc and
-- turns such a request away with a shaped 503 instead; a request the picker refused never
-- gets here (ext_proc answered it directly).

local NAMESPACE = "envoy.lb"
local KEY = "x-gateway-destination-endpoint"
local BODY = '{"error":{"message":"The endpoint picker is unavailable; please retry.",'
  .. '"type":"server_error","param":null,"code":"picker_unavailable"}}'

function envoy_on_request(handle)
  local lb = handle:streamInfo():dynamicMetadata():get(NAMESPACE)
  if lb == nil or lb[KEY] == nil or lb[KEY] == "" then
    handle:respond({ [":status"] = "503", ["content-type"] = "application/json",
      ["retry-after"] = "1" }, BODY)
  end
end
