#!/usr/bin/env python3
"""Idle and slow clients: gateway memory and a normal client's latency under 10,000 of each.

Starts a simulated vLLM backend (`sluice sim --speed 0`) and Sluice in front of it with the
default connection limits, except `max_connections` raised just above the client count (and,
with --smoke, a short `header_read_timeout` so the run takes seconds). Then, in turn:

1. baseline: gateway RSS and the latency of a normal client (a fresh connection per request,
   `POST /v1/chat/completions`, from a process of its own), with nothing else going on;
2. idle: N connections that each send one request, get the answer and then stay silent
   (kept-alive, as a pooled client leaves them); RSS and the normal client's latency while
   they are held; then they are closed and RSS is sampled again;
3. slow: N connections that trickle a request head one byte every `--trickle` seconds
   (slowloris); RSS and the normal client's latency while they are held; then the run waits
   for the gateway to cut them (`header_read_timeout`) and counts how many it cut in time.

Clients are spread over 127.0.0.2-127.0.0.21 as source addresses (Linux loopback), so
ephemeral ports do not run out (and each address stays under the default per-address cap of
1000, which loopback is exempt from by default anyway). Prints a table and
writes JSON to bench/results/.

Usage:
  python3 bench/hardening/idle_clients.py                # 10,000 of each (release build)
  python3 bench/hardening/idle_clients.py --smoke        # a few hundred, a few seconds (CI)
  python3 bench/hardening/idle_clients.py --binary PATH  # use an existing sluice binary
"""

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import platform
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BODY = json.dumps({"model": "m", "max_tokens": 4,
                   "messages": [{"role": "user", "content": "Hello there!"}]}).encode()
SOURCES = [f"127.0.0.{i}" for i in range(2, 22)]


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
                return round(int(line.split()[1]) / 1024.0, 1)
    return float("nan")


def open_fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


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


