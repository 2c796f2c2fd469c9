#!/usr/bin/env python3
"""Routing benchmark: round-robin, least-request, token-aware and prefix-affinity on the same
simulated heterogeneous fleet under the same open-loop workload, in one run.

Fleet (all `sluice sim`, same seed, so a prompt gets the same answer length everywhere):
  fast-0, fast-1  vLLM, 32 sequences, prefill 50 us/token, decode step 10 ms + 0.1 ms/seq
  slow-0, slow-1  vLLM, 16 sequences, prefill 150 us/token, decode step 20 ms + 0.3 ms/seq
  tgi-0           TGI,  16 sequences, prefill 100 us/token, decode step 20 ms + 0.1 ms/seq
Nothing about these speeds is configured in the gateway: token-aware learns them.

Workload (Poisson arrivals, streamed chat completions, a fixed seed):
  50% short chats         ~150 prompt tokens, max_tokens 64
  30% shared system prompt one of 48 system prompts of ~1500 tokens (skewed) + a short question,
                           max_tokens 128 (these are the prefix-cache candidates)
  20% long prompts         3000-6000 prompt tokens, max_tokens 512
The rate is `--load` (default 0.75) times the fleet's estimated capacity (`CAPACITY_RPS`, from
the timing model above, checked by `--calibrate`).

Each policy gets a fresh fleet and gateway, a warm-up (not measured) and a measured window.
Reports p50/p99 TTFT, p50/p99 end-to-end latency, throughput, per-backend share and the
prefix-cache hit rate, prints a table, writes JSON to bench/results/routing.json and a chart to
bench/results/routing.svg.

Two prefix-cache hit rates:
  overall    cached / all prompt tokens, from the simulators' /sim/state counters (all
             backends, warm-up included). Only the "shared" class can hit, and long prompts
             dominate the token count, so its ceiling is about 30%.
  per class  from each measured request's own usage: the vLLM sims run with
             --enable-prompt-tokens-details, so usage.prompt_tokens_details.cached_tokens says
             how many of its prompt tokens were cached (absent = 0, as vLLM leaves it out then).
             The requests ask for stream_options.include_usage, so the usage chunk reaches the
             client. TGI reports no cached tokens: its requests are left out of these rates.

What the workload allows: the run prints (and stores as `warm_ceilings`) the share of measured
shared-class requests whose system prompt their backend has already seen (with an unbounded
cache, and with one keeping a prompt 6 s), for round-robin and for one backend per prompt. And how sticky a policy is: the share of
measured shared-class requests sent where the previous request with their system prompt went
(`shared_stickiness`).

Caches under pressure (`--prefix-cache-share F`): each sim's prefix cache keeps only F of its
KV capacity (`sluice sim --prefix-cache-tokens`); admission, batch and speeds are unchanged, so
the fleet's capacity and the offered load are the same. It stands for engines whose free KV
blocks (where vLLM keeps cached prefixes) are small next to the distinct system prompts (48 x
~1500 tokens here). Results go to bench/results/routing-pressure.{json,svg}.

Usage:
  python3 bench/routing/bench.py                  # full run (~4-5 minutes)
  python3 bench/routing/bench.py --prefix-cache-share 0.33   # caches under pressure
  python3 bench/routing/bench.py --smoke          # seconds; checks the harness
  python3 bench/routing/bench.py --binary PATH    # use an existing sluice binary
"""

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POLICIES = ["round-robin", "least-request", "token-aware", "prefix-affinity"]

COMMON = ["--seed", "7", "--min-output-tokens", "8", "--max-output-tokens", "600",
          "--max-model-len", "16384"]
