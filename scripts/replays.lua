-- wrk: 16 keys, reused: after each key's first request, every request is a replay. Used by
-- bench.sh and instructions.sh.
local requests, n = {}, 0
local body = '{"amount":2000,"currency":"eur","customer":"cus_9s6XKzkNRiz8i3"}'
function init(args)
    for i = 1, 16 do
        requests[i] = wrk.format("POST", nil, {
            ["Host"] = wrk.headers["Host"],
            ["Content-Type"] = "application/json",
            ["Idempotency-Key"] = "replay-" .. i,
        }, body)
    end
end
function request()
    n = n % 16 + 1
    return requests[n]
end
-- The tail percentiles wrk's own report rounds off or leaves out, in µs, for bench.sh.
function done(summary, latency, requests)
    io.write(string.format("tail_us %d %d %d\n", latency:percentile(50), latency:percentile(99), latency:percentile(99.9)))
end
