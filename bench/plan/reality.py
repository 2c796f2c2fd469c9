#!/usr/bin/env python3
"""The planner against reality: for seven workload shapes, `sluice plan` predicts p50/p99 time
to first token (TTFT) for the fleet it recommends (N) and one server fewer (N-1) (optionally N
with one server down); the same requests are then replayed in real time through `sluice serve`
in front of live `sluice sim` fleets of those sizes, and the client-side TTFTs are compared
with the predictions.

What the plan knows of the engine (`--timing`):
- `live` (the default): the plan is made from the live fleet's own exported profile, not from
  the timing the simulators were configured with. Per workload: (1) a plan with the configured
  timing gives a first N; (2) N simulators come up behind `sluice serve` (scraping the engines'
  metrics every second, `[health] signals_interval`), are warmed up as below, and get a
  *profiling* copy of the workload (same generator, another seed, `--profile-duration`
  seconds); (3) the gateway's `GET /admin/profile` is saved and the workload is planned again
  with a measured candidate (`profile = ...`, `backend = [every backend]`): the planner fits
  the engine's step costs to the windows the gateway scraped. That plan's N and N-1 are
  replayed and compared. The fitted costs (± standard errors) are printed against the
  configured timing, ratio per cost, with the plan's warnings.
- `configured`: the plan's candidate is the simulators' own timing (`[candidate.timing]` =
  `sluice sim --max-num-seqs ...`), no profiling; fleets N, N-1 and N with one down.

The workloads: chat, rag (long prompts), agent (shared system preambles, prefix-affinity),
bursty (on/off arrivals: 20 s at a high rate, 20 s at a low one), bimodal (80% of prompts near
200 tokens, 20% near 3,000), longout (answers of ~600 tokens; routed least-request, see
WORKLOADS) and hetero, a fleet of two backend speeds: in its profiling fleet the slower half of
the simulators run the same timing two times slower (prefill and decode costs doubled; the
profiling rate is scaled by the fleet's capacity, so each engine is about as busy as in the
replays), the plan is "more servers like the fast ones" (the fast backends' windows only), and
the replays run fast simulators only. A second candidate merging every backend shows the
warning naming the backends that differ from the merged fit.

The fit table shows, per measured candidate, the costs the plan used (± the fit's standard
errors, from the plan's JSON `fit`), the time ratio (the windows' engine time over what the fit
predicts; above 1, stalled steps, which the planner adds back to the costs), and each backend's
own fit as the gateway exported it (`engine.fit`), all against the configured timing; then the
plan's warnings. (A plan whose JSON has no `fit` gets the backends' standard errors only, and
the differing backends named here by the planner's rule, marked "[reality.py]".)

The same requests on both sides: this script generates each workload (seeded) as a list of
chat requests with exact token counts (the simulator's documented tokenizer and chat template,
replicated below and checked against every response's usage), writes it as a workload trace
(the format the gateway's [trace] records, `max_tokens` included) that the plan reads, and
replays exactly those requests at exactly those arrival offsets. Each request asks for
`max_tokens` with `ignore_eos`, so it generates exactly that many tokens.

Verdicts: both sides are samples of the same traffic, so both are judged by the one rule the
planner decides with. A p99 TTFT "meets" the SLO when the upper end of its 95% interval does,
"misses" when the lower end is above it, and is "not sure" otherwise. A fleet counts as meeting
the SLO only when its verdict is "meets"; plan and reality agree on a row when they both count
it so or both do not. The table also prints the measured point p99 against the SLO, the reading
that ignores the replay's own uncertainty, so that no row is hidden by the rule, and the p50 and
p99 ratios planned/measured (the bar: within ±20%, i.e. 0.80-1.20).

TTFT is measured by the client: from just before the request is sent to the first SSE event
with non-empty content. "One down": N simulators behind the gateway, one of them killed
(SIGKILL) just before the first request; the gateway finds out by itself. Before each replay
(and before profiling) the gateway is brought to what a gateway in service knows (every
engine's batch limit, learned from its metrics) by bursts of other requests; those bursts are
in the profile too, as a live fleet's other traffic would be. Backends are named as the planner
names its engines, and shared preambles carry the gateway's own fingerprint, because
prefix-affinity homes a prefix by a hash of both.

Each workload is replayed for its own duration (`duration` below): long enough that its p99's
95% interval is narrow next to the SLO. Prefix-affinity's tail is the lumpiest, so the agent
workload needs three times the requests of the others for the same width. The load average is
printed before every phase: the comparison is only meaningful on an otherwise quiet machine.

Usage: cargo build --release && python3 bench/plan/reality.py
       [--workloads chat,rag,agent,bursty,bimodal,longout,hetero] [--timing live|configured]
       [--fleets N,N-1[,down]] [--duration SECONDS (all workloads)] [--profile-duration SECONDS]
       [--plan-only] [--binary PATH] [--json OUT] | --table RESULTS
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

# ---- the engine every simulator runs and the configured plan's candidate is -------------------
TIMING = {
    "max_num_seqs": 8,
    "kv_capacity_tokens": 200_000,
    "prefill_us": 100,       # per uncached prompt token
    "decode_base_us": 25_000,
    "decode_per_seq_us": 1_500,
    "block_size": 16,
}
SLOWER = 2.0  # hetero: the slow simulators' costs, times the configured ones
PROFILE_SEED = 1000  # the profiling copy's seed: the workload's own plus this

# The fitted costs as the plan reports them, against the configured ones (seconds).
COSTS = [("prefill_per_token", "prefill_per_token_s", TIMING["prefill_us"] * 1e-6),
         ("decode_base", "decode_base_s", TIMING["decode_base_us"] * 1e-6),
         ("decode_per_seq", "decode_per_seq_s", TIMING["decode_per_seq_us"] * 1e-6)]

# ---- workloads ---------------------------------------------------------------------------------
# rate: requests/s, or burst: (high rate, low rate, seconds of each phase) for on/off arrivals;
# prompt: log-normal (mean, sd, max) tokens of the user message, or prompt_mix: [(share,
# (mean, sd, max))]; output: likewise, the answer (its max is every request's max_tokens cap);
# prefix: (preambles, tokens) every request starts with one of; slo: p99 TTFT bound (s);
# duration: seconds of arrivals per replay; slow_half: profile on a fleet of two speeds.
WORKLOADS = {
    "chat": dict(rate=4.5, prompt=(250, 200, 2000), output=(140, 90, 600), prefix=None,
                 policy="token-aware", slo=1.0, seed=11, duration=300),
    "rag": dict(rate=4.0, prompt=(3000, 1200, 7000), output=(60, 30, 300), prefix=None,
                policy="token-aware", slo=1.5, seed=12, duration=300),
    "agent": dict(rate=3.5, prompt=(200, 150, 1500), output=(90, 60, 400), prefix=(6, 2500),
                  policy="prefix-affinity", slo=1.0, seed=13, duration=900),
    "bursty": dict(burst=(6.0, 1.5, 20.0), prompt=(250, 200, 2000),
                   output=(120, 80, 600), prefix=None, policy="token-aware", slo=1.0, seed=14,
                   duration=150),
    "bimodal": dict(rate=3.0, prompt_mix=[(0.8, (200, 40, 400)), (0.2, (3000, 300, 4000))],
                    output=(120, 80, 600), prefix=None, policy="token-aware", slo=1.0, seed=15,
                    duration=150),
    # least-request: with answers this long, token-aware's expected finishing time is ruled
    # by each backend's believed decode speed, and it queues a few requests for seconds beside
    # idle engines at any fleet size (the planner shows it too: no N meets a 1 s SLO).
    "longout": dict(rate=1.0, prompt=(300, 200, 2000), output=(600, 250, 1500), prefix=None,
                    policy="least-request", slo=1.0, seed=16, duration=150),
    "hetero": dict(rate=3.0, prompt=(250, 200, 2000), output=(140, 90, 600), prefix=None,
                   policy="token-aware", slo=1.0, seed=17, duration=150, slow_half=True),
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


def arrivals(rng, w, duration, scale):
    """Arrival offsets: Poisson at `rate`, or on/off (`burst`: a phase at the high rate, one at
    the low rate, in turn). Piecewise Poisson is exact by memorylessness: a gap that crosses a
    phase boundary is drawn again from the boundary at the next phase's rate. `scale`
    multiplies the rates (the profiling fleet of two speeds)."""
    t = 0.0
    while True:
        if "burst" not in w:
            t += rng.expovariate(w["rate"] * scale)
        else:
            high, low, phase = w["burst"]
            k = int(t // phase)
            gap = rng.expovariate((high if k % 2 == 0 else low) * scale)
            if t + gap >= (k + 1) * phase:
                t = (k + 1) * phase
                continue
            t += gap
        if t >= duration:
            return
        yield t


def prompt_tokens(rng, w):
    """A user message's length: one log-normal, or a mixture of them (`prompt_mix`)."""
    if "prompt_mix" not in w:
        return lognormal(rng, *w["prompt"])
    u = rng.random()
    for share, spec in w["prompt_mix"]:
        if u < share:
            break
        u -= share
    return lognormal(rng, *spec)


