#!/usr/bin/env python3
"""The planner against reality: for three workloads (chat-heavy, long-prompt RAG, shared-prefix
agent traffic), `sluice plan` predicts p50/p99 time to first token (TTFT) for the fleet it
recommends (N), one server fewer (N-1) and N with one server down; the same requests are then
replayed in real time through `sluice serve` in front of live `sluice sim` fleets of those
sizes, and the client-side TTFTs are compared with the predictions.

The same requests on both sides: this script generates each workload (seeded) as a list of
chat requests with exact token counts (the simulator's documented tokenizer and chat template,
replicated below and checked against every response's usage), writes it as a workload trace
(the format the gateway's [trace] records, `max_tokens` included) that the plan reads, and
replays exactly those requests at exactly those arrival offsets. The simulators and the plan's
candidate get the same engine timing (`[candidate.timing]` = `sluice sim --max-num-seqs ...`);
each request asks for `max_tokens` with `ignore_eos`, so it generates exactly that many tokens.

Verdicts: both sides are samples of the same traffic, so both are judged by the one rule the
planner decides with. A p99 TTFT "meets" the SLO when the upper end of its 95% interval does,
"misses" when the lower end is above it, and is "not sure" otherwise. A fleet counts as meeting
the SLO only when its verdict is "meets"; plan and reality agree on a row when they both count
it so or both do not. The table also prints the measured point p99 against the SLO, the reading
that ignores the replay's own uncertainty, so that no row is hidden by the rule.

TTFT is measured by the client: from just before the request is sent to the first SSE event
with non-empty content. "One down": N simulators behind the gateway, one of them killed
(SIGKILL) just before the first request; the gateway finds out by itself. Before each replay
the gateway is brought to what a gateway in service knows (every engine's batch limit, learned
from its metrics) by bursts of other requests; its backends are named as the planner names its
engines, and shared preambles carry the gateway's own fingerprint, because prefix-affinity
homes a prefix by a hash of both.

Each workload is replayed for its own duration (`duration` below): long enough that its p99's
95% interval is narrow next to the SLO. Prefix-affinity's tail is the lumpiest, so the agent
workload needs three times the requests of the others for the same width.

Usage: cargo build --release && python3 bench/plan/reality.py [--workloads chat,rag,agent]
       [--duration SECONDS (all workloads)] [--binary PATH] [--json OUT]
Only the Python standard library is used. Everything listens on 127.0.0.1.
"""
import argparse
import http.client
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

# The process helpers the chaos benchmarks share.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "chaos"))
from chaos import free_port, get_json, wait_port  # noqa: E402

# ---- the engine every simulator runs and the plan's candidate is ----------------------------
TIMING = {
    "max_num_seqs": 8,
    "kv_capacity_tokens": 200_000,
    "prefill_us": 100,       # per uncached prompt token
    "decode_base_us": 25_000,
    "decode_per_seq_us": 1_500,
    "block_size": 16,
}

# ---- workloads ---------------------------------------------------------------------------------
# rate: requests/s; prompt/output: log-normal (mean, sd, max) tokens of the user message and the
# answer; prefix: (preambles, tokens) every request starts with one of; slo: p99 TTFT bound (s);
# duration: seconds of arrivals per replay.
WORKLOADS = {
    "chat": dict(rate=4.5, prompt=(250, 200, 2000), output=(140, 90, 600), prefix=None,
                 policy="token-aware", slo=1.0, seed=11, duration=300),
    "rag": dict(rate=4.0, prompt=(3000, 1200, 7000), output=(60, 30, 300), prefix=None,
                policy="token-aware", slo=1.5, seed=12, duration=300),
    "agent": dict(rate=3.5, prompt=(200, 150, 1500), output=(90, 60, 400), prefix=(6, 2500),
                  policy="prefix-affinity", slo=1.0, seed=13, duration=900),
}

# ---- the simulator's tokenizer and chat template (src/sim/text.rs) ---------------------------
WORDS = ["the", "a", "of", "to", "and", "in", "is", "it", "you", "he", "was", "for", "on",
         "are", "as", "his", "at", "be", "one", "had", "by", "but", "not", "all", "we", "can",
         "sky", "sea", "sun", "red", "big", "new", "old", "way", "day", "man", "fox", "owl"]


