"""End-to-end check of the gateway's Anthropic Messages API with the official `anthropic` SDK.

Run by tests/it/api_messages.rs, which starts simulated backends and a gateway and passes:
  SLUICE_BASE_URL      the gateway's root URL (the SDK appends /v1/messages)
  SLUICE_KEY           a valid key with a generous token limit
  SLUICE_LIMITED_KEY   a valid key whose token limit one request exhausts
  SLUICE_MODEL         a model a vLLM backend serves (through an alias)
  SLUICE_CUT_MODEL     a model whose only backend cuts streams mid-way
  SLUICE_TGI_MODEL     a model only a TGI backend serves (by translation)
Prints one line per check and exits non-zero on the first failure.
"""

import os

import anthropic
from anthropic import Anthropic
from checks import check, done, raises

base_url = os.environ["SLUICE_BASE_URL"]
model = os.environ["SLUICE_MODEL"]
cut_model = os.environ["SLUICE_CUT_MODEL"]
tgi_model = os.environ["SLUICE_TGI_MODEL"]


def make(key):
    return Anthropic(base_url=base_url, api_key=key, max_retries=0, timeout=30)


client = make(os.environ["SLUICE_KEY"])


say = [{"role": "user", "content": "Say hello"}]

# Whole.
m = client.messages.create(model=model, max_tokens=5, messages=say)
check("create type", m.type == "message", m)
check("create model is the name asked for", m.model == model, m.model)
check("create content", m.content and m.content[0].type == "text", m)
check("create usage", m.usage.input_tokens > 0 and m.usage.output_tokens == 5, m.usage)

# Streamed, event by event and as the SDK's accumulated message.
with client.messages.stream(model=model, max_tokens=6, messages=say) as s:
    kinds = [e.type for e in s]
    final = s.get_final_message()
check("stream starts with message_start", kinds[0] == "message_start", kinds)
check("stream ends with message_stop", kinds[-1] == "message_stop", kinds)
check("stream has text", "content_block_delta" in kinds or "text" in kinds, kinds)
check("stream model", final.model == model, final.model)
check("stream usage", final.usage.output_tokens == 6 and final.usage.input_tokens > 0, final.usage)

# Token counting, routed by model.
c = client.messages.count_tokens(model=model, messages=say)
check("count_tokens", c.input_tokens > 0, c)

# Sluice's own errors raise the SDK's classes.
e = raises(
    "unknown model is NotFoundError",
    anthropic.NotFoundError,
    lambda: client.messages.create(model="no-such-model", max_tokens=5, messages=say),
)
check("not_found_error type", e.body["error"]["type"] == "not_found_error", e.body)
raises(
    "wrong key is AuthenticationError",
    anthropic.AuthenticationError,
    lambda: make("sk-sluice-wrong").messages.create(model=model, max_tokens=5, messages=say),
)
m = client.messages.create(model=tgi_model, max_tokens=5, messages=say)
check("a model only TGI serves is answered by translation", m.usage.output_tokens > 0, m)
e = raises(
    "a field translation cannot carry is BadRequestError naming it",
    anthropic.BadRequestError,
    lambda: client.messages.create(model=tgi_model, max_tokens=5, messages=say, extra_body={"top_k": 3}),
)
check("names the field", "`top_k`" in e.message, e.message)


# A stream the backend cuts mid-way raises.
def cut():
    with client.messages.stream(model=cut_model, max_tokens=50, messages=say) as s:
        for _ in s:
            pass


raises("mid-stream failure raises", anthropic.APIStatusError, cut)

# A token limit stops a Messages client.
limited = make(os.environ["SLUICE_LIMITED_KEY"])
limited.messages.create(model=model, max_tokens=40, messages=say)
e = raises(
    "over its token limit is RateLimitError",
    anthropic.RateLimitError,
    lambda: limited.messages.create(model=model, max_tokens=40, messages=say),
)
check("rate_limit_error type", e.body["error"]["type"] == "rate_limit_error", e.body)
check("retry-after", "retry-after" in e.response.headers, dict(e.response.headers))

done()
