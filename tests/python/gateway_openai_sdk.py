"""End-to-end check of the gateway with the official OpenAI Python SDK.

Run by tests/it/gateway_openai_sdk.rs, which starts simulated backends and a gateway and passes:
  SLUICE_BASE_URL   the gateway's /v1 URL
  SLUICE_MODEL      a model the fleet serves (through an alias)
  SLUICE_CUT_MODEL  a model whose only backend cuts streams mid-way
Prints one line per check and exits non-zero on the first failure.
"""

import os

import openai
from openai import OpenAI
from checks import check, done

base_url = os.environ["SLUICE_BASE_URL"]
model = os.environ["SLUICE_MODEL"]
cut_model = os.environ["SLUICE_CUT_MODEL"]
client = OpenAI(base_url=base_url, api_key="sk-test", max_retries=0, timeout=30)


# Non-streaming chat.
r = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Say hello"}], max_tokens=5
)
check("chat object", r.object == "chat.completion", r)
check("chat model is the name asked for", r.model == model, r.model)
check("chat content", bool(r.choices[0].message.content), r)
check("chat usage", r.usage is not None and r.usage.completion_tokens == 5, r.usage)

# Streaming with include_usage: content chunks, then one usage chunk with no choices.
chunks = list(
    client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Count to three"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
)
text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
check("stream text", len(text) > 0, chunks)
usage_chunks = [c for c in chunks if c.usage is not None]
check("stream usage chunk", len(usage_chunks) == 1 and usage_chunks[0].choices == [], usage_chunks)
check("stream usage counts", usage_chunks[0].usage.completion_tokens == 6, usage_chunks[0].usage)
check("stream model", all(c.model == model for c in chunks), [c.model for c in chunks])

# Streaming without include_usage: no usage chunk at all.
chunks = list(
    client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
    )
)
check("no usage chunk unless asked", all(c.usage is None for c in chunks), chunks)
check("every chunk has a choice", all(len(c.choices) == 1 for c in chunks), chunks)

# Completions and embeddings.
r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=4)
check("completion", r.object == "text_completion" and r.usage.completion_tokens == 4, r)
e = client.embeddings.create(model=model, input=["a", "b"])
check("embeddings", len(e.data) == 2 and len(e.data[0].embedding) > 1, e)

# Models.
ids = [m.id for m in client.models.list()]
check("models list", model in ids, ids)
check("model retrieve", client.models.retrieve(model).id == model)

# An unknown model raises NotFoundError.
try:
    client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    check("unknown model raises", False, "no exception")
except openai.NotFoundError as err:
    check("unknown model raises NotFoundError", err.status_code == 404, err)

# A stream cut by the backend mid-way raises instead of returning a truncated answer.
try:
    got = ""
    for c in client.chat.completions.create(
        model=cut_model, messages=[{"role": "user", "content": "long story"}], max_tokens=50, stream=True
    ):
        if c.choices:
            got += c.choices[0].delta.content or ""
    check("cut stream raises", False, f"returned {got!r} without an error")
except openai.APIError as err:
    check("cut stream raises APIError", "incomplete" in str(err.message), err)

done()
