#!/usr/bin/env python3
"""Batch API on idle capacity: a 10,000-line batch beside the interactive load of
bench/routing, on one fleet and one gateway, in one run.

Fleet: the four vLLM simulators of bench/routing (fast-0, fast-1: 32 sequences; slow-0,
slow-1: 16 sequences; same timing flags), 96 batch slots in all, behind one `sluice serve`
with the default routing policy and `[batch] dir` in a temporary folder (`max_in_flight` at
the fleet's slot count, so the runner's headroom test, not the cap, decides what runs).

Phases, each on the same fleet and gateway:
  A  the interactive load alone: bench/routing's workload (streamed chats, Poisson arrivals,
     a fixed seed) at `--load` of the four engines' request capacity for `--warmup` +
     `--duration` seconds; only the last `--duration` seconds are measured.
  B  the same requests at the same arrival times (same seed), with a batch of `--lines`
     chat-completion lines (short prompts, `max_tokens` `--batch-max-tokens`) submitted when
     the arrivals start; measured over the same window.
  C  the interactive load stops; the batch runs alone until it completes (at most
     `--tail` seconds).

Measured:
  interactive TTFT     time to the first streamed text of each interactive request, p50/p99,
                       phase B over phase A (target: p99 ratio <= 1.10).
  engine busy time     running-batch integral: seconds of running sequences per second, from
                       each simulator's own /metrics. Two readings of the same quantity:
                       `vllm:num_requests_running` sampled every `--sample` seconds and
                       integrated over the window, and the growth of
                       `vllm:request_inference_time_seconds_sum` (each finished request's
                       time in the running batch, so a request straddling the window's edge
                       counts where it ends). The fleet's capacity is the sum of the
                       engines' `--max-num-seqs` (sequence slots); the interactive load leaves
                       capacity - busy_A of it idle.
  idle capacity used   (busy_B - busy_A) / (capacity - busy_A) (target: >= 0.80).
  batch line rate      completed lines per second during phase B's window (from
                       GET /v1/batches/{id} every second) and in phase C, alone; the batch
                       must finish faster without the interactive load.

The gateway sets no `max_concurrent` by default: it learns each engine's batch limit from what
the engine reports. `--known-slots` configures each backend's `max_concurrent` at its
engine's `--max-num-seqs`, as an operator who knows them would; interactive requests then wait
in the gateway's queue, not inside an engine, when every slot is taken. Each phase's
interactive TTFT is also given per backend and request class (`by_backend`).

Writes bench/results/batch-idle.json (or batch-idle-smoke.json) and prints a table.

Usage:
  python3 bench/batch/idle.py                   # full run (~4 minutes)
  python3 bench/batch/idle.py --smoke           # under a minute; checks the harness
  python3 bench/batch/idle.py --binary PATH     # use an existing sluice binary
  python3 bench/batch/idle.py --known-slots     # backends with max_concurrent configured
"""

import argparse
import asyncio
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _routing():
    """bench/routing/bench.py: its fleet, workload, load driver and helpers."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "routing_bench", os.path.join(ROOT, "bench", "routing", "bench.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


routing = _routing()

# The vLLM engines of the routing fleet, with their timing; capacity in requests per second
# of the routing workload (bench/routing's estimates: fast ~8.2, slow ~2.5 req/s each).
FLEET = [(n, k, f) for n, k, f in routing.FLEET if k == "vllm"]
CAPACITY_RPS = 2 * 8.2 + 2 * 2.5


def slots_of(flags):
    return int(flags[flags.index("--max-num-seqs") + 1])


SLOTS = {n: slots_of(f) for n, _, f in FLEET}

RUNNING = re.compile(r'^vllm:num_requests_running\{[^}]*\} (\S+)$', re.M)
WAITING = re.compile(r'^vllm:num_requests_waiting\{[^}]*\} (\S+)$', re.M)
INFER_SUM = re.compile(r'^vllm:request_inference_time_seconds_sum\{[^}]*\} (\S+)$', re.M)


def scrape(port):
    """(running, waiting, inference seconds sum) from one simulator's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        t = r.read().decode()
    return (float(RUNNING.search(t).group(1)), float(WAITING.search(t).group(1)),
            float(INFER_SUM.search(t).group(1)))


