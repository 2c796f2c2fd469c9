#!/usr/bin/env python3
"""KV-cache events seen from outside: subscribe to an engine's publisher, make it store and
reuse prompt blocks, ask for a replay, and print the shapes of what arrived.

Works against a real vLLM started with `--kv-events-config` (and `--enable-prompt-tokens-details`)
and against `sluice sim --kind vllm --kv-events-config ...`, so the two outputs can be compared
line by line. It reads, in order:

1. `GET /kv_event_sources`: the publisher's endpoints (a `*` host becomes the engine's host).
2. Connects a SUB socket (topic from the sources) and a DEALER to the replay endpoint.
3. Sends two chat requests sharing a long system prompt, then (with `--reset`) calls
   `POST /reset_prefix_cache` and sends one more request; prints each request's usage.
4. Prints every live message: frame count, topic, sequence number, and the decoded batch with
   long integer lists shortened to their length and first values.
5. Sends a replay request `["", seq]` for the first sequence number it saw (or 0) and prints
   every answer message's frame layout until the end marker (sequence -1).

Needs Python with `pyzmq` and `msgspec` (vLLM's own environment has both).

    python bench/kv/sub_check.py --url http://127.0.0.1:8000 --model tiny [--reset]

`--reset` needs the engine's development routes (vLLM: `VLLM_SERVER_DEV_MODE=1`; the
simulator: `--server-dev-mode`). For the simulator, e.g.:

    sluice sim --kind vllm --model tiny --port 8000 --block-size 128 \
        --enable-prompt-tokens-details --server-dev-mode \
        --kv-events-config '{"enable_kv_cache_events":true,"endpoint":"tcp://*:0","replay_endpoint":"tcp://*:0","topic":"kv"}'
"""

import argparse
import json
import time
import urllib.error
import urllib.parse
import urllib.request

import msgspec
import zmq

SYSTEM = "You are a careful assistant who answers in short sentences. " * 40


def http(url, method="GET", body=None, timeout=60):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def dial(endpoint, host):
    """The address to connect to for an engine's endpoint setting."""
    rest = endpoint.split("://", 1)[1]
    h, port = rest.rsplit(":", 1)
    if h in ("*", "0.0.0.0", "[::]", "::"):
        h = host
    return f"tcp://{h}:{port}"


def short(v):
    """`v` with long lists of integers shortened, for printing."""
    if isinstance(v, list):
        if len(v) > 6 and all(isinstance(x, int) for x in v):
            return f"<{len(v)} ints: {v[:3]}...>"
        return [short(x) for x in v]
    if isinstance(v, dict):
        return {k: short(x) for k, x in v.items()}
    if isinstance(v, bytes):
        return f"<{len(v)} bytes>"
    return v


def shape(payload):
    """The decoded batch, with each event's keys in wire order."""
    batch = msgspec.msgpack.decode(payload)
    return {
        "array_len": len(batch),
        "ts_type": type(batch[0]).__name__,
        "events": [short(e) for e in batch[1]],
        "rest": batch[2:],
    }


def chat(url, model, user, max_tokens):
    body = {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": user},
        ],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    if model:
        body["model"] = model
    status, text = http(url + "/v1/chat/completions", "POST", body)
    usage = json.loads(text).get("usage") if status == 200 else text
    print(f"chat {user!r}: {status} usage={json.dumps(usage)}")


def drain(sub, deadline_s, quiet_s):
    """Live messages until `quiet_s` without one, or `deadline_s` in all."""
    out = []
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if not sub.poll(int(quiet_s * 1000)):
            break
        out.append(sub.recv_multipart())
    return out


def replay(dealer, start, deadline_s):
    dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
    end = time.monotonic() + deadline_s
    answers = []
    while time.monotonic() < end:
        if not dealer.poll(int(max(0.0, end - time.monotonic()) * 1000)):
            print("replay: no end marker before the deadline")
            break
        frames = dealer.recv_multipart()
        answers.append(frames)
        seqs = [f for f in frames if len(f) == 8]
        if seqs and int.from_bytes(seqs[0], "big", signed=True) == -1:
            break
    return answers


def print_live(messages):
    for frames in messages:
        topic, seq, payload = frames[0], frames[1], frames[-1]
        print(
            f"live: {len(frames)} frames, topic={topic!r}, "
            f"seq={int.from_bytes(seq, 'big', signed=True)}"
        )
        print("  " + json.dumps(shape(payload)))


def print_replay(answers):
    for frames in answers:
        layout = [
            f"seq {int.from_bytes(f, 'big', signed=True)}" if len(f) == 8 else f"{len(f)} bytes"
            for f in frames
        ]
        print(f"replay: {len(frames)} frames: {layout}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--reset", action="store_true", help="also reset the prefix cache")
    a = ap.parse_args()
    host = urllib.parse.urlparse(a.url).hostname
    status, text = http(a.url + "/kv_event_sources")
    print(f"/kv_event_sources: {status} {text}")
    sources = json.loads(text)
    if not sources:
        print("no publisher: the engine runs without KV-cache events")
        return
    cfg = next(iter(sources.values()))
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(dial(cfg["endpoint"], host))
    sub.setsockopt(zmq.SUBSCRIBE, cfg.get("topic", "").encode())
    dealer = ctx.socket(zmq.DEALER)
    if cfg.get("replay_endpoint"):
        dealer.connect(dial(cfg["replay_endpoint"], host))
    # a SUB socket misses what is published before its subscription reaches the publisher;
    # replay (below) shows those batches anyway
    time.sleep(0.5)
    model = a.model
    chat(a.url, model, "first question", a.max_tokens)
    chat(a.url, model, "second question", a.max_tokens)
    if a.reset:
        status, text = http(a.url + "/reset_prefix_cache", "POST")
        print(f"/reset_prefix_cache: {status} {text}")
        live = drain(sub, 3.0, 1.0)
        print(f"after the reset, before the next request: {len(live)} live messages")
        print_live(live)
        chat(a.url, model, "after the reset", a.max_tokens)
    live = drain(sub, 10.0, 1.5)
    print_live(live)
    if cfg.get("replay_endpoint"):
        print_replay(replay(dealer, 0, 10.0))
        print("replay from seq 1:")
        print_replay(replay(dealer, 1, 10.0))
        dealer.send_multipart([b"", b"\x00" * 8, b"extra"])
        print(f"malformed request answered: {bool(dealer.poll(1000))}")
    sub.close(0)
    dealer.close(0)


if __name__ == "__main__":
    main()
