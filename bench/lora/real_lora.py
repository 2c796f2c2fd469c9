#!/usr/bin/env python3
"""LoRA adapters through Sluice against two real vLLM servers: adapters configured in Sluice and
loaded nowhere all answer, concurrent requests for a missing adapter share one load, a mixed
stream over more adapters than the engines have slots answers without errors, and an adapter
whose path holds nothing is a client error naming it while the engines stay healthy.

What it proves, end to end with vLLM's own run-time LoRA API (`POST /v1/load_lora_adapter`,
`POST /v1/unload_lora_adapter`) rather than the simulator's imitation of it:
- Sluice resolves a request whose `model` names an `[[adapters]]` entry to an engine of the
  adapter's base model, loads the adapter there when no engine holds it, and the engine's
  answer names the adapter as its `model`;
- concurrent requests for one missing adapter share one load (never two loads of it on one
  engine; Sluice's `sluice_adapter_loads_total` and the engines' own `/v1/models` agree);
- with more adapters than slots (`--max-loras 1` per engine, four adapters), Sluice unloads the
  least recently used idle adapter to make room and every request still answers;
- a load the engine refuses (a path with no adapter) answers the client 4xx with code
  `adapter_load_failed` and a message naming the adapter, and both engines stay healthy.

Method:
1. Writes four tiny adapters a0..a3 for the tiny model into a work folder (rank 8 on
   `q_proj`/`v_proj` of every layer, different random weights each: `adapter_config.json` and
   `adapter_model.safetensors`, made with the torch and safetensors of vLLM's own environment,
   no hub, no peft), and reserves a fifth path that holds nothing.
2. Starts two real vLLM (CPU) servers, each on its own core, with `--enable-lora --max-loras 1
   --max-lora-rank 8 --max-cpu-loras 2` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`; no adapter
   is loaded at start (checked in their `/v1/models`).
3. Starts `sluice serve` with both as `kind = "vllm"` backends of the model (`engine-0`,
   `engine-1`), the four adapters and `broken` (the empty path) as `[[adapters]]`,
   `[routing] expose_backend_header = true` and an `[admin]` listener; `--max-adapters` sets
   each backend's `max_adapters` (default: unset, so the engines' own slots are the budget).
4. Through Sluice with the OpenAI Python SDK (no retries in the client):
   (a) each adapter in turn, twice: the backend (`x-sluice-backend`), the answer's `model`, and
       whether the repeat went where the adapter is now held without another load;
   (b) `--concurrent` simultaneous requests for an adapter that no engine lists (when (a) left
       every adapter loaded somewhere, one is first unloaded on the engines themselves and
       Sluice is waited for to see it gone): Sluice's load counter per backend before and
       after, and which engines list it afterwards;
   (c) `--mixed` requests over the four adapters (seeded order, `--mixed-concurrency` clients,
       bounded by `--mixed-deadline`): errors, backends, loads and unloads meanwhile;
   (d) `broken`: the status, code and message, then every backend's state in `/admin/backends`
       (polled for a few seconds) and the engines' `/health`;
   (e) `/admin/backends` adapters (held, max_lora, load_seconds), Sluice's `/v1/models`, the
       `sluice_adapter_*` metrics, each engine's own adapter list (whether Sluice's held set
       matches it, and engines holding more adapters than their budget), and the engines' log
       lines about adapters loaded and removed: an independent count that Sluice's load and
       unload counters are checked against (`counts_agree`).
5. Prints a summary and writes a JSON results file (no machine paths in it: the work folder is
   written as `<work>`). Every process started is stopped on every exit path (normal end,
   error, Ctrl-C, SIGTERM). The engines' and Sluice's logs stay in the work folder.

Usage (the Python running this needs the `openai` package; vLLM's venv has it):
  VENV/bin/python bench/lora/real_lora.py --binary target/release/sluice \
      --vllm VENV/bin/vllm --model MODEL [--concurrent 8] [--mixed 40] \
      [--mixed-concurrency 4] [--max-adapters N] [--workdir DIR] [--json OUT]
MODEL is the tiny Llama of bench/plan/real_vllm.py (`--make-model`). Every path is an argument
(or the environment variable SLUICE_BIN, VLLM_BIN, TINY_MODEL). Everything listens on 127.0.0.1.
"""
import argparse
import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "plan"))
import real_vllm as rv  # noqa: E402  (starting, waiting for and stopping vLLM servers)
from chaos import free_port, get_json, post_json, wait_port  # noqa: E402  (real_vllm put it on the path)