def generate(w, duration, scale=1.0):
    """The workload's requests: (offset s, messages, prompt tokens, max_tokens, prefix)."""
    rng = random.Random(w["seed"])
    preambles = []
    if w["prefix"]:
        count, tokens = w["prefix"]
        for j in range(count):
            text = f"agent{j} tools:" + words(rng, tokens)
            shared = count_tokens(f"<|system|>\n{text}\n<|user|>")
            preambles.append((text, shared, gateway_prefix_hash("system", text)))
    out = []
    for i, t in enumerate(arrivals(rng, w, duration, scale)):
        user = f"u{i}" + words(rng, prompt_tokens(rng, w))
        messages, prefix = [{"role": "user", "content": user}], None
        if preambles:
            text, shared, fp = rng.choice(preambles)
            messages.insert(0, {"role": "system", "content": text})
            prefix = (fp, shared)
        out.append((t, messages, count_tokens(render(messages)), lognormal(rng, *w["output"]),
                    prefix))
    return out


def write_trace(path, reqs):
    with open(path, "w") as f:
        for at, _, prompt, out, prefix in reqs:
            line = {"ts": 1_000_000.0 + at, "model": "m", "api": "/v1/chat/completions",
                    "prompt_tokens": prompt, "completion_tokens": out, "max_tokens": out}
            if prefix:
                line["prefix"], line["prefix_tokens"] = f"{prefix[0]:016x}", prefix[1]
            f.write(json.dumps(line) + "\n")