FLEET = [
    ("fast-0", "vllm", ["--max-num-seqs", "32", "--prefill-us-per-token", "50",
                        "--decode-base-us", "10000", "--decode-per-seq-us", "100",
                        "--kv-capacity-tokens", "120000"]),
    ("fast-1", "vllm", ["--max-num-seqs", "32", "--prefill-us-per-token", "50",
                        "--decode-base-us", "10000", "--decode-per-seq-us", "100",
                        "--kv-capacity-tokens", "120000"]),
    ("slow-0", "vllm", ["--max-num-seqs", "16", "--prefill-us-per-token", "150",
                        "--decode-base-us", "20000", "--decode-per-seq-us", "300",
                        "--kv-capacity-tokens", "60000"]),
    ("slow-1", "vllm", ["--max-num-seqs", "16", "--prefill-us-per-token", "150",
                        "--decode-base-us", "20000", "--decode-per-seq-us", "300",
                        "--kv-capacity-tokens", "60000"]),
    ("tgi-0", "tgi", ["--max-num-seqs", "16", "--prefill-us-per-token", "100",
                      "--decode-base-us", "20000", "--decode-per-seq-us", "100",
                      "--kv-capacity-tokens", "60000", "--max-concurrent-requests", "128",
                      "--max-input-tokens", "12000"]),
]
# Requests per second the fleet sustains at speed 1 with this mix (see the module doc; the
# timing-model estimate: fast ~8.2, slow ~2.5, TGI ~3.2 req/s).
CAPACITY_RPS = 24.0
# Distinct long system prompts (more than one engine's prefix cache holds next to its work).
N_SYSTEMS = 48

WORDS = ("the of and to in is was for on that with as by at from his her an be this which or "
         "are have had not but one all were they their there been has more if will would about "
         "into than them can only other new some what time could these two may then first any "
         "like now my such make over our even most me state after also made many did must "
         "before back through years where much your way down should because each just those "
         "people how too little good very world still own see men work long here between both "
         "life being under never day same another know while last might us great old year off "
         "come since against go came right used take three").split()


# vLLM reports each request's prefix-cache hit in its usage when started with this flag.
VLLM_FLAGS = ["--enable-prompt-tokens-details"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url, timeout=30):
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


def get_json(url, headers=None):
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


class Procs:
    def __init__(self):
        self.procs = []

    def start(self, args):
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
        self.procs = []


def text(rng, tokens):
    """About `tokens` tokens of text (the gateway's estimate is bytes / 4)."""
    out, size = [], 0
    while size < tokens * 4:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def workload(seed, n):
    """The request bodies, in arrival order, and their class."""
    rng = random.Random(seed)
    systems = [text(random.Random(1000 + i), 1500) for i in range(N_SYSTEMS)]
    reqs = []
    for k in range(n):
        u = rng.random()
        if u < 0.5:
            kind = "short"
            msgs = [{"role": "user", "content": f"[{k}] " + text(rng, rng.randint(80, 220))}]
            max_tokens = 64
        elif u < 0.8:
            kind = "shared"
            # a skewed choice: the first system prompts are the hot ones
            s = min(int(rng.expovariate(1.0 / 12)), len(systems) - 1)
            msgs = [{"role": "system", "content": systems[s]},
                    {"role": "user", "content": f"[{k}] " + text(rng, rng.randint(20, 60))}]
            max_tokens = 128
        else:
            kind = "long"
            msgs = [{"role": "user", "content": f"[{k}] " + text(rng, rng.randint(3000, 6000))}]
            max_tokens = 512
        body = json.dumps({"model": "m", "stream": True, "max_tokens": max_tokens,
                           "stream_options": {"include_usage": True},
                           "messages": msgs}).encode()
        reqs.append((kind, body))
    return reqs


def usage_in(tail):
    """(prompt_tokens, cached_tokens) from the usage chunk at the end of a stream (the raw
    socket bytes may carry chunked-encoding size lines, so this looks for the fields)."""
    at = tail.rfind(b'"usage":{')
    if at < 0:
        return None, None
    usage = tail[at:at + 400]
    end = usage.find(b"}}")  # the usage object ends before its chunk's closing brace
    usage = usage[:end + 2] if end >= 0 else usage
    m = re.search(rb'"prompt_tokens":(\d+)', usage)
    if not m:
        return None, None
    c = re.search(rb'"cached_tokens":(\d+)', usage)
    return int(m.group(1)), int(c.group(1)) if c else 0


