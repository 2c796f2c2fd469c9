#!/usr/bin/env python3
"""Cache-exact routing against two real vLLM servers with KV-cache events: does the gateway's
expected cached prefix equal what the engine reports, and does routing keep sessions' caches
as warm as pinning each session to one engine would?

1. Starts two real vLLM (CPU) servers, each on its own core, with
   `--kv-events-config` (ZMQ PUB on `tcp://*:port`, a replay endpoint),
   `--enable-prompt-tokens-details` (usage reports `cached_tokens`) and
   `VLLM_SERVER_DEV_MODE=1` (`POST /reset_prefix_cache` between runs).
2. Starts `sluice serve` with both as `kind = "vllm"` backends, the model's `tokenizer` folder
   configured (so the gateway computes the engine's token ids), `expose_backend_header = true`
   (answers carry `x-sluice-backend` and `x-sluice-cached-prefix`), the default policy.
3. An agent workload: `--sessions` conversations sharing one of two system prompts, each
   `--turns` turns long; every turn resends the whole history (system, the user turns, the
   engine's own earlier answers), as coding agents and chat clients do. Sessions run
   concurrently, turns in order. Answers are `--answer-tokens` long (`ignore_eos`).
4. Run A, through Sluice: per request the backend, `x-sluice-cached-prefix` (predicted) and
   `usage.prompt_tokens_details.cached_tokens` (reported).
5. The caches are reset; run B, the same workload straight to the engines, each session pinned
   to one engine (session i to engine i mod 2): the hit ratio pinning gives.
6. Prints and records: the share of requests whose predicted cached prefix equals the reported
   one (target: >= 99%), the engine-reported hit ratio (cached / prompt tokens) of both runs and
   their ratio (target: >= 0.9), and the KV view of each backend from `/admin/backends`.

Setting up vLLM and the tiny model: see bench/plan/real_vllm.py (same venv, same model; the
model folder holds tokenizer.json and its chat template).

Usage:
  cargo build --release
  python3 bench/kv/real_agents.py --sluice target/release/sluice --vllm VENV/bin/vllm \
      --model MODEL [--sessions 12] [--turns 5] [--json OUT]
Only the Python standard library is used. Everything listens on 127.0.0.1.
"""
import argparse
import http.client
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "plan"))
import real_vllm as rv  # noqa: E402  (starting, waiting for and stopping vLLM servers)

WORDS = ("alpha beta gamma delta build test deploy config module function error value "
         "request stream token cache engine router replica session answer question").split()