def configured_candidate(name):
    """A candidate whose engine is the simulators' configured timing."""
    t = TIMING
    return f"""[[candidate]]
name = "{name}"
price_per_hour = 1.0
[candidate.timing]
max_num_seqs = {t['max_num_seqs']}
kv_capacity_tokens = {t['kv_capacity_tokens']}
prefill_per_token = "{t['prefill_us']}us"
decode_base = "{t['decode_base_us']}us"
decode_per_seq = "{t['decode_per_seq_us']}us"
block_size = {t['block_size']}
"""


def measured_candidate(name, profile, backends):
    """A candidate measured from a live gateway's profile: the named backends merged."""
    return f"""[[candidate]]
name = "{name}"
price_per_hour = 1.0
profile = "{os.path.basename(profile)}"
backend = {json.dumps(backends)}
"""


def write_plan(path, trace, w, max_servers, candidates):
    """A plan file of the trace (beside it) for the workload's SLO and policy. Only p99 TTFT
    is bounded: TPOT and queue wait get bounds no fleet here comes near."""
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

""" + "\n".join(candidates))


def run_plan(binary, plan_path):
    """`sluice plan --json`: its candidates by name."""
    out = plan_path + ".json"
    done = subprocess.run([binary, "plan", plan_path, "--quiet", "--json", out],
                          stdout=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SystemExit(f"sluice plan {os.path.basename(plan_path)} failed (see above)")
    with open(out) as f:
        doc = json.load(f)
    return {c["name"]: c for c in doc["candidates"]}


# ---- processes ---------------------------------------------------------------------------------
def start_sim(binary, port, slower=1.0):
    """A simulated vLLM of the configured timing, its costs times `slower`."""
    t = TIMING
    cost = lambda us: str(round(us * slower))
    return subprocess.Popen(
        [binary, "sim", "--kind", "vllm", "--port", str(port), "--model", "m",
         "--threads", "1",
         "--max-num-seqs", str(t["max_num_seqs"]),
         "--kv-capacity-tokens", str(t["kv_capacity_tokens"]),
         "--prefill-us-per-token", cost(t["prefill_us"]),
         "--decode-base-us", cost(t["decode_base_us"]),
         "--decode-per-seq-us", cost(t["decode_per_seq_us"]),
         "--block-size", str(t["block_size"]),
         "--max-model-len", "32768"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class Fleet:
    """`n` simulators behind one gateway routing with `policy`; the last `slow` of them run
    SLOWER (named `slow-j`, the others `engine-i`)."""

    def __init__(self, binary, n, policy, workdir, slow=0):
        self.ports = [free_port() for _ in range(n)]
        self.sims = [start_sim(binary, p, SLOWER if i >= n - slow else 1.0)
                     for i, p in enumerate(self.ports)]
        # Named as the planner names its engines: prefix-affinity homes each prefix by a
        # rendezvous hash of the backends' names, so other names are another draw of homes.
        self.names = [f"engine-{i}" if i < n - slow else f"slow-{i - (n - slow)}"
                      for i in range(n)]
        self.fast = self.names[:n - slow]
        for p in self.ports:
            wait_port(p)
        self.port = free_port()
        self.gw = self.start_gateway(binary, policy, workdir)
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

    def start_gateway(self, binary, policy, workdir):
        """`sluice serve` in front of the simulators; it scrapes their metrics every second
        (the engine timing windows of /admin/profile are one scrape interval each)."""
        cfg = (f'[server]\nlisten = "127.0.0.1:{self.port}"\n'
               f'[routing]\npolicy = "{policy}"\nexpose_backend_header = true\n')
        cfg += '[health]\ninterval = "500ms"\ntimeout = "400ms"\nsignals_interval = "1s"\n'
        for name, p in zip(self.names, self.ports):
            cfg += (f'[[backends]]\nname = "{name}"\nkind = "vllm"\n'
                    f'url = "http://127.0.0.1:{p}"\nmodels = ["m"]\n')
        path = os.path.join(workdir, f"gateway-{self.port}.toml")
        with open(path, "w") as f:
            f.write(cfg)
        env = dict(os.environ, SLUICE_LOG="warn")
        gw = subprocess.Popen([binary, "serve", "--config", path], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port)
        return gw

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


def replay(port, reqs, before_start=None, send=None, join_timeout=600):
    """Each request on its own thread at its arrival offset (`send`, default `one`, fills in
    its result); returns the results in order."""
    send = send or one
    results = [None] * len(reqs)
    threads = []
    if before_start:
        before_start()
    t0 = time.monotonic() + 0.2
    for i, req in enumerate(reqs):
        delay = t0 + req[0] - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # the workload's arrival schedule
        th = threading.Thread(target=send, args=(port, req, t0, results, i), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(timeout=join_timeout)
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


def say(text):
    print(text, file=sys.stderr, flush=True)


# ---- the live profile --------------------------------------------------------------------------
def profile_fleet(binary, name, w, n, workdir, seconds):
    """Profile a live fleet of `n` simulators under a profiling copy of the workload (another
    seed) and save the gateway's GET /admin/profile. For a workload of two speeds the slower
    half run SLOWER, and the rates are scaled by the fleet's capacity (in fast engines) over
    `n`, so that every engine is about as busy as in the replays of `n` fast ones."""
    slow = n // 2 if w.get("slow_half") else 0
    scale = (n - slow + slow / SLOWER) / n
    reqs = generate(dict(w, seed=w["seed"] + PROFILE_SEED), seconds, scale)
    load = load_avg()
    say(f"{name} profiling: {n} simulators ({slow} slower), {len(reqs)} requests over "
        f"{seconds:.0f} s; load average {load:.2f}")
    fleet = Fleet(binary, n, w["policy"], workdir, slow=slow)
    try:
        res = replay(fleet.port, reqs)
        time.sleep(2.5)  # one more scrape: the last window of traffic
        doc = get_json(fleet.port, "/admin/profile")
    finally:
        fleet.stop()
    path = os.path.join(workdir, f"{name}-profile.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    failed = sum(1 for r in res if not (r and r["ttft"] is not None))
    return {"path": os.path.basename(path), "servers": n, "requests": len(reqs), "failed": failed,
            "rate_scale": scale, "load_before": load, "fast": fleet.fast,
            "slow": fleet.names[len(fleet.fast):], "doc": doc}


def fit_summary(cand, profile, backends):
    """What the plan fitted for a measured candidate: the costs it planned with (its engine in
    the JSON) against the configured ones. Standard errors and warnings come from the plan's
    fit summary when its JSON carries one (`fit`); otherwise each backend's own fit as the
    gateway exported it (`engine.fit`) stands in for the uncertainty, and that is noted."""
    fit = cand.get("fit")
    params = {}
    for name, key, configured in COSTS:
        se = next((p["stderr"] for p in fit["params"] if p["name"] == name), None) if fit else None
        value = cand["engine"][key]
        params[name] = {"value": value, "stderr": se, "configured": configured,
                        "ratio": value / configured}
    return {"backends": backends, "params": params,
            "slots": cand["engine"]["max_num_seqs"],
            "kv_capacity_tokens": cand["engine"]["kv_capacity_tokens"],
            "windows": fit.get("samples") if fit else None,
            "time_ratio": fit.get("time_ratio") if fit else None,
            "warnings": fit.get("warnings", []) if fit else [],
            "source": "plan" if fit else
            "the plan's engine; standard errors from each backend's own fit (engine.fit): "
            "the plan JSON carries no fit summary",
            "per_backend": backend_fits(profile, backends)}


def backend_fits(profile, backends):
    """Each named backend's own fit as the gateway exported it, with ratios to the configured
    costs (a slower simulator's are SLOWER times them)."""
    out = {}
    for b in profile["backends"]:
        fit = (b.get("engine") or {}).get("fit")
        if b["name"] not in backends:
            continue
        if not fit:
            out[b["name"]] = {"error": (b.get("engine") or {}).get("fit_error", "no engine timing")}
            continue
        out[b["name"]] = {"windows": fit["windows"], "batch_range": fit["batch_range"],
                          "prompt_range": fit["prompt_range"],
                          "time_ratio": fit.get("time_ratio"),
                          **{name: dict(fit[name], ratio=fit[name]["value"] / configured)
                             for name, _, configured in COSTS}}
    return out


def differing(summary):
    """The planner's rule for naming a merged backend (its own cost more than 15% and more
    than twice the standard errors from the merged fit's), applied here to the per-backend
    fits when the plan JSON has no warnings to show; the merged fit's own standard error is
    not known here, so only the backend's counts."""
    out = []
    for name, own in summary["per_backend"].items():
        for cost, merged in summary["params"].items():
            if cost not in own or merged["value"] <= 0:
                continue
            gap = abs(own[cost]["value"] - merged["value"])
            if gap > 0.15 * merged["value"] and gap > 2 * own[cost]["stderr"]:
                out.append(f"`{name}` differs from the merged fit: {cost} "
                           f"{own[cost]['value'] * 1e3:.3f} ms where the merged fit has "
                           f"{merged['value'] * 1e3:.3f} ms "
                           f"({own[cost]['value'] / merged['value']:.2f}x) [reality.py]")
    return out


def plan_live(binary, name, w, trace, prof, workdir):
    """Plan the workload from the profile: "more servers like" the fast backends (all of them
    when the fleet had one speed); with two speeds, also every backend merged, for the
    planner's warning about the ones that differ."""
    cands = [measured_candidate("live", prof["path"], prof["fast"])]
    if prof["slow"]:
        cands.append(measured_candidate("live-all", prof["path"], prof["fast"] + prof["slow"]))
    plan_path = os.path.join(workdir, f"{name}-live.toml")
    write_plan(plan_path, trace, w, 12, cands)
    plans = run_plan(binary, plan_path)
    fits = {"live": fit_summary(plans["live"], prof["doc"], prof["fast"])}
    if prof["slow"]:
        merged = fit_summary(plans["live-all"], prof["doc"], prof["fast"] + prof["slow"])
        if not plans["live-all"].get("fit"):
            merged["warnings"] = differing(merged)
        fits["live-all"] = merged
    return plans["live"], fits


# ---- one workload ------------------------------------------------------------------------------
def workload_rows(args, binary, name, workdir):
    """Plan one workload (from the configured timing, then from the live profile when
    `--timing live`) and replay its fleets: the table's rows and the profile's record."""
    w = WORKLOADS[name]
    duration = args.duration or w["duration"]
    reqs = generate(w, duration)
    trace = os.path.join(workdir, f"{name}.jsonl")
    write_trace(trace, reqs)
    plan_path = os.path.join(workdir, f"{name}.toml")
    write_plan(plan_path, trace, w, 12, [configured_candidate("sim")])
    cand = run_plan(binary, plan_path)["sim"]
    say(f"{name}: {len(reqs)} requests, mean prompt {sum(r[2] for r in reqs) / len(reqs):.0f}, "
        f"mean output {sum(r[3] for r in reqs) / len(reqs):.0f} tokens; configured plan: "
        + describe(cand))
    record = {"configured_n": cand["smallest"]}
    if not 2 <= (cand["smallest"] or 0):
        return [], skip(record, name, f"the configured plan needs N >= 2, got {cand['smallest']}")
    if args.timing == "live":
        prof = profile_fleet(binary, name, w, cand["smallest"], workdir, args.profile_duration)
        cand, fits = plan_live(binary, name, w, trace, prof, workdir)
        record.update({k: v for k, v in prof.items() if k != "doc"}, fits=fits,
                      live_n=cand["smallest"], profile=prof["doc"])
        say(f"{name}: live plan: " + describe(cand))
        if not 2 <= (cand["smallest"] or 0):
            return [], skip(record, name, f"the live plan needs N >= 2, got {cand['smallest']}")
    return replay_rows(args, binary, name, w, reqs, duration, cand), record


def skip(record, name, why):
    """A workload whose plan leaves no N and N-1 to replay: said, recorded, and the run goes
    on with the next one (a long run should not end on one workload's plan)."""
    say(f"{name}: {why}: no replays")
    record["skipped"] = why
    return record


def describe(cand):
    """The plan's N and every count it evaluated: p99 TTFT and its 95% interval."""
    points = {int(k): v for k, v in cand["points"].items()}
    return f"N = {cand['smallest']}; " + ", ".join(
        f"{k}: p99 {ms(v['ttft_p99'])} ms ({ms(v['ttft_p99_low'])}-{ms(v['ttft_p99_high'])})"
        for k, v in sorted(points.items()))


def replay_rows(args, binary, name, w, reqs, duration, cand):
    """The chosen fleets of the plan `cand`, replayed (or only listed with --plan-only)."""
    n = cand["smallest"]
    points = {int(k): v for k, v in cand["points"].items()}
    fleets = {"N": ("N", n, n, False), "N-1": ("N-1", n - 1, n - 1, False),
              "down": ("N, one down", n, n - 1, True)}
    rows = []
    for label, live, planned, kill in (fleets[k] for k in args.fleets.split(",")):
        st = points[planned]
        row = {"workload": name, "fleet": label, "servers": live, "requests": len(reqs),
               "duration_s": duration, "timing": args.timing,
               "slo_s": w["slo"], "policy": w["policy"],
               "plan_p50": st["ttft_p50"], "plan_p99": st["ttft_p99"],
               "plan_p99_interval": [st["ttft_p99_low"], st["ttft_p99_high"]],
               "load_before": load_avg()}
        if not args.plan_only:
            say(f"{name} {label}: {live} simulators; load average {row['load_before']:.2f}")
            row.update(measure(binary, live, w["policy"], reqs, args.workdir, kill))
        rows.append(row)
        say(json.dumps({k: v for k, v in row.items() if k != "per_request"}))
    return rows


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--binary", default=os.path.join(here, "..", "..", "target", "release", "sluice"))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--timing", choices=["live", "configured"], default="live",
                    help="plan from the live fleet's exported profile (default) or from the "
                         "simulators' configured timing")
    ap.add_argument("--duration", type=float,
                    help="seconds of arrivals per replay, for every workload (default: its own)")
    ap.add_argument("--profile-duration", type=float, default=90.0,
                    help="seconds of arrivals of the profiling copy (--timing live)")
    ap.add_argument("--fleets", help="which fleets to replay, of N, N-1, down "
                                     "(default: N,N-1 with --timing live, else N,N-1,down)")
    ap.add_argument("--plan-only", action="store_true",
                    help="plan, do not replay (--timing live still profiles a live fleet)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--table", metavar="RESULTS",
                    help="print the tables of a results file, run nothing")
    args = ap.parse_args()
    if args.table:
        return print_results(args.table)
    args.fleets = args.fleets or ("N,N-1" if args.timing == "live" else "N,N-1,down")
    binary = os.path.abspath(args.binary)
    if not os.path.exists(binary):
        raise SystemExit(f"{binary} not found: run `cargo build --release` first")
    args.workdir = tempfile.mkdtemp(prefix="sluice-plan-reality-")
    rows, profiles = [], {}
    for name in args.workloads.split(","):
        got, profiles[name] = workload_rows(args, binary, name, args.workdir)
        rows += got
        save(args, rows, profiles)  # after every workload: a long run keeps what it did
    print_table(rows, args.plan_only)
    print_skipped(profiles)
    if args.timing == "live":
        print()
        print_fits(profiles)


