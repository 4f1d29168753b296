-- inferplane edge: reject request-body keys the API does not know (request path).
--
-- The transcoder silently drops JSON keys its request message does not define (Envoy has no
-- option to reject them: envoyproxy/envoy#46623), so `"temprature": 0.2` would be served as
-- if it were absent. OpenAI answers 400 "Unrecognized request argument supplied: X" with
-- `param` naming the key; this filter does the same for every REST route with a body, at the
-- top level and inside the nested messages the proto defines (each chat message, its
-- tool_calls[].function, tools[].function, stream_options, an API key's limits), e.g. param
-- `messages[0].weight`. Keys of free-form values (Struct / Value fields such as
-- response_format, metadata, a tool's parameters schema, message content) are not checked:
-- the transcoder keeps them whole. An unknown key whose value is null passes: null asks for
-- nothing (it means "unset" in proto3 JSON and to OpenAI), and assistant messages echoed from
-- an OpenAI SDK object carry `"refusal": null`, `"audio": null`, ...
--
-- The tables below (TYPES, ROUTES) are generated from the transcoder's own descriptor set by
-- inferplane/edge/_fields.py: a key is known when it is a field's proto name or its json_name,
-- exactly what the transcoder accepts (measured on Envoy 1.40). The filter runs after the
-- stream router (a client's own /internal/... path is already a 404) and before the
-- transcoder, on the body json_to_metadata has buffered. The scanner only tokenises, one
-- forward pass: strings and unchecked values are jumped over with plain string.find (memchr),
-- so its cost grows with the number of strings and keys, not with the length of the text
-- (bench/field_guard_cost.py). A body it cannot read (not JSON, truncated) is left to the
-- transcoder, whose parse error is the better answer; an error of the scanner itself also
-- lets the request through, so a bug here can never turn a valid request away.

__FIELD_TABLES__

local find, byte, sub, char = string.find, string.byte, string.sub, string.char
local MALFORMED = "malformed"
local MAX_PARAM_BYTES = 256

-- Byte loops rather than patterns here: LuaJIT compiles them, and runs are a byte or two.
local function skip_ws(s, i)
  local c = byte(s, i)
  while c == 32 or c == 10 or c == 13 or c == 9 do
    i = i + 1
    c = byte(s, i)
  end
  return i
end

-- The end of a number, true, false or null at s[i] (the transcoder judges its spelling).
local function skip_scalar(s, i)
  local c = byte(s, i)
  while c ~= nil and c ~= 44 and c ~= 125 and c ~= 93 and c ~= 32 and c ~= 10 and c ~= 13
    and c ~= 9 do
    i = i + 1
    c = byte(s, i)
  end
  return i
end

-- s[i] is the opening quote; returns the index just after the closing quote.
local function skip_string(s, i)
  local j = i + 1
  while true do
    local q = find(s, '"', j, true)
    if q == nil then error(MALFORMED, 0) end
    local k = q - 1
    while byte(s, k) == 92 do k = k - 1 end
    if (q - 1 - k) % 2 == 0 then return q + 1 end
    j = q + 1
  end
end

-- The next position of the quote and of each bracket at or after the scan's cursor
-- (math.huge: none left), kept across calls for the whole body. The scan only moves forward,
-- so each is searched for (plain find: memchr) again only once the cursor has passed it, and
-- every byte is looked at at most once per character however values nest or alternate.
local HUGE, min = math.huge, math.min
local nq, no1, no2, nc1, nc2 = 0, 0, 0, 0, 0

local function reset_cursor()
  nq, no1, no2, nc1, nc2 = 0, 0, 0, 0, 0
end

-- Any JSON value at s[i]; returns the index just after it. Brackets are only counted (the
-- transcoder validates them): an array of 100k token ids costs five memchr calls.
local function skip_value(s, i)
  local c = byte(s, i)
  if c == 34 then return skip_string(s, i) end
  if c ~= 123 and c ~= 91 then return skip_scalar(s, i) end
  local depth, j = 0, i
  while true do
    if nq < j then nq = find(s, '"', j, true) or HUGE end
    if no1 < j then no1 = find(s, "[", j, true) or HUGE end
    if no2 < j then no2 = find(s, "{", j, true) or HUGE end
    if nc1 < j then nc1 = find(s, "]", j, true) or HUGE end
    if nc2 < j then nc2 = find(s, "}", j, true) or HUGE end
    local p = min(nq, no1, no2, nc1, nc2)
    if p == HUGE then error(MALFORMED, 0) end
    if p == nq then
      j = skip_string(s, p)
    else
      j = p + 1
      if p == no1 or p == no2 then
        depth = depth + 1
      else
        depth = depth - 1
        if depth == 0 then return j end
      end
    end
  end
end

local SIMPLE_ESCAPES = { b = "\b", f = "\f", n = "\n", r = "\r", t = "\t" }

local function utf8(code)
  if code < 0x80 then return char(code) end
  if code < 0x800 then return char(0xC0 + math.floor(code / 0x40), 0x80 + code % 0x40) end
  if code < 0x10000 then
    return char(0xE0 + math.floor(code / 0x1000), 0x80 + math.floor(code / 0x40) % 0x40,
      0x80 + code % 0x40)
  end
  return char(0xF0 + math.floor(code / 0x40000), 0x80 + math.floor(code / 0x1000) % 0x40,
    0x80 + math.floor(code / 0x40) % 0x40, 0x80 + code % 0x40)
end

-- The text of a key written with escapes (`"max\u005ftokens"` is max_tokens to the transcoder).
local function unescape(raw)
  local out, i = {}, 1
  while i <= #raw do
    local b = find(raw, "\\", i, true)
    if b == nil then
      out[#out + 1] = sub(raw, i)
      break
    end
    out[#out + 1] = sub(raw, i, b - 1)
    local e = sub(raw, b + 1, b + 1)
    if e == "u" then
      local code = tonumber(sub(raw, b + 2, b + 5), 16)
      if code == nil then error(MALFORMED, 0) end
      i = b + 6
      if code >= 0xD800 and code <= 0xDBFF and sub(raw, i, i + 1) == "\\u" then
        local low = tonumber(sub(raw, i + 2, i + 5), 16)
        if low ~= nil and low >= 0xDC00 and low <= 0xDFFF then
          code = 0x10000 + (code - 0xD800) * 0x400 + (low - 0xDC00)
          i = i + 6
        end
      end
      if code >= 0xD800 and code <= 0xDFFF then code = 0xFFFD end
      out[#out + 1] = utf8(code)
    else
      out[#out + 1] = SIMPLE_ESCAPES[e] or e
      i = b + 2
    end
  end
  return table.concat(out)
end

-- Where the scan is: the keys (strings) and list indexes (numbers) from the body down to the
-- current value. Kept as a stack and written out only for a rejection, so a list of many
-- messages costs no string building.
local where, depth = {}, 0

local function param_for(key)
  local parts = {}
  for n = 1, depth do
    local part = where[n]
    if type(part) == "number" then
      parts[#parts + 1] = "[" .. part .. "]"
    elseif #parts == 0 then
      parts[1] = part
    else
      parts[#parts + 1] = "." .. part
    end
  end
  parts[#parts + 1] = (#parts == 0) and key or ("." .. key)
  return table.concat(parts)
end

local scan_object

-- A value of a message-typed field (kind n > 0: message n; -n: a map of message n): an
-- object, a list of objects (repeated), or anything else the transcoder will judge. Only
-- objects are descended into, so recursion follows the protos' nesting, not the body's.
local function scan_value(s, i, kind)
  local c = byte(s, i)
  if c == 123 then
    if kind > 0 then return scan_object(s, i, TYPES[kind], nil) end
    return scan_object(s, i, nil, -kind)
  end
  if c == 91 and kind > 0 then
    local j, index = skip_ws(s, i + 1), 0
    if byte(s, j) == 93 then return j + 1 end
    depth = depth + 1
    while true do
      where[depth] = index
      if byte(s, j) == 123 then
        j = scan_object(s, j, TYPES[kind], nil)
      else
        j = skip_value(s, j)
      end
      j = skip_ws(s, j)
      local d = byte(s, j)
      if d == 93 then
        depth = depth - 1
        return j + 1
      end
      if d ~= 44 then error(MALFORMED, 0) end
      j, index = skip_ws(s, j + 1), index + 1
    end
  end
  return skip_value(s, i)
end

-- The object at s[i]: with `fields` (message keys -> kind), every key must be one of them;
-- without, it is a map whose values are message `map_of`. Returns the index after it.
scan_object = function(s, i, fields, map_of)
  local j = skip_ws(s, i + 1)
  if byte(s, j) == 125 then return j + 1 end
  while true do
    if byte(s, j) ~= 34 then error(MALFORMED, 0) end
    local e = skip_string(s, j)
    local key = sub(s, j + 1, e - 2)
    if find(key, "\\", 1, true) then key = unescape(key) end
    j = skip_ws(s, e)
    if byte(s, j) ~= 58 then error(MALFORMED, 0) end
    j = skip_ws(s, j + 1)
    local kind = map_of
    if fields ~= nil then
      kind = fields[key]
      if kind == nil then
        -- null asks for nothing (proto3 JSON and OpenAI: the same as leaving the key out), so
        -- an echoed history's `"refusal": null` is no reason to fail.
        if sub(s, j, j + 3) ~= "null" then error({ param = param_for(key) }, 0) end
        kind = 0
      end
    end
    if kind == 0 then
      j = skip_value(s, j)
    else
      depth = depth + 1
      where[depth] = key
      j = scan_value(s, j, kind)
      depth = depth - 1
    end
    j = skip_ws(s, j)
    local c = byte(s, j)
    if c == 125 then return j + 1 end
    if c ~= 44 then error(MALFORMED, 0) end
    j = skip_ws(s, j + 1)
  end
end

local function route_type(method, path)
  local found = nil
  for _, route in ipairs(ROUTES) do
    if route[1] == method and find(path, route[2]) then
      -- Two bindings of different bodies for one path: leave it to the transcoder.
      if found ~= nil and found ~= route[3] then return nil end
      found = route[3]
    end
  end
  return found
end

local ESCAPES = { ['"'] = '\\"', ['\\'] = '\\\\', ['\n'] = '\\n', ['\r'] = '\\r', ['\t'] = '\\t' }

local function json_string(s)
  return '"' .. s:gsub('[%c"\\]', function(c)
    return ESCAPES[c] or string.format("\\u%04x", c:byte())
  end) .. '"'
end

-- At most MAX_PARAM_BYTES of a (client-chosen) key, cut on a UTF-8 character boundary.
local function bounded(param)
  if #param <= MAX_PARAM_BYTES then return param end
  local cut = MAX_PARAM_BYTES
  while cut > 0 and byte(param, cut + 1) >= 0x80 and byte(param, cut + 1) < 0xC0 do
    cut = cut - 1
  end
  return sub(param, 1, cut) .. "..."
end

-- Anthropic's paths answer in Anthropic's error shape, {"type": "error", "error": {"type",
-- "message"}} (no param field: the message names it): error_shaper.lua, the first filter, marks
-- such a request in the edge's dynamic metadata (NAMESPACE / ANTHROPIC_KEY).
local NAMESPACE = "__METADATA_NAMESPACE__"
local ANTHROPIC_KEY = "__ANTHROPIC_MARK__"

local function is_anthropic(handle)
  local marks = handle:streamInfo():dynamicMetadata():get(NAMESPACE)
  return marks ~= nil and marks[ANTHROPIC_KEY] == true
end

local function rejection(param, anthropic)
  local message = json_string("Unrecognized request argument supplied: " .. bounded(param))
  if anthropic then
    return '{"type":"error","error":{"type":"invalid_request_error","message":' .. message .. '}}'
  end
  return '{"error":{"message":' .. message .. ',"type":"invalid_request_error","param":'
    .. json_string(bounded(param)) .. ',"code":null}}'
end

local function check(s, kind)
  local i = skip_ws(s, 1)
  if byte(s, i) ~= 123 then return end
  reset_cursor()
  depth = 0
  scan_object(s, i, TYPES[kind], nil)
end

function envoy_on_request(handle)
  local headers = handle:headers()
  local path = (headers:get(":path") or ""):match("^[^?#]*")
  local kind = route_type(headers:get(":method"), path)
  if kind == nil then return end
  local body = handle:body()
  if body == nil then return end
  local ok, err = pcall(check, body:getBytes(0, body:length()), kind)
  if not ok and type(err) == "table" then
    handle:respond({ [":status"] = "400", ["content-type"] = "application/json" },
      rejection(err.param, is_anthropic(handle)))
  end
end
