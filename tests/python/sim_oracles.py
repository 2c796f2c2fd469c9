"""Official clients as oracles for the simulator's personalities.

Run by tests/it/sim_python_oracles.rs, which starts the simulators and passes their URLs:
SIM_VLLM_URL, SIM_TGI_URL, SIM_OLLAMA_URL, and SIM_VLLM_STORE_URL (a vLLM simulator with the
Responses store on, at real speed). Exits non-zero on the first failed check.
"""
import os

import anthropic
import ollama
import openai
from text_generation import Client as TgiClient
from checks import check

VLLM = os.environ["SIM_VLLM_URL"]
VLLM_STORE = os.environ["SIM_VLLM_STORE_URL"]
TGI = os.environ["SIM_TGI_URL"]
OLLAMA = os.environ["SIM_OLLAMA_URL"]


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


def vllm_responses():
    c = openai.OpenAI(base_url=f"{VLLM_STORE}/v1", api_key="unused", max_retries=0)
    r = c.responses.create(model="tiny", input="Hello", max_output_tokens=5)
    check(
        "vllm responses",
        r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 5,
        r,
    )
    check("vllm responses output_text", len(r.output_text.split()) == 5, r.output_text)
    got = c.responses.retrieve(r.id)
    check("vllm responses retrieve", got.id == r.id and got.output_text == r.output_text, got)
    r2 = c.responses.create(model="tiny", input="More", max_output_tokens=3, previous_response_id=r.id)
    check(
        "vllm responses previous_response_id",
        r2.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens,
        (r.usage, r2.usage),
    )
    kinds = []
    text = []
    with c.responses.stream(model="tiny", input="Hello", max_output_tokens=4) as s:
        for ev in s:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                text.append(ev.delta)
        final = s.get_final_response()
    check(
        "vllm responses stream",
        kinds[0] == "response.created" and kinds[-1] == "response.completed" and "".join(text) == final.output_text,
        kinds,
    )
    check("vllm responses stream usage", final.usage.output_tokens == 4, final.usage)
    b = c.responses.create(model="tiny", input="A long story", max_output_tokens=400, background=True)
    check("vllm responses background", b.status == "queued" and b.background, b)
    x = c.responses.cancel(b.id)
    check("vllm responses cancel", x.status == "cancelled", x)
    check("vllm responses cancelled stays", c.responses.retrieve(b.id).status == "cancelled")
    try:
        c.responses.retrieve("resp_doesnotexist")
        check("vllm responses unknown id raises", False)
    except openai.NotFoundError as err:
        check("vllm responses unknown id is NotFoundError", err.body["param"] == "response_id", err.body)


def vllm_messages():
    a = anthropic.Anthropic(base_url=VLLM, api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Well?"}]
    m = a.messages.create(model="tiny", max_tokens=5, system="Be brief.", messages=msgs)
    check(
        "vllm messages",
        m.stop_reason == "max_tokens" and m.usage.output_tokens == 5 and m.content[0].type == "text",
        m,
    )
    n = a.messages.count_tokens(model="tiny", system="Be brief.", messages=msgs)
    check("vllm messages count_tokens", n.input_tokens == m.usage.input_tokens, (n, m.usage))
    with a.messages.stream(model="tiny", max_tokens=4, messages=msgs) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    check(
        "vllm messages stream",
        final.usage.output_tokens == 4 and final.stop_reason == "max_tokens" and final.content[0].text == text,
        final,
    )
    try:
        a.messages.create(model="nope", max_tokens=5, messages=msgs)
        check("vllm messages unknown model raises", False)
    except anthropic.NotFoundError as err:
        check("vllm messages unknown model is NotFoundError", err.body["type"] == "error", err.body)


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
    vllm_responses()
    vllm_messages()
    tgi_native()
    ollama_native()
    print("ALL ORACLE CHECKS PASSED")


if __name__ == "__main__":
    main()
