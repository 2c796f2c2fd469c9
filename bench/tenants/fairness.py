#!/usr/bin/env python3
"""Fairness under saturation: a heavy tenant sending 10x the load of a light one.

One simulated vLLM server (realistic timing, `--speed 1`) behind Sluice with a concurrency cap
of 4, so requests beyond it wait in the gateway's queue, which serves tenants fairly. The light
tenant sends one request at a time; its latency is measured alone first (the baseline), then
while the heavy tenant keeps 10x as many requests in flight. Target: the light tenant's p99
stays within 2x of its unloaded value.

Usage: python3 bench/tenants/fairness.py [--binary target/release/sluice] [--seconds 20]
"""

import argparse
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEAVY = "sk-sluice-bench-heavy-000000000000000000000000000000000000"
LIGHT = "sk-sluice-bench-light-000000000000000000000000000000000000"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


def call(port, key, max_tokens):
    body = json.dumps({"model": "m", "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "Tell me something."}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
            ok = r.status == 200
    except Exception:
        ok = False
    return time.perf_counter() - t0, ok


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


def light_run(port, seconds):
    lat, errors = [], 0
    end = time.time() + seconds
    while time.time() < end:
        d, ok = call(port, LIGHT, 16)
        if ok:
            lat.append(d)
        else:
            errors += 1
        time.sleep(0.05)
    return lat, errors


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary")
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--heavy-clients", type=int, default=10)
    args = ap.parse_args()
    binary = args.binary
    if not binary:
        subprocess.run(["cargo", "build", "--release", "--locked"], cwd=ROOT, check=True)
        binary = os.path.join(ROOT, "target/release/sluice")
    procs = []
    try:
        sim_port = free_port()
        procs.append(subprocess.Popen([binary, "sim", "--kind", "vllm", "--port", str(sim_port), "--model", "m",
                                       "--speed", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_http(f"http://127.0.0.1:{sim_port}/health")
        gw_port = free_port()
        keys = ""
        for name, key in (("heavy", HEAVY), ("light", LIGHT)):
            keys += f'[[keys]]\nname = "{name}"\nhash = "sha256:{hashlib.sha256(key.encode()).hexdigest()}"\n'
        cfg = (f'[server]\nlisten = "127.0.0.1:{gw_port}"\n[queue]\nsize = 4096\ntimeout = "120s"\n'
               f'[[backends]]\nname = "gpu"\nkind = "vllm"\nurl = "http://127.0.0.1:{sim_port}"\nmodels = ["m"]\n'
               f'max_concurrent = 4\n{keys}')
        path = os.path.join(tempfile.mkdtemp(prefix="sluice-fair-"), "sluice.toml")
        with open(path, "w") as f:
            f.write(cfg)
        procs.append(subprocess.Popen([binary, "serve", "--config", path], env=dict(os.environ, SLUICE_LOG="warn"),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_http(f"http://127.0.0.1:{gw_port}/readyz")

        base, base_err = light_run(gw_port, args.seconds / 2)

        stop = threading.Event()
        heavy_done = [0, 0]

        def heavy():
            while not stop.is_set():
                _, ok = call(gw_port, HEAVY, 16)
                heavy_done[0 if ok else 1] += 1

        threads = [threading.Thread(target=heavy, daemon=True) for _ in range(args.heavy_clients)]
        for t in threads:
            t.start()
        time.sleep(1)
        loaded, loaded_err = light_run(gw_port, args.seconds)
        stop.set()
        for t in threads:
            t.join(timeout=130)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()

    res = {
        "light_unloaded": {"n": len(base), "p50_s": round(pct(base, 0.5), 4), "p99_s": round(pct(base, 0.99), 4), "errors": base_err},
        "light_loaded": {"n": len(loaded), "p50_s": round(pct(loaded, 0.5), 4), "p99_s": round(pct(loaded, 0.99), 4), "errors": loaded_err},
        "heavy": {"ok": heavy_done[0], "errors": heavy_done[1], "clients": args.heavy_clients},
    }
    res["light_p99_ratio"] = round(res["light_loaded"]["p99_s"] / res["light_unloaded"]["p99_s"], 3)
    print(json.dumps(res, indent=1))
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", f"fairness-{time.strftime('%Y%m%d-%H%M%S')}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
