#!/usr/bin/env python3
"""Gateway benchmark: Sluice side by side with direct access and nginx, in one run.

Starts simulated backends in zero-delay mode (`sluice sim --speed 0`), nginx as a plain
keep-alive reverse proxy to the same simulators (the baseline), and Sluice twice: "full" (API keys,
limits and token-aware routing on, the realistic configuration) and "bare" (no keys, no limits).
Targets are loaded in alternating rounds with wrk (saturation, concurrency 1) and oha (fixed
rate, latency corrected for coordinated omission), and measured with a small asyncio client for streaming fidelity, large bodies and many
concurrent streams. Prints a table and writes JSON to bench/results/.

Usage:
  python3 bench/gateway/bench.py                 # full run (release build, a few minutes)
  python3 bench/gateway/bench.py --smoke         # seconds; what CI runs so the harness cannot rot
  python3 bench/gateway/bench.py --binary PATH   # use an existing sluice binary
"""

import argparse
import asyncio
import json
import os
import platform
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL_BODY = json.dumps(
    {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Hello there!"}]}
)
# A key whose hash is in the "full" config; not a secret (benchmarks only).
BENCH_KEY = "sk-sluice-bench-0000000000000000000000000000000000000000"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raise_nofile():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(hard, want)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


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


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def children(pid):
    """Direct children of a process (nginx's workers)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except OSError:
                continue
    return out


def rss_tree_mb(pid):
    """RSS of a process and its direct children: Sluice is one process, nginx a master and workers."""
    return sum(rss_mb(p) for p in [pid, *children(pid)])


def cpu_seconds(pid):
    """User + system CPU of a process and its direct children (nginx's workers)."""
    ticks = os.sysconf(os.sysconf_names["SC_CLK_TCK"])
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry) == pid or int(fields[1]) == pid:
            total += int(fields[11]) + int(fields[12])
    return total / ticks


class Procs:
    def __init__(self):
        self.procs = []

    def start(self, args, **kw):
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             preexec_fn=raise_nofile, **kw)
        self.procs.append(p)
        return p

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def sim(procs, binary, extra=()):
    port = free_port()
    procs.start([binary, "sim", "--kind", "vllm", "--port", str(port), "--model", "m", *extra])
    wait_http(f"http://127.0.0.1:{port}/health")
    return port


def sluice_config(port, backends, full):
    import hashlib
    # Every bench client shares one address: the per-address connection cap (default 1000;
    # loopback is exempt by default) is lifted explicitly for the 10,000-stream run, so the
    # figures do not depend on that default, and the total cap (default 10,000) leaves room for
    # the harness's own connections next to the 10,000 streams.
    lines = [f'[server]\nlisten = "127.0.0.1:{port}"\nmax_connections = 20000\nmax_connections_per_ip = 20000\n',
             '[routing]\npolicy = "token-aware"\n' if full else '[routing]\npolicy = "round-robin"\n',
             '[timeouts]\nidle = "600s"\nfirst_byte = "600s"\n']
    for i, b in enumerate(backends):
        lines.append(f'[[backends]]\nname = "sim-{i}"\nkind = "vllm"\nurl = "http://127.0.0.1:{b}"\nmodels = ["m"]\n')
    if full:
        h = hashlib.sha256(BENCH_KEY.encode()).hexdigest()
        lines.append(f'[[keys]]\nname = "bench"\nhash = "sha256:{h}"\nmodels = ["m"]\n'
                     'requests_per_minute = 100000000\ntokens_per_minute = 100000000000\nmax_concurrent = 100000\n')
    return "\n".join(lines)


def start_sluice(procs, binary, backends, full, tmp):
    port = free_port()
    path = os.path.join(tmp, f"sluice-{'full' if full else 'bare'}.toml")
    with open(path, "w") as f:
        f.write(sluice_config(port, backends, full))
    env = dict(os.environ, SLUICE_LOG="warn")
    p = procs.start([binary, "serve", "--config", path], env=env)
    wait_http(f"http://127.0.0.1:{port}/readyz")
    return port, p