def save(args, rows, profiles):
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"timing": TIMING, "slower": SLOWER, "mode": args.timing,
                       "workloads": WORKLOADS, "profiles": profiles, "rows": rows}, f, indent=1)


def print_skipped(profiles):
    for name, rec in profiles.items():
        if rec.get("skipped"):
            print(f"\n{name}: not replayed: {rec['skipped']}")


def print_results(path):
    """The tables of a results file (older files: intervals recomputed, no fit table)."""
    with open(path) as f:
        doc = json.load(f)
    rows = doc["rows"]
    for r in rows:
        if "p99_interval" not in r:
            r["p99_interval"] = p99_interval([t for _, t, _ in r["per_request"]])
        if "p50" not in r:
            r["p50"] = pct([t for _, t, _ in r["per_request"]], 50)
    print_table(rows, False)
    print_skipped(doc.get("profiles", {}))
    if doc.get("profiles") and doc.get("mode") == "live":
        print()
        print_fits(doc["profiles"])


def verdict(interval, slo):
    """"meets" when the p99's 95% interval lies at or below the SLO, "misses" when it lies
    above, "not sure" when the SLO is inside it: the planner's rule, for either side."""
    if interval[1] <= slo:
        return "meets"
    return "misses" if interval[0] > slo else "not sure"