async def one(port, body, timeout):
    """Send one streamed request; returns (ok, ttft, e2e, backend, prompt_tokens, cached)."""
    start = time.perf_counter()
    ttft = None
    backend = None
    tail = b""
    try:
        r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
        w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n"
                b"Content-Type: application/json\r\nConnection: close\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await w.drain()
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), timeout)
        status = int(head.split(b" ", 2)[1])
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"x-sluice-backend:"):
                backend = line.split(b":", 1)[1].strip().decode()
        buf = b""
        deadline = start + timeout
        while True:
            chunk = await asyncio.wait_for(r.read(65536), max(0.1, deadline - time.perf_counter()))
            if not chunk:
                break
            tail = (tail + chunk)[-8192:]
            if ttft is None:
                buf += chunk
                i = 0
                while True:
                    idx = buf.find(b'"content":"', i)
                    if idx < 0:
                        break
                    nxt = buf[idx + 11:idx + 12]
                    if nxt and nxt != b'"':
                        ttft = time.perf_counter() - start  # first event carrying text
                        break
                    i = idx + 11
                if len(buf) > 1 << 20:
                    buf = buf[-4096:]
        w.close()
        ok = status == 200 and ttft is not None
        prompt, cached = usage_in(tail)
        return ok, ttft, time.perf_counter() - start, backend, prompt, cached
    except Exception:
        return False, None, time.perf_counter() - start, backend, None, None


def fmt_or_dash(v, spec=".3f"):
    """A table cell: `v` formatted, or "-" when it was not measured."""
    return "-" if v is None else format(v, spec)


def shown_path(path):
    """A path as results show it: relative to the repository, or only its file name when it
    lies outside (results never name a folder of the machine that ran them)."""
    rel = os.path.relpath(path, ROOT)
    return os.path.basename(path) if rel.startswith("..") else rel


def pct(values, p):
    if not values:
        return None
    v = sorted(values)
    k = min(len(v) - 1, max(0, int(round(p / 100.0 * (len(v) - 1)))))
    return v[k]


async def drive(port, reqs, rate, warmup_s, seed, timeout):
    """Send `reqs` open-loop; returns the measured results, how long sending took, and the
    backend each request (warm-up included) was served by, in arrival order."""
    rng = random.Random(seed)
    results = []
    served_by = [None] * len(reqs)
    tasks = []
    t0 = time.perf_counter()
    at = 0.0
    for i, (kind, body) in enumerate(reqs):
        at += rng.expovariate(rate)
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        measured = at >= warmup_s

        async def run(i=i, kind=kind, body=body, measured=measured):
            ok, ttft, e2e, backend, prompt, cached = await one(port, body, timeout)
            served_by[i] = backend
            if measured:
                results.append({"kind": kind, "ok": ok, "ttft": ttft, "e2e": e2e,
                                "backend": backend, "end": time.perf_counter() - t0,
                                "prompt_tokens": prompt, "cached_tokens": cached,
                                "i": i})
        tasks.append(asyncio.ensure_future(run()))
    sent_until = time.perf_counter() - t0
    await asyncio.gather(*tasks)
    return results, sent_until, served_by


def system_of(reqs):
    """The system prompt (index) of each shared-class request, None for the others."""
    systems = {t: i for i, t in enumerate(
        text(random.Random(1000 + i), 1500) for i in range(N_SYSTEMS))}
    return [systems[json.loads(body)["messages"][0]["content"]] if kind == "shared" else None
            for kind, body in reqs]


def stickiness(results, served_by, systems):
    """Of the measured shared-class requests, the share sent to the backend that served the
    previous request with the same system prompt (warm-up included), and the share sent to
    the backend that served most of their system prompt's requests; and the moves (previous
    backend -> this one) counted."""
    last, counts, same, n, moves = {}, {}, 0, 0, {}
    measured = {r["i"] for r in results if r["kind"] == "shared"}
    for i, s in enumerate(systems):
        if s is None or served_by[i] is None:
            continue
        if i in measured and s in last:
            n += 1
            same += served_by[i] == last[s]
            if served_by[i] != last[s]:
                move = f"{last[s]}->{served_by[i]}"
                moves[move] = moves.get(move, 0) + 1
        last[s] = served_by[i]
        c = counts.setdefault(s, {})
        c[served_by[i]] = c.get(served_by[i], 0) + 1
    home = {s: max(c, key=c.get) for s, c in counts.items()}
    at_home = [served_by[i] == home[systems[i]] for i in measured if served_by[i] is not None]
    return {"same_as_previous": same / n if n else None,
            "at_most_used": sum(at_home) / len(at_home) if at_home else None,
            # measured requests sent elsewhere than the previous one with their system prompt
            "moves": dict(sorted(moves.items(), key=lambda kv: -kv[1]))}