def start_nginx(procs, backends, tmp):
    port = free_port()
    ups = "\n".join(f"    server 127.0.0.1:{b};" for b in backends)
    conf = f"""
worker_processes auto;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 65536; }}
worker_rlimit_nofile 65536;
http {{
  access_log off;
  client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/fcgi; uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
  client_max_body_size 16m;
  client_body_buffer_size 16m;
  upstream sims {{
{ups}
    keepalive 1024;
  }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{
      proxy_pass http://sims;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout 600s;
    }}
  }}
}}
"""
    path = os.path.join(tmp, "nginx.conf")
    with open(path, "w") as f:
        f.write(conf)
    p = procs.start(["nginx", "-c", path, "-g", "daemon off;"])
    wait_http(f"http://127.0.0.1:{port}/health")
    return port, p


UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}


def parse_duration(s):
    m = re.match(r"([\d.]+)(us|ms|s|m)$", s.strip())
    return float(m.group(1)) * UNITS[m.group(2)] if m else float("nan")


def wrk(url, seconds, conns, threads, body_file, headers):
    script = body_file + ".lua"
    with open(script, "w") as f:
        f.write('wrk.method = "POST"\n')
        f.write(f'wrk.body = io.open("{body_file}"):read("*a")\n')
        f.write('wrk.headers["Content-Type"] = "application/json"\n')
        for k, v in headers.items():
            f.write(f'wrk.headers["{k}"] = "{v}"\n')
    out = subprocess.run(["wrk", "-t", str(threads), "-c", str(conns), "-d", f"{seconds}s", "--latency",
                          "-s", script, url], capture_output=True, text=True, timeout=seconds + 60).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    total = int(re.search(r"(\d+) requests in", out).group(1))
    errors = 0
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if m:
        errors += int(m.group(1))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if m:
        errors += sum(int(x) for x in m.groups())
    pct = {p: parse_duration(v) for p, v in re.findall(r"^\s+(50|75|90|99)%\s+(\S+)", out, re.M)}
    return {"rps": rps, "requests": total, "errors": errors,
            "p50_ms": pct.get("50", float("nan")) * 1e3, "p99_ms": pct.get("99", float("nan")) * 1e3}


def fixed_rate(url, seconds, rate, body_file, headers):
    """Requests at a fixed rate with oha, latency corrected for coordinated omission: a request
    the load generator could not send on time counts from when it was due, so a target past its
    saturation shows its queue in the percentiles instead of quietly lowering the rate."""
    args = ["oha", "-z", f"{seconds}s", "-w", "-c", "64", "-q", str(rate), "--latency-correction",
            "--no-tui", "--output-format", "json", "-m", "POST", "-T", "application/json", "-D", body_file]
    for k, v in headers.items():
        args += ["-H", f"{k}: {v}"]
    out = subprocess.run(args + [url], capture_output=True, text=True, timeout=seconds + 60).stdout
    j = json.loads(out)
    codes = {int(c): n for c, n in (j.get("statusCodeDistribution") or {}).items()}
    ok = codes.get(200, 0)
    failed = sum(codes.values()) - ok + sum((j.get("errorDistribution") or {}).values())
    lat = j.get("latencyPercentiles") or {}
    ms = lambda v: float("nan") if v is None else v * 1e3
    return {"rate": rate, "ok": ok, "achieved_rps": round(ok / seconds), "errors": failed,
            "p50_ms": ms(lat.get("p50")), "p99_ms": ms(lat.get("p99"))}