def ms(s):
    return "inf" if s == float("inf") else f"{s * 1000:.0f}"


def ratio(planned, measured):
    return f"{planned / measured:.2f}" if measured not in (0, float("inf")) else "-"


def print_table(rows, plan_only):
    span = lambda i: "{}-{}".format(*map(ms, i))
    print("| workload | fleet | servers | planned p50 / p99 ms | planned p99 95% interval ms | "
          "measured p50 / p99 ms | measured p99 95% interval ms | p50 planned/measured | "
          "p99 planned/measured | SLO | verdict planned / measured | agree | "
          "measured point p99 vs SLO |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        planned = verdict(r["plan_p99_interval"], r["slo_s"])
        head = (f"| {r['workload']} | {r['fleet']} | {r['servers']} | {ms(r['plan_p50'])} / "
                f"{ms(r['plan_p99'])} | {span(r['plan_p99_interval'])} |")
        if plan_only:
            print(f"{head} - | - | - | - | {ms(r['slo_s'])} | {planned} / - | - | - |")
            continue
        measured = verdict(r["p99_interval"], r["slo_s"])
        agree = "yes" if (planned == "meets") == (measured == "meets") else "**no**"
        point = "below" if r["p99"] <= r["slo_s"] else "above"
        print(f"{head} {ms(r['p50'])} / {ms(r['p99'])} | {span(r['p99_interval'])} | "
              f"{ratio(r['plan_p50'], r['p50'])} | {ratio(r['plan_p99'], r['p99'])} | "
              f"{ms(r['slo_s'])} | {planned} / {measured} | {agree} | {point} |")


def print_fits(profiles):
    """The costs each live plan fitted, against the configured timing (ratio fitted /
    configured; a slower simulator's are SLOWER times the configured), then the plan's
    warnings."""
    print("| workload | fit | backends | windows | prefill_per_token us | decode_base ms | "
          "decode_per_seq ms | time ratio | slots / KV tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    notes = []
    for name, rec in profiles.items():
        for label, fit in (rec.get("fits") or {}).items():
            costs = [cost_cell(p["value"], p["stderr"], p["ratio"], scale)
                     for (_, p), scale in zip(fit["params"].items(), (1e6, 1e3, 1e3))]
            print(f"| {name} | plan `{label}` | {len(fit['backends'])} | {fit['windows'] or '-'} | "
                  + " | ".join(costs) + f" | {times(fit.get('time_ratio'))} | "
                  f"{fit['slots']} / {fit['kv_capacity_tokens']} |")
            notes += [f"- {name} `{label}`: {w}" for w in fit["warnings"]]
        for b, own in (rec.get("fits", {}).get("live-all") or rec.get("fits", {}).get("live")
                       or {}).get("per_backend", {}).items():
            if "error" in own:
                print(f"| {name} | backend | {b} | - | {own['error']} | | | | |")
                continue
            costs = [cost_cell(own[c]["value"], own[c]["stderr"], own[c]["ratio"], scale)
                     for (c, _, _), scale in zip(COSTS, (1e6, 1e3, 1e3))]
            print(f"| {name} | backend | {b} | {own['windows']} | " + " | ".join(costs)
                  + f" | {times(own.get('time_ratio'))} | |")
        if rec.get("fits"):
            notes.append(f"- {name}: profiled on {rec['servers']} simulators "
                         f"({len(rec['slow'])} slower), {rec['requests']} requests "
                         f"({rec['failed']} failed), load average before {rec['load_before']:.2f}")
        if rec.get("fits") and not any(f["source"] == "plan" for f in rec["fits"].values()):
            notes.append(f"- {name}: {rec['fits']['live']['source']}")
    if notes:
        print()
        print("\n".join(notes))


def times(ratio):
    return "-" if ratio is None else f"{ratio:.2f}"


def cost_cell(value, stderr, r, scale):
    se = f" ± {stderr * scale:.3g}" if stderr is not None else ""
    return f"{value * scale:.4g}{se} ({r:.2f}x)"


if __name__ == "__main__":
    main()
