-- wrk: a POST without an idempotency key, passed through. Used by bench.sh and instructions.sh.
wrk.method = "POST"
wrk.body = '{"amount":2000,"currency":"eur","customer":"cus_9s6XKzkNRiz8i3"}'
wrk.headers["Content-Type"] = "application/json"
-- The tail percentiles wrk's own report rounds off or leaves out, in µs, for bench.sh.
function done(summary, latency, requests)
    io.write(string.format("tail_us %d %d %d\n", latency:percentile(50), latency:percentile(99), latency:percentile(99.9)))
end