def warm_ceilings(reqs, rate, seed, warmup_s, within_s=6.0):
    """What the workload allows: the share of the measured shared-class requests sent to a vLLM
    backend that has already seen their system prompt, for round-robin (request k to backend
    k mod 5, the fleet's order) and for one vLLM backend per system prompt (perfect affinity);
    with an unbounded cache, and with a cache that keeps a prompt `within_s` seconds after its
    last use (about how long a fast sim's 120k-token cache takes to fill with new prompt tokens
    at this load). Arrival times as in `drive`. The per-request hit rate is about this share
    times the system prompt's part of the prompt tokens (~96% in the sims)."""
    vllm = [i for i, (_, kind, _) in enumerate(FLEET) if kind == "vllm"]
    rng = random.Random(seed)
    at = 0.0
    shared = []
    for k, system in enumerate(system_of(reqs)):
        at += rng.expovariate(rate)
        if system is not None:
            shared.append((k, at, system))

    def share(backend_of, within):
        last, warm, n = {}, 0, 0
        for k, t, s in shared:
            b = backend_of(k, s)
            if t >= warmup_s and b in vllm:
                n += 1
                warm += (b, s) in last and t - last[(b, s)] <= within
            last[(b, s)] = t
        return warm / n if n else None

    policies = {"round-robin": lambda k, s: k % len(FLEET),
                "one backend per prompt": lambda k, s: vllm[s % len(vllm)]}
    return {"unbounded": {p: share(f, float("inf")) for p, f in policies.items()},
            f"kept {within_s:g} s": {p: share(f, within_s) for p, f in policies.items()}}


def sim_counters(ports):
    hits = queries = 0
    per = {}
    for name, port in ports.items():
        try:
            st = get_json(f"http://127.0.0.1:{port}/sim/state")
        except Exception:
            continue
        h = sum(m.get("prefix_cache_hits", 0) for m in st.get("models", []))
        q = sum(m.get("prefix_cache_queries", 0) for m in st.get("models", []))
        per[name] = {"hits": h, "queries": q}
        hits += h
        queries += q
    return hits, queries, per


