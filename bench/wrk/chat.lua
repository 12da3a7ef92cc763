-- wrk script for bench/peers.py: POST the request body in $WRK_BODY_FILE to the target URL and,
-- when the run is over, print one JSON line (prefixed "wrk-summary ") with the figures the bench
-- reads: completed requests, errors (socket errors and non-2xx answers), latency percentiles.
local path = os.getenv("WRK_BODY_FILE") or error("WRK_BODY_FILE is not set")
local file = assert(io.open(path, "rb"))
wrk.method = "POST"
wrk.body = file:read("*a")
file:close()
wrk.headers["content-type"] = "application/json"

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'wrk-summary {"requests":%d,"duration_us":%d,"errors":%d,"non_2xx":%d,"p50_us":%d,"p99_us":%d}\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(99)))
end