def count_tokens(text):
    """Pieces (a whitespace run, then an alphanumeric run or one other character), each cut
    into chunks of at most 4 bytes; a chunk is a token (ASCII text only)."""
    n, i, end = 0, 0, len(text)
    while i < end:
        start = i
        while i < end and text[i] in " \t\n\r\x0b\x0c":
            i += 1
        if i < end:
            if text[i].isalnum():
                while i < end and text[i].isalnum():
                    i += 1
            else:
                i += 1
        n += math.ceil((i - start) / 4)
    return n


def fnv1a(data):
    h = 0xcbf29ce484222325
    for b in data:
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h


def gateway_prefix_hash(role, content):
    """The fingerprint the gateway gives a conversation's prefix (every message but the last:
    the raw JSON of its role and content, src/openai/request.rs): prefix-affinity homes a
    prefix by it, so the plan must route on the same value."""
    return fnv1a((json.dumps(role) + json.dumps(content)).encode())


def render(messages):
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def lognormal(rng, mean, sd, top):
    s2 = math.log(1 + (sd / mean) ** 2)
    v = math.exp(math.log(mean) - s2 / 2 + math.sqrt(s2) * rng.gauss(0, 1))
    return max(1, min(top, round(v)))


def words(rng, n):
    return "".join(" " + rng.choice(WORDS) for _ in range(n))


def generate(w, duration):
    """The workload's requests: (offset s, messages, prompt tokens, max_tokens, prefix)."""
    rng = random.Random(w["seed"])
    preambles = []
    if w["prefix"]:
        count, tokens = w["prefix"]
        for j in range(count):
            text = f"agent{j} tools:" + words(rng, tokens)
            shared = count_tokens(f"<|system|>\n{text}\n<|user|>")
            preambles.append((text, shared, gateway_prefix_hash("system", text)))
    out, t, i = [], 0.0, 0
    while True:
        t += rng.expovariate(w["rate"])
        if t >= duration:
            return out
        user = f"u{i}" + words(rng, lognormal(rng, *w["prompt"]))
        messages, prefix = [{"role": "user", "content": user}], None
        if preambles:
            text, shared, fp = rng.choice(preambles)
            messages.insert(0, {"role": "system", "content": text})
            prefix = (fp, shared)
        out.append((t, messages, count_tokens(render(messages)), lognormal(rng, *w["output"]),
                    prefix))
        i += 1


def write_trace(path, reqs):
    with open(path, "w") as f:
        for at, _, prompt, out, prefix in reqs:
            line = {"ts": 1_000_000.0 + at, "model": "m", "api": "/v1/chat/completions",
                    "prompt_tokens": prompt, "completion_tokens": out, "max_tokens": out}
            if prefix:
                line["prefix"], line["prefix_tokens"] = f"{prefix[0]:016x}", prefix[1]
            f.write(json.dumps(line) + "\n")


def write_plan(path, trace, w, max_servers):
    t = TIMING
    with open(path, "w") as f:
        f.write(f"""[workload]
trace = "{os.path.basename(trace)}"

[slo]
ttft_p99 = "{int(w['slo'] * 1000)}ms"
tpot_p99 = "10s"
max_queue_wait = "1h"

[search]
max_servers = {max_servers}
policy = "{w['policy']}"

[[candidate]]
name = "sim"
price_per_hour = 1.0
[candidate.timing]
max_num_seqs = {t['max_num_seqs']}
kv_capacity_tokens = {t['kv_capacity_tokens']}
prefill_per_token = "{t['prefill_us']}us"
decode_base = "{t['decode_base_us']}us"
decode_per_seq = "{t['decode_per_seq_us']}us"
block_size = {t['block_size']}
""")


def run_plan(binary, plan_path):
    out = plan_path + ".json"
    subprocess.run([binary, "plan", plan_path, "--quiet", "--json", out], check=True,
                   stdout=subprocess.DEVNULL)
    with open(out) as f:
        doc = json.load(f)
    return doc["candidates"][0]


