#!/usr/bin/env python3
"""Rescue benchmark (issue 18 item 1): 3 simulated vLLM servers (separate `sluice sim`
processes, realistic timing) behind one `sluice serve` with the DEFAULT config (health probes
every 1 s, thresholds of 2, `first_byte` 60 s, `response` 600 s). Concurrent clients send
streamed and non-streamed chats back to back, each with a 30 s client timeout; backend s1 is
hung (fault `hang`: connections accepted, nothing answered) and released later. Reports
requests sent and failed during the hang, the time until s1 left the pool, and the slowest
answer of a request sent during the hang.

Usage: python3 bench/chaos/rescue.py [--clients 32] [--binary PATH] [--hang 8]
Only the Python standard library is used. Everything listens on 127.0.0.1.
"""
import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from chaos import Watch, free_port, get_json, post_json, wait_port  # noqa: E402

CLIENT_TIMEOUT = 30.0


def start_sim(binary, port):
    return subprocess.Popen(
        [binary, "sim", "--kind", "vllm", "--port", str(port), "--model", "m"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class Load:
    """`clients` threads, each a keep-alive client alternating streamed and whole chats."""

    def __init__(self, port, clients):
        self.port, self.clients = port, clients
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.results = []  # (start, end, ok, backend)
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True)
                        for i in range(clients)]

    def one(self, conn, stream):
        body = json.dumps({"model": "m", "max_tokens": 16, "stream": stream,
                           "messages": [{"role": "user", "content": "hello there"}]})
        conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        ok = r.status == 200
        if stream:
            ok = ok and b'"error"' not in data and data.rstrip().endswith(b"data: [DONE]")
        return ok, r.getheader("x-sluice-backend")

    def run(self, i):
        conn, n = None, i
        while not self.stop.is_set():
            t0 = time.time()
            ok, backend = False, None
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=CLIENT_TIMEOUT)
                ok, backend = self.one(conn, n % 2 == 0)
            except (OSError, http.client.HTTPException):
                conn = None
            n += 1
            with self.lock:
                self.results.append((t0, time.time(), ok, backend))

    def start(self):
        for t in self.threads:
            t.start()

    def finish(self):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=CLIENT_TIMEOUT + 5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=os.path.join(os.path.dirname(__file__), "..", "..", "target", "release", "sluice"))
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--hang", type=float, default=8.0, help="seconds s1 stays hung")
    ap.add_argument("--probe-interval", default=None,
                    help='[health] interval, e.g. "30s": probes too slow to notice, so only '
                         'the hang deadline can (default: the default config)')
    args = ap.parse_args()
    binary = os.path.abspath(args.binary)
    if not os.path.exists(binary):
        raise SystemExit(f"{binary} not found: run `cargo build --release` first")
    ports = [free_port() for _ in range(3)]
    sims = [start_sim(binary, p) for p in ports]
    for p in ports:
        wait_port(p)
    gw_port = free_port()
    cfg = f'[server]\nlisten = "127.0.0.1:{gw_port}"\n[routing]\nexpose_backend_header = true\n'
    if args.probe_interval:
        cfg += f'[health]\ninterval = "{args.probe_interval}"\n'
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
            if all(b["state"] == "healthy" for b in get_json(gw_port, "/admin/backends")["backends"]):
                break
            time.sleep(0.05)
        watch = Watch(gw_port)
        watch.thread.start()
        load = Load(gw_port, args.clients)
        load.start()
        time.sleep(4)
        t_hang = time.time()
        post_json(ports[1], "/sim/fault", {"mode": "hang"})
        time.sleep(args.hang)
        t_release = time.time()
        post_json(ports[1], "/sim/fault", {"mode": "healthy"})
        time.sleep(2)
        load.finish()
        watch.stop.set()
        watch.thread.join(timeout=2)
        detected = watch.first_not_routable(t_hang)
        during = [r for r in load.results if t_hang <= r[0] < t_release]
        lat = sorted(r[1] - r[0] for r in during)
        report = {
            "clients": args.clients,
            "probe_interval": args.probe_interval or "1s (default)",
            "hang_s": args.hang,
            "sent_during_hang": len(during),
            "failed_during_hang": sum(1 for r in during if not r[2]),
            "failed_total": sum(1 for r in load.results if not r[2]),
            "time_to_detection_s": round(detected, 3) if detected is not None else None,
            "slowest_answer_s": round(lat[-1], 3) if lat else None,
            "p99_s": round(lat[int(len(lat) * 0.99) - 1], 3) if lat else None,
            # requests sent before detection (so possibly caught on s1) still unanswered 2 s
            # after it
            "waiting_over_2s_past_detection": sum(
                1 for r in during
                if detected is not None and r[0] < t_hang + detected
                and r[1] > t_hang + detected + 2.0),
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