class Sampler:
    """Samples every engine's /metrics every `period` seconds (bounded by `limit` samples)
    and the batch's progress every second, in a thread."""

    def __init__(self, sims, gw, period, limit):
        self.sims, self.gw, self.period, self.limit = sims, gw, period, limit
        self.samples = []  # (t, {name: (running, waiting, infer_sum)})
        self.progress = []  # (t, completed, failed, status)
        self.batch = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        last_batch = 0.0
        for _ in range(self.limit):
            if self.stop.is_set():
                return
            t = time.perf_counter()
            try:
                self.samples.append((t, {n: scrape(p) for n, p in self.sims.items()}))
            except Exception:
                pass
            if self.batch and t - last_batch >= 1.0:
                last_batch = t
                try:
                    b = routing.get_json(f"http://127.0.0.1:{self.gw}/v1/batches/{self.batch}")
                    c = b.get("request_counts") or {}
                    self.progress.append((t, c.get("completed", 0), c.get("failed", 0),
                                          b.get("status")))
                except Exception:
                    pass
            self.stop.wait(max(0.0, self.period - (time.perf_counter() - t)))

    def busy(self, t0, t1):
        """Per engine over [t0, t1]: mean running sequences (sampled gauge), mean waiting,
        and running seconds per second from the inference-time sum."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        out = {}
        for n in self.sims:
            run = [s[1][n][0] for s in inside]
            wait = [s[1][n][1] for s in inside]
            out[n] = {"running": sum(run) / len(run) if run else None,
                      "waiting": sum(wait) / len(wait) if wait else None}
            if len(inside) >= 2:
                span = inside[-1][0] - inside[0][0]
                out[n]["inference_s_per_s"] = (inside[-1][1][n][2] - inside[0][1][n][2]) / span
            else:
                out[n]["inference_s_per_s"] = None
        return out

    def done_at(self, t):
        """Batch lines completed or failed by time `t` (interpolated between polls)."""
        prev = (None, 0)
        for pt, c, f, _ in self.progress:
            if pt >= t:
                if prev[0] is None:
                    return c + f
                w = (t - prev[0]) / max(pt - prev[0], 1e-9)
                return prev[1] + w * (c + f - prev[1])
            prev = (pt, c + f)
        return prev[1]


def batch_file(n, prompt_tokens, max_tokens):
    """The batch's JSONL: `n` chat-completion lines, each its own short prompt."""
    rng = routing.random.Random(99)
    out = []
    for i in range(n):
        body = {"model": "m", "max_tokens": max_tokens,
                "messages": [{"role": "user",
                              "content": f"[b{i}] " + routing.text(rng, prompt_tokens)}]}
        out.append(json.dumps({"custom_id": f"line-{i}", "method": "POST",
                               "url": "/v1/chat/completions", "body": body}))
    return ("\n".join(out) + "\n").encode()


