#!/usr/bin/env python3
"""Continuation benchmark: 3 simulated vLLM servers (separate `sluice sim` processes, real-time
speed, answers longer than the limit) behind one `sluice serve`; `--clients` long streams
(`max_tokens` 400, include_usage) run at once, and `--kill-after` seconds after every stream
has received tokens the backend serving the most of them is SIGKILLed. Each stream is read to its end and checked as a
client would: an error event or a broken read is a failure; otherwise it must hold exactly
`max_tokens` tokens, one role delta, one finish_reason, one id/created/model, and usage that
sums to what was received. Run with continuation on (default) and `--no-continue`.

Usage: cargo build --release && python3 bench/chaos/resume.py [--clients 32] [--no-continue]
Only the Python standard library is used. Everything listens on 127.0.0.1.
"""
import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from chaos import free_port, get_json, wait_port  # noqa: E402

MAX_TOKENS = 400


def start_sim(binary, port):
    return subprocess.Popen(
        [binary, "sim", "--kind", "vllm", "--port", str(port), "--model", "m", "--speed", "1",
         "--min-output-tokens", "1000", "--max-output-tokens", "1000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class Stream(threading.Thread):
    """One client: one streamed chat, read to its end and checked."""

    def __init__(self, port, i):
        super().__init__(daemon=True)
        self.port, self.i = port, i
        self.backend, self.tokens, self.roles, self.finishes = None, 0, 0, []
        self.idents, self.usage, self.error, self.done = set(), None, None, False
        self.first_token = threading.Event()
        self.longest_gap = 0.0

    def run(self):
        body = json.dumps({"model": "m", "max_tokens": MAX_TOKENS, "stream": True, "seed": self.i,
                           "stream_options": {"include_usage": True},
                           "messages": [{"role": "user", "content": f"story {self.i}"}]})
        try:
            c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            c.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
            r = c.getresponse()
            self.backend = r.getheader("x-sluice-backend")
            last = time.time()
            for line in r:
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                now = time.time()
                self.longest_gap = max(self.longest_gap, now - last)
                last = now
                data = line[6:]
                if data == b"[DONE]":
                    self.done = True
                    continue
                ev = json.loads(data)
                if "error" in ev:
                    self.error = ev["error"].get("message", "error")
                    continue
                self.idents.add((ev.get("id"), ev.get("created"), ev.get("model")))
                if ev.get("usage"):
                    self.usage = ev["usage"]
                for ch in ev.get("choices", []):
                    d = ch.get("delta", {})
                    if "role" in d:
                        self.roles += 1
                    if d.get("content"):
                        self.tokens += 1
                        self.first_token.set()
                    if ch.get("finish_reason"):
                        self.finishes.append(ch["finish_reason"])
        except Exception as e:  # a broken read is a failure as the client sees it
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.first_token.set()

    def whole(self):
        u = self.usage or {}
        return (self.error is None and self.done and self.tokens == MAX_TOKENS
                and self.roles == 1 and len(self.finishes) == 1 and len(self.idents) == 1
                and u.get("completion_tokens") == MAX_TOKENS
                and u.get("total_tokens") == u.get("prompt_tokens", -1) + MAX_TOKENS)


def metric(port, name):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(name))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=os.path.join(os.path.dirname(__file__), "..", "..", "target", "release", "sluice"))
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--no-continue", action="store_true")
    ap.add_argument("--kill-after", type=float, default=2.0,
                    help="seconds after every stream has its first token")
    args = ap.parse_args()
    binary = os.path.abspath(args.binary)
    if not os.path.exists(binary):
        raise SystemExit(f"{binary} not found: run `cargo build --release` first")

    ports = [free_port() for _ in range(3)]
    sims = [start_sim(binary, p) for p in ports]
    for p in ports:
        wait_port(p)
    gw_port = free_port()
    cfg = f"""
[server]
listen = "127.0.0.1:{gw_port}"
[routing]
policy = "least-request"
expose_backend_header = true
continue_streams = {"false" if args.no_continue else "true"}
[health]
interval = "200ms"
timeout = "300ms"
healthy_threshold = 2
unhealthy_threshold = 2
"""
    for i, p in enumerate(ports):
        cfg += f'\n[[backends]]\nname = "s{i}"\nkind = "vllm"\nurl = "http://127.0.0.1:{p}"\nmodels = ["m"]\n'
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(cfg)
        cfg_path = f.name
    env = dict(os.environ, SLUICE_LOG="warn")
    gw = subprocess.Popen([binary, "serve", "--config", cfg_path], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(gw_port)
        end = time.time() + 10
        while time.time() < end:
            doc = get_json(gw_port, "/admin/backends")
            if all(b["state"] == "healthy" for b in doc["backends"]):
                break
            time.sleep(0.05)
        streams = [Stream(gw_port, i) for i in range(args.clients)]
        t0 = time.time()
        for s in streams:
            s.start()
        for s in streams:
            s.first_token.wait(30)
        on = {}
        for s in streams:
            on[s.backend] = on.get(s.backend, 0) + 1
        victim = max(on, key=on.get)
        time.sleep(args.kill_after)
        before = [s.tokens for s in streams if s.backend == victim]
        t_kill = time.time()
        sims[int(victim[1:])].send_signal(signal.SIGKILL)
        for s in streams:
            s.join(120)
        hit = [s for s in streams if s.backend == victim]
        report = {
            "continue_streams": not args.no_continue,
            "clients": args.clients,
            "max_tokens": MAX_TOKENS,
            "killed": victim,
            "killed_after_s": round(t_kill - t0, 2),
            "streams_on_killed_backend": len(hit),
            "their_tokens_before_kill_min_max": [min(before, default=0), max(before, default=0)],
            "client_errors": sum(1 for s in streams if s.error),
            "whole_answers": sum(1 for s in streams if s.whole()),
            "continued (metric)": metric(gw_port, "sluice_stream_continuations_total"),
            "longest_gap_on_killed_streams_s": round(max((s.longest_gap for s in hit), default=0), 3),
            "total_s": round(time.time() - t0, 2),
            "errors": sorted({s.error for s in streams if s.error})[:3],
        }
        print(json.dumps(report, indent=2))
    finally:
        gw.terminate()
        for s in sims:
            s.kill()
        gw.wait(timeout=10)
        os.unlink(cfg_path)


if __name__ == "__main__":
    sys.exit(main())
