-- wrk script for bench/peers.py: POST the request body in $WRK_BODY_FILE to the target URL and,
-- when the run is over, print one JSON line (prefixed "wrk-summary ") with the figures the bench
-- reads: completed requests, errors (socket errors and non-2xx answers), latency percentiles.
-- A body holding the marker VARY_N is sent with the marker replaced by a counter, so every
-- request's prompt differs (no cache in a proxy can answer a repeat); one without it is sent
-- as is (bench/http_stack.py's engine body).
local path = os.getenv("WRK_BODY_FILE") or error("WRK_BODY_FILE is not set")
local file = assert(io.open(path, "rb"))
local body = file:read("*a")
file:close()
wrk.method = "POST"
wrk.body = body
wrk.headers["content-type"] = "application/json"

local head, tail = body:match("^(.-)VARY_N(.*)$")
if head ~= nil then
  local n = 0
  request = function()
    n = n + 1
    return wrk.format(nil, nil, nil, head .. n .. tail)
  end
end

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'wrk-summary {"requests":%d,"duration_us":%d,"errors":%d,"non_2xx":%d,"p50_us":%d,"p99_us":%d}\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(99)))
end
