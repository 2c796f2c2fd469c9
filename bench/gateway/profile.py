#!/usr/bin/env python3
"""Hot-path profile: instructions per request through Sluice, counted by valgrind's callgrind.

Instruction counts do not depend on what else the machine is doing, so two builds can be
compared on a noisy machine. Starts a zero-delay vLLM simulator natively and Sluice under
callgrind in the benchmark's realistic configuration (an API key with limits, token-aware
routing over two backends), warms up, zeroes the counters, sends N small non-streamed chat
requests (and optionally N streamed ones) over one keep-alive connection, dumps, and prints
instructions per request and the functions with the largest self cost.

Usage:
  python3 bench/gateway/profile.py                       # release build with line tables
  python3 bench/gateway/profile.py --binary PATH -n 2000 --stream
Needs valgrind (Debian package). Build with debug line tables for readable names:
  CARGO_PROFILE_RELEASE_DEBUG=line-tables-only cargo build --release
"""

import argparse
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import BENCH_KEY, ROOT, SMALL_BODY, Procs, sim, sluice_config, free_port, wait_http  # noqa: E402


def short_name(location):
    """`file:function [object]` without the build machine's directories and the object."""
    location = re.sub(r"\s*\[[^\]]*\]$", "", location)
    location = re.sub(r"^.*?/registry/src/[^/]+/", "", location)
    location = re.sub(r"^/rustc/[0-9a-f]+/", "", location)
    location = location.replace(ROOT + "/", "")
    return location[:160]


def send(port, n, stream):
    body = json.loads(SMALL_BODY)
    body["stream"] = stream
    data = json.dumps(body).encode()
    hdr = {"Content-Type": "application/json", "Authorization": f"Bearer {BENCH_KEY}"}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    for _ in range(n):
        conn.request("POST", "/v1/chat/completions", data, hdr)
        r = conn.getresponse()
        r.read()
        if r.status != 200:
            sys.exit(f"unexpected status {r.status}")
    conn.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", help="sluice binary (default: build target/release/sluice with line tables)")
    ap.add_argument("-n", type=int, default=1000, help="requests measured")
    ap.add_argument("--stream", action="store_true", help="also measure streamed requests")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--bare", action="store_true", help="bare proxy settings (no keys, round-robin)")
    args = ap.parse_args()
    binary = args.binary
    if not binary:
        env = dict(os.environ, CARGO_PROFILE_RELEASE_DEBUG="line-tables-only")
        subprocess.run(["cargo", "build", "--release", "--locked"], cwd=ROOT, check=True, env=env)
        binary = os.path.join(ROOT, "target/release/sluice")
    tmp = tempfile.mkdtemp(prefix="sluice-profile-")
    procs = Procs()
    results = {}
    try:
        sims = [sim(procs, binary, ["--speed", "0"]) for _ in range(2)]
        port = free_port()
        cfg = os.path.join(tmp, "sluice.toml")
        with open(cfg, "w") as f:
            f.write(sluice_config(port, sims, not args.bare))
        out = os.path.join(tmp, "callgrind.out")
        p = procs.start(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                         "--dump-instr=no", "--collect-atstart=yes", binary, "serve", "--config", cfg],
                        env=dict(os.environ, SLUICE_LOG="warn"))
        wait_http(f"http://127.0.0.1:{port}/readyz", timeout=120)
        kinds = [("non-stream", False)] + ([("stream", True)] if args.stream else [])
        for label, stream in kinds:
            send(port, 100, stream)  # warm up: connections, pools, caches
            subprocess.run(["callgrind_control", "-z", str(p.pid)], check=True, capture_output=True)
            t = time.time()
            send(port, args.n, stream)
            subprocess.run(["callgrind_control", "-d", label, str(p.pid)], check=True, capture_output=True)
            dumps = sorted(f for f in os.listdir(tmp) if f.startswith("callgrind.out."))
            dump = os.path.join(tmp, dumps[-1])
            ann = subprocess.run(["callgrind_annotate", "--threshold=100", "--auto=no", dump],
                                 capture_output=True, text=True, check=True).stdout
            total = int(re.search(r"([\d,]+)\s+\(100.0%\)\s+PROGRAM TOTALS", ann).group(1).replace(",", ""))
            per = total / args.n
            top = []
            for line in ann.splitlines():
                m = re.match(r"\s*([\d,]+)\s+\(\s*([\d.]+)%\)\s+(.*)", line)
                # Self cost; the thread entry points (~100%) carry everything and say nothing.
                if m and "PROGRAM TOTALS" not in line and float(m.group(2)) < 99:
                    top.append((float(m.group(2)), short_name(m.group(3))))
                if len(top) >= args.top:
                    break
            results[label] = {"requests": args.n, "instructions_per_request": round(per),
                              "wall_seconds_under_callgrind": round(time.time() - t, 1),
                              "top_self": [{"percent": a, "function": b} for a, b in top]}
            print(f"\n== {label}: {per:,.0f} instructions per request ({args.n} requests)")
            for a, b in top:
                print(f"{a:6.1f}%  {b}")
    finally:
        procs.stop()
    out_dir = os.path.join(ROOT, "bench", "results")
    os.makedirs(out_dir, exist_ok=True)
    config = "bare" if args.bare else "full"
    results["config"] = config
    with open(os.path.join(out_dir, f"profile-{config}-{time.strftime('%Y%m%d-%H%M%S')}.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