# ---- processes ---------------------------------------------------------------------------------
def start_sim(binary, port):
    t = TIMING
    return subprocess.Popen(
        [binary, "sim", "--kind", "vllm", "--port", str(port), "--model", "m",
         "--threads", "1",
         "--max-num-seqs", str(t["max_num_seqs"]),
         "--kv-capacity-tokens", str(t["kv_capacity_tokens"]),
         "--prefill-us-per-token", str(t["prefill_us"]),
         "--decode-base-us", str(t["decode_base_us"]),
         "--decode-per-seq-us", str(t["decode_per_seq_us"]),
         "--block-size", str(t["block_size"]),
         "--max-model-len", "32768"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)



class Fleet:
    """`n` simulators behind one gateway routing with `policy`."""

    def __init__(self, binary, n, policy, workdir):
        self.ports = [free_port() for _ in range(n)]
        self.sims = [start_sim(binary, p) for p in self.ports]
        for p in self.ports:
            wait_port(p)
        self.port = free_port()
        cfg = f'[server]\nlisten = "127.0.0.1:{self.port}"\n[routing]\npolicy = "{policy}"\nexpose_backend_header = true\n'
        cfg += '[health]\ninterval = "500ms"\ntimeout = "400ms"\n'
        # Named as the planner names its engines: prefix-affinity homes each prefix by a
        # rendezvous hash of the backends' names, so other names are another draw of homes.
        for i, p in enumerate(self.ports):
            cfg += (f'[[backends]]\nname = "engine-{i}"\nkind = "vllm"\n'
                    f'url = "http://127.0.0.1:{p}"\nmodels = ["m"]\n')
        path = os.path.join(workdir, f"gateway-{self.port}.toml")
        with open(path, "w") as f:
            f.write(cfg)
        env = dict(os.environ, SLUICE_LOG="warn")
        self.gw = subprocess.Popen([binary, "serve", "--config", path], env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port)
        end = time.time() + 15
        while time.time() < end:
            doc = get_json(self.port, "/admin/backends")
            if all(b["state"] == "healthy" for b in doc["backends"]):
                break
            time.sleep(0.05)
        else:
            self.stop()
            raise SystemExit("the backends did not become healthy")
        self.warm_up()

    def home_levels(self):
        """Each backend's prefix-affinity weight step and the capacity it stands for."""
        doc = get_json(self.port, "/admin/backends")
        return [(b["routing"]["speeds"]["home_level"],
                 b["routing"]["speeds"]["capacity_tokens_per_second"]) for b in doc["backends"]]

    def learned_slots(self):
        doc = get_json(self.port, "/admin/backends")
        return [b["routing"]["signals"]["learned_slots"] for b in doc["backends"]]

    def warm_up(self):
        """A gateway in service knows each engine's batch limit (learned from its metrics
        when requests wait beside a full batch); a fresh one assumes vLLM's default of 256
        and piles requests onto one engine until it learns. So before the replay, bursts of
        a few more requests than the fleet's slots, until every backend has learned them."""
        slots = TIMING["max_num_seqs"]
        for burst in range(4):
            if all(s == slots for s in self.learned_slots()):
                return
            n = len(self.ports) * (slots + 4)
            reqs = [(0.0, [{"role": "user", "content": f"warm{burst}x{k}" + " the" * 40}],
                     0, 48, None) for k in range(n)]
            replay(self.port, reqs)
        raise SystemExit(f"the gateway did not learn the batch limits: {self.learned_slots()}")

    def prefill_speeds(self):
        doc = get_json(self.port, "/admin/backends")
        return [b["routing"]["speeds"]["prefill_tokens_per_second"] for b in doc["backends"]]

    def kill_one(self):
        self.sims[-1].kill()
        self.sims[-1].wait()

    def stop(self):
        self.gw.terminate()
        for s in self.sims:
            s.kill()
        self.gw.wait(timeout=10)
        for s in self.sims:
            s.wait()


# ---- the replay --------------------------------------------------------------------------------
def one(port, req, t0, results, idx):
    at, messages, prompt, out, _ = req
    body = json.dumps({"model": "m", "messages": messages, "max_tokens": out,
                       "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}})
    sent = time.monotonic()
    ttft, usage, status, backend = None, None, None, None
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        c.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        r = c.getresponse()
        status = r.status
        backend = r.getheader("x-sluice-backend")
        while True:
            line = r.readline()
            if not line:
                break
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            if ttft is None and b'"content":"' in line and b'"content":""' not in line:
                ttft = time.monotonic() - sent
            if b'"usage":{' in line:
                usage = json.loads(line[6:]).get("usage")
        c.close()
    except (OSError, http.client.HTTPException, ValueError):
        pass
    results[idx] = {"at": at, "late_s": sent - (t0 + at), "ttft": ttft, "status": status,
                    "backend": backend,
                    "prompt_ok": bool(usage) and usage.get("prompt_tokens") == prompt,
                    "completion_ok": bool(usage) and usage.get("completion_tokens") == out}


class Monitor:
    """Samples every simulator's running/waiting counts every 50 ms (from /sim/state)."""

    def __init__(self, ports):
        self.ports, self.samples = ports, []  # (t, [(running, waiting)] per sim)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        t0 = time.monotonic()
        while not self.stop.is_set():
            row = []
            for p in self.ports:
                try:
                    s = get_json(p, "/sim/state")
                    row.append((s["running"], s["waiting"]))
                except (OSError, ValueError, KeyError, http.client.HTTPException):
                    row.append(None)
            self.samples.append((round(time.monotonic() - t0, 3), row))
            time.sleep(0.05)

    def finish(self):
        self.stop.set()
        self.thread.join(timeout=5)
        # samples where some engine queued while another had a free batch slot
        slots = TIMING["max_num_seqs"]
        misrouted = [(t, row) for t, row in self.samples
                     if any(x and x[0] >= slots and x[1] > 0 for x in row)
                     and any(x and x[0] + x[1] < slots for x in row)]
        return {"samples": len(self.samples), "queued_beside_room": len(misrouted)}


def replay(port, reqs, before_start=None):
    results = [None] * len(reqs)
    threads = []
    if before_start:
        before_start()
    t0 = time.monotonic() + 0.2
    for i, req in enumerate(reqs):
        delay = t0 + req[0] - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # the workload's arrival schedule
        th = threading.Thread(target=one, args=(port, req, t0, results, i), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(timeout=600)
    return results


def pct(values, p):
    """Nearest rank, as the planner computes it."""
    v = sorted(values)
    return v[max(1, min(len(v), math.ceil(p / 100 * len(v)))) - 1]


def p99_interval(values):
    """The nearest ranks bounding a 95% confidence interval of the p99, as the planner
    computes them (normal approximation of the binomial count below it)."""
    v, n = sorted(values), len(values)
    half = 1.96 * math.sqrt(n * 0.99 * 0.01)
    lo, hi = max(1, math.floor(n * 0.99 - half)), max(1, math.ceil(n * 0.99 + half))
    return [v[min(lo, n) - 1], v[min(hi, n) - 1]]


def measure(binary, n, policy, reqs, workdir, kill_one=False):
    fleet = Fleet(binary, n, policy, workdir)
    mon = Monitor(fleet.ports[:-1] if kill_one else fleet.ports)
    levels_before = fleet.home_levels()
    prefill_before = fleet.prefill_speeds()
    try:
        res = replay(fleet.port, reqs, fleet.kill_one if kill_one else None)
        backends = get_json(fleet.port, "/admin/backends")
        levels_after = fleet.home_levels()
    finally:
        watch = mon.finish()
        fleet.stop()
    ok = [r for r in res if r and r["ttft"] is not None]
    ttfts = [r["ttft"] for r in ok]
    failed = len(reqs) - len(ok)
    # a failed request never got its first token: it counts as infinitely late
    all_ttfts = ttfts + [float("inf")] * failed
    return {
        "p50": pct(all_ttfts, 50), "p99": pct(all_ttfts, 99),
        "p99_interval": p99_interval(all_ttfts), "failed": failed,
        "count_mismatch": sum(1 for r in ok if not (r["prompt_ok"] and r["completion_ok"])),
        "late_p99_ms": 1000 * pct([r["late_s"] for r in res if r], 99),
        "monitor": watch,
        "learned_slots": [b["routing"]["signals"]["learned_slots"] for b in backends["backends"]],
        "home_levels": {"before": levels_before, "after": levels_after},
        "prefill_tps_before": prefill_before,
        "per_request": [(round(r["at"], 4), r["ttft"] and round(r["ttft"], 4), r["backend"])
                        for r in res if r],
    }


def load_avg():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--binary", default=os.path.join(here, "..", "..", "target", "release", "sluice"))
    ap.add_argument("--workloads", default="chat,rag,agent")
    ap.add_argument("--duration", type=float,
                    help="seconds of arrivals per replay, for every workload (default: its own)")
    ap.add_argument("--fleets", default="N,N-1,down", help="which fleets to replay")
    ap.add_argument("--plan-only", action="store_true", help="plan, do not replay")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--table", metavar="RESULTS", help="print the table of a results file, run nothing")
    args = ap.parse_args()
    if args.table:
        with open(args.table) as f:
            rows = json.load(f)["rows"]
        for r in rows:
            if "p99_interval" not in r:
                r["p99_interval"] = p99_interval([t for _, t, _ in r["per_request"]])
        print_table(rows, False)
        return
    binary = os.path.abspath(args.binary)
    if not os.path.exists(binary):
        raise SystemExit(f"{binary} not found: run `cargo build --release` first")
    workdir = tempfile.mkdtemp(prefix="sluice-plan-reality-")
    rows = []
    for name in args.workloads.split(","):
        w = WORKLOADS[name]
        duration = args.duration or w["duration"]
        reqs = generate(w, duration)
        trace = os.path.join(workdir, f"{name}.jsonl")
        plan_path = os.path.join(workdir, f"{name}.toml")
        write_trace(trace, reqs)
        write_plan(plan_path, trace, w, max_servers=12)
        cand = run_plan(binary, plan_path)
        n = cand["smallest"]
        points = {int(k): v for k, v in cand["points"].items()}
        print(f"{name}: {len(reqs)} requests, mean prompt "
              f"{sum(r[2] for r in reqs) / len(reqs):.0f}, mean output "
              f"{sum(r[3] for r in reqs) / len(reqs):.0f} tokens; plan: N = {n}; "
              + ", ".join(f"{k}: p99 {v['ttft_p99'] * 1000:.0f} ms" for k, v in sorted(points.items())),
              file=sys.stderr)
        if n is None or n < 2:
            raise SystemExit(f"{name}: the plan needs N >= 2 to compare N-1, got {n}")
        fleets = [("N", n, n, False), ("N-1", n - 1, n - 1, False), ("N, one down", n, n - 1, True)]
        keys = dict(zip(["N", "N-1", "down"], fleets))
        for label, live, planned, kill in (keys[k] for k in args.fleets.split(",")):
            st = points[planned]
            row = {"workload": name, "fleet": label, "servers": live, "requests": len(reqs),
                   "duration_s": duration,
                   "slo_s": w["slo"], "policy": w["policy"],
                   "plan_p50": st["ttft_p50"], "plan_p99": st["ttft_p99"],
                   "plan_p99_interval": [st["ttft_p99_low"], st["ttft_p99_high"]],
                   "load_before": load_avg()}
            if not args.plan_only:
                row.update(measure(binary, live, w["policy"], reqs, workdir, kill))
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "per_request"}),
                  file=sys.stderr)
    print_table(rows, args.plan_only)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"timing": TIMING, "workloads": WORKLOADS, "rows": rows}, f, indent=1)


