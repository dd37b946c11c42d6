-- wrk: a POST with a unique Idempotency-Key per request: prefix (the first argument after
-- `--`), the thread's number and a counter. Used by bench.sh, soak.sh and instructions.sh.
local threads = 0
function setup(thread)
    threads = threads + 1
    thread:set("id", threads)
end
local prefix, counter = "", 0
function init(args)
    prefix = (args[1] or "run") .. "-" .. tostring(id) .. "-"
end
local body = '{"amount":2000,"currency":"eur","customer":"cus_9s6XKzkNRiz8i3"}'
function request()
    counter = counter + 1
    return wrk.format("POST", nil, {
        ["Host"] = wrk.headers["Host"],
        ["Content-Type"] = "application/json",
        ["Idempotency-Key"] = prefix .. counter,
    }, body)
end
-- The tail percentiles wrk's own report rounds off or leaves out, in µs, for bench.sh.
function done(summary, latency, requests)
    io.write(string.format("tail_us %d %d %d\n", latency:percentile(50), latency:percentile(99), latency:percentile(99.9)))
end
