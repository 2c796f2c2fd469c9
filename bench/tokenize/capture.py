#!/usr/bin/env python3
"""Ground truth for `src/tokenizer`: the prompt token ids a real vLLM computes for a set of
chat and completions requests, written as a JSON fixture that `tests/it/tokenizer_vllm.rs`
compares with Sluice's own tokenizer, token for token.

For one tokenizer fixture folder (tests/fixtures/tokenizer/<name>/: a tokenizer.json plus a
chat template in tokenizer_config.json or chat_template.jinja) it:
1. copies the model folder (weights and config of a small model whose vocabulary the fixture's
   tokenizer.json matches) to a temporary folder and puts the fixture's tokenizer files in
   place of the model's own (the model's chat_template.jinja is removed, so the fixture's
   template is the one served);
2. starts a real vLLM on 127.0.0.1 with it (`vllm serve ... --served-model-name tiny`) and
   waits for `GET /health`;
3. POSTs every request of `cases()` to the path it names: `/tokenize` (chat form and
   completions form), `/v1/chat/completions` and `/v1/completions` with
   `return_token_ids: true` and `max_tokens: 1` (the engine's own prompt ids);
4. writes `{"vllm": version, "fixture": name, "cases": [{name, path, body, ids}]}`, where
   `body` is the exact text that was sent (key order matters to templates) and `ids` the
   prompt token ids the server answered; then stops the server.

Usage (the vLLM CPU build and the tiny random-weight Llama of bench/plan/real_vllm.py):
  python3 bench/tokenize/capture.py --vllm VENV/bin/vllm --model MODEL_DIR \
      --fixture tests/fixtures/tokenizer/tiny-tools \
      --out tests/fixtures/tokenizer/tiny-tools.vllm.json
Or against a vLLM already serving the fixture as model `tiny`: `--url http://127.0.0.1:PORT`
(then --vllm and --model are not needed). Only the Python standard library is used.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "  Current weather for a city.  ",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7.5},
            },
            "required": ["city"],
        },
        "strict": True,
        "x-extra": "dropped by vLLM",
    },
}
CLOCK = {"type": "function", "function": {"name": "now"}}

TOOL_TURNS = [
    {"role": "system", "content": "You can look things up."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"unit": "celsius", "city": "Paris"}'},
            },
            {
                "type": "function",
                "id": "call_2",
                "function": {"arguments": '{"city":"Oslo","days":2}', "name": "get_weather"},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "9 C"}, {"type": "text", "text": "rain"}]},
    {"role": "assistant", "content": "Paris: 18 C and sunny. Oslo: 9 C with rain."},
    {"role": "user", "content": "Thanks!"},
]


def chat(messages, **extra):
    body = {"model": "tiny", "messages": messages}
    body.update(extra)
    return body


def cases():
    """(name, path, body) of every request; the body is sent as json.dumps(body)."""
    hello = [{"role": "user", "content": "Hello there, how are you?"}]
    multi = [
        {"role": "system", "content": "  You are terse.  "},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "/raw And 3 + 3?"},
    ]
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "Rules:"}, {"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "first part"}, "second part", {"type": "text", "text": "third"}]},
    ]
    odd_args = [
        {"role": "user", "content": "Call it."},
        {
            "role": "assistant",
            "content": "Calling.",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "now", "arguments": ""}},
                {"id": "b", "type": "function", "function": {"name": "now", "arguments": "{not json"}},
                {"id": "c", "type": "function", "function": {"name": "now", "arguments": "[1, 2]"}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "12:00"},
    ]
    unicode = [
        {"role": "user", "content": "Caf\u00e9 \u2615 \U0001F600 \"quotes\" \\ back\nslash <s> tab\there", "name": "ana"},
    ]
    developer = [
        {"role": "developer", "content": "Follow the house style."},
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Late system text."},
    ]
    reasoning = [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": "Done.", "reasoning": "It is simple."},
        {"role": "user", "content": "Again."},
    ]
    out = [
        ("single_turn", "/tokenize", chat(hello)),
        ("system_multi_turn", "/tokenize", chat(multi)),
        ("tool_calls_and_results", "/tokenize", chat(TOOL_TURNS, tools=[WEATHER, CLOCK])),
        ("tools_list", "/tokenize", chat(hello, tools=[CLOCK, WEATHER])),
        ("empty_tools_list", "/tokenize", chat(hello, tools=[])),
        ("list_of_parts", "/tokenize", chat(parts)),
        ("no_generation_prompt", "/tokenize", chat(multi, add_generation_prompt=False)),
        (
            "continue_final_message",
            "/tokenize",
            chat(hello + [{"role": "assistant", "content": "I am fine, and  "}],
                 add_generation_prompt=False, continue_final_message=True),
        ),
        (
            "continue_final_parts",
            "/tokenize",
            chat(hello + [{"role": "assistant", "content": [{"type": "text", "text": "Well,"}]}],
                 add_generation_prompt=False, continue_final_message=True),
        ),
        ("odd_tool_arguments", "/tokenize", chat(odd_args, tools=[CLOCK])),
        ("unicode_and_special_text", "/tokenize", chat(unicode)),
        ("developer_role", "/tokenize", chat(developer[:2])),
        ("reasoning", "/tokenize", chat(reasoning)),
        (
            "template_kwargs",
            "/tokenize",
            chat(hello, chat_template_kwargs={"enable_thinking": False, "unused": None}),
        ),
        ("add_special_tokens", "/tokenize", chat(hello, add_special_tokens=True)),
        ("prompt", "/tokenize", {"model": "tiny", "prompt": "Hello world"}),
        ("prompt_spaces_specials", "/tokenize", {"model": "tiny", "prompt": "  two spaces, </s> and <s> inside\n"}),
        ("prompt_unicode", "/tokenize", {"model": "tiny", "prompt": "na\u00efve \u00fcber \u65e5\u672c \U0001F680"}),
        (
            "prompt_no_specials",
            "/tokenize",
            {"model": "tiny", "prompt": "Hello world", "add_special_tokens": False},
        ),
        ("chat_completions", "/v1/chat/completions", chat(multi)),
        (
            "chat_completions_tools",
            "/v1/chat/completions",
            chat(TOOL_TURNS, tools=[WEATHER, CLOCK], tool_choice="none"),
        ),
        ("chat_completions_reasoning_effort", "/v1/chat/completions", chat(hello, reasoning_effort="none")),
        ("chat_completions_developer", "/v1/chat/completions", chat(developer)),
        ("completions", "/v1/completions", {"model": "tiny", "prompt": "Once upon a time"}),
    ]
    return out


def post(url, path, text, timeout=60):
    req = urllib.request.Request(
        url + path, data=text.encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def prompt_ids(path, answer):
    if path == "/tokenize":
        return answer["tokens"]
    if path == "/v1/completions":
        return answer["choices"][0]["prompt_token_ids"]
    return answer["prompt_token_ids"]


def capture(url):
    out = []
    for name, path, body in cases():
        if path != "/tokenize":
            body = dict(body, max_tokens=1, return_token_ids=True, temperature=0)
        text = json.dumps(body, ensure_ascii=False)
        status, answer = post(url, path, text)
        if status != 200:
            print(f"{name}: {path} answered {status}: {answer}", file=sys.stderr)
            out.append({"name": name, "path": path, "body": text, "status": status})
            continue
        ids = prompt_ids(path, answer)
        out.append({"name": name, "path": path, "body": text, "ids": ids})
        print(f"{name}: {len(ids)} tokens", file=sys.stderr)
    return out


def prepare(model, fixture, into):
    shutil.copytree(model, into, dirs_exist_ok=True)
    for f in TOKENIZER_FILES:
        p = os.path.join(into, f)
        if os.path.exists(p):
            os.remove(p)
    for f in TOKENIZER_FILES:
        src = os.path.join(fixture, f)
        if os.path.exists(src):
            shutil.copyfile(src, os.path.join(into, f))


def wait_health(url, proc, deadline_s=300):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise SystemExit("vLLM did not become healthy in time")


def serve(vllm, folder, port, log):
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_HOST_IP="127.0.0.1",
    )
    cmd = [
        vllm, "serve", folder, "--served-model-name", "tiny", "--host", "127.0.0.1",
        "--port", str(port), "--max-model-len", "1024", "--enforce-eager",
    ]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def version(url):
    try:
        with urllib.request.urlopen(url + "/version", timeout=5) as r:
            return json.loads(r.read()).get("version")
    except (urllib.error.URLError, OSError, ValueError):
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fixture", required=True, help="tokenizer fixture folder")
    ap.add_argument("--out", required=True, help="the JSON fixture to write")
    ap.add_argument("--url", help="a vLLM already serving the fixture as model `tiny`")
    ap.add_argument("--vllm", default=os.environ.get("VLLM_BIN"), help="the vllm command")
    ap.add_argument("--model", default=os.environ.get("TINY_MODEL"), help="the model folder")
    ap.add_argument("--port", type=int, default=8917)
    args = ap.parse_args()
    proc = None
    tmp = None
    url = args.url
    try:
        if url is None:
            if not (args.vllm and args.model):
                raise SystemExit("give --url, or --vllm and --model")
            tmp = tempfile.mkdtemp(prefix="tokenize-capture-")
            folder = os.path.join(tmp, "model")
            prepare(args.model, args.fixture, folder)
            log = open(os.path.join(tmp, "vllm.log"), "w")
            proc = serve(args.vllm, folder, args.port, log)
            url = f"http://127.0.0.1:{args.port}"
            wait_health(url, proc)
        result = {
            "vllm": version(url),
            "fixture": os.path.basename(os.path.normpath(args.fixture)),
            "cases": capture(url),
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, ensure_ascii=False)
            f.write("\n")
        failed = [c["name"] for c in result["cases"] if "ids" not in c]
        print(f"wrote {args.out}: {len(result['cases'])} cases, refused: {failed}", file=sys.stderr)
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
