#!/usr/bin/env python3
"""One trace from the client to the engine, with real parts: a real vLLM (CPU) with its own
OpenTelemetry tracing on and Sluice in front of it, both exporting to one OTLP/HTTP receiver
built on the official `opentelemetry-proto` package. A client request carrying a
`traceparent` must yield one trace holding the client's parent, Sluice's server span and its
phase spans, and vLLM's `llm_request` span as a child of Sluice's attempt span.

Run with the Python of vLLM's environment (it has vLLM's OpenTelemetry packages, which
include `opentelemetry-proto`):

  VENV/bin/python bench/tracing/real_vllm.py --binary target/release/sluice \\
      --vllm VENV/bin/vllm --model MODEL_DIR [--json bench/results/tracing-real-vllm.json]

Prints the trace as a tree and exits non-zero when a check fails.
"""

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

SPANS = []
LOCK = threading.Lock()


def any_value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


class Receiver(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        with LOCK:
            for rs in req.resource_spans:
                service = next((any_value(a.value) for a in rs.resource.attributes
                                if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        SPANS.append({
                            "service": service, "name": s.name, "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                            "start_ns": s.start_time_unix_nano, "end_ns": s.end_time_unix_nano,
                            "attrs": {a.key: any_value(a.value) for a in s.attributes},
                        })
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url, within):
    deadline = time.time() + within
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    sys.exit(f"not ready in {within}s: {url}")


def trace_of(trace_id):
    with LOCK:
        return [s for s in SPANS if s["trace_id"] == trace_id]


def tree(spans, client_parent):
    by_parent = {}
    for s in spans:
        by_parent.setdefault(s["parent"], []).append(s)
    lines = [f"client span {client_parent} (the client's, not exported)"]

    def walk(parent, depth):
        for s in sorted(by_parent.get(parent, []), key=lambda s: s["start_ns"]):
            ms = (s["end_ns"] - s["start_ns"]) / 1e6
            keys = ("sluice.backend", "sluice.attempt.outcome", "gen_ai.usage.output_tokens",
                    "gen_ai.response.model", "gen_ai.usage.completion_tokens", "sluice.ttft_ms",
                    "gen_ai.latency.time_to_first_token")
            shown = {k: s["attrs"][k] for k in keys if k in s["attrs"]}
            lines.append(f"{'  ' * depth}└─ [{s['service']}] {s['name']} {s['span_id']} {ms:.1f} ms {shown}")
            walk(s["span_id"], depth + 1)

    walk(client_parent, 1)
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", required=True)
    ap.add_argument("--vllm", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--json")
    args = ap.parse_args()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    otlp = f"http://127.0.0.1:{server.server_address[1]}"
    vllm_port, port = free_port(), free_port()
    tmp = tempfile.mkdtemp(prefix="sluice-trace-")
    # offline, a 1 GiB KV cache on the CPU backend (as bench/plan/real_vllm.py), its traces over
    # OTLP/HTTP to the same receiver
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1",
               OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf", OTEL_SERVICE_NAME="vllm")
    vllm = subprocess.Popen(
        [args.vllm, "serve", args.model, "--served-model-name", "tiny", "--host", "127.0.0.1",
         "--port", str(vllm_port), "--max-model-len", "1024", "--enforce-eager", "--max-num-seqs", "4",
         "--otlp-traces-endpoint", f"{otlp}/v1/traces"],
        env=env, stdout=open(os.path.join(tmp, "vllm.log"), "w"), stderr=subprocess.STDOUT,
        start_new_session=True)
    procs = [vllm]
    try:
        print(f"logs in {tmp}", flush=True)
        wait_http(f"http://127.0.0.1:{vllm_port}/health", 600)
        config = os.path.join(tmp, "sluice.toml")
        with open(config, "w") as f:
            f.write(f'[server]\nlisten = "127.0.0.1:{port}"\n\n[tracing]\notlp_endpoint = "{otlp}"\n'
                    f'export_interval = "200ms"\n\n[[backends]]\nname = "vllm-cpu"\nkind = "vllm"\n'
                    f'url = "http://127.0.0.1:{vllm_port}"\nmodels = ["tiny"]\n')
        sluice = subprocess.Popen([args.binary, "serve", "--config", config],
                                  env=dict(os.environ, SLUICE_LOG_FORMAT="json"),
                                  stdout=open(os.path.join(tmp, "sluice.log"), "w"),
                                  stderr=subprocess.STDOUT)
        procs.append(sluice)
        wait_http(f"http://127.0.0.1:{port}/readyz", 60)

        results = {"vllm_version": subprocess.run([args.vllm, "--version"], capture_output=True,
                                                  text=True).stdout.strip(), "requests": []}
        ok = True
        for stream in (False, True):
            trace = f"{random.getrandbits(128):032x}"
            parent = f"{random.getrandbits(64):016x}"
            body = json.dumps({"model": "tiny", "max_tokens": 8, "stream": stream,
                               "messages": [{"role": "user", "content": "Say hello."}]}).encode()
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/chat/completions", data=body, method="POST",
                headers={"content-type": "application/json",
                         "traceparent": f"00-{trace}-{parent}-01"})
            with urllib.request.urlopen(req, timeout=120) as r:
                r.read()
                status = r.status
            # vLLM's batch processor sends every 5 s by default
            deadline = time.time() + 30
            while time.time() < deadline:
                spans = trace_of(trace)
                if any(s["name"] == "llm_request" for s in spans) and any(
                        s["name"].startswith("POST ") for s in spans):
                    break
                time.sleep(0.5)
            spans = trace_of(trace)
            server = next((s for s in spans if s["name"].startswith("POST ")), None)
            attempt = next((s for s in spans if s["name"] == "sluice.attempt"), None)
            engine = next((s for s in spans if s["name"] == "llm_request"), None)
            first = next((s for s in spans if s["name"] == "sluice.first_token"), None)
            checks = {
                "status_200": status == 200,
                "server_span_child_of_client": bool(server) and server["parent"] == parent,
                "attempt_child_of_server": bool(server and attempt) and attempt["parent"] == server["span_id"],
                "vllm_span_child_of_attempt": bool(attempt and engine) and engine["parent"] == attempt["span_id"],
                "one_trace": all(s["trace_id"] == trace for s in spans),
                # a stream's wait for its first token: from the send, so it holds the engine's
                # own time to first token (vLLM's, from its arrival) and ends after the engine
                # made that token
                "first_token_span": (bool(server and first and engine)
                                     and first["parent"] == server["span_id"]
                                     and first["start_ns"] <= engine["start_ns"]
                                     and (first["end_ns"] - first["start_ns"]) / 1e9
                                     >= engine["attrs"].get("gen_ai.latency.time_to_first_token", 0))
                if stream else first is None,
            }
            print(f"\n{'stream' if stream else 'whole'} answer, trace {trace}:")
            print(tree(spans, parent))
            print("checks:", json.dumps(checks))
            ok = ok and all(checks.values())
            results["requests"].append({"stream": stream, "trace_id": trace, "client_parent": parent,
                                        "checks": checks, "spans": spans})
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        if not ok:
            sys.exit("a check failed")
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