def post(url, body, content_type):
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": content_type})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def submit(gw, content):
    """Upload the file (multipart, as OpenAI's clients send it) and create the batch."""
    boundary = "----sluicebench" + str(os.getpid())
    parts = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
             f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
             f"filename=\"lines.jsonl\"\r\nContent-Type: application/jsonl\r\n\r\n").encode()
    body = parts + content + f"\r\n--{boundary}--\r\n".encode()
    f = post(f"http://127.0.0.1:{gw}/v1/files", body,
             f"multipart/form-data; boundary={boundary}")
    b = post(f"http://127.0.0.1:{gw}/v1/batches",
             json.dumps({"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                         "completion_window": "24h"}).encode(), "application/json")
    return b["id"]


def interactive(gw, reqs, rate, args):
    """One phase of the interactive load: the measured results (TTFT of the streamed
    requests that arrived after the warm-up) and the phase's start."""
    t0 = time.perf_counter()
    results, sent_until, _ = asyncio.run(
        routing.drive(gw, reqs, rate, args.warmup, args.seed, args.timeout))
    return results, t0, sent_until


def summary(results):
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    def pcts(v):
        return {"n": len(v), "p50_ttft_s": routing.pct(v, 50), "p99_ttft_s": routing.pct(v, 99)}

    by_kind = {k: pcts([r["ttft"] for r in ok if r["kind"] == k])
               for k in ("short", "shared", "long")}
    by_backend = {}
    for r in ok:
        e = by_backend.setdefault(r["backend"] or "?", {})
        e.setdefault(r["kind"], []).append(r["ttft"])
    by_backend = {b: {k: pcts(v) for k, v in e.items()} for b, e in sorted(by_backend.items())}
    return {"requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
            "p50_ttft_s": routing.pct(ttft, 50), "p90_ttft_s": routing.pct(ttft, 90),
            "p99_ttft_s": routing.pct(ttft, 99), "by_kind": by_kind, "by_backend": by_backend,
            "_ttft": ttft}


def ratio_interval(a, b, p=99, rounds=2000, seed=1):
    """95% bootstrap interval of pct(b, p) / pct(a, p): each phase's requests resampled with
    replacement (unpaired, so a little wider than the paired truth)."""
    import random
    rng = random.Random(seed)
    if not a or not b:
        return None
    ratios = []
    for _ in range(rounds):
        ra = routing.pct(rng.choices(a, k=len(a)), p)
        rb = routing.pct(rng.choices(b, k=len(b)), p)
        if ra:
            ratios.append(rb / ra)
    ratios.sort()
    return [ratios[int(0.025 * len(ratios))], ratios[int(0.975 * len(ratios)) - 1]]


def fleet_busy(per):
    """Fleet totals of Sampler.busy's per-engine figures."""
    def total(key):
        v = [e[key] for e in per.values()]
        return None if any(x is None for x in v) else sum(v)
    return {"running": total("running"), "waiting": total("waiting"),
            "inference_s_per_s": total("inference_s_per_s"), "per_engine": per}


def run(args, reqs, rate, tmp):
    procs = routing.Procs()
    try:
        sims = {}
        for name, kind, extra in FLEET:
            port = routing.free_port()
            procs.start([args.binary, "sim", "--kind", kind, "--port", str(port), "--model", "m",
                         "--speed", str(args.speed), "--threads", "1", *routing.COMMON,
                         *extra])
            sims[name] = port
        for port in sims.values():
            routing.wait_http(f"http://127.0.0.1:{port}/health")
        gw = routing.free_port()
        cfg = [f'[server]\nlisten = "127.0.0.1:{gw}"\n',
               '[timeouts]\nidle = "600s"\nfirst_byte = "600s"\nresponse = "600s"\n',
               '[queue]\nsize = 100000\ntimeout = "600s"\n',
               f'[batch]\ndir = "{os.path.join(tmp, "batch")}"\n'
               f'max_in_flight = {sum(SLOTS.values())}\n'
               + (f'max_ttft_rise = {args.max_ttft_rise}\n'
                  if args.max_ttft_rise is not None else '')]
        cfg.append('[routing]\nexpose_backend_header = true\n'
                   + (f'policy = "{args.policy}"\n' if args.policy else ''))
        for name, port in sims.items():
            cfg.append(f'[[backends]]\nname = "{name}"\nkind = "vllm"\n'
                       f'url = "http://127.0.0.1:{port}"\nmodels = ["m"]\n'
                       + (f'max_concurrent = {SLOTS[name]}\n' if args.known_slots else ''))
        path = os.path.join(tmp, "gateway.toml")
        with open(path, "w") as f:
            f.write("\n".join(cfg))
        procs.start([args.binary, "serve", "--config", path])
        routing.wait_http(f"http://127.0.0.1:{gw}/readyz")
        content = batch_file(args.lines, args.batch_prompt_tokens, args.batch_max_tokens)

        total_s = 2 * (args.warmup + args.duration) + args.tail + 120
        sampler = Sampler(sims, gw, args.sample, int(total_s / args.sample))
        sampler.thread.start()

        print(f"phase A: interactive alone, {len(reqs)} requests at {rate:.1f} req/s", flush=True)
        res_a, a0, sent_a = interactive(gw, reqs, rate, args)
        win_a = (a0 + args.warmup, a0 + sent_a)
        time.sleep(args.gap)  # the last answers of A drain

        print(f"phase B: the same load with a {args.lines}-line batch", flush=True)
        submitted = time.perf_counter()
        batch = submit(gw, content)
        sampler.batch = batch
        res_b, b0, sent_b = interactive(gw, reqs, rate, args)
        win_b = (b0 + args.warmup, b0 + sent_b)
        b_end = time.perf_counter()

        print("phase C: the batch alone", flush=True)
        deadline = b_end + args.tail
        final = None
        while time.perf_counter() < deadline:
            final = routing.get_json(f"http://127.0.0.1:{gw}/v1/batches/{batch}")
            if final.get("status") in ("completed", "failed", "expired", "cancelled"):
                break
            time.sleep(0.5)
        finished = time.perf_counter()
        time.sleep(min(1.5, args.sample * 3))
        sampler.stop.set()
        sampler.thread.join(timeout=10)
    finally:
        procs.stop()

    capacity = float(sum(SLOTS.values()))
    busy_a = fleet_busy(sampler.busy(*win_a))
    busy_b = fleet_busy(sampler.busy(*win_b))

    def used(key):
        a, b = busy_a[key], busy_b[key]
        if a is None or b is None or capacity - a <= 0:
            return None
        return (b - a) / (capacity - a)

    # batch lines per second: phase B's measured window; phase C from the end of B's
    # arrivals until the batch completed (its last lines drain at a falling rate: the
    # rate alone is taken to 90% of what remained, the whole tail is reported too)
    rate_b = (sampler.done_at(win_b[1]) - sampler.done_at(win_b[0])) / (win_b[1] - win_b[0])
    left_c = args.lines - sampler.done_at(b_end)
    c90 = None
    if left_c > 0:
        target = sampler.done_at(b_end) + 0.9 * left_c
        c90 = next((t for t, c, f, _ in sampler.progress if c + f >= target and t > b_end), None)
    rate_c = (0.9 * left_c / (c90 - b_end)) if c90 and c90 > b_end else None
    status = (final or {}).get("status")
    counts = (final or {}).get("request_counts") or {}
    t_ref = submitted
    timeline = [{"t": round(t - t_ref, 2), "done": c + f, "status": s}
                for t, c, f, s in sampler.progress]
    return {
        "phase_a": {"interactive": summary(res_a), "window_s": win_a[1] - win_a[0],
                    "busy": busy_a},
        "phase_b": {"interactive": summary(res_b), "window_s": win_b[1] - win_b[0],
                    "busy": busy_b, "batch_lines_per_s": rate_b,
                    "batch_done_at_window_start": sampler.done_at(win_b[0]),
                    "batch_done_at_end": sampler.done_at(b_end)},
        "phase_c": {"batch_lines_per_s": rate_c, "lines_left_at_start": left_c,
                    "seconds_to_complete": finished - b_end if status == "completed" else None},
        "capacity_slots": capacity,
        "idle_capacity_used": used("running"),
        "idle_capacity_used_inference_sum": used("inference_s_per_s"),
        "batch": {"id": batch, "lines": args.lines, "status": status, "counts": counts,
                  "seconds_from_submit": finished - submitted},
        "timeline": timeline,
    }


fmt = routing.fmt_or_dash


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default=os.path.join(ROOT, "target", "release", "sluice"))
    ap.add_argument("--duration", type=float, default=60.0, help="measured seconds per phase")
    ap.add_argument("--warmup", type=float, default=10.0, help="first seconds not measured")
    ap.add_argument("--load", type=float, default=0.5,
                    help="interactive rate as a fraction of the engines' request capacity")
    ap.add_argument("--speed", type=float, default=1.0, help="simulator time compression")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--policy", default=None, help="routing policy (default: the gateway's)")
    ap.add_argument("--lines", type=int, default=10000, help="batch lines")
    ap.add_argument("--batch-prompt-tokens", type=int, default=60)
    ap.add_argument("--batch-max-tokens", type=int, default=32)
    ap.add_argument("--tail", type=float, default=240.0,
                    help="longest wait for the batch after the interactive load stops")
    ap.add_argument("--gap", type=float, default=8.0, help="seconds between phases A and B")
    ap.add_argument("--sample", type=float, default=0.25, help="seconds between /metrics scrapes")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--max-ttft-rise", type=float, default=None,
                    help="[batch] max_ttft_rise (default: the gateway's)")
    ap.add_argument("--known-slots", action="store_true",
                    help="configure each backend's max_concurrent at its engine's max-num-seqs")
    ap.add_argument("--smoke", action="store_true", help="under a minute; checks the harness")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "batch-idle.json"))
    args = ap.parse_args()
    if args.smoke:
        args.duration, args.warmup, args.speed, args.lines = 5.0, 1.0, 5.0, 1000
        args.gap, args.tail, args.sample = 1.0, 30.0, 0.2
        if args.out.endswith("batch-idle.json"):
            args.out = args.out.replace("batch-idle.json", "batch-idle-smoke.json")
    if not os.path.exists(args.binary):
        subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    rate = CAPACITY_RPS * args.speed * args.load
    reqs = routing.workload(args.seed, int(rate * (args.warmup + args.duration)))
    load_before = os.getloadavg()
    print(f"fleet: {', '.join(SLOTS)} ({sum(SLOTS.values())} slots); interactive {rate:.1f} "
          f"req/s ({args.load:.0%} of ~{CAPACITY_RPS * args.speed:.1f}); batch {args.lines} "
          f"lines; speed {args.speed}; load average {load_before[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        r = run(args, reqs, rate, tmp)
    load_after = os.getloadavg()
    a, b, c = r["phase_a"], r["phase_b"], r["phase_c"]
    pa, pb = a["interactive"]["p99_ttft_s"], b["interactive"]["p99_ttft_s"]
    ratio = pb / pa if pa and pb else None
    interval = ratio_interval(a["interactive"].pop("_ttft"), b["interactive"].pop("_ttft"))
    faster = (c["batch_lines_per_s"] or 0) > (b["batch_lines_per_s"] or 0)
    r["targets"] = {
        "p99_ttft_ratio": ratio, "p99_ttft_ratio_met": ratio is not None and ratio <= 1.10,
        "p99_ttft_ratio_interval_95": interval,
        "idle_capacity_used": r["idle_capacity_used"],
        "idle_capacity_used_met": (r["idle_capacity_used"] or 0) >= 0.80,
        "faster_alone": faster,
        "batch_completed": r["batch"]["status"] == "completed",
    }
    cap = r["capacity_slots"]
    print()
    print(f"{'phase':<28}{'A: interactive':>16}{'B: + batch':>14}{'C: batch alone':>16}")
    rows = [
        ("interactive requests ok", a["interactive"]["ok"], b["interactive"]["ok"], None, "d"),
        ("interactive errors", a["interactive"]["errors"], b["interactive"]["errors"], None, "d"),
        ("TTFT p50 (s)", a["interactive"]["p50_ttft_s"], b["interactive"]["p50_ttft_s"], None,
         ".3f"),
        ("TTFT p99 (s)", pa, pb, None, ".3f"),
        ("running seqs (of %d)" % cap, a["busy"]["running"], b["busy"]["running"], None, ".1f"),
        ("  by inference-time sum", a["busy"]["inference_s_per_s"],
         b["busy"]["inference_s_per_s"], None, ".1f"),
        ("waiting seqs", a["busy"]["waiting"], b["busy"]["waiting"], None, ".2f"),
        ("batch lines/s", None, b["batch_lines_per_s"], c["batch_lines_per_s"], ".1f"),
    ]
    for name, va, vb, vc, spec in rows:
        print(f"{name:<28}{fmt(va, spec):>16}{fmt(vb, spec):>14}{fmt(vc, spec):>16}")
    t = r["targets"]
    print()
    ci = (f", 95% interval {fmt(interval[0])}-{fmt(interval[1])}" if interval else "")
    print(f"p99 TTFT B/A: {fmt(ratio)}{ci} (target <= 1.10: "
          f"{'met' if t['p99_ttft_ratio_met'] else 'NOT met'})")
    print(f"idle capacity used: {fmt(r['idle_capacity_used'])} (inference-time sum: "
          f"{fmt(r['idle_capacity_used_inference_sum'])}; target >= 0.80: "
          f"{'met' if t['idle_capacity_used_met'] else 'NOT met'})")
    print(f"batch: {r['batch']['status']} {r['batch']['counts']} in "
          f"{r['batch']['seconds_from_submit']:.1f} s; faster alone: {faster}")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    doc = {
        "bench": "batch-idle",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_before": load_before, "load_average_after": load_after},
        "args": {k: (routing.shown_path(v) if k in ("binary", "out") else v)
                 for k, v in vars(args).items()},
        "rate_rps": rate,
        "fleet": [{"name": n, "kind": k, "flags": f} for n, k, f in FLEET],
        **r,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {os.path.relpath(args.out, ROOT)}")
    ok = (r["batch"]["status"] == "completed" and a["interactive"]["ok"] > 0
          and b["interactive"]["ok"] > 0 and r["idle_capacity_used"] is not None)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
