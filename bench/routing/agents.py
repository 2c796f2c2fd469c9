#!/usr/bin/env python3
"""Coding-agent routing benchmark: Sluice's cache-exact routing against its own older policies
and against two peers' cache-aware routers, on the same simulated fleet and the same seeded
workload, in one run.

Fleet (a fresh one per configuration; all `sluice sim --kind vllm`, same seed, so a prompt gets
the same answer on every engine and in every configuration):
  fast-0..5  32 sequences, prefill 50 us/token, decode step 10 ms + 0.1 ms/seq, KV 120k tokens
  slow-0..1  16 sequences, prefill 150 us/token, decode step 20 ms + 0.3 ms/seq, KV 60k tokens
Every engine tokenizes with tests/fixtures/tokenizer/tiny-tools (as vLLM would with the model's
tokenizer), keeps a prefix cache of its KV capacity in blocks of 16 tokens, reports
`usage.prompt_tokens_details.cached_tokens` and publishes its KV-cache events over ZMQ (free
ports). One backend's cache holds a few agents' histories, not all of them: the point is
sending each turn to where its history is cached.

Workload (seeded; identical for every configuration):
  --sessions agent sessions (default 60) start as a Poisson process over --spread seconds; each
  has 10-30 turns (the few long-context ones 6-12). Every turn resends the whole history: one of
  4 system prompts (~1.5-2k tokens; groups of sessions share one), the task, then per turn
  the tool output or code the agent read (100-600 tokens) and the engine's previous answers,
  verbatim. --long sessions start with a large context (12-24k tokens: files read in). Sizes
  are in the engines' tokens (the fixture tokenizer's). Between turns the agent "reads" the answer: a think time of
  200-800 ms. Each turn is a streamed chat completion (max_tokens 128-512) with
  stream_options.include_usage; TTFT is measured client-side (first content delta).
  Simulated time runs --speed times faster (think times, spread and engine timing alike).

Configurations (each on a fresh fleet, in this order):
  sluice-exact        Sluice token-aware with `[[models]] tokenizer`: each backend scored on the
                      prompt tokens its KV events say it has not cached (the new routing)
  sluice-token-aware  Sluice token-aware without a tokenizer (the previous behaviour: estimates)
  sluice-prefix-aff   Sluice prefix-affinity (weighted rendezvous hash of the history)
  vllm-router         vllm-router (PyPI `vllm-router`) --policy cache_aware
  smg                 SGLang's Shepherd Model Gateway (PyPI `smg`) `smg launch --policy
                      cache_aware`
  sluice-2-replicas   two Sluice gateways (sluice-exact's config) in front of one fleet: the
                      replica agreement measurement, below
The peers are installed at run time with pip into a venv under the run's temporary folder
(`--peers-venv` reuses one); a peer that cannot be installed or started is reported with the
reason and the others run.

Metrics per configuration, over the measured requests (those sent after --warmup seconds):
  hit ratio       engine-reported: sum cached_tokens / sum prompt_tokens from each answer's usage
                  (and the sims' own counters over the whole run, as a cross-check)
  TTFT            p50 / p99, client-side; end-to-end p50 / p99
  throughput      answered requests per second over the measured span, and prompt tokens/s
  share           per backend (from each sim's finished-request counter, whole run)
  exact           Sluice with a tokenizer: share of answers whose `x-sluice-cached-prefix` (what
                  routing expected cached on the chosen backend) equals the engine's
                  `cached_tokens`
  stayed          Sluice: share of turns (after the first) sent where the session's previous turn
                  went
  ceiling         what the workload allows: every turn after the first finds its whole previous
                  prompt cached (in whole blocks), the first turn nothing

Replica agreement ("two replicas fed the same request stream choose the same backend"). Sluice
has no dry-run endpoint, and the two designs that avoid one measure something else: sending
the stream to two replicas in front of two identical fleets compares two whole systems whose
timing differs (one different choice changes where that session's history is cached, and every
later choice of that session follows it: divergence compounds and says nothing about whether the
replicas see the same state); sending every request to both replicas in front of one fleet
doubles the load and puts each prefix on two engines. So: two replicas A and B, same config, in
front of the same fleet, as two gateway replicas behind a load balancer with session affinity:
even sessions go through A, odd ones through B (each replica carries half of the traffic and
sees only its own requests in flight, as in production). For every request sent to its replica,
the identical body with one extra field, `"ignore_eos": "probe"` (not a field Sluice reads; the
engine rejects its type with a 400 before scheduling anything), is sent to the other replica at
the same moment; that replica routes it exactly as it would route the request (same prompt ids,
same max_tokens, same model, same KV index and engine signals) and names its choice in
`x-sluice-backend`. Agreement is the share of requests whose real and probed choices are the
same backend. The probe costs the engines a parse and a 400, and the probing replica holds it in
flight for about a millisecond; it reports no usage, so it teaches that replica nothing.

Usage:
  python3 bench/routing/agents.py                       # full run (~15-20 minutes)
  python3 bench/routing/agents.py --smoke               # under a minute: checks the harness
  python3 bench/routing/agents.py --configs sluice-exact,vllm-router
  python3 bench/routing/agents.py --binary PATH --peers-venv DIR
Results: bench/results/agents.json (agents-smoke.json for --smoke); per-request records in the
run's temporary folder (printed).
"""

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench import ROOT, Procs, free_port, get_json, pct, shown_path, wait_http  # noqa: E402
from bench import fmt_or_dash as fmt  # noqa: E402

