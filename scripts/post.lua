-- wrk: a POST without an idempotency key, passed through. Used by bench.sh and instructions.sh.
wrk.method = "POST"
wrk.body = '{"amount":2000,"currency":"eur","customer":"cus_9s6XKzkNRiz8i3"}'
wrk.headers["Content-Type"] = "application/json"
