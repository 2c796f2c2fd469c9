#!/usr/bin/env python3
"""A/B of two (or three) Sluice builds in one run: same simulators, same nginx baseline, alternating
rounds.

Machines here are noisy, so a change to the data path is judged against the build before it in
the same run, never against figures from another day. Both builds serve the realistic "full"
configuration of bench.py (API keys, limits, token-aware routing; targets `a`, `b`) and the bare
one (round-robin, no key; `a-bare`, `b-bare`) in front of the same two zero-delay simulators;
nginx in front of the same simulators is the yardstick. Each round loads every target in turn:
saturation (wrk -c64, CPU per 10k requests), concurrency 1 (p50/p99), and a fixed rate (oha,
latency corrected for coordinated omission) at 30% of the slower build's saturation in the first
round. The best round per target is reported, with every round in the JSON so the spread is
visible.

With --streams N (N > 0), the streaming checks of bench.py follow for nginx and both builds:
gap fidelity and time to first byte on a sim decoding a token per 10 ms (direct as the
reference), then N concurrent streams held on a sim sending a token per second, with the RSS
per held stream and the idle RSS of a fresh gateway of each build.

Usage:
  python3 bench/gateway/ab.py --a OLD_BINARY --b NEW_BINARY [--c THIRD_BINARY] [--rounds 4] [--seconds 6] [--streams 10000]
  python3 bench/gateway/ab.py --smoke --a BIN --b BIN     # seconds; keeps the harness working
"""

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time

from bench import (BENCH_KEY, ROOT, SMALL_BODY, Procs, cpu_seconds, fixed_rate, hold_streams, pct,
                   raise_nofile, rss_mb, sim, start_nginx, start_sluice, stream_gaps, wrk)


def shown(path):
    """A binary's name as the results file records it: relative to the repository when inside it."""
    full = os.path.abspath(path)
    return os.path.relpath(full, ROOT) if full.startswith(ROOT + os.sep) else os.path.basename(full)


def round_of(targets, secs, body, rate):
    """One pass over every target; returns {target: measurements}."""
    out = {}
    for name, (port, hdr, proc) in targets.items():
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        before = cpu_seconds(proc.pid)
        sat = wrk(url, secs, 64, 2, body, hdr)
        cpu = (cpu_seconds(proc.pid) - before) / max(1, sat["requests"]) * 1e4
        c1 = wrk(url, secs, 1, 1, body, hdr)
        fixed = fixed_rate(url, secs, rate, body, hdr) if rate else None
        out[name] = {"rps": sat["rps"], "sat_errors": sat["errors"], "cpu_s_per_10k": round(cpu, 3),
                     "c1_p50_ms": c1["p50_ms"], "c1_p99_ms": c1["p99_ms"], "c1_errors": c1["errors"],
                     "fixed": fixed}
    return out


def best(rounds, name, key, agg):
    vals = [r[name][key] for r in rounds if r[name][key] == r[name][key]]
    return agg(vals) if vals else float("nan")


def summary(rounds):
    s = {}
    for name in rounds[0]:
        fixed = [r[name]["fixed"] for r in rounds if r[name]["fixed"]]
        s[name] = {"rps": best(rounds, name, "rps", max),
                   "cpu_s_per_10k": best(rounds, name, "cpu_s_per_10k", min),
                   "c1_p50_ms": best(rounds, name, "c1_p50_ms", min),
                   "c1_p99_ms": best(rounds, name, "c1_p99_ms", min),
                   "fixed_p99_ms": min((f["p99_ms"] for f in fixed), default=float("nan")),
                   "errors": sum(r[name]["sat_errors"] + r[name]["c1_errors"] + (r[name]["fixed"] or {}).get("errors", 0)
                                 for r in rounds)}
    return s


def streaming(procs, builds, n, toks):
    """Gap fidelity and TTFB: direct, nginx and each build on one 10 ms-per-token sim."""
    sp = sim(procs, builds[-1][1], ["--speed", "1", "--decode-base-us", "10000", "--decode-per-seq-us", "0",
                        "--prefill-us-per-token", "1", "--min-output-tokens", "1000", "--max-output-tokens", "2000"])
    auth = {"Authorization": f"Bearer {BENCH_KEY}"}
    ports = [("direct", sp, {}), ("nginx", start_nginx(procs, [sp], tempfile.mkdtemp(prefix="sluice-ab-sn-"))[0], {})]
    for name, binary in builds:
        port, _ = start_sluice(procs, binary, [sp], True, tempfile.mkdtemp(prefix=f"sluice-ab-s{name}-"))
        ports.append((name, port, auth))
    out = {}
    for name, port, hdr in ports:
        ttfb, gaps = asyncio.run(stream_gaps(port, hdr, n, toks))
        out[name] = {"ttfb_p50_ms": round(pct(ttfb, 0.5), 3),
                     "gap_p50_ms": round(pct(gaps, 0.5), 3), "gap_p99_ms": round(pct(gaps, 0.99), 3),
                     "gaps_within_1ms_of_10ms": round(sum(1 for g in gaps if abs(g - 10) <= 1) / max(1, len(gaps)), 3)}
    return out