try:
    import openai
except ImportError:  # pragma: no cover
    raise SystemExit("the openai package is needed: run this with a Python that has it "
                     "(vLLM's venv does), or `pip install openai`")

ADAPTERS = ["a0", "a1", "a2", "a3"]
BROKEN = "broken"

# ---- the adapters (run with the venv's Python, not this one) ----------------------------------
MAKE_ADAPTERS = r'''
import json, os, sys
import torch
from safetensors.torch import save_file
model, out, names = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
rank = int(sys.argv[4])
cfg = json.load(open(os.path.join(model, "config.json")))
hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
outs = {"q_proj": cfg["num_attention_heads"] * head_dim,
        "v_proj": cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim}
for i, name in enumerate(names):
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    g = torch.Generator().manual_seed(1000 + i)
    tensors = {}
    for l in range(layers):
        for mod, o in outs.items():
            p = f"base_model.model.model.layers.{l}.self_attn.{mod}"
            tensors[p + ".lora_A.weight"] = torch.randn(rank, hidden, generator=g) * 0.1
            tensors[p + ".lora_B.weight"] = torch.randn(o, rank, generator=g) * 0.1
    save_file(tensors, os.path.join(d, "adapter_model.safetensors"))
    json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
               "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
               "target_modules": list(outs), "fan_in_fan_out": False,
               "modules_to_save": None, "base_model_name_or_path": model},
              open(os.path.join(d, "adapter_config.json"), "w"), indent=1)
print("adapters written:", names)
'''


def make_adapters(python, model, out, rank):
    os.makedirs(out, exist_ok=True)
    subprocess.run([python, "-c", MAKE_ADAPTERS, model, out, ",".join(ADAPTERS), str(rank)],
                   check=True, timeout=300)
    return {n: os.path.join(out, n) for n in ADAPTERS}


# ---- processes ---------------------------------------------------------------------------------
def start_engines(a, workdir):
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    extra = ["--enable-lora", "--max-loras", str(a.max_loras), "--max-lora-rank", str(a.rank),
             "--max-cpu-loras", str(a.max_cpu_loras)]
    ports, procs = [], []
    for i in range(2):
        port = free_port()
        ports.append(port)
        procs.append(rv.start_vllm(a.vllm, a.model, port, i, 8,
                                   os.path.join(workdir, f"vllm-{i}.log"), extra))
    return ports, procs


def start_gateway(a, engine_ports, paths, broken_path, workdir):
    port, admin = free_port(), free_port()
    cfg = (f'[server]\nlisten = "127.0.0.1:{port}"\n\n'
           f'[admin]\nlisten = "127.0.0.1:{admin}"\n\n'
           '[routing]\nexpose_backend_header = true\n\n'
           '[health]\ninterval = "1s"\nsignals_interval = "1s"\n\n')
    for i, p in enumerate(engine_ports):
        cfg += (f'[[backends]]\nname = "engine-{i}"\nkind = "vllm"\n'
                f'url = "http://127.0.0.1:{p}"\nmodels = ["{rv.MODEL_NAME}"]\n')
        if a.max_adapters is not None:
            cfg += f"max_adapters = {a.max_adapters}\n"
        cfg += "\n"
    for name in ADAPTERS:
        cfg += (f'[[adapters]]\nname = "{name}"\nbase = "{rv.MODEL_NAME}"\n'
                f'path = "{paths[name]}"\n\n')
    cfg += f'[[adapters]]\nname = "{BROKEN}"\nbase = "{rv.MODEL_NAME}"\npath = "{broken_path}"\n'
    path = os.path.join(workdir, "sluice.toml")
    with open(path, "w") as f:
        f.write(cfg)
    log = open(os.path.join(workdir, "sluice.log"), "w")
    gw = subprocess.Popen([a.binary, "serve", "--config", path],
                          env=dict(os.environ, SLUICE_LOG=a.sluice_log), stdout=log,
                          stderr=subprocess.STDOUT, start_new_session=True)
    wait_port(port, 60)
    wait_port(admin, 60)
    end = time.time() + 120
    while time.time() < end:
        if gw.poll() is not None:
            raise SystemExit(f"sluice exited ({gw.returncode}); see {workdir}/sluice.log")
        doc = get_json(admin, "/admin/backends")
        if all(b["state"] == "healthy" for b in doc["backends"]):
            return gw, port, admin
        time.sleep(0.5)
    raise SystemExit("the backends did not become healthy behind the gateway")