TOKENIZER = os.path.join(ROOT, "tests", "fixtures", "tokenizer", "tiny-tools")
MODEL = "m"
BLOCK = 16
CONFIGS = ["sluice-exact", "sluice-token-aware", "sluice-prefix-aff", "vllm-router", "smg",
           "sluice-2-replicas"]
PEERS = {"vllm-router": "vllm-router", "smg": "smg"}  # configuration -> PyPI package

COMMON = ["--seed", "7", "--min-output-tokens", "16", "--max-output-tokens", "400",
          "--max-model-len", "65536", "--block-size", str(BLOCK),
          "--enable-prompt-tokens-details"]
FAST = ["--max-num-seqs", "32", "--prefill-us-per-token", "50", "--decode-base-us", "10000",
        "--decode-per-seq-us", "100", "--kv-capacity-tokens", "120000"]
SLOW = ["--max-num-seqs", "16", "--prefill-us-per-token", "150", "--decode-base-us", "20000",
        "--decode-per-seq-us", "300", "--kv-capacity-tokens", "60000"]
FLEET = [(f"fast-{i}", FAST) for i in range(6)] + [(f"slow-{i}", SLOW) for i in range(2)]

WORDS = ("the of and to in is for on that with as by at from be this which or are have not "
         "but one all they there been has more if will would about into than them can only "
         "other new some what time could these two may then first any like now such make over "
         "even most after also made many did must before back through where much way down "
         "should because each just those how too little good very still own see work long here "
         "between both being under never same another know while last might great old").split()
IDENTS = ("request backend config tokens cache index score stream client handler queue buffer "
          "session result error value state engine router prefix block batch worker limit "
          "budget span header body answer prompt model usage metric guard pool slot").split()


# Bytes per token of the fixture's tokenizer (a byte-level BPE of 4096 tokens), measured on
# this generator's text: the sizes below are in the engines' own tokens.
PROSE_BYTES, CODE_BYTES = 4.0, 1.7


def prose(rng, tokens):
    """About `tokens` tokens of plain text."""
    out, size = [], 0
    while size < tokens * PROSE_BYTES:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def code(rng, tokens):
    """About `tokens` tokens of what an agent reads: source, diffs, test logs."""
    lines, size = [], 0
    while size < tokens * CODE_BYTES:
        a, b, c = rng.choice(IDENTS), rng.choice(IDENTS), rng.choice(IDENTS)
        n = rng.randint(0, 999)
        kind = rng.random()
        if kind < 0.35:
            line = f"    let {a}_{n} = {b}.{c}(&{a}, {rng.randint(1, 64)})?;"
        elif kind < 0.5:
            line = f"fn {a}_{b}(&self, {c}: u{rng.choice([8, 16, 32, 64])}) -> Result<{b.title()}> {{"
        elif kind < 0.7:
            line = (f"2026-12-07T10:{rng.randint(0, 59):02}:{rng.randint(0, 59):02}Z "
                    f"{rng.choice(['INFO', 'WARN', 'DEBUG'])} {a}::{b}: {prose(rng, 8)}")
        elif kind < 0.8:
            line = f"test {a}::{b}_{c}_{n} ... {rng.choice(['ok', 'ok', 'ok', 'FAILED'])}"
        elif kind < 0.9:
            line = f"+        if {a}.{b} > {n} {{ return Err(Error::{c.title()}); }}"
        else:
            line = f"    // {prose(rng, 10)}"
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)


def system_prompt(i):
    rng = random.Random(1000 + i)
    tools = "\n".join(
        f"- {rng.choice(IDENTS)}_{rng.choice(IDENTS)}(path, {rng.choice(IDENTS)}): "
        + prose(rng, 40) for _ in range(12))
    return (f"You are coding agent #{i}. You work in a large Rust repository through tools.\n"
            f"Tools:\n{tools}\nRules: " + prose(rng, rng.randint(700, 1500)))