def verdict(interval, slo):
    """"meets" when the p99's 95% interval lies at or below the SLO, "misses" when it lies
    above, "not sure" when the SLO is inside it: the planner's rule, for either side."""
    if interval[1] <= slo:
        return "meets"
    return "misses" if interval[0] > slo else "not sure"


def print_table(rows, plan_only):
    ms = lambda s: "inf" if s == float("inf") else f"{s * 1000:.0f}"
    span = lambda i: "{}-{}".format(*map(ms, i))
    print("| workload | fleet | servers | planned p50 / p99 ms | planned p99 95% interval ms | "
          "measured p50 / p99 ms | measured p99 95% interval ms | p99 planned/measured | SLO | "
          "verdict planned / measured | agree | measured point p99 vs SLO |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        planned = verdict(r["plan_p99_interval"], r["slo_s"])
        head = (f"| {r['workload']} | {r['fleet']} | {r['servers']} | {ms(r['plan_p50'])} / "
                f"{ms(r['plan_p99'])} | {span(r['plan_p99_interval'])} |")
        if plan_only:
            print(f"{head} - | - | - | {ms(r['slo_s'])} | {planned} / - | - | - |")
            continue
        ratio = r["plan_p99"] / r["p99"] if r["p99"] not in (0, float("inf")) else float("nan")
        measured = verdict(r["p99_interval"], r["slo_s"])
        agree = "yes" if (planned == "meets") == (measured == "meets") else "**no**"
        point = "below" if r["p99"] <= r["slo_s"] else "above"
        print(f"{head} {ms(r['p50'])} / {ms(r['p99'])} | {span(r['p99_interval'])} | "
              f"{ratio:.2f} | {ms(r['slo_s'])} | {planned} / {measured} | {agree} | {point} |")


if __name__ == "__main__":
    main()
