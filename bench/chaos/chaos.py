#!/usr/bin/env python3
"""Chaos benchmark: 3 simulated vLLM servers (separate `sluice sim` processes) behind one
`sluice serve`, steady non-streamed load from many concurrent clients; one backend is
SIGKILLed mid-run and restarted later, then the same backend is hung (fault `hang`) and
released. Reports requests sent and failed, time to ejection, time to rejoin.

Usage: cargo build --release && python3 bench/chaos/chaos.py [--clients 32] [--binary PATH]
Only the Python standard library is used. Everything listens on 127.0.0.1.
"""
import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, timeout=10.0):
    end = time.time() + timeout
    while time.time() < end:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise SystemExit(f"port {port} did not open")


def start_sim(binary, port):
    return subprocess.Popen(
        [binary, "sim", "--kind", "vllm", "--port", str(port), "--model", "m", "--speed", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def post_json(port, path, body, timeout=5.0):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def get_json(port, path):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=2.0)
    c.request("GET", path)
    r = c.getresponse()
    data = json.loads(r.read())
    c.close()
    return data


class Load:
    """`clients` threads, each a keep-alive client sending chats back to back."""

    def __init__(self, port, clients, ttfb):
        self.port, self.clients, self.ttfb = port, clients, ttfb
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.results = []  # (start, end, ok, backend)
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(clients)]

    def run(self):
        body = json.dumps({"model": "m", "max_tokens": 8,
                           "messages": [{"role": "user", "content": "hello"}]})
        conn = None
        while not self.stop.is_set():
            t0 = time.time()
            ok, backend = False, None
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.ttfb + 10)
                conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
                r = conn.getresponse()
                r.read()
                ok = r.status == 200
                backend = r.getheader("x-sluice-backend")
            except (OSError, http.client.HTTPException):
                conn = None
            with self.lock:
                self.results.append((t0, time.time(), ok, backend))

    def start(self):
        for t in self.threads:
            t.start()

    def finish(self):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=15)


class Watch:
    """Polls /admin/backends every 10 ms: s1's state and attempt count over time."""

    def __init__(self, port):
        self.port = port
        self.stop = threading.Event()
        self.samples = []  # (time, state, requests_total)
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.is_set():
            try:
                doc = get_json(self.port, "/admin/backends")
                b = next(x for x in doc["backends"] if x["name"] == "s1")
                self.samples.append((time.time(), b["state"], b["requests_total"]))
            except Exception:
                pass
            time.sleep(0.01)

    def first_not_routable(self, after):
        for t, state, _ in self.samples:
            if t >= after and state not in ("healthy", "unknown", "overloaded"):
                return t - after
        return None

    def last_new_request(self, after, until):
        base = None
        last = after
        for t, _, n in self.samples:
            if t < after or t > until:
                continue
            if base is None:
                base = n
            elif n > base:
                base, last = n, t
        return last - after

    def healthy_again(self, after):
        for t, state, _ in self.samples:
            if t >= after and state == "healthy":
                return t - after
        return None


def summarize(load, name, t_from, t_to):
    rows = [r for r in load.results if t_from <= r[0] < t_to]
    failed = [r for r in rows if not r[2]]
    lat = sorted(r[1] - r[0] for r in rows)
    p99 = lat[int(len(lat) * 0.99) - 1] if lat else 0
    return {"phase": name, "sent": len(rows), "failed": len(failed),
            "max_latency_s": round(lat[-1], 3) if lat else 0, "p99_latency_s": round(p99, 3)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=os.path.join(os.path.dirname(__file__), "..", "..", "target", "release", "sluice"))
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--ttfb", type=float, default=1.0, help="non-stream response-head timeout (s)")
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
[timeouts]
response = "{args.ttfb}s"
first_byte = "{args.ttfb}s"
[health]
interval = "200ms"
timeout = "300ms"
healthy_threshold = 2
unhealthy_threshold = 2
slow_start = "2s"
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
        watch = Watch(gw_port)
        watch.thread.start()
        load = Load(gw_port, args.clients, args.ttfb)
        t0 = time.time()
        load.start()

        time.sleep(2)
        t_kill = time.time()
        sims[1].send_signal(signal.SIGKILL)
        sims[1].wait()
        time.sleep(3)
        t_restart = time.time()
        sims[1] = start_sim(binary, ports[1])
        time.sleep(3)

        t_hang = time.time()
        post_json(ports[1], "/sim/fault", {"mode": "hang"})
        time.sleep(3)
        t_release = time.time()
        post_json(ports[1], "/sim/fault", {"mode": "healthy"})
        time.sleep(3)
        t_end = time.time()
        load.finish()
        watch.stop.set()
        watch.thread.join(timeout=2)

        served_by_s1_after = lambda a, b: sum(1 for r in load.results if a <= r[0] < b and r[3] == "s1")
        report = {
            "clients": args.clients,
            "ttfb_timeout_s": args.ttfb,
            "total": summarize(load, "all", t0, t_end),
            "kill": summarize(load, "kill", t_kill, t_restart),
            "kill_time_to_ejection_s": round(watch.first_not_routable(t_kill) or -1, 3),
            "kill_last_new_request_to_s1_s": round(watch.last_new_request(t_kill, t_restart), 3),
            "restart_time_to_rejoin_s": round(watch.healthy_again(t_restart) or -1, 3),
            "restart_served_by_s1": served_by_s1_after(t_restart, t_hang),
            "hang": summarize(load, "hang", t_hang, t_release),
            "hang_time_to_ejection_s": round(watch.first_not_routable(t_hang) or -1, 3),
            "hang_last_new_request_to_s1_s": round(watch.last_new_request(t_hang, t_release), 3),
            "hang_failed_after_detection": sum(
                1 for r in load.results
                if not r[2] and t_hang + (watch.first_not_routable(t_hang) or 0) + args.ttfb < r[0] < t_release),
            "release_time_to_rejoin_s": round(watch.healthy_again(t_release) or -1, 3),
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