# ---- observations ------------------------------------------------------------------------------
def engine_adapters(port):
    """The adapters an engine itself lists (`/v1/models` entries with a parent): {id: parent}."""
    doc = get_json(port, "/v1/models")
    return {m["id"]: m["parent"] for m in doc["data"] if m.get("parent")}


def held_now(engine_ports):
    """Each engine's own adapter list, sorted."""
    return {f"engine-{i}": sorted(engine_adapters(p)) for i, p in enumerate(engine_ports)}


def engine_health(port):
    try:
        status, _ = rv_get(port, "/health")
        return status
    except OSError as e:
        return str(e)


def rv_get(port, path):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", path)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def sluice_metrics(admin):
    """The `sluice_adapter_*` series of Sluice's /metrics: {series: value}."""
    _, text = rv_get(admin, "/metrics")
    out = {}
    for line in text.decode().splitlines():
        if line.startswith("sluice_adapter_"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def loads_by(metrics, outcome):
    """{backend: count} of `sluice_adapter_loads_total` with that outcome."""
    out = {}
    for k, v in metrics.items():
        m = re.match(r'sluice_adapter_loads_total\{(.*)\}$', k)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            if labels.get("outcome") == outcome:
                out[labels["backend"]] = out.get(labels["backend"], 0) + v
    return out


def unloads_by(metrics):
    out = {}
    for k, v in metrics.items():
        m = re.match(r'sluice_adapter_unloads_total\{.*backend="([^"]*)".*\}$', k)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0) + v
    return out


def diff(after, before):
    return {k: after.get(k, 0) - before.get(k, 0) for k in sorted(set(after) | set(before))}


def admin_view(admin):
    doc = get_json(admin, "/admin/backends")
    return {b["name"]: {"state": b["state"], "adapters": b.get("adapters")}
            for b in doc["backends"]}


def engine_log_counts(workdir, i):
    """Lines of engine i's log about adapters loaded and removed (vLLM's own record)."""
    loaded, removed = {}, {}
    try:
        with open(os.path.join(workdir, f"vllm-{i}.log"), errors="replace") as f:
            for line in f:
                m = re.search(r"Loaded new LoRA adapter: name '([^']+)'", line)
                if m:
                    loaded[m.group(1)] = loaded.get(m.group(1), 0) + 1
                m = re.search(r"Removed LoRA adapter: name '([^']+)'", line)
                if m:
                    removed[m.group(1)] = removed.get(m.group(1), 0) + 1
    except OSError:
        pass
    return {"loaded": loaded, "removed": removed}


def sluice_log_notes(workdir, limit=40):
    """Sluice's log lines at WARN or ERROR, and those about adapters (work folder hidden)."""
    notes = []
    try:
        with open(os.path.join(workdir, "sluice.log"), errors="replace") as f:
            for line in f:
                if re.search(r"WARN|ERROR|adapter|lora", line, re.I):
                    notes.append(scrub(re.sub(r"\x1b\[[0-9;]*m", "", line.rstrip()), workdir))
    except OSError:
        pass
    return {"count": len(notes), "lines": notes[:limit]}


def scrub(text, workdir):
    return text.replace(workdir, "<work>") if isinstance(text, str) else text


