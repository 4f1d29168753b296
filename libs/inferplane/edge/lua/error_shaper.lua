-- inferplane edge: OpenAI error shaper (response path) and request size guard (request path).
--
-- Runs FIRST in http_filters, so on the response path it runs LAST and sees the transcoded
-- response. A gRPC error from a servicer arrives as a trailers-only response: the transcoder
-- (convert_grpc_status: false) has set :status from grpc-status and leaves grpc-status,
-- grpc-message and the servicer's trailing metadata (the error type / code / param keys
-- below, retry-after; see inferplane/runtime/service/_interceptor.py) as response headers. This script
-- turns them into OpenAI's body {"error": {"message", "type", "param", "code"}}
-- (https://platform.openai.com/docs/guides/error-codes) and strips the gRPC headers that the
-- transcoder leaks on every response, success included (grpc-status: 0, grpc-message, ...).
-- With convert_grpc_status: true the transcoder would answer a google.rpc.Status JSON
-- ({"code":16,"message":...}) instead, which OpenAI's clients do not read.
--
-- Errors NOT from an inferplane servicer (no error type key: an unhandled Python
-- exception -> UNKNOWN "Exception calling application: ...", Envoy's own gRPC-style local
-- replies such as "upstream connect error ...") get a generic message per status so no
-- internals leak. The body is only touched for error responses, so SSE success streams are
-- never buffered.
--
-- Anthropic's Messages API (paths under ANTHROPIC_PREFIX): a servicer's error on those paths
-- leaves in Anthropic's shape {"type": "error", "error": {"type", "message"}}
-- (https://docs.anthropic.com/en/api/errors): the type follows the HTTP status
-- (ANTHROPIC_TYPES, from inferplane.apis.anthropic.ERROR_TYPES) and 503 becomes Anthropic's 529
-- overloaded_error (ANTHROPIC_STATUS). The request hook marks the stream (dynamic metadata
-- NAMESPACE / ANTHROPIC_KEY): the response hook cannot read the request's path, and the filters
-- after the transcoder see the gRPC method's path, so they read the mark too (the field guard,
-- the picker guard). Local replies of the filters after this
-- one (auth's denial, the field guard, the transcoder, the picker, Envoy's own) are not
-- reshaped here: a Lua response hook cannot buffer a local reply's body (measured on Envoy
-- 1.40: the script stops at handle:body() and the reply leaves unchanged), so each of those
-- answers in Anthropic's shape itself on these paths (auth, field_guard.lua, picker_guard.lua,
-- the picker, and local_reply_config's mappers for Anthropic paths, edge/_replies.py).
--
-- On the request path it rejects bodies over the edge's limit with a 413 before anything
-- buffers them. Envoy 1.40 can otherwise deadlock on such a body: ext_authz holds body data
-- with watermark flow control while its Check is in flight; if the whole body arrives in that
-- window the buffer crosses the limit, the connection stops reading, and json_to_metadata (which
-- buffers without watermarks) then waits for the rest of the body forever — no 413, just a
-- hung request until the stream idle timeout. The declared content-length is checked in
-- constant time. A body without one (chunked, HTTP/2) cannot be refused here: once a Lua
-- script lets the headers through to read body chunks, it can no longer respond (measured on
-- Envoy 1.40: "respond() cannot be called if headers have been continued", and the body went
-- on), so the body size limit filter right after this one counts those (edge/_filters.py).

local MAX_REQUEST_BYTES = __MAX_REQUEST_BYTES__
-- Audio uploads (multipart/form-data, files up to 25 MB as OpenAI) have their own limit.
local MAX_AUDIO_REQUEST_BYTES = __MAX_AUDIO_REQUEST_BYTES__
local AUDIO_PREFIX = "__AUDIO_PREFIX__"
-- The servicer's error trailers (inferplane.runtime OPENAI_ERROR_*_KEY).
local ERROR_TYPE = "__ERROR_TYPE_KEY__"
local ERROR_CODE = "__ERROR_CODE_KEY__"
local ERROR_PARAM = "__ERROR_PARAM_KEY__"

-- Anthropic's paths and error types (inferplane.wire.apis, inferplane.apis.anthropic).
local ANTHROPIC_PREFIX = "__ANTHROPIC_PREFIX__"
local NAMESPACE = "__METADATA_NAMESPACE__"
local ANTHROPIC_KEY = "__ANTHROPIC_MARK__"
local ANTHROPIC_TYPES = __ANTHROPIC_TYPES__
local ANTHROPIC_STATUS = __ANTHROPIC_STATUS__

local GENERIC_5XX = "The server had an error while processing your request. Sorry about that!"
local GENERIC_503 = "The service is temporarily unavailable; please retry."
local GENERIC_504 = "The request timed out before the model answered; please retry."

-- Envoy's own gRPC -> HTTP mapping (Grpc::Utility::grpcToHttpStatus).
local HTTP_STATUS = {
  [1] = 499, [2] = 500, [3] = 400, [4] = 504, [5] = 404, [6] = 409, [7] = 403, [8] = 429,
  [9] = 400, [10] = 409, [11] = 400, [12] = 501, [13] = 500, [14] = 503, [15] = 500, [16] = 401,
}