def workload(seed, n_sessions, n_long, spread):
    """The sessions: start time (simulated seconds), system prompt, turns (user message,
    max_tokens, think time after the answer). The same for every configuration."""
    rng = random.Random(seed)
    long_ids = set(rng.sample(range(n_sessions), min(n_long, n_sessions)))
    at = 0.0
    rate = n_sessions / spread
    sessions = []
    for s in range(n_sessions):
        srng = random.Random(seed * 100003 + s)
        system = srng.choices(range(4), weights=[4, 3, 2, 1])[0]
        is_long = s in long_ids
        n_turns = srng.randint(6, 12) if is_long else srng.randint(10, 30)
        task = f"[session {s}] Task: " + prose(srng, srng.randint(60, 200))
        if is_long:
            task += "\nFiles read so far:\n" + code(srng, srng.randint(12000, 24000))
        turns = []
        for t in range(n_turns):
            user = task if t == 0 else f"Tool output (step {t}):\n" + code(srng, srng.randint(100, 600))
            turns.append((user, srng.randint(128, 512), srng.uniform(0.2, 0.8)))
        sessions.append({"id": s, "start": at, "system": system, "long": is_long, "turns": turns})
        at += rng.expovariate(rate)
    return sessions


# ---------------------------------------------------------------------------------------------
# HTTP: one streamed chat completion, read to its end

async def read_body(r, headers, deadline):
    """Yield the body's bytes (chunked or not) until it ends."""
    chunked = headers.get("transfer-encoding", "").lower() == "chunked"
    length = headers.get("content-length")

    async def rd(coro):
        return await asyncio.wait_for(coro, max(0.05, deadline - time.perf_counter()))
    if chunked:
        while True:
            line = await rd(r.readuntil(b"\r\n"))
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await rd(r.readuntil(b"\r\n"))
                return
            data = await rd(r.readexactly(size))
            await rd(r.readexactly(2))
            yield data
    elif length is not None:
        left = int(length)
        while left > 0:
            data = await rd(r.read(min(left, 65536)))
            if not data:
                return
            left -= len(data)
            yield data
    else:
        while True:
            data = await rd(r.read(65536))
            if not data:
                return
            yield data


async def chat(port, body, timeout):
    """POST a streamed chat; returns a dict: status, headers, ttft, e2e, text, usage, error."""
    start = time.perf_counter()
    deadline = start + timeout
    out = {"status": None, "headers": {}, "ttft": None, "e2e": None, "text": "", "usage": None,
           "error": None}
    w = None
    try:
        r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
        w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n"
                b"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                b"Connection: close\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await w.drain()
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), timeout)
        lines = head.decode("latin-1").split("\r\n")
        out["status"] = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        out["headers"] = headers
        buf = b""
        parts = []
        raw = []
        async for data in read_body(r, headers, deadline):
            if out["status"] != 200:
                raw.append(data)
                continue
            buf += data
            while True:
                i = buf.find(b"\n\n")
                if i < 0:
                    break
                event, buf = buf[:i], buf[i + 2:]
                for line in event.split(b"\n"):
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        continue
                    try:
                        chunk = json.loads(payload)
                    except ValueError:
                        continue
                    for c in chunk.get("choices") or []:
                        piece = (c.get("delta") or {}).get("content")
                        if piece:
                            if out["ttft"] is None:
                                out["ttft"] = time.perf_counter() - start
                            parts.append(piece)
                    if chunk.get("usage"):
                        out["usage"] = chunk["usage"]
        out["text"] = "".join(parts)
        if out["status"] != 200:
            out["error"] = f"status {out['status']}: {b''.join(raw)[:200].decode('latin-1')}"
        elif out["ttft"] is None:
            out["error"] = "no content"
    except Exception as e:  # noqa: BLE001 - any failure is the request's outcome
        out["error"] = f"{type(e).__name__}: {e}"[:200]
    finally:
        if w is not None:
            w.close()
    out["e2e"] = time.perf_counter() - start
    return out


# ---------------------------------------------------------------------------------------------
# Processes: the fleet, the gateways

class LoggedProcs(Procs):
    """bench.py's Procs, with each process's output kept in a log file."""

    def start_logged(self, args, log, env=None):
        f = open(log, "ab")
        p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env)
        f.close()
        self.procs.append(p)
        return p