def pct(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def read_response(r):
    """One HTTP/1.1 response with a content-length body; returns the status code."""
    head = await r.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = 0
    for line in lines[1:]:
        k, _, v = line.partition(":")
        if k.strip().lower() == "content-length":
            length = int(v.strip())
    if length:
        await r.readexactly(length)
    return status


def read_response_sync(sock):
    """One HTTP/1.1 response with a content-length body from a blocking socket; its status."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ValueError("closed before the response head")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = 0
    for line in lines[1:]:
        k, _, v = line.partition(":")
        if k.strip().lower() == "content-length":
            length = int(v.strip())
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ValueError("closed inside the body")
        rest += chunk
    return status


def probe_sync(port, n):
    """A normal client: n requests, each on a fresh connection; latencies in ms and errors.
    Runs in a process of its own (see `probe`)."""
    lat, errors = [], 0
    req = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
           f"content-length: {len(BODY)}\r\nconnection: close\r\n\r\n").encode() + BODY
    for _ in range(n):
        t = time.perf_counter()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(req)
                status = read_response_sync(sock)
            if status != 200:
                errors += 1
                continue
            lat.append((time.perf_counter() - t) * 1000)
        except (OSError, ValueError, IndexError):
            errors += 1
    return {"requests": n, "errors": errors, "p50_ms": round(pct(lat, 0.5), 3),
            "p99_ms": round(pct(lat, 0.99), 3), "max_ms": round(max(lat) if lat else float("nan"), 3)}


PROBE_POOL = None


async def probe(port, n):
    """`probe_sync` in the probe process, so this event loop (busy with thousands of idle or
    slow clients) does not count as gateway latency."""
    return await asyncio.get_running_loop().run_in_executor(PROBE_POOL, probe_sync, port, n)


async def open_from(i, port):
    return await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", port, local_addr=(SOURCES[i % len(SOURCES)], 0)), 30)


async def open_many(n, port, one):
    """Run `one(i)` for n clients, at most 256 connecting at a time; returns their results."""
    sem = asyncio.Semaphore(256)

    async def guarded(i):
        async with sem:
            try:
                return await one(i)
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError):
                return None

    return await asyncio.gather(*(guarded(i) for i in range(n)))


async def idle_phase(port, pid, n, hold, probe_n):
    async def one(i):
        r, w = await open_from(i, port)
        w.write(b"GET /healthz HTTP/1.1\r\nhost: bench\r\n\r\n")
        status = await asyncio.wait_for(read_response(r), 30)
        return (r, w) if status == 200 else None

    t = time.perf_counter()
    conns = [c for c in await open_many(n, port, one) if c]
    opened_s = time.perf_counter() - t
    await asyncio.sleep(1)
    during = {"rss_mb": rss_mb(pid), "fds": open_fds(pid)}
    lat = await probe(port, probe_n)
    await asyncio.sleep(max(0, hold - 1))
    during["rss_mb_end"] = rss_mb(pid)
    checked_after_s = round(time.perf_counter() - t, 2)
    # Still open? A read that times out means the gateway kept the connection.
    alive = 0
    for r, w in conns[: min(200, len(conns))]:
        try:
            data = await asyncio.wait_for(r.read(1), 0.005)
            if data:
                alive += 1
        except asyncio.TimeoutError:
            alive += 1
    sampled = min(200, len(conns))
    for _, w in conns:
        w.close()
    await asyncio.sleep(2)
    return {"clients": n, "held": len(conns), "open_seconds": round(opened_s, 2), "during": during,
            "still_open_of_sampled": f"{alive}/{sampled}", "checked_after_s": checked_after_s, "probe": lat,
            "after": {"rss_mb": rss_mb(pid), "fds": open_fds(pid)}}


async def slow_phase(port, pid, n, trickle, header_timeout, probe_n):
    head = b"GET /healthz HTTP/1.1\r\nhost: bench\r\nx-slow: " + b"a" * 4000 + b"\r\n\r\n"
    cut_after = []

    async def one(i):
        r, w = await open_from(i, port)
        start = time.perf_counter()

        async def run():
            for b in head:
                w.write(bytes([b]))
                try:
                    await w.drain()
                    await asyncio.wait_for(r.read(1), trickle)
                    break  # an answer (408) or EOF: the gateway cut this client
                except asyncio.TimeoutError:
                    continue
                except OSError:
                    break
            cut_after.append(time.perf_counter() - start)
            w.close()

        return asyncio.ensure_future(run())

    t = time.perf_counter()
    tasks = [x for x in await open_many(n, port, one) if x]
    opened_s = time.perf_counter() - t
    await asyncio.sleep(1)
    during = {"rss_mb": rss_mb(pid), "fds": open_fds(pid)}
    lat = await probe(port, probe_n)
    during["rss_mb_end"] = rss_mb(pid)
    # Every slow client is cut by the gateway once header_read_timeout has passed.
    deadline = time.perf_counter() + header_timeout + opened_s + 10
    while time.perf_counter() < deadline and len(cut_after) < len(tasks):
        await asyncio.sleep(0.2)
    for x in tasks:
        x.cancel()
    await asyncio.sleep(2)
    in_time = sum(1 for c in cut_after if c <= header_timeout + 2)
    return {"clients": n, "held": len(tasks), "open_seconds": round(opened_s, 2), "during": during,
            "probe": lat, "cut": len(cut_after), "cut_within_timeout_plus_2s": in_time,
            "cut_after_p50_s": round(pct(cut_after, 0.5), 2), "cut_after_max_s": round(max(cut_after) if cut_after else float("nan"), 2),
            "after": {"rss_mb": rss_mb(pid), "fds": open_fds(pid)}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="a few hundred clients, a few seconds")
    ap.add_argument("--binary", help="sluice binary (default: build target/release/sluice)")
    ap.add_argument("--clients", type=int, default=10000)
    ap.add_argument("--hold", type=float, default=10, help="seconds the idle clients are held")
    ap.add_argument("--header-timeout", type=float, default=30,
                    help="the gateway's header_read_timeout, s (default: the gateway's default)")
    ap.add_argument("--trickle", type=float, default=1.0, help="seconds between two bytes of a slow client")
    ap.add_argument("--probe", type=int, default=200, help="normal requests per measurement")
    args = ap.parse_args()
    if args.smoke:
        args.clients, args.hold, args.header_timeout, args.trickle, args.probe = 300, 1.5, 4, 0.2, 20
    raise_nofile()
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < args.clients + 500:
        sys.exit(f"open-file limit {soft} is too low for {args.clients} clients")
    binary = args.binary
    if not binary:
        subprocess.run(["cargo", "build", "--release", "--locked"], cwd=ROOT, check=True)
        binary = os.path.join(ROOT, "target/release/sluice")

    global PROBE_POOL
    PROBE_POOL = concurrent.futures.ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    PROBE_POOL.submit(pct, [1], 0.5).result()
    procs = Procs()
    tmp = tempfile.mkdtemp(prefix="sluice-hardening-")
    results = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
               "mode": "smoke" if args.smoke else "full", "clients": args.clients,
               "header_read_timeout_s": args.header_timeout, "trickle_s": args.trickle}
    try:
        sim_port = free_port()
        procs.start([binary, "sim", "--kind", "vllm", "--port", str(sim_port), "--model", "m", "--speed", "0"])
        wait_http(f"http://127.0.0.1:{sim_port}/health")
        port = free_port()
        path = os.path.join(tmp, "sluice.toml")
        with open(path, "w") as f:
            f.write(f'[server]\nlisten = "127.0.0.1:{port}"\nmax_connections = {args.clients + 1000}\n'
                    f'header_read_timeout = "{args.header_timeout}s"\n'
                    f'[[backends]]\nname = "sim"\nkind = "vllm"\nurl = "http://127.0.0.1:{sim_port}"\nmodels = ["m"]\n')
        gw = procs.start([binary, "serve", "--config", path], env=dict(os.environ, SLUICE_LOG="error"))
        wait_http(f"http://127.0.0.1:{port}/readyz")

        async def run():
            await probe(port, 20)  # warm-up
            base = {"rss_mb": rss_mb(gw.pid), "fds": open_fds(gw.pid), "probe": await probe(port, args.probe)}
            idle = await idle_phase(port, gw.pid, args.clients, args.hold, args.probe)
            slow = await slow_phase(port, gw.pid, args.clients, args.trickle, args.header_timeout, args.probe)
            return base, idle, slow

        base, idle, slow = asyncio.run(run())
        results.update(baseline=base, idle=idle, slow=slow)
        if gw.poll() is not None:
            sys.exit("the gateway exited during the run")
    finally:
        procs.stop()
        PROBE_POOL.shutdown()

    n = args.clients
    results["summary"] = {
        "rss_per_idle_conn_kib": round((idle["during"]["rss_mb"] - base["rss_mb"]) * 1024 / max(1, idle["held"]), 2),
        "rss_per_slow_conn_kib": round((slow["during"]["rss_mb"] - base["rss_mb"]) * 1024 / max(1, slow["held"]), 2),
        "rss_after_over_baseline": round(slow["after"]["rss_mb"] / base["rss_mb"], 3),
        "probe_p99_idle_over_baseline": round(idle["probe"]["p99_ms"] / base["probe"]["p99_ms"], 3),
        "probe_p99_slow_over_baseline": round(slow["probe"]["p99_ms"] / base["probe"]["p99_ms"], 3),
    }
    print(f"\n{'phase':<10} {'held':>6} {'RSS MB':>8} {'fds':>6} {'probe p50 ms':>13} {'probe p99 ms':>13} {'errors':>7}")
    print(f"{'baseline':<10} {0:>6} {base['rss_mb']:>8} {base['fds']:>6} {base['probe']['p50_ms']:>13} {base['probe']['p99_ms']:>13} {base['probe']['errors']:>7}")
    for name, ph in (("idle", idle), ("slow", slow)):
        print(f"{name:<10} {ph['held']:>6} {ph['during']['rss_mb']:>8} {ph['during']['fds']:>6} "
              f"{ph['probe']['p50_ms']:>13} {ph['probe']['p99_ms']:>13} {ph['probe']['errors']:>7}")
        print(f"{name + ' after':<10} {0:>6} {ph['after']['rss_mb']:>8} {ph['after']['fds']:>6}")
    print(f"\nslow clients cut: {slow['cut']}/{slow['held']} (within header_read_timeout + 2 s: "
          f"{slow['cut_within_timeout_plus_2s']}; p50 {slow['cut_after_p50_s']} s, max {slow['cut_after_max_s']} s)")
    print("summary:", json.dumps(results["summary"], indent=1))

    out_dir = os.path.join(ROOT, "bench", "results")
    os.makedirs(out_dir, exist_ok=True)
    name = "hardening-smoke.json" if args.smoke else f"hardening-{time.strftime('%Y%m%d-%H%M%S')}.json"
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(results, f, indent=1)
    problems = []
    if idle["held"] < n or slow["held"] < n:
        problems.append(f"not every client was held (idle {idle['held']}, slow {slow['held']} of {n})")
    if base["probe"]["errors"] or idle["probe"]["errors"] or slow["probe"]["errors"]:
        problems.append("the normal client saw errors")
    if slow["cut"] < slow["held"]:
        problems.append(f"only {slow['cut']} of {slow['held']} slow clients were cut")
    if problems:
        sys.exit("; ".join(problems))


if __name__ == "__main__":
    main()