-- OpenAI `code` when the servicer did not send one.
local DEFAULT_CODE = {
  [1] = "cancelled", [2] = "internal_error", [3] = "invalid_request", [4] = "timeout",
  [5] = "not_found", [6] = "already_exists", [7] = "permission_denied",
  [8] = "rate_limit_exceeded", [9] = "failed_precondition", [10] = "aborted",
  [11] = "out_of_range", [12] = "unimplemented", [13] = "internal_error",
  [14] = "service_unavailable", [15] = "internal_error", [16] = "invalid_api_key",
}

local STRIP = {
  "grpc-status", "grpc-message", "grpc-status-details-bin", "grpc-accept-encoding",
  "grpc-encoding", ERROR_TYPE, ERROR_CODE, ERROR_PARAM,
}

local function percent_decode(s)
  return (s:gsub("%%(%x%x)", function(hex) return string.char(tonumber(hex, 16)) end))
end

local ESCAPES = { ['"'] = '\\"', ['\\'] = '\\\\', ['\n'] = '\\n', ['\r'] = '\\r', ['\t'] = '\\t' }

-- JSON string literal; bytes >= 0x80 pass through, so UTF-8 stays UTF-8.
local function json_string(s)
  if s == nil then return "null" end
  return '"' .. s:gsub('[%c"\\]', function(c)
    return ESCAPES[c] or string.format("\\u%04x", c:byte())
  end) .. '"'
end

local function default_type(http_status)
  if http_status == 429 then return "rate_limit_error" end
  if http_status >= 500 then return "server_error" end
  return "invalid_request_error"
end

local function message_for(code, http_status, headers, shaped_upstream)
  if code == 2 or (not shaped_upstream and http_status >= 500) then
    -- UNKNOWN is never raised on purpose; other unshaped 5xx come from Envoy or a crash.
    if http_status == 503 then return GENERIC_503 end
    if http_status == 504 then return GENERIC_504 end
    return GENERIC_5XX
  end
  local raw = headers:get("grpc-message")
  if raw == nil or raw == "" then return "Request failed with status " .. http_status .. "." end
  return percent_decode(raw)
end

-- Anthropic's error body and status for an HTTP status and a message.
local function anthropic_error(http_status, message)
  local error_type = ANTHROPIC_TYPES[http_status]
    or (http_status >= 500 and "api_error" or "invalid_request_error")
  return ANTHROPIC_STATUS[http_status] or http_status,
    '{"type":"error","error":{"type":' .. json_string(error_type)
    .. ',"message":' .. json_string(message) .. '}}'
end

local function shape(handle, headers, code, anthropic)
  local http_status = HTTP_STATUS[code] or 500
  -- gRPC has no "payload too large": a replica refusing an oversized upload says so by code
  -- (INVALID_ARGUMENT, code request_too_large), and the client gets OpenAI's 413.
  if headers:get(ERROR_CODE) == "request_too_large" then
    http_status = 413
  end
  local error_type = headers:get(ERROR_TYPE)
  local shaped = error_type ~= nil
  local message = message_for(code, http_status, headers, shaped)
  local body
  if anthropic then
    http_status, body = anthropic_error(http_status, message)
  else
    body = '{"error":{"message":' .. json_string(message)
      .. ',"type":' .. json_string(error_type or default_type(http_status))
      .. ',"param":' .. json_string(headers:get(ERROR_PARAM))
      .. ',"code":' .. json_string(headers:get(ERROR_CODE) or DEFAULT_CODE[code])
      .. '}}'
  end
  headers:replace(":status", tostring(http_status))
  headers:replace("content-type", "application/json")
  -- always_wrap_body: a trailers-only reply has no body buffer yet.
  handle:body(true):setBytes(body)
end

local function is_anthropic(path)
  local base = path:match("^[^?#]*")
  return base == ANTHROPIC_PREFIX or base:sub(1, #ANTHROPIC_PREFIX + 1) == ANTHROPIC_PREFIX .. "/"
end

-- 413 before anything buffers the body: an empty body local_reply_config fills in OpenAI's
-- shape, or Anthropic's body itself on its paths (the reply mappers pass an Anthropic path's
-- Lua replies through).
local function too_large(handle, anthropic)
  if not anthropic then
    handle:respond({ [":status"] = "413" }, "")
    return
  end
  local status, body = anthropic_error(413, "The request body is too large; the limit is "
    .. MAX_REQUEST_BYTES .. " bytes.")
  handle:respond({ [":status"] = tostring(status), ["content-type"] = "application/json" }, body)
end

function envoy_on_request(handle)
  local headers = handle:headers()
  local limit = MAX_REQUEST_BYTES
  local path = headers:get(":path") or ""
  local anthropic = is_anthropic(path)
  if anthropic then
    handle:streamInfo():dynamicMetadata():set(NAMESPACE, ANTHROPIC_KEY, true)
  end
  if path:sub(1, #AUDIO_PREFIX) == AUDIO_PREFIX then
    limit = MAX_AUDIO_REQUEST_BYTES
  end
  local length = headers:get("content-length")
  if length ~= nil and (tonumber(length) or 0) > limit then
    too_large(handle, anthropic)
  end
end

function envoy_on_response(handle)
  local headers = handle:headers()
  local status = headers:get("grpc-status")
  if status ~= nil and status ~= "0" then
    local marks = handle:streamInfo():dynamicMetadata():get(NAMESPACE)
    shape(handle, headers, tonumber(status) or 2, marks ~= nil and marks[ANTHROPIC_KEY] == true)
  end
  for _, key in ipairs(STRIP) do
    headers:remove(key)
  end
end
