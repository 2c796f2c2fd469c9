"""Official clients as oracles for the simulator's personalities.

Run by tests/it/sim_python_oracles.rs, which starts the simulators and passes their URLs:
SIM_VLLM_URL, SIM_TGI_URL, SIM_OLLAMA_URL. Exits non-zero on the first failed check.
"""
import os
import sys

import ollama
import openai
from text_generation import Client as TgiClient

VLLM = os.environ["SIM_VLLM_URL"]
TGI = os.environ["SIM_TGI_URL"]
OLLAMA = os.environ["SIM_OLLAMA_URL"]


def check(name, cond, detail=""):
    if not cond:
        print(f"FAIL {name} {detail}")
        sys.exit(1)
    print(f"ok   {name}")


def openai_surface(label, base, model, embeddings):
    c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    r = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=5
    )
    check(f"{label} chat", r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5, r)
    check(f"{label} chat usage", r.usage.total_tokens == r.usage.prompt_tokens + 5, r.usage)
    text = []
    usage = None
    finish = None
    for chunk in c.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.content:
                text.append(ch.delta.content)
            if ch.finish_reason:
                finish = ch.finish_reason
    check(f"{label} chat stream", len(text) == 4 and finish == "length", (text, finish))
    check(f"{label} chat stream usage", usage is not None and usage.completion_tokens == 4, usage)
    r = c.completions.create(model=model, prompt="Once upon", max_tokens=3)
    check(f"{label} completions", r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3, r)
    ids = [m.id for m in c.models.list()]
    check(f"{label} models", len(ids) >= 1, ids)
    if embeddings:
        e = c.embeddings.create(model=model, input=["a", "b"])
        check(f"{label} embeddings", len(e.data) == 2 and len(e.data[0].embedding) > 0, e)
    try:
        c.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
        if label != "tgi":
            check(f"{label} unknown model raises", False)
    except openai.NotFoundError:
        check(f"{label} unknown model is NotFoundError", label != "tgi")


def tgi_native():
    c = TgiClient(TGI, timeout=20)
    r = c.generate("Hello", max_new_tokens=5, seed=7)
    check("tgi generate", r.details.generated_tokens == 5 and r.details.finish_reason == "length", r)
    check("tgi generate text", r.generated_text == "".join(t.text for t in r.details.tokens), r)
    tokens = []
    last = None
    for resp in c.generate_stream("Hello", max_new_tokens=4):
        tokens.append(resp.token.text)
        last = resp
    check("tgi generate_stream", len(tokens) == 4, tokens)
    check("tgi generate_stream details", last.details is not None and last.details.generated_tokens == 4, last)
    check("tgi generate_stream text", last.generated_text == "".join(tokens), last)


def ollama_native():
    c = ollama.Client(host=OLLAMA)
    r = c.chat(model="llama3.2", messages=[{"role": "user", "content": "Hello"}], options={"num_predict": 3})
    check("ollama chat", r.done and r.eval_count == 3 and r.message.role == "assistant", r)
    check("ollama chat durations", r.total_duration > 0 and r.prompt_eval_count > 0, r)
    parts = []
    final = None
    for part in c.chat(
        model="llama3.2", messages=[{"role": "user", "content": "Hello"}], stream=True, options={"num_predict": 4}
    ):
        parts.append(part.message.content)
        final = part
    check("ollama chat stream", final.done and final.done_reason == "length" and len(parts) == 5, parts)
    g = c.generate(model="llama3.2", prompt="Hi", options={"num_predict": 2})
    check("ollama generate", g.done and g.eval_count == 2, g)
    tags = [m.model for m in c.list().models]
    check("ollama tags", "llama3.2:latest" in tags, tags)
    ps = [m.model for m in c.ps().models]
    check("ollama ps", "llama3.2:latest" in ps, ps)
    e = c.embed(model="llama3.2", input=["a", "b"])
    check("ollama embed", len(e.embeddings) == 2, e)
    try:
        c.chat(model="missing", messages=[{"role": "user", "content": "x"}])
        check("ollama missing model raises", False)
    except ollama.ResponseError as err:
        check("ollama missing model 404", err.status_code == 404, err)


def main():
    openai_surface("vllm", VLLM, "tiny", True)
    openai_surface("tgi", TGI, "tgi", False)
    openai_surface("ollama", OLLAMA, "llama3.2", True)
    tgi_native()
    ollama_native()
    print("ALL ORACLE CHECKS PASSED")


if __name__ == "__main__":
    main()
