-- inferplane edge: turn away a client address that keeps failing authentication (both paths).
--
-- Every request with a made-up key costs auth a Check (a hash and a database lookup, since a
-- random key never hits the cache). This filter runs right before ext_authz: it counts the
-- 401s each client address got in the current fixed window (the response hook sees ext_authz's
-- local reply), and once an address reached the limit, its requests get a shaped 429 with
-- Retry-After until the window ends, without asking auth. Addresses that authenticate are
-- never counted. State is per Envoy worker (a local limit): with N workers an address may get
-- up to N times the limit per window. Memory is bounded by the addresses that failed in one
-- window (the table is dropped when the window turns).

local LIMIT = __AUTH_FAILURE_LIMIT__
local WINDOW = __AUTH_FAILURE_WINDOW__
local BODY = '{"error":{"message":"Too many requests with an invalid API key from this address; '
  .. 'retry later with a valid key.","type":"requests","param":null,'
  .. '"code":"rate_limit_exceeded"}}'

local window_start = 0
local failures = {}

local function address(handle)
  local remote = handle:streamInfo():downstreamRemoteAddress() or ""
  return remote:match("^(.*):%d+$") or remote
end

local function turn(now)
  local start = now - now % WINDOW
  if start ~= window_start then
    window_start = start
    failures = {}
  end
end

function envoy_on_request(handle)
  local now = os.time()
  turn(now)
  if (failures[address(handle)] or 0) >= LIMIT then
    local retry = window_start + WINDOW - now
    handle:respond({ [":status"] = "429", ["content-type"] = "application/json",
      ["retry-after"] = tostring(retry > 0 and retry or 1) }, BODY)
  end
end

function envoy_on_response(handle)
  if handle:headers():get(":status") == "401" then
    turn(os.time())
    local who = address(handle)
    failures[who] = (failures[who] or 0) + 1
  end
end
