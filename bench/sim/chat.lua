-- wrk script: one small non-stream chat completion per request, over keep-alive.
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"m","messages":[{"role":"user","content":"Say hello"}],"max_tokens":16}'