def start_engines(vllm, model, ports, logdir):
    procs = []
    for i, (port, kv) in enumerate(ports):
        extra = ["--enable-prompt-tokens-details", "--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"tcp://*:{kv}", "replay_endpoint": f"tcp://*:{kv + 1}", "topic": "kv"})]
        os.environ["VLLM_SERVER_DEV_MODE"] = "1"
        procs.append(rv.start_vllm(vllm, model, port, i, 8, os.path.join(logdir, f"vllm-{i}.log"),
                                   extra))
    for (port, _), p in zip(ports, procs):
        rv.wait_health(port, p)
    return procs


def start_gateway(sluice, model, ports, port, logdir):
    cfg = os.path.join(logdir, "sluice.toml")
    with open(cfg, "w") as f:
        f.write(f'[server]\nlisten = "127.0.0.1:{port}"\n\n[routing]\nexpose_backend_header = true\n\n'
                f'[[models]]\nname = "{rv.MODEL_NAME}"\ntokenizer = "{model}"\n\n')
        for i, (p, _) in enumerate(ports):
            f.write(f'[[backends]]\nname = "engine-{i}"\nkind = "vllm"\n'
                    f'url = "http://127.0.0.1:{p}"\nmodels = ["{rv.MODEL_NAME}"]\n\n')
    log = open(os.path.join(logdir, "sluice.log"), "w")
    proc = subprocess.Popen([sluice, "serve", "--config", cfg], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    rv.wait_health(port, proc, 60, "/readyz")
    return proc


def kv_live(port, n, timeout=60):
    """Until every backend's KV subscription is warm or cold."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        views = backends_kv(port)
        if len(views) == n and all(v["status"] in ("warm", "cold") for v in views.values()):
            return views
        time.sleep(0.5)
    raise SystemExit(f"KV subscriptions not live: {backends_kv(port)}")


def backends_kv(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/admin/backends")
    doc = json.loads(c.getresponse().read())
    return {b["name"]: b["kv_cache"] for b in doc["backends"]}


def chat(port, messages, answer_tokens):
    body = json.dumps({"model": rv.MODEL_NAME, "messages": messages, "max_tokens": answer_tokens,
                       "ignore_eos": True, "temperature": 0})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    r = c.getresponse()
    data = json.loads(r.read())
    if r.status != 200:
        raise RuntimeError(f"{r.status}: {data}")
    usage = data["usage"]
    details = usage.get("prompt_tokens_details") or {}
    predicted = r.getheader("x-sluice-cached-prefix")
    return {
        "backend": r.getheader("x-sluice-backend"),
        "predicted": int(predicted) if predicted is not None else None,
        "reported": details.get("cached_tokens") or 0,
        "prompt": usage["prompt_tokens"],
        "answer": data["choices"][0]["message"]["content"],
    }


def sessions(seed, n, turns, words):
    rng = random.Random(seed)
    systems = [" ".join(rng.choice(WORDS) for _ in range(words * 3)) for _ in range(2)]
    return [{"system": systems[i % 2],
             "users": [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(turns)]}
            for i in range(n)]


def run(port_of, plan, answer_tokens):
    """Each session's turns in order, sessions concurrently; `port_of(i)` is where session i goes."""
    out, lock = [], threading.Lock()

    def session(i, s):
        msgs = [{"role": "system", "content": s["system"]}]
        for t, u in enumerate(s["users"]):
            msgs.append({"role": "user", "content": u})
            r = chat(port_of(i), msgs, answer_tokens)
            msgs.append({"role": "assistant", "content": r["answer"]})
            r.update(session=i, turn=t)
            with lock:
                out.append(r)

    threads = [threading.Thread(target=session, args=(i, s)) for i, s in enumerate(plan)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return out


def reset(ports):
    for p, _ in ports:
        c = http.client.HTTPConnection("127.0.0.1", p, timeout=30)
        c.request("POST", "/reset_prefix_cache")
        c.getresponse().read()


def hit_ratio(rs):
    return sum(r["reported"] for r in rs) / max(1, sum(r["prompt"] for r in rs))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sluice", default=os.environ.get("SLUICE_BIN", "target/release/sluice"))
    ap.add_argument("--vllm", default=os.environ.get("VLLM_BIN"))
    ap.add_argument("--model", default=os.environ.get("TINY_MODEL"))
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--words", type=int, default=24, help="words per user turn (system: 3x)")
    ap.add_argument("--answer-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not (a.vllm and a.model):
        ap.error("--vllm and --model are required")
    logdir = tempfile.mkdtemp(prefix="sluice-kv-")
    ports = [(18201, 25601), (18202, 25611)]
    gw_port = 18200
    engines, gw = [], None
    try:
        engines = start_engines(a.vllm, a.model, ports, logdir)
        gw = start_gateway(a.sluice, a.model, ports, gw_port, logdir)
        kv_live(gw_port, len(ports))
        plan = sessions(a.seed, a.sessions, a.turns, a.words)
        reset(ports)
        t0 = time.time()
        routed = run(lambda i: gw_port, plan, a.answer_tokens)
        routed_s = time.time() - t0
        views = backends_kv(gw_port)
        reset(ports)
        pinned = run(lambda i: ports[i % len(ports)][0], plan, a.answer_tokens)
    finally:
        if gw:
            rv.stop(gw, group=True)
        for p in engines:
            rv.stop(p, group=True)
    known = [r for r in routed if r["predicted"] is not None]
    exact = sum(1 for r in known if r["predicted"] == r["reported"])
    share = {b: sum(1 for r in routed if r["backend"] == b) for b in {r["backend"] for r in routed}}
    doc = {
        "requests": len(routed),
        "predicted": len(known),
        "predicted_exact": exact,
        "predicted_exact_share": exact / max(1, len(known)),
        "misses": [r for r in known if r["predicted"] != r["reported"]][:10],
        "hit_ratio_routed": hit_ratio(routed),
        "hit_ratio_pinned": hit_ratio(pinned),
        "hit_ratio_vs_pinned": hit_ratio(routed) / max(1e-9, hit_ratio(pinned)),
        "backend_share": share,
        "routed_seconds": routed_s,
        "kv_views": views,
        # the workload's settings (not the paths of this run's binaries)
        "args": {k: v for k, v in vars(a).items() if k not in ("sluice", "vllm", "model", "json")},
    }
    for r in doc["misses"]:
        r.pop("answer", None)
    print(json.dumps({k: v for k, v in doc.items() if k != "args"}, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