def start_sim(procs, binary, speed, tmp, name, extra):
    """One engine on free ports; started again on new ports (up to 3 times) when it exits at
    start-up (a port taken between choosing it and binding it)."""
    for attempt in range(3):
        port, zmq, replay = free_port(), free_port(), free_port()
        kv = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": f"tcp://*:{zmq}", "replay_endpoint": f"tcp://*:{replay}",
                         "topic": "kv"})
        p = procs.start_logged([binary, "sim", "--kind", "vllm", "--port", str(port),
                                "--model", MODEL, "--speed", str(speed), "--tokenizer", TOKENIZER,
                                "--kv-events-config", kv, *COMMON, *extra],
                               os.path.join(tmp, f"sim-{name}.log"))
        deadline = time.time() + 30
        while time.time() < deadline and p.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return port
            except Exception:
                time.sleep(0.05)
        if p.poll() is None:
            break
    raise RuntimeError(f"sim {name} did not start (see sim-{name}.log)")


def start_fleet(procs, binary, speed, tmp):
    return {name: start_sim(procs, binary, speed, tmp, name, extra) for name, extra in FLEET}


def sluice_config(policy, tokenizer, sims, gw, admin, signals_interval=None):
    cfg = [f'[server]\nlisten = "127.0.0.1:{gw}"\n',
           f'[admin]\nlisten = "127.0.0.1:{admin}"\n',
           f'[routing]\npolicy = "{policy}"\nexpose_backend_header = true\n',
           '[timeouts]\nidle = "600s"\nfirst_byte = "600s"\nresponse = "600s"\n',
           '[queue]\nsize = 100000\ntimeout = "600s"\n']
    if signals_interval:
        cfg.append(f'[health]\nsignals_interval = "{signals_interval}"\n')
    if tokenizer:
        cfg.append(f'[[models]]\nname = "{MODEL}"\ntokenizer = "{TOKENIZER}"\n')
    for name, port in sims.items():
        cfg.append(f'[[backends]]\nname = "{name}"\nkind = "vllm"\n'
                   f'url = "http://127.0.0.1:{port}"\nmodels = ["{MODEL}"]\n')
    return "\n".join(cfg)


def start_sluice(procs, binary, policy, tokenizer, sims, tmp, tag, signals_interval=None):
    gw, admin = free_port(), free_port()
    path = os.path.join(tmp, f"{tag}.toml")
    with open(path, "w") as f:
        f.write(sluice_config(policy, tokenizer, sims, gw, admin, signals_interval))
    procs.start_logged([binary, "serve", "--config", path], os.path.join(tmp, f"{tag}.log"))
    wait_http(f"http://127.0.0.1:{gw}/readyz")
    # every backend's KV index live before traffic (the same start for every Sluice config)
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            v = get_json(f"http://127.0.0.1:{admin}/admin/backends")
            if all((b.get("kv_cache") or {}).get("status") == "warm" for b in v["backends"]):
                break
        except Exception:
            pass
        time.sleep(0.1)
    return gw, admin


def install_peers(venv, log):
    """pip install the peers into `venv`; returns {config: executable or error string}."""
    out = {}
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        r = subprocess.run([sys.executable, "-m", "venv", venv], capture_output=True, text=True)
        if r.returncode:
            return {c: f"venv failed: {r.stderr.strip()[-300:]}" for c in PEERS}
    for config, package in PEERS.items():
        exe = os.path.join(venv, "bin", package)
        if not os.path.exists(exe):
            with open(log, "ab") as f:
                r = subprocess.run([py, "-m", "pip", "install", "-q", package],
                                   stdout=f, stderr=subprocess.STDOUT, timeout=900)
            if r.returncode or not os.path.exists(exe):
                with open(log, "rb") as f:
                    tail = f.read()[-400:].decode("utf-8", "replace")
                out[config] = f"pip install {package} failed: {tail.strip()}"
                continue
        ver = subprocess.run([py, "-m", "pip", "show", package], capture_output=True, text=True)
        version = next((ln.split(":", 1)[1].strip() for ln in ver.stdout.splitlines()
                        if ln.startswith("Version:")), "?")
        out[config] = (exe, version)
    return out


def wait_router(port, procs_entry, timeout=60):
    """A peer is ready when it answers a one-token chat (the same probe for every config)."""
    body = json.dumps({"model": MODEL, "max_tokens": 1,
                       "messages": [{"role": "user", "content": "ready?"}]}).encode()
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        if procs_entry.poll() is not None:
            raise RuntimeError(f"exited with status {procs_entry.returncode}")
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                         data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return
        except Exception as e:  # noqa: BLE001
            last = e
        time.sleep(0.25)
    raise RuntimeError(f"not ready after {timeout} s: {last}")