# ---- requests through Sluice -------------------------------------------------------------------
def ask(client, model, max_tokens, prompt="Say something."):
    """One chat through Sluice: status, backend, the answer's model, latency, error."""
    t0 = time.time()
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=model, max_tokens=max_tokens, temperature=0,
            messages=[{"role": "user", "content": prompt}])
        r = raw.parse()
        return {"adapter": model, "status": raw.status_code,
                "backend": raw.headers.get("x-sluice-backend"),
                "request_id": raw.headers.get("x-request-id"), "model": r.model,
                "answer": r.choices[0].message.content, "seconds": round(time.time() - t0, 3)}
    except openai.APIStatusError as e:
        try:
            body = e.response.json()
        except ValueError:
            body = e.response.text[:500]
        return {"adapter": model, "status": e.status_code,
                "backend": e.response.headers.get("x-sluice-backend"),
                "request_id": e.response.headers.get("x-request-id"), "error": body,
                "seconds": round(time.time() - t0, 3)}
    except openai.APIError as e:  # connection errors, timeouts
        return {"adapter": model, "status": None, "error": f"{type(e).__name__}: {e}",
                "seconds": round(time.time() - t0, 3)}


def ok(r):
    return r["status"] == 200 and r.get("model") == r["adapter"]


def phase_each(client, a, admin):
    out = []
    for name in ADAPTERS:
        first = ask(client, name, a.max_tokens)
        before = loads_by(sluice_metrics(admin), "loaded")
        again = ask(client, name, a.max_tokens)
        after = loads_by(sluice_metrics(admin), "loaded")
        out.append({"adapter": name, "first": first, "again": again,
                    "again_same_backend": again.get("backend") == first.get("backend"),
                    "loads_for_again": sum(diff(after, before).values())})
        print(f"  {name}: {first['status']} backend={first.get('backend')} "
              f"model={first.get('model')} {first['seconds']}s; again {again['status']} "
              f"backend={again.get('backend')} {again['seconds']}s")
    return out


def phase_concurrent(client, a, admin, engine_ports):
    listed = [engine_adapters(p) for p in engine_ports]
    missing = [n for n in ADAPTERS if not any(n in ls for ls in listed)]
    made_missing = None
    if not missing:
        # every adapter is held somewhere (the engines' slots were not known yet when they were
        # loaded): unload one on the engines themselves, then wait until Sluice has seen it go
        target = ADAPTERS[0]
        made_missing = {}
        for i, p in enumerate(engine_ports):
            if target in listed[i]:
                status, body = post_json(p, "/v1/unload_lora_adapter", {"lora_name": target}, 30)
                made_missing[f"engine-{i}"] = status
        end = time.time() + 30
        while time.time() < end and any(
                target in [h["name"] for h in (v["adapters"] or {}).get("held", [])]
                for v in admin_view(admin).values()):
            time.sleep(0.5)
    else:
        target = missing[0]
    m0 = sluice_metrics(admin)
    barrier = threading.Barrier(a.concurrent)
    results = [None] * a.concurrent

    def one(i):
        try:
            barrier.wait(timeout=30)
        except threading.BrokenBarrierError:
            pass
        results[i] = ask(client, target, a.max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(a.concurrent)]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join(a.request_timeout + 30)
    wall = time.time() - t0
    m1 = sluice_metrics(admin)
    after = [engine_adapters(p) for p in engine_ports]
    loaded = diff(loads_by(m1, "loaded"), loads_by(m0, "loaded"))
    doc = {
        "adapter": target,
        "unloaded_first_on_the_engines": made_missing,
        "requests": a.concurrent,
        "answered": sum(1 for r in results if r and ok(r)),
        "backends": count([r.get("backend") for r in results if r]),
        "seconds_wall": round(wall, 3),
        "seconds_max": max((r["seconds"] for r in results if r), default=None),
        "loads_by_backend": loaded,
        "loads_total": sum(loaded.values()),
        "refused_or_failed": sum(sum(diff(loads_by(m1, o), loads_by(m0, o)).values())
                                 for o in ("refused", "failed")),
        "unloads_by_backend": diff(unloads_by(m1), unloads_by(m0)),
        "engines_listing_it": [f"engine-{i}" for i, ls in enumerate(after) if target in ls],
        "parents": {f"engine-{i}": ls.get(target) for i, ls in enumerate(after) if target in ls},
        "errors": [r for r in results if not (r and ok(r))],
    }
    # one load shared: at most one load per engine, and as many loads as engines listing it
    doc["shared_one_load"] = (all(v <= 1 for v in loaded.values())
                              and doc["loads_total"] == len(doc["engines_listing_it"]))
    return doc