def held(procs, builds, n):
    """n concurrent streams through nginx and each build in turn (a fresh gateway each, one slow sim)."""
    hold = sim(procs, builds[-1][1], ["--speed", "1", "--decode-base-us", "1000000", "--decode-per-seq-us", "0",
                          "--max-num-seqs", "100000", "--kv-capacity-tokens", "1000000000",
                          "--min-output-tokens", "1000", "--max-output-tokens", "2000"])
    auth = {"Authorization": f"Bearer {BENCH_KEY}"}
    port, proc = start_nginx(procs, [hold], tempfile.mkdtemp(prefix="sluice-ab-hn-"))
    out = {"nginx": asyncio.run(hold_streams(port, {}, n, proc.pid))}
    for name, binary in builds:
        port, proc = start_sluice(procs, binary, [hold], True, tempfile.mkdtemp(prefix=f"sluice-ab-h{name}-"))
        idle = rss_mb(proc.pid)
        out[name] = asyncio.run(hold_streams(port, auth, n, proc.pid))
        out[name]["fresh_idle_rss_mb"] = round(idle, 1)
        proc.terminate()
        proc.wait()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="the build before the change")
    ap.add_argument("--b", required=True, help="the build with the change")
    ap.add_argument("--c", help="a third build, measured beside a and b")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=int, default=6)
    ap.add_argument("--streams", type=int, default=0, help="held streams after the rounds (0: none)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    for tool in ("wrk", "nginx", "oha"):
        if not shutil.which(tool):
            sys.exit(f"{tool} is required (see bench.py)")
    raise_nofile()
    secs, rounds = (1, 1) if args.smoke else (args.seconds, args.rounds)
    procs = Procs()
    tmp = tempfile.mkdtemp(prefix="sluice-ab-")
    builds = [("a", args.a), ("b", args.b)] + ([("c", args.c)] if args.c else [])
    results = {**{n: shown(b) for n, b in builds}, "seconds": secs, "rounds": []}
    try:
        sims = [sim(procs, args.b, ["--speed", "0", "--max-model-len", "4000000"]) for _ in range(2)]
        nginx_port, nginx_proc = start_nginx(procs, sims, tmp)
        auth = {"Authorization": f"Bearer {BENCH_KEY}"}
        targets = {"nginx": (nginx_port, {}, nginx_proc)}
        for name, binary in builds:
            port, proc = start_sluice(procs, binary, sims, True, tempfile.mkdtemp(prefix=f"sluice-ab-{name}-"))
            targets[name] = (port, auth, proc)
        for name, binary in builds:
            port, proc = start_sluice(procs, binary, sims, False, tempfile.mkdtemp(prefix=f"sluice-ab-{name}b-"))
            targets[f"{name}-bare"] = (port, {}, proc)
        body = os.path.join(tmp, "small.json")
        with open(body, "w") as f:
            f.write(SMALL_BODY)
        first = round_of(targets, secs, body, 0)
        rate = max(50, int(0.3 * min(first[n]["rps"] for n, _ in builds)))
        results["fixed_rate"] = rate
        results["rounds"].append(first)
        for _ in range(rounds):
            results["rounds"].append(round_of(targets, secs, body, rate))
        for p in (proc for t, (_, _, proc) in targets.items() if t != "nginx"):
            p.terminate()
            p.wait()
        n_streams = 200 if args.smoke else args.streams
        if n_streams:
            results["streaming"] = streaming(procs, builds, *((2, 20) if args.smoke else (10, 100)))
            results["held_streams"] = held(procs, builds, n_streams)
    finally:
        procs.stop()

    s = summary(results["rounds"])
    results["summary"] = s
    ng = s["nginx"]
    others = [t for t in s if t != "nginx"]
    results["ratios"] = {**{f"rps_{n}_over_a": round(s[n]["rps"] / s["a"]["rps"], 3) for n, _ in builds[1:]},
                         **{f"cpu_{n}_over_a": round(s[n]["cpu_s_per_10k"] / max(1e-9, s["a"]["cpu_s_per_10k"]), 3)
                            for n, _ in builds[1:]},
                         **{f"{t}_over_nginx": round(s[t]["rps"] / ng["rps"], 3) for t in others},
                         **{f"{t}_cpu_over_nginx": round(s[t]["cpu_s_per_10k"] / max(1e-9, ng["cpu_s_per_10k"]), 3)
                            for t in others}}
    print(f"\n{'target':<7} {'sat rps':>9} {'cpu s/10k':>10} {'c1 p50 ms':>10} {'c1 p99 ms':>10} "
          f"{'p99 @' + str(results.get('fixed_rate', '')) + '/s':>12} {'errors':>7}")
    for n, v in s.items():
        print(f"{n:<7} {v['rps']:>9.0f} {v['cpu_s_per_10k']:>10.3f} {v['c1_p50_ms']:>10.3f} "
              f"{v['c1_p99_ms']:>10.3f} {v['fixed_p99_ms']:>12.3f} {v['errors']:>7}")
    print("ratios:", json.dumps(results["ratios"]))
    for name, v in results.get("streaming", {}).items():
        print(f"stream {name:<7} ttfb p50 {v['ttfb_p50_ms']:.3f} ms, gaps p50/p99 {v['gap_p50_ms']:.3f}/"
              f"{v['gap_p99_ms']:.3f} ms, within 1 ms of 10 ms {v['gaps_within_1ms_of_10ms']:.3f}")
    for name, v in results.get("held_streams", {}).items():
        print(f"held {name:<7} {v['held']}/{v['streams']} held, idle {v['idle_rss_mb']} MB, with streams "
              f"{v['rss_mb']} MB, {v['kb_per_stream']} KB per stream, errors {v['error_kinds']}")
    out_dir = os.path.join(ROOT, "bench", "results")
    os.makedirs(out_dir, exist_ok=True)
    name = "ab-smoke.json" if args.smoke else f"ab-{time.strftime('%Y%m%d-%H%M%S')}.json"
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(results, f, indent=1)
    errors = sum(v["errors"] for v in s.values()) + sum(
        v["errors"] for v in results.get("held_streams", {}).values())
    if args.smoke and errors:
        sys.exit(f"smoke run saw {errors} errors")


if __name__ == "__main__":
    main()