async def stream_gaps(port, headers, n_streams, max_tokens):
    """Open n streams one after another; return TTFB and inter-chunk gaps in ms."""
    ttfb, gaps = [], []
    body = json.dumps({"model": "m", "stream": True, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "Tell me a story"}]}).encode()
    for _ in range(n_streams):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
                + "Connection: close\r\n\r\n").encode()
        t0 = time.perf_counter()
        w.write(head + body)
        await w.drain()
        buf = b""
        last = None
        first = None
        while True:
            chunk = await r.read(65536)
            if not chunk:
                break
            now = time.perf_counter()
            events = (buf + chunk).count(b"data: {")
            buf = b""
            if events and b'"content":"' in chunk:
                if first is None:
                    first = now
                    ttfb.append((now - t0) * 1e3)
                elif last is not None:
                    gaps.append((now - last) * 1e3)
                last = now
        w.close()
    return ttfb, gaps


async def hold_streams(port, headers, n, rss_pid):
    """Open n concurrent streams, wait until each got its first chunk, measure RSS, close.

    RSS is the process tree's (nginx: master and workers) before and with the streams held."""
    body = json.dumps({"model": "m", "stream": True, "max_tokens": 1000,
                       "messages": [{"role": "user", "content": "hold"}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            + "\r\n").encode()
    idle = rss_tree_mb(rss_pid)
    conns, errors, kinds = [], 0, {}
    sem = asyncio.Semaphore(500)

    async def one():
        nonlocal errors
        async with sem:
            try:
                r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 30)
                w.write(head + body)
                await w.drain()
                got = b""
                while b"data: " not in got:
                    c = await asyncio.wait_for(r.read(4096), 60)
                    if not c:
                        raise ConnectionError("closed")
                    got += c
                if not got.startswith(b"HTTP/1.1 200"):
                    raise ConnectionError(got[:40])
                conns.append(w)
            except Exception as e:
                errors += 1
                kind = str(e)[:60] or type(e).__name__
                kinds[kind] = kinds.get(kind, 0) + 1

    await asyncio.gather(*(one() for _ in range(n)))
    peak = rss_tree_mb(rss_pid)
    for w in conns:
        w.close()
    return {"streams": n, "held": len(conns), "errors": errors, "error_kinds": kinds, "idle_rss_mb": round(idle, 1),
            "rss_mb": round(peak, 1), "kb_per_stream": round((peak - idle) * 1024 / max(1, len(conns)), 1)}


def latency_chart_svg(sweep, path):
    """Latency against offered load, one colour per target: p99 solid, p50 dashed (log scale)."""
    import math
    colours = {"direct": "#444444", "nginx": "#2b8a3e", "sluice-bare": "#1c7ed6", "sluice": "#e8590c"}
    w, h, left, right, top, bottom = 720, 420, 70, 150, 30, 50
    pts = [(r, v) for series in sweep.values() for r, p50, p99 in series for v in (p50, p99) if v == v and v > 0]
    if not pts:
        return
    xmax = max(r for r, _ in pts) * 1.05
    ylo = 10 ** math.floor(math.log10(min(v for _, v in pts)))
    yhi = 10 ** math.ceil(math.log10(max(v for _, v in pts)))

    def x(r):
        return left + (w - left - right) * r / xmax

    def y(v):
        return top + (h - top - bottom) * (1 - (math.log10(v) - math.log10(ylo)) / (math.log10(yhi) - math.log10(ylo)))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{left}" y="18" font-size="14">Latency against offered load (p99 solid, p50 dashed)</text>']
    decade = ylo
    while decade <= yhi * 1.0001:
        out.append(f'<line x1="{left}" x2="{w - right}" y1="{y(decade):.1f}" y2="{y(decade):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y(decade) + 4:.1f}" text-anchor="end">{decade:g} ms</text>')
        decade *= 10
    for i in range(6):
        r = xmax * i / 5
        out.append(f'<text x="{x(r):.1f}" y="{h - bottom + 18}" text-anchor="middle">{r:.0f}</text>')
    out.append(f'<text x="{(left + w - right) / 2}" y="{h - 10}" text-anchor="middle">offered load (requests/s)</text>')
    out.append(f'<line x1="{left}" x2="{w - right}" y1="{h - bottom}" y2="{h - bottom}" stroke="black"/>')
    out.append(f'<line x1="{left}" x2="{left}" y1="{top}" y2="{h - bottom}" stroke="black"/>')
    for i, (name, series) in enumerate(sweep.items()):
        c = colours.get(name, "#862e9c")
        for idx, dash in ((2, ""), (1, ' stroke-dasharray="5,4"')):
            line = [(x(p[0]), y(p[idx])) for p in series if p[idx] == p[idx] and p[idx] > 0]
            if line:
                d = " ".join(f"{a:.1f},{b:.1f}" for a, b in line)
                out.append(f'<polyline points="{d}" fill="none" stroke="{c}" stroke-width="2"{dash}/>')
        ly = top + 20 + 20 * i
        out.append(f'<line x1="{w - right + 15}" x2="{w - right + 40}" y1="{ly}" y2="{ly}" stroke="{c}" stroke-width="2"/>')
        out.append(f'<text x="{w - right + 46}" y="{ly + 4}">{name}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def pct(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="a few seconds, to keep the harness working")
    ap.add_argument("--binary", help="sluice binary (default: build target/release/sluice)")
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--streams", type=int, default=10000)
    args = ap.parse_args()
    for tool, how in (("wrk", "apt-get install -y wrk"), ("nginx", "apt-get install -y nginx"),
                      ("oha", "cargo install --locked oha")):
        if not shutil.which(tool):
            sys.exit(f"{tool} is required ({how})")
    raise_nofile()
    secs = 1 if args.smoke else args.seconds
    rounds = 1 if args.smoke else args.rounds
    binary = args.binary
    if not binary:
        subprocess.run(["cargo", "build", "--release", "--locked"], cwd=ROOT, check=True)
        binary = os.path.join(ROOT, "target/release/sluice")

    procs = Procs()
    tmp = tempfile.mkdtemp(prefix="sluice-bench-")
    results = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                           # Each stream held through a proxy takes two sockets in it.
                           "open_files_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0]},
               "mode": "smoke" if args.smoke else "full", "seconds": secs, "rounds": rounds}
    try:
        sims = [sim(procs, binary, ["--speed", "0", "--max-model-len", "4000000"]) for _ in range(2)]
        nginx_port, nginx_proc = start_nginx(procs, sims, tmp)
        full_port, full_proc = start_sluice(procs, binary, sims, True, tmp)
        bare_port, bare_proc = start_sluice(procs, binary, sims, False, tmp)
        auth = {"Authorization": f"Bearer {BENCH_KEY}"}
        targets = {
            "direct": (sims[0], {}, None),
            "nginx": (nginx_port, {}, nginx_proc),
            "sluice-bare": (bare_port, {}, bare_proc),
            "sluice": (full_port, auth, full_proc),
        }
        results["idle_rss_mb"] = round(rss_mb(full_proc.pid), 1)
        small = os.path.join(tmp, "small.json")
        with open(small, "w") as f:
            f.write(SMALL_BODY)
        big = os.path.join(tmp, "big.json")
        with open(big, "w") as f:
            f.write(json.dumps({"model": "m", "max_tokens": 4,
                                "messages": [{"role": "user", "content": "x" * (1 << 20)}]}))

        sat, c1, bigr, cpu = {}, {}, {}, {}
        for r in range(rounds):
            for name, (port, hdr, proc) in targets.items():
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                before = cpu_seconds(proc.pid) if proc else None
                s = wrk(url, secs, 64, 2, small, hdr)
                if proc:
                    cpu.setdefault(name, []).append((cpu_seconds(proc.pid) - before) / max(1, s["requests"]) * 1e4)
                sat.setdefault(name, []).append(s)
                c1.setdefault(name, []).append(wrk(url, secs, 1, 1, small, hdr))
                bigr.setdefault(name, []).append(wrk(url, secs, 8, 1, big, hdr))

        def best(runs, key, agg=max):
            return agg(x[key] for x in runs)

        results["saturation"] = {n: {"rps": best(v, "rps"), "p99_ms": best(v, "p99_ms", min),
                                     "errors": sum(x["errors"] for x in v)} for n, v in sat.items()}
        results["concurrency_1"] = {n: {"p50_ms": best(v, "p50_ms", min), "p99_ms": best(v, "p99_ms", min),
                                        "errors": sum(x["errors"] for x in v)} for n, v in c1.items()}
        results["body_1mb"] = {n: {"rps": best(v, "rps"), "p50_ms": best(v, "p50_ms", min),
                                   "errors": sum(x["errors"] for x in v)} for n, v in bigr.items()}
        results["cpu_seconds_per_10k"] = {n: round(min(v), 3) for n, v in cpu.items()}

        # Moderate load: the same fixed rate for every target, 30% of the slowest one's saturation,
        # so that no target is measured past its own limit.
        slowest = min(results["saturation"].values(), key=lambda v: v["rps"])["rps"]
        results["moderate_rate_basis_rps"] = slowest
        rate = max(50, int(0.3 * slowest))
        mod = {}
        for name, (port, hdr, _) in targets.items():
            mod[name] = fixed_rate(f"http://127.0.0.1:{port}/v1/chat/completions", secs * 2, rate, small, hdr)
        results["moderate_rate"] = mod

        # Latency against load: fixed rates as fractions of the slowest target's saturation, the
        # 0.3 point being the moderate-rate run above; the points above 1 are past that target's
        # limit and show how far the others go.
        fractions = [0.1, 0.3] if args.smoke else [0.1, 0.3, 0.5, 0.7, 0.9, 1.5, 2.5]
        sweep = {}
        for frac in fractions:
            frate = max(50, int(frac * slowest))
            for name, (port, hdr, _) in targets.items():
                m = mod[name] if frac == 0.3 else fixed_rate(
                    f"http://127.0.0.1:{port}/v1/chat/completions", secs * 2, frate, small, hdr)
                sweep.setdefault(name, []).append((frate, m["p50_ms"], m["p99_ms"], m["achieved_rps"]))
        results["latency_vs_load"] = {n: [{"rate": r, "p50_ms": a, "p99_ms": b, "achieved_rps": c}
                                          for r, a, b, c in v] for n, v in sweep.items()}

        # Streaming fidelity: a separate sim whose decode step is 10 ms.
        sp = sim(procs, binary, ["--speed", "1", "--decode-base-us", "10000", "--decode-per-seq-us", "0",
                                 "--prefill-us-per-token", "1", "--min-output-tokens", "1000", "--max-output-tokens", "2000"])
        s_nginx, _ = start_nginx(procs, [sp], tempfile.mkdtemp(prefix="sluice-bench-ng-"))
        s_full, _ = start_sluice(procs, binary, [sp], True, tempfile.mkdtemp(prefix="sluice-bench-st-"))
        n, toks = (2, 20) if args.smoke else (10, 100)
        stream = {}
        for name, port, hdr in (("direct", sp, {}), ("nginx", s_nginx, {}), ("sluice", s_full, auth)):
            ttfb, gaps = asyncio.run(stream_gaps(port, hdr, n, toks))
            stream[name] = {"ttfb_p50_ms": round(pct(ttfb, 0.5), 3),
                            "gap_p50_ms": round(pct(gaps, 0.5), 3), "gap_p99_ms": round(pct(gaps, 0.99), 3),
                            "gaps_within_1ms_of_10ms": round(sum(1 for g in gaps if abs(g - 10) <= 1) / max(1, len(gaps)), 3)}
        results["streaming"] = stream

        # Many concurrent streams: a slow sim (one token per second) that admits them all.
        hold = sim(procs, binary, ["--speed", "1", "--decode-base-us", "1000000", "--decode-per-seq-us", "0",
                                   "--max-num-seqs", "100000", "--kv-capacity-tokens", "1000000000",
                                   "--min-output-tokens", "1000", "--max-output-tokens", "2000"])
        n_hold = 200 if args.smoke else args.streams
        h_nginx, h_nginx_proc = start_nginx(procs, [hold], tempfile.mkdtemp(prefix="sluice-bench-hn-"))
        results["concurrent_streams_nginx"] = asyncio.run(hold_streams(h_nginx, {}, n_hold, h_nginx_proc.pid))
        h_port, h_proc = start_sluice(procs, binary, [hold], True, tempfile.mkdtemp(prefix="sluice-bench-h-"))
        results["idle_rss_mb"] = round(rss_mb(h_proc.pid), 1)
        results["concurrent_streams"] = asyncio.run(hold_streams(h_port, auth, n_hold, h_proc.pid))
    finally:
        procs.stop()

    sat = results["saturation"]
    ratios = {
        "throughput_sluice_over_nginx": round(sat["sluice"]["rps"] / sat["nginx"]["rps"], 3),
        "throughput_sluice_over_direct": round(sat["sluice"]["rps"] / sat["direct"]["rps"], 3),
        "throughput_bare_over_nginx": round(sat["sluice-bare"]["rps"] / sat["nginx"]["rps"], 3),
        "added_p50_c1_ms": round(results["concurrency_1"]["sluice"]["p50_ms"] - results["concurrency_1"]["direct"]["p50_ms"], 3),
        "moderate_rate_rps": results["moderate_rate"]["sluice"]["rate"],
        "added_p99_moderate_ms": round(results["moderate_rate"]["sluice"]["p99_ms"] - results["moderate_rate"]["direct"]["p99_ms"], 3),
        "added_ttfb_stream_ms": round(results["streaming"]["sluice"]["ttfb_p50_ms"] - results["streaming"]["direct"]["ttfb_p50_ms"], 3),
        "cpu_sluice_over_nginx": round(results["cpu_seconds_per_10k"]["sluice"] / max(1e-9, results["cpu_seconds_per_10k"]["nginx"]), 3),
    }
    results["ratios"] = ratios

    print(f"\n{'target':<12} {'sat rps':>10} {'c1 p50 ms':>10} {'c1 p99 ms':>10} {'mod p99 ms':>11} {'1MB rps':>9} {'errors':>7}")
    for n in targets:
        errs = sat[n]["errors"] + results["concurrency_1"][n]["errors"] + results["body_1mb"][n]["errors"] + results["moderate_rate"][n]["errors"]
        print(f"{n:<12} {sat[n]['rps']:>10.0f} {results['concurrency_1'][n]['p50_ms']:>10.3f} "
              f"{results['concurrency_1'][n]['p99_ms']:>10.3f} {results['moderate_rate'][n]['p99_ms']:>11.3f} "
              f"{results['body_1mb'][n]['rps']:>9.0f} {errs:>7}")
    print("\nstreaming:", json.dumps(results["streaming"]))
    print("cpu s/10k requests:", json.dumps(results["cpu_seconds_per_10k"]))
    print("concurrent streams:", json.dumps(results["concurrent_streams"]), "idle RSS MB:", results["idle_rss_mb"])
    print("concurrent streams through nginx:", json.dumps(results["concurrent_streams_nginx"]))
    print("ratios:", json.dumps(ratios, indent=1))

    out_dir = os.path.join(ROOT, "bench", "results")
    os.makedirs(out_dir, exist_ok=True)
    name = "gateway-smoke.json" if args.smoke else f"gateway-{time.strftime('%Y%m%d-%H%M%S')}.json"
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(results, f, indent=1)
    chart = "gateway-smoke.svg" if args.smoke else "gateway-latency-vs-load.svg"
    latency_chart_svg({n: [(p["rate"], p["p50_ms"], p["p99_ms"]) for p in v]
                       for n, v in results["latency_vs_load"].items()}, os.path.join(out_dir, chart))
    total_errors = (sum(v["errors"] for v in sat.values()) + results["concurrent_streams"]["errors"]
                    + results["concurrent_streams_nginx"]["errors"])
    if args.smoke and total_errors:
        sys.exit(f"smoke run saw {total_errors} errors")


if __name__ == "__main__":
    main()