def run_policy(binary, policy, args, reqs, rate, tmp):
    procs = Procs()
    try:
        ports = {}
        for name, kind, extra in FLEET:
            port = free_port()
            flags = VLLM_FLAGS if kind == "vllm" else []
            if args.prefix_cache_share:
                kv = int(extra[extra.index("--kv-capacity-tokens") + 1])
                flags = flags + ["--prefix-cache-tokens", str(int(kv * args.prefix_cache_share))]
            procs.start([binary, "sim", "--kind", kind, "--port", str(port), "--model", "m",
                         "--speed", str(args.speed), *COMMON, *extra, *flags])
            ports[name] = (kind, port)
        for name, (kind, port) in ports.items():
            wait_http(f"http://127.0.0.1:{port}/health")
        gw = free_port()
        admin = free_port()
        cfg = [f'[server]\nlisten = "127.0.0.1:{gw}"\n',
               f'[admin]\nlisten = "127.0.0.1:{admin}"\n',
               f'[routing]\npolicy = "{policy}"\nexpose_backend_header = true\n',
               '[timeouts]\nidle = "600s"\nfirst_byte = "600s"\nresponse = "600s"\n',
               '[queue]\nsize = 100000\ntimeout = "600s"\n']
        for name, (kind, port) in ports.items():
            cfg.append(f'[[backends]]\nname = "{name}"\nkind = "{kind}"\n'
                       f'url = "http://127.0.0.1:{port}"\nmodels = ["m"]\n')
        path = os.path.join(tmp, f"{policy}.toml")
        with open(path, "w") as f:
            f.write("\n".join(cfg))
        procs.start([binary, "serve", "--config", path])
        wait_http(f"http://127.0.0.1:{gw}/readyz")
        sim_ports = {n: p for n, (_, p) in ports.items()}
        started = time.perf_counter()
        results, sent_until, served_by = asyncio.run(
            drive(gw, reqs, rate, args.warmup, args.seed, args.timeout))
        wall = time.perf_counter() - started
        hits, queries, per_sim = sim_counters(sim_ports)
        try:
            admin_view = get_json(f"http://127.0.0.1:{admin}/admin/backends")
        except Exception:
            admin_view = None
    finally:
        procs.stop()
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    e2e = [r["e2e"] for r in ok]
    share = {}
    for r in ok:
        share[r["backend"] or "?"] = share.get(r["backend"] or "?", 0) + 1
    measured_span = max((r["end"] for r in ok), default=1.0) - args.warmup
    vllm = {n for n, kind, _ in FLEET if kind == "vllm"}

    def hit_rate(rs):
        # requests served by a backend that reports cached tokens (vLLM with details on)
        rep = [r for r in rs if r["backend"] in vllm and r["prompt_tokens"]]
        prompt = sum(r["prompt_tokens"] for r in rep)
        cached = sum(r["cached_tokens"] or 0 for r in rep)
        return (cached / prompt if prompt else None), len(rep)

    by_kind = {}
    for kind in ("short", "shared", "long"):
        k = [r for r in ok if r["kind"] == kind]
        rate, reported = hit_rate(k)
        by_kind[kind] = {"n": len(k), "p99_ttft_s": pct([r["ttft"] for r in k], 99),
                         "p50_ttft_s": pct([r["ttft"] for r in k], 50),
                         "p99_e2e_s": pct([r["e2e"] for r in k], 99),
                         "prefix_hit_rate": rate, "hit_rate_requests": reported}
    measured_hit, _ = hit_rate(ok)
    by_backend = {}
    for name in sorted({r["backend"] or "?" for r in ok}):
        k = [r for r in ok if (r["backend"] or "?") == name]
        by_backend[name] = {"n": len(k), "p99_ttft_s": pct([r["ttft"] for r in k], 99),
                            "kinds": {c: sum(1 for r in k if r["kind"] == c)
                                      for c in ("short", "shared", "long")}}
    speeds = {}
    if admin_view:
        for b in admin_view.get("backends", []):
            rt = b.get("routing") or {}
            speeds[b["name"]] = {
                "decode_tps": (rt.get("speeds") or {}).get("decode_tokens_per_second"),
                "prefill_tps": (rt.get("speeds") or {}).get("prefill_tokens_per_second"),
                "learned_slots": (rt.get("signals") or {}).get("learned_slots"),
                # prefix affinity's weight: learned capacity and its quantised step
                "capacity_tps": (rt.get("speeds") or {}).get("capacity_tokens_per_second"),
                "home_level": (rt.get("speeds") or {}).get("home_level"),
            }
    return {
        "policy": policy,
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "p50_ttft_s": pct(ttft, 50),
        "p99_ttft_s": pct(ttft, 99),
        "p50_e2e_s": pct(e2e, 50),
        "p99_e2e_s": pct(e2e, 99),
        "throughput_rps": len(ok) / max(measured_span, 1e-9),
        "share": {k: round(v / max(len(ok), 1), 3) for k, v in sorted(share.items())},
        "prefix_cache_hit_rate": hits / queries if queries else None,
        "prefix_cache_hit_rate_measured": measured_hit,
        "prefix_cache_per_backend": per_sim,
        "shared_stickiness": stickiness(results, served_by, system_of(reqs)),
        "by_kind": by_kind,
        "by_backend": by_backend,
        "learned": speeds,
        "wall_s": wall,
        "sent_for_s": sent_until,
    }