def phase_mixed(client, a, admin):
    rng = random.Random(a.seed)
    plan = [rng.choice(ADAPTERS) for _ in range(a.mixed)]
    m0 = sluice_metrics(admin)
    results, lock = [], threading.Lock()
    t0 = time.time()
    deadline = t0 + a.mixed_deadline
    nxt = iter(enumerate(plan))

    def worker():
        while time.time() < deadline:
            with lock:
                item = next(nxt, None)
            if item is None:
                return
            i, name = item
            sent = round(time.time() - t0, 3)
            r = ask(client, name, a.max_tokens, f"Request {i}: say something.")
            r["i"], r["sent_at"] = i, sent
            with lock:
                results.append(r)

    threads = [threading.Thread(target=worker) for _ in range(a.mixed_concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1.0, deadline - time.time()) + a.request_timeout)
    wall = time.time() - t0
    m1 = sluice_metrics(admin)
    results.sort(key=lambda r: r["i"])
    errors = [r for r in results if not ok(r)]
    lat = sorted(r["seconds"] for r in results)
    return {
        "planned": len(plan), "sent": len(results), "answered": len(results) - len(errors),
        "errors": len(errors), "error_samples": errors[:10],
        "not_sent_by_deadline": len(plan) - len(results),
        "by_adapter": {n: count([r.get("backend") for r in results if r["adapter"] == n])
                       for n in ADAPTERS},
        "seconds_wall": round(wall, 3),
        "latency_p50": lat[len(lat) // 2] if lat else None,
        "latency_max": lat[-1] if lat else None,
        "loads_by_backend": diff(loads_by(m1, "loaded"), loads_by(m0, "loaded")),
        "refused_by_backend": diff(loads_by(m1, "refused"), loads_by(m0, "refused")),
        "failed_by_backend": diff(loads_by(m1, "failed"), loads_by(m0, "failed")),
        "unloads_by_backend": diff(unloads_by(m1), unloads_by(m0)),
    }


def phase_broken(client, a, admin, engine_ports, workdir):
    m0 = sluice_metrics(admin)
    r = ask(client, BROKEN, a.max_tokens)
    m1 = sluice_metrics(admin)
    err = r.get("error") if isinstance(r.get("error"), dict) else {}
    e = err.get("error", {}) if isinstance(err.get("error"), dict) else {}
    message = e.get("message") or ""
    states = []
    end = time.time() + a.health_watch
    while time.time() < end:
        states.append({n: v["state"] for n, v in admin_view(admin).items()})
        time.sleep(0.5)
    return {
        "status": r["status"],
        "code": e.get("code"),
        "type": e.get("type"),
        "message": scrub(message, workdir),
        "message_names_adapter": f"`{BROKEN}`" in message or BROKEN in message,
        "is_4xx": isinstance(r["status"], int) and 400 <= r["status"] < 500,
        "refused_by_backend": diff(loads_by(m1, "refused"), loads_by(m0, "refused")),
        "failed_by_backend": diff(loads_by(m1, "failed"), loads_by(m0, "failed")),
        "states_seen": sorted({s for snap in states for s in snap.values()}),
        "all_healthy_throughout": all(s == "healthy" for snap in states for s in snap.values()),
        "engine_health": {f"engine-{i}": engine_health(p) for i, p in enumerate(engine_ports)},
        "base_model_after": ok_base(client, a),
    }


def ok_base(client, a):
    r = ask(client, rv.MODEL_NAME, a.max_tokens)
    return {"status": r["status"], "backend": r.get("backend"), "model": r.get("model")}


def count(xs):
    out = {}
    for x in xs:
        out[str(x)] = out.get(str(x), 0) + 1
    return out


# ---- main --------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default=os.environ.get("SLUICE_BIN", "target/release/sluice"))
    ap.add_argument("--vllm", default=os.environ.get("VLLM_BIN"))
    ap.add_argument("--model", default=os.environ.get("TINY_MODEL"))
    ap.add_argument("--python", default=None,
                    help="the Python with torch and safetensors that writes the adapters "
                         "(default: the one beside --vllm)")
    ap.add_argument("--workdir", default=None, help="adapters and logs (default: a new temp dir)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--max-loras", type=int, default=1)
    ap.add_argument("--max-cpu-loras", type=int, default=2)
    ap.add_argument("--max-adapters", type=int, default=None,
                    help="each backend's max_adapters (default: unset, the engine's slots)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrent", type=int, default=8)
    ap.add_argument("--mixed", type=int, default=40)
    ap.add_argument("--mixed-concurrency", type=int, default=4)
    ap.add_argument("--mixed-deadline", type=float, default=600.0)
    ap.add_argument("--health-watch", type=float, default=5.0,
                    help="seconds the backends' states are watched after the broken request")
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--engine-start-timeout", type=float, default=900.0)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--sluice-log", default="info")
    ap.add_argument("--json", default="bench/results/lora-real.json")
    a = ap.parse_args()
    if not (a.vllm and a.model):
        ap.error("--vllm and --model are required")
    a.model = os.path.abspath(a.model)
    python = a.python or os.path.join(os.path.dirname(os.path.abspath(a.vllm)), "python")
    workdir = os.path.abspath(a.workdir) if a.workdir else tempfile.mkdtemp(prefix="sluice-lora-")
    os.makedirs(workdir, exist_ok=True)
    print("work folder:", workdir)

    # SIGTERM and SIGHUP end the run through the `finally` below, as Ctrl-C does
    def die(signum, _frame):
        raise SystemExit(f"stopped by signal {signum}")
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, die)

    procs, started = [], time.time()
    doc = {}
    try:
        paths = make_adapters(python, a.model, os.path.join(workdir, "adapters"), a.rank)
        broken_path = os.path.join(workdir, "adapters", "nothing-here")
        if os.path.exists(broken_path):
            raise SystemExit(f"{broken_path} exists; the broken adapter's path must hold nothing")
        engine_ports, engines = start_engines(a, workdir)
        procs += engines
        t0 = time.time()
        for p, proc in zip(engine_ports, engines):
            rv.wait_health(p, proc, a.engine_start_timeout)
        doc["engines_up_seconds"] = round(time.time() - t0, 1)
        at_start = {f"engine-{i}": engine_adapters(p) for i, p in enumerate(engine_ports)}
        if any(at_start.values()):
            raise SystemExit(f"adapters loaded at start: {at_start}")
        print(f"engines up in {doc['engines_up_seconds']} s, no adapters loaded")
        gw, port, admin = start_gateway(a, engine_ports, paths, broken_path, workdir)
        procs.append(gw)
        doc["admin_at_start"] = admin_view(admin)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=a.request_timeout)
        _, models = rv_get(port, "/v1/models")
        doc["sluice_models"] = {m["id"]: m.get("parent") for m in json.loads(models)["data"]}

        print("(a) each adapter, twice")
        doc["each"] = phase_each(client, a, admin)
        doc["engines_after_each"] = held_now(engine_ports)
        print(f"(b) {a.concurrent} concurrent requests for an adapter loaded nowhere")
        doc["concurrent"] = phase_concurrent(client, a, admin, engine_ports)
        print("   ", {k: doc["concurrent"].get(k) for k in
                      ("adapter", "answered", "loads_by_backend", "engines_listing_it")})
        print(f"(c) {a.mixed} mixed requests, {a.mixed_concurrency} clients")
        doc["mixed"] = phase_mixed(client, a, admin)
        doc["engines_after_mixed"] = held_now(engine_ports)
        print("   ", {k: doc["mixed"][k] for k in ("sent", "answered", "errors",
                                                   "loads_by_backend", "unloads_by_backend")})
        print("(d) the broken adapter")
        doc["broken"] = phase_broken(client, a, admin, engine_ports, workdir)
        print("   ", doc["broken"]["status"], doc["broken"]["code"], doc["broken"]["message"])
        print("(e) the end state")
        time.sleep(2)  # one more discovery round, so the views compared below are current
        doc["admin_at_end"] = admin_view(admin)
        doc["engines_at_end"] = {f"engine-{i}": engine_adapters(p)
                                 for i, p in enumerate(engine_ports)}
        doc["over_budget"] = {
            n: {"held": len(doc["engines_at_end"][n]), "max_lora": v["adapters"].get("max_lora"),
                "max_adapters": a.max_adapters}
            for n, v in doc["admin_at_end"].items()
            if len(doc["engines_at_end"][n]) > (a.max_adapters or v["adapters"].get("max_lora")
                                                 or a.max_loras)}
        doc["sluice_held_matches_engines"] = {
            n: sorted(h["name"] for h in (v["adapters"] or {}).get("held", []))
            == sorted(doc["engines_at_end"][n]) for n, v in doc["admin_at_end"].items()}
        doc["metrics_at_end"] = sluice_metrics(admin)
        _, models = rv_get(port, "/v1/models")
        doc["sluice_models_at_end"] = {m["id"]: m.get("parent")
                                       for m in json.loads(models)["data"]}
    finally:
        for p in reversed(procs):
            rv.stop(p, group=True)
    doc["engine_logs"] = {f"engine-{i}": engine_log_counts(workdir, i) for i in range(2)}
    if "metrics_at_end" in doc:
        # Sluice's counters against the engines' own record of loads and removals (less the
        # removals made directly on the engines in (b), if any)
        m = doc["metrics_at_end"]
        direct = sum(1 for v in (doc["concurrent"].get("unloaded_first_on_the_engines") or {})
                     .values() if v == 200)
        doc["counts_agree"] = {
            "sluice_loaded": sum(loads_by(m, "loaded").values()),
            "engines_loaded": sum(sum(e["loaded"].values()) for e in doc["engine_logs"].values()),
            "sluice_unloads": sum(unloads_by(m).values()),
            "engines_removed_for_sluice": sum(sum(e["removed"].values())
                                              for e in doc["engine_logs"].values()) - direct,
        }
    doc["sluice_log"] = sluice_log_notes(workdir)
    doc["seconds_total"] = round(time.time() - started, 1)
    doc["args"] = {k: v for k, v in vars(a).items()
                   if k not in ("binary", "vllm", "model", "python", "workdir", "json")}
    doc = json.loads(scrub(json.dumps(doc), workdir))
    summary(doc)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        print("results:", a.json)
    print("logs:", workdir)


