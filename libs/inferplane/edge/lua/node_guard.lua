-- inferplane node Envoy: only replica processes on THIS node (request path).
--
-- The node-local Envoy (inferplane.edge.build_node_bootstrap) forwards to the address in the
-- replica address header (HEADER, filled in from inferplane.wire.headers REPLICA_ADDRESS)
-- through an ORIGINAL_DST cluster, which would connect to ANY address it is given. The
-- endpoint picker sets that header beside the picked endpoint it gives the gateway
-- (`<replica host>:<this Envoy's port>`), so the replica's host is the address the gateway
-- dialled: the local address of this request's connection. Any
-- other host (a pick meant for another node, a forged header) or no header is refused with a
-- shaped 421 before routing, and so is this Envoy's own port (a loop).

local HEADER = "__REPLICA_HEADER__"

local function split(address)
  -- "10.1.2.3:8000" or "[fd00::1]:8000" -> host, port
  local host, port = address:match("^%[([^%]]+)%]:(%d+)$")
  if host == nil then
    host, port = address:match("^([^:]+):(%d+)$")
  end
  return host, port
end

local function refuse(handle, message)
  local body = '{"error":{"message":"' .. message .. '","type":"invalid_request_error",'
    .. '"param":null,"code":"misdirected_request"}}'
  handle:respond({ [":status"] = "421", ["content-type"] = "application/json" }, body)
end

function envoy_on_request(handle)
  local target = handle:headers():get(HEADER)
  if target == nil or target == "" then
    refuse(handle, "The request names no replica (" .. HEADER .. "); "
      .. "it must come through the gateway's endpoint picker.")
    return
  end
  local host, port = split(target)
  local here_host, here_port = split(handle:streamInfo():downstreamLocalAddress() or "")
  if host == nil or host ~= here_host or port == here_port then
    refuse(handle, "The replica named by " .. HEADER .. " is not on this node.")
  end
end