def start_peer(procs, config, exe, sims, tmp):
    port, prom = free_port(), free_port()
    workers = [f"http://127.0.0.1:{p}" for p in sims.values()]
    if config == "vllm-router":
        args = [exe, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
                "--policy", "cache_aware", "--prometheus-port", str(prom),
                "--worker-startup-check-interval", "1", "--log-level", "warning"]
    else:
        args = [exe, "launch", "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *workers, "--policy", "cache_aware",
                "--prometheus-port", str(prom), "--prometheus-host", "127.0.0.1",
                "--worker-startup-check-interval", "1", "--log-level", "warn"]
    log = os.path.join(tmp, f"{config}.log")
    with open(log, "ab") as f:
        f.write((" ".join(os.path.basename(a) if a == exe else a for a in args) + "\n").encode())
    p = procs.start_logged(args, log)
    try:
        wait_router(port, p)
    except RuntimeError as e:
        with open(log, "rb") as f:
            tail = f.read()[-600:].decode("utf-8", "replace")
        raise RuntimeError(f"{config} {e}; log tail: {tail.strip()}") from None
    return port


# ---------------------------------------------------------------------------------------------
# Driving the sessions

async def run_sessions(sessions, routes, args, probe_routes=None):
    """Run every session against `routes` (session -> gateway port); with `probe_routes`, also
    send each request's probe to the other replica. Returns the per-request records."""
    records = []
    speed = args.speed
    t0 = time.perf_counter()
    stop_at = t0 + args.max_wall

    async def session(s):
        await asyncio.sleep(max(0.0, s["start"] / speed - (time.perf_counter() - t0)))
        port = routes(s["id"])
        msgs = [{"role": "system", "content": system_prompt(s["system"])}]
        prev_backend = None
        for t, (user, max_tokens, think) in enumerate(s["turns"]):
            if time.perf_counter() > stop_at:
                break
            msgs.append({"role": "user", "content": user})
            req = {"model": MODEL, "stream": True, "max_tokens": max_tokens,
                   "stream_options": {"include_usage": True}, "messages": msgs}
            body = json.dumps(req).encode()
            sent = time.perf_counter() - t0
            probe = None
            if probe_routes:
                pbody = json.dumps(dict(req, ignore_eos="probe")).encode()
                probe = asyncio.ensure_future(chat(probe_routes(s["id"]), pbody, 30))
            res = await chat(port, body, args.timeout)
            usage = res["usage"] or {}
            details = usage.get("prompt_tokens_details") or {}
            rec = {"session": s["id"], "turn": t, "long": s["long"], "sent": sent,
                   "ok": res["error"] is None, "error": res["error"], "ttft": res["ttft"],
                   "e2e": res["e2e"], "prompt_tokens": usage.get("prompt_tokens"),
                   "cached_tokens": details.get("cached_tokens", 0) if usage else None,
                   "completion_tokens": usage.get("completion_tokens"),
                   "backend": res["headers"].get("x-sluice-backend"),
                   "predicted": res["headers"].get("x-sluice-cached-prefix"),
                   "prev_backend": prev_backend, "answer_len": len(res["text"])}
            if probe is not None:
                p = await probe
                rec["probe_backend"] = p["headers"].get("x-sluice-backend")
                rec["probe_status"] = p["status"]
            records.append(rec)
            if res["error"] is not None:
                break  # the history cannot go on the same way in every configuration
            prev_backend = rec["backend"]
            msgs.append({"role": "assistant", "content": res["text"]})
            await asyncio.sleep(think / speed)

    await asyncio.gather(*(session(s) for s in sessions))
    return records, time.perf_counter() - t0


def sim_state(sims):
    per = {}
    for name, port in sims.items():
        try:
            st = get_json(f"http://127.0.0.1:{port}/sim/state")
        except Exception:
            continue
        m = st.get("models", [{}])[0]
        per[name] = {"hits": m.get("prefix_cache_hits", 0),
                     "queries": m.get("prefix_cache_queries", 0),
                     "finished": m.get("requests_finished", 0),
                     "aborted": m.get("requests_aborted", 0),
                     "by_status": (st.get("counters") or {}).get("by_status")}
    return per