def chart(results, doc):
    """A plain SVG: p50 and p99 TTFT (log scale) and prefix-cache hit rates per policy."""
    import math
    colors = {"round-robin": "#9e9e9e", "least-request": "#5b8def",
              "token-aware": "#2e7d32", "prefix-affinity": "#e08a1e"}
    w, h, top, bottom = 900, 360, 50, 300
    panels = [("p50 TTFT (s, log)", "p50_ttft_s", True), ("p99 TTFT (s, log)", "p99_ttft_s", True),
              ("prefix-cache hit: shared class / all tokens", None, False)]
    pw = w / len(panels)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           f'viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="11">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="18" text-anchor="middle" font-size="14">Routing policies, '
           f'{doc["rate_rps"]:.0f} req/s on a heterogeneous fleet (speed {doc["args"]["speed"]}'
           + (f', prefix caches {doc["args"]["prefix_cache_share"]:.0%} of KV'
              if doc["args"].get("prefix_cache_share") else '') + ')'
           f'</text>']
    n = max(len(results), 1)
    for p, (title, key, log) in enumerate(panels):
        x0 = p * pw + 40
        inner = pw - 60
        out.append(f'<text x="{x0 + inner / 2}" y="40" text-anchor="middle">{title}</text>')
        out.append(f'<line x1="{x0}" y1="{bottom}" x2="{x0 + inner}" y2="{bottom}" stroke="#333"/>')
        out.append(f'<line x1="{x0}" y1="{top}" x2="{x0}" y2="{bottom}" stroke="#333"/>')
        if log:
            vals = [r[key] for r in results if r.get(key)]
            lo = 10 ** math.floor(math.log10(min(vals))) if vals else 0.01
            hi = 10 ** math.ceil(math.log10(max(vals))) if vals else 10
            if hi <= lo:
                hi = lo * 10

            def y(v, lo=lo, hi=hi):
                return bottom - (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) * (bottom - top)
            t = lo
            while t <= hi * 1.0001:
                out.append(f'<line x1="{x0 - 3}" y1="{y(t):.1f}" x2="{x0 + inner}" y2="{y(t):.1f}" '
                           f'stroke="#eee"/><text x="{x0 - 5}" y="{y(t) + 4:.1f}" '
                           f'text-anchor="end">{t:g}</text>')
                t *= 10
            bw = inner / n * 0.7
            for i, r in enumerate(results):
                v = r.get(key)
                if not v:
                    continue
                bx = x0 + inner / n * (i + 0.15)
                out.append(f'<rect x="{bx:.1f}" y="{y(v):.1f}" width="{bw:.1f}" '
                           f'height="{bottom - y(v):.1f}" fill="{colors.get(r["policy"], "#777")}"/>')
                out.append(f'<text x="{bx + bw / 2:.1f}" y="{y(v) - 3:.1f}" '
                           f'text-anchor="middle">{v:.2f}</text>')
        else:
            def y(v):
                return bottom - v * (bottom - top)
            for t in (0, 0.25, 0.5, 0.75, 1.0):
                out.append(f'<line x1="{x0 - 3}" y1="{y(t):.1f}" x2="{x0 + inner}" y2="{y(t):.1f}" '
                           f'stroke="#eee"/><text x="{x0 - 5}" y="{y(t) + 4:.1f}" '
                           f'text-anchor="end">{t:.0%}</text>')
            bw = inner / n * 0.35
            for i, r in enumerate(results):
                shared = r["by_kind"]["shared"]["prefix_hit_rate"] or 0.0
                overall = r.get("prefix_cache_hit_rate") or 0.0
                bx = x0 + inner / n * (i + 0.12)
                c = colors.get(r["policy"], "#777")
                out.append(f'<rect x="{bx:.1f}" y="{y(shared):.1f}" width="{bw:.1f}" '
                           f'height="{bottom - y(shared):.1f}" fill="{c}"/>')
                out.append(f'<text x="{bx + bw / 2:.1f}" y="{y(shared) - 3:.1f}" '
                           f'text-anchor="middle">{shared:.0%}</text>')
                out.append(f'<rect x="{bx + bw:.1f}" y="{y(overall):.1f}" width="{bw:.1f}" '
                           f'height="{bottom - y(overall):.1f}" fill="{c}" fill-opacity="0.4"/>')
                out.append(f'<text x="{bx + 1.5 * bw:.1f}" y="{y(overall) - 3:.1f}" '
                           f'text-anchor="middle">{overall:.0%}</text>')
    for i, r in enumerate(results):
        lx = 40 + i * 200
        out.append(f'<rect x="{lx}" y="{h - 38}" width="12" height="12" '
                   f'fill="{colors.get(r["policy"], "#777")}"/>'
                   f'<text x="{lx + 16}" y="{h - 28}">{r["policy"]}</text>')
    out.append(f'<text x="40" y="{h - 8}" fill="#555">hit-rate panel: solid = shared-system-prompt '
               f'requests (per-request cached_tokens), pale = all prompt tokens (engine counters)'
               f'</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def fmt(v, unit=""):
    if v is None:
        return "-"
    return f"{v:.3f}{unit}" if isinstance(v, float) else str(v)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default=os.path.join(ROOT, "target", "release", "sluice"))
    ap.add_argument("--duration", type=float, default=45.0, help="seconds of arrivals per policy")
    ap.add_argument("--warmup", type=float, default=10.0, help="first seconds not measured")
    ap.add_argument("--load", type=float, default=0.75, help="fraction of fleet capacity")
    ap.add_argument("--speed", type=float, default=1.0, help="simulator time compression")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--smoke", action="store_true", help="a few seconds per policy")
    ap.add_argument("--prefix-cache-share", type=float, default=None,
                    help="prefix cache of each sim as this share of its KV capacity (caches "
                         "under pressure; admission keeps the whole KV); default: all of it")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "routing.json"))
    args = ap.parse_args()
    if args.smoke:
        args.duration, args.warmup, args.speed = 4.0, 1.0, 10.0
        if args.out.endswith("routing.json"):
            args.out = args.out.replace("routing.json", "routing-smoke.json")
    if args.prefix_cache_share and args.out.endswith("routing.json"):
        args.out = args.out.replace("routing.json", "routing-pressure.json")
    if not os.path.exists(args.binary):
        subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    rate = CAPACITY_RPS * args.speed * args.load
    n = int(rate * args.duration)
    reqs = workload(args.seed, n)
    policies = [p for p in args.policies.split(",") if p]
    print(f"fleet: {', '.join(n for n, _, _ in FLEET)}; rate {rate:.1f} req/s "
          f"({args.load:.0%} of ~{CAPACITY_RPS * args.speed:.1f}); {n} requests per policy; "
          f"speed {args.speed}", flush=True)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for p in policies:
            r = run_policy(args.binary, p, args, reqs, rate, tmp)
            out.append(r)
            print(f"{p:16} ok {r['ok']:5} err {r['errors']:3}  TTFT p50 {fmt(r['p50_ttft_s'])} "
                  f"p99 {fmt(r['p99_ttft_s'])}  e2e p50 {fmt(r['p50_e2e_s'])} p99 {fmt(r['p99_e2e_s'])}  "
                  f"{r['throughput_rps']:.1f} req/s  prefix hit {fmt(r['prefix_cache_hit_rate'])} "
                  f"(shared class {fmt(r['by_kind']['shared']['prefix_hit_rate'])}, sent where "
                  f"its system prompt went last {fmt(r['shared_stickiness']['same_as_previous'])})  "
                  f"share {r['share']}", flush=True)
    by = {r["policy"]: r for r in out}
    ratios = {}
    ta = by.get("token-aware")
    if ta and ta["p99_ttft_s"]:
        for other in ("round-robin", "least-request"):
            if other in by and by[other]["p99_ttft_s"]:
                ratios[f"token-aware/{other} p99 TTFT"] = ta["p99_ttft_s"] / by[other]["p99_ttft_s"]
        pa = by.get("prefix-affinity")
        if pa and pa["p99_ttft_s"]:
            ratios["prefix-affinity/token-aware p99 TTFT"] = pa["p99_ttft_s"] / ta["p99_ttft_s"]
    rr, pa = by.get("round-robin"), by.get("prefix-affinity")
    if rr and pa:
        a = pa["by_kind"]["shared"]["prefix_hit_rate"]
        b = rr["by_kind"]["shared"]["prefix_hit_rate"]
        if a is not None and b:
            ratios["prefix-affinity/round-robin shared-class hit rate"] = a / b
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}")
    ceilings = warm_ceilings(reqs, rate, args.seed, args.warmup)
    for cache, by_policy in ceilings.items():
        print(f"shared-class requests that could find their system prompt warm, cache {cache}: "
              + ", ".join(f"{k} {fmt(v)}" for k, v in by_policy.items()))
    doc = {
        "bench": "routing",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        # paths relative to the repository, so no machine's directories end up in results
        "args": {k: (shown_path(v) if k in ("binary", "out") else v)
                 for k, v in vars(args).items()},
        "rate_rps": rate,
        "fleet": [{"name": n, "kind": k, "flags": f} for n, k, f in FLEET],
        "results": out,
        "ratios": ratios,
        "warm_ceilings": ceilings,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    svg = args.out[:-len(".json")] + ".svg" if args.out.endswith(".json") else args.out + ".svg"
    with open(svg, "w") as f:
        f.write(chart(out, doc))
    print(f"wrote {os.path.relpath(args.out, ROOT)} and {os.path.relpath(svg, ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