def summary(doc):
    print("\n== summary")
    for e in doc["each"]:
        f = e["first"]
        print(f"  {e['adapter']}: status {f['status']}, backend {f.get('backend')}, "
              f"model {f.get('model')}, {f['seconds']} s (repeat: same backend "
              f"{e['again_same_backend']}, loads {e['loads_for_again']})")
    c = doc["concurrent"]
    if c["unloaded_first_on_the_engines"]:
        print(f"  (every adapter was held after (a): {c['adapter']} unloaded on the engines "
              f"first: {c['unloaded_first_on_the_engines']})")
    print(f"  concurrent: {c['answered']}/{c['requests']} answered for {c['adapter']}; "
          f"loads {c['loads_by_backend']}; listed by {c['engines_listing_it']} "
          f"(parents {c['parents']}); shared one load: {c['shared_one_load']}")
    m = doc["mixed"]
    print(f"  mixed: {m['answered']}/{m['planned']} answered, {m['errors']} errors; "
          f"loads {m['loads_by_backend']}, unloads {m['unloads_by_backend']}, "
          f"p50 {m['latency_p50']} s, max {m['latency_max']} s")
    b = doc["broken"]
    print(f"  broken: {b['status']} {b['code']}: {b['message']!r}; names it "
          f"{b['message_names_adapter']}; healthy throughout {b['all_healthy_throughout']}")
    for n, v in doc["admin_at_end"].items():
        ad = v["adapters"] or {}
        print(f"  {n}: {v['state']}, held {[h['name'] for h in ad.get('held', [])]}, "
              f"max_lora {ad.get('max_lora')}, load_seconds {ad.get('load_seconds')}; "
              f"engine lists {sorted(doc['engines_at_end'][n])}")
    print(f"  engines after (a): {doc['engines_after_each']}, after (c): "
          f"{doc['engines_after_mixed']}; over budget at end: {doc['over_budget']}")
    print(f"  engine logs: {doc['engine_logs']}")
    print(f"  Sluice's counters against the engines' logs: {doc.get('counts_agree')}")
    print(f"  sluice log notes: {doc['sluice_log']['count']}")


if __name__ == "__main__":
    main()