def summarize(config, records, wall, per_sim, args, extra=None):
    measured = [r for r in records if r["sent"] >= args.warmup / args.speed]
    ok = [r for r in measured if r["ok"]]
    rep = [r for r in ok if r["prompt_tokens"]]
    prompt = sum(r["prompt_tokens"] for r in rep)
    cached = sum(r["cached_tokens"] or 0 for r in rep)
    ttft = [r["ttft"] for r in ok]
    e2e = [r["e2e"] for r in ok]
    span = (max((r["sent"] + r["e2e"] for r in ok), default=0.0)
            - min((r["sent"] for r in ok), default=0.0))
    finished = {n: v["finished"] for n, v in per_sim.items()}
    total = sum(finished.values()) or 1
    hits = sum(v["hits"] for v in per_sim.values())
    queries = sum(v["queries"] for v in per_sim.values())
    out = {
        "config": config,
        "requests": len(records),
        "measured": len(measured),
        "ok": len(ok),
        "errors": len(measured) - len(ok),
        "error_samples": sorted({r["error"] for r in measured if r["error"]})[:5],
        "hit_ratio": cached / prompt if prompt else None,
        "hit_ratio_sims_whole_run": hits / queries if queries else None,
        "usage_reported": len(rep),
        "p50_ttft_s": pct(ttft, 50),
        "p90_ttft_s": pct(ttft, 90),
        "p99_ttft_s": pct(ttft, 99),
        "p50_e2e_s": pct(e2e, 50),
        "p99_e2e_s": pct(e2e, 99),
        "throughput_rps": len(ok) / span if span else None,
        "prompt_tokens_per_s": prompt / span if span else None,
        "mean_prompt_tokens": prompt / len(rep) if rep else None,
        "max_prompt_tokens": max((r["prompt_tokens"] for r in rep), default=None),
        "share": {n: round(v / total, 3) for n, v in sorted(finished.items())},
        "per_sim": per_sim,
        "wall_s": wall,
    }
    # what the workload allows: each later turn hits its whole previous prompt, in blocks
    by_session = {}
    for r in sorted(records, key=lambda r: (r["session"], r["turn"])):
        by_session.setdefault(r["session"], []).append(r)
    ceil_cached = ceil_prompt = 0
    counted = {id(r) for r in rep}
    for turns in by_session.values():
        prev = None
        for r in turns:
            if id(r) in counted:
                ceil_prompt += r["prompt_tokens"]
                if prev:
                    ceil_cached += min(prev // BLOCK * BLOCK, r["prompt_tokens"] - 1)
            prev = r["prompt_tokens"]
    out["hit_ceiling"] = ceil_cached / ceil_prompt if ceil_prompt else None
    # long-context sessions apart
    lg = [r for r in ok if r["long"]]
    out["long_sessions"] = {"n": len(lg), "p99_ttft_s": pct([r["ttft"] for r in lg], 99),
                            "p50_ttft_s": pct([r["ttft"] for r in lg], 50)}
    with_backend = [r for r in ok if r["backend"]]
    if with_backend:
        later = [r for r in with_backend if r["prev_backend"]]
        out["stayed"] = (sum(r["backend"] == r["prev_backend"] for r in later) / len(later)
                         if later else None)
        pred = [r for r in with_backend if r["predicted"] is not None and r["prompt_tokens"]]
        if pred:
            out["exact"] = sum(int(r["predicted"]) == (r["cached_tokens"] or 0)
                               for r in pred) / len(pred)
            out["exact_n"] = len(pred)
            out["predicted_over"] = sum(int(r["predicted"]) > (r["cached_tokens"] or 0)
                                        for r in pred)
            out["predicted_under"] = sum(int(r["predicted"]) < (r["cached_tokens"] or 0)
                                         for r in pred)
    if with_backend:
        # where the turns that left their session's backend went, and what it cost them
        moved = [r for r in later if r["backend"] != r["prev_backend"]]
        stay = [r for r in later if r["backend"] == r["prev_backend"]]
        out["moves"] = {
            "n": len(moved),
            "to_slow": sum(r["backend"].startswith("slow") for r in moved),
            "cached_share": (sum(r["cached_tokens"] or 0 for r in moved)
                             / max(1, sum(r["prompt_tokens"] or 0 for r in moved))),
            "p50_ttft_s": pct([r["ttft"] for r in moved], 50),
            "p99_ttft_s": pct([r["ttft"] for r in moved], 99),
            "stayed_p50_ttft_s": pct([r["ttft"] for r in stay], 50),
            "stayed_p99_ttft_s": pct([r["ttft"] for r in stay], 99),
        }
    if extra:
        out.update(extra)
    return out


class AdminPoller:
    """With --trace-admin: every 0.5 s, each backend's learned speeds and the gateway's load as
    routing sees them (for reading a run's decisions afterwards)."""

    def __init__(self, admin):
        import threading
        self.rows, self.done = [], threading.Event()
        self.thread = None
        if admin:
            self.t0 = time.perf_counter()
            self.thread = threading.Thread(target=self.run, args=(admin,), daemon=True)
            self.thread.start()

    def run(self, admin):
        while not self.done.wait(0.5):
            try:
                v = get_json(f"http://127.0.0.1:{admin}/admin/backends")
            except Exception:
                continue
            row = {"t": time.perf_counter() - self.t0}
            for b in v["backends"]:
                rt = b.get("routing") or {}
                sp, gw = rt.get("speeds") or {}, rt.get("gateway") or {}
                row[b["name"]] = [sp.get("prefill_tokens_per_second"),
                                  sp.get("decode_tokens_per_second"),
                                  gw.get("inflight_requests"), gw.get("pending_prefill_tokens")]
            self.rows.append(row)

    def stop(self, path):
        if self.thread:
            self.done.set()
            self.thread.join()
            with open(path, "w") as f:
                for r in self.rows:
                    f.write(json.dumps(r) + "\n")


def run_config(config, binary, sessions, args, tmp, peers):
    procs = LoggedProcs()
    ctmp = os.path.join(tmp, config)
    os.makedirs(ctmp, exist_ok=True)
    extra = {}
    try:
        sims = start_fleet(procs, binary, args.speed, ctmp)
        probe_routes = None
        if config.startswith("sluice-"):
            policy = "prefix-affinity" if config == "sluice-prefix-aff" else "token-aware"
            tokenizer = config in ("sluice-exact", "sluice-2-replicas")
            gw, admin = start_sluice(procs, binary, policy, tokenizer, sims, ctmp, "gw-a",
                                    args.signals_interval)
            wait_router(gw, procs.procs[-1])
            routes = lambda s: gw  # noqa: E731
            if config == "sluice-2-replicas":
                gw_b, _ = start_sluice(procs, binary, policy, tokenizer, sims, ctmp, "gw-b",
                                      args.signals_interval)
                wait_router(gw_b, procs.procs[-1])
                routes = lambda s: gw if s % 2 == 0 else gw_b  # noqa: E731
                probe_routes = lambda s: gw_b if s % 2 == 0 else gw  # noqa: E731
            extra["policy"] = policy
            extra["tokenizer"] = tokenizer
        else:
            got = peers.get(config)
            if not isinstance(got, tuple):
                return {"config": config, "skipped": got or "not installed"}
            exe, version = got
            extra["version"] = version
            extra["policy"] = "cache_aware"
            try:
                gw = start_peer(procs, config, exe, sims, ctmp)
            except RuntimeError as e:
                return {"config": config, "skipped": str(e)[:1500], "version": version}
            routes = lambda s: gw  # noqa: E731
        poller = AdminPoller(admin if config.startswith("sluice-") and args.trace_admin else None)
        records, wall = asyncio.run(run_sessions(sessions, routes, args, probe_routes))
        poller.stop(os.path.join(ctmp, "admin-trace.jsonl"))
        per_sim = sim_state(sims)
        if config.startswith("sluice-"):
            try:
                v = get_json(f"http://127.0.0.1:{admin}/admin/backends")
                extra["kv_cache"] = {b["name"]: b.get("kv_cache") for b in v["backends"]}
                extra["learned"] = {
                    b["name"]: {k: (b.get("routing") or {}).get("speeds", {}).get(k)
                                for k in ("prefill_tokens_per_second",
                                          "decode_tokens_per_second", "ttft_seconds")}
                    for b in v["backends"]}
            except Exception:
                pass
    finally:
        procs.stop()
    with open(os.path.join(ctmp, "requests.jsonl"), "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    if probe_routes:
        probed = [r for r in records if r.get("probe_backend") and r["backend"]]
        extra["replica_agreement"] = (sum(r["probe_backend"] == r["backend"] for r in probed)
                                      / len(probed) if probed else None)
        extra["replica_probes"] = len(probed)
        extra["probe_statuses"] = sorted({r.get("probe_status") for r in records
                                          if r.get("probe_status") is not None})
    return summarize(config, records, wall, per_sim, args, extra)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default=os.path.join(ROOT, "target", "release", "sluice"))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--sessions", type=int, default=60)
    ap.add_argument("--long", type=int, default=4, help="sessions with a very long context")
    ap.add_argument("--spread", type=float, default=60.0,
                    help="simulated seconds over which sessions start (Poisson)")
    ap.add_argument("--speed", type=float, default=1.0, help="simulator time compression")
    ap.add_argument("--warmup", type=float, default=8.0,
                    help="simulated seconds whose requests are not measured")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    ap.add_argument("--max-wall", type=float, default=420.0,
                    help="seconds per configuration after which no new turn starts")
    ap.add_argument("--peers-venv", default=None,
                    help="venv holding vllm-router and smg (created and filled if missing)")
    ap.add_argument("--trace-admin", action="store_true",
                    help="record Sluice's learned speeds and load every 0.5 s (work folder)")
    ap.add_argument("--signals-interval", default=None,
                    help="Sluice's [health] signals_interval (default: Sluice's own)")
    ap.add_argument("--smoke", action="store_true", help="under a minute: checks the harness")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "agents.json"))
    args = ap.parse_args()
    if args.smoke:
        args.sessions, args.long, args.spread, args.speed, args.warmup = 6, 1, 4.0, 4.0, 0.0
        args.max_wall = 20.0
        if args.out.endswith("agents.json"):
            args.out = args.out.replace("agents.json", "agents-smoke.json")
        if args.configs == ",".join(CONFIGS):
            args.configs = "sluice-exact,sluice-2-replicas"
    if not os.path.exists(args.binary):
        subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    configs = [c for c in args.configs.split(",") if c]
    sessions = workload(args.seed, args.sessions, args.long, args.spread)
    n_turns = sum(len(s["turns"]) for s in sessions)
    tmp = tempfile.mkdtemp(prefix="sluice-agents-")
    print(f"fleet: {', '.join(n for n, _ in FLEET)}; {len(sessions)} sessions "
          f"({args.long} long), {n_turns} turns; speed {args.speed}; work folder {tmp}",
          flush=True)
    peers = {}
    if any(c in PEERS for c in configs):
        venv = args.peers_venv or os.path.join(tmp, "peers-venv")
        peers = install_peers(venv, os.path.join(tmp, "pip.log"))
        for c, v in peers.items():
            print(f"{c}: " + (f"{os.path.basename(v[0])} {v[1]}" if isinstance(v, tuple)
                              else f"NOT AVAILABLE: {v}"), flush=True)
    out = []
    for c in configs:
        r = run_config(c, args.binary, sessions, args, tmp, peers)
        out.append(r)
        if "skipped" in r:
            print(f"{c:19} SKIPPED: {r['skipped']}", flush=True)
            continue
        print(f"{c:19} ok {r['ok']:5} err {r['errors']:3}  hit {fmt(r['hit_ratio'])} "
              f"(ceiling {fmt(r['hit_ceiling'])})  TTFT p50 {fmt(r['p50_ttft_s'])} "
              f"p99 {fmt(r['p99_ttft_s'])}  e2e p99 {fmt(r['p99_e2e_s'])}  "
              f"{fmt(r['throughput_rps'], '.2f')} req/s"
              + (f"  exact {fmt(r['exact'])}" if r.get("exact") is not None else "")
              + (f"  stayed {fmt(r['stayed'])}" if r.get("stayed") is not None else "")
              + (f"  replicas agree {fmt(r['replica_agreement'])} of {r['replica_probes']}"
                 if "replica_agreement" in r else "")
              + f"  share {r['share']}", flush=True)
        if r["error_samples"]:
            print(f"{'':19} errors: {r['error_samples']}", flush=True)
    by = {r["config"]: r for r in out if "skipped" not in r}
    ratios = {}
    peers_run = [by[c] for c in PEERS if c in by and by[c]["p99_ttft_s"]]
    ex = by.get("sluice-exact")
    if ex and peers_run:
        best_p99 = min(peers_run, key=lambda r: r["p99_ttft_s"])
        best_hit = max(peers_run, key=lambda r: r["hit_ratio"] or 0)
        ratios = {
            "best_peer_p99_ttft": best_p99["config"],
            "p99_ttft_vs_best_peer": ex["p99_ttft_s"] / best_p99["p99_ttft_s"],
            "best_peer_hit": best_hit["config"],
            "hit_ratio_vs_best_peer": ((ex["hit_ratio"] or 0) / best_hit["hit_ratio"]
                                       if best_hit["hit_ratio"] else None),
            "target_hit_met": (ex["hit_ratio"] or 0) >= (best_hit["hit_ratio"] or 0),
            "target_p99_met": ex["p99_ttft_s"] <= 0.7 * best_p99["p99_ttft_s"],
        }
    rep = by.get("sluice-2-replicas")
    if rep and rep.get("replica_agreement") is not None:
        ratios["replica_agreement"] = rep["replica_agreement"]
        ratios["target_replicas_met"] = rep["replica_agreement"] >= 0.95
    for k, v in ratios.items():
        print(f"{k}: {fmt(v) if isinstance(v, float) else v}")
    doc = {
        "bench": "routing-agents",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "args": {k: (shown_path(v) if k in ("binary", "out") and v else v)
                 for k, v in vars(args).items() if k != "peers_venv"},
        "fleet": [{"name": n, "flags": f} for n, f in FLEET],
        "common_flags": COMMON,
        "workload": {"sessions": len(sessions), "turns": n_turns,
                     "long_sessions": sum(s["long"] for s in sessions)},
        "results": out,
        "ratios": ratios,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {os.path.relpath(args.out, ROOT)}; per-request records under {tmp}")
    if args.smoke:
        shutil.rmtree(os.path.join(tmp, "peers-venv"), ignore_errors=True)
        bad = [r for r in out if "skipped" not in r and (r["ok"] == 0 or r["errors"])]
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
