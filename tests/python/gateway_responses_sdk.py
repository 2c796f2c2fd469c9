"""The Responses API through two gateway replicas with the official OpenAI Python SDK.

Run by tests/it/api_responses.rs, which starts vLLM sims with the response store on and two
gateways with the same config, and passes:
  SLUICE_BASE_URL, SLUICE_BASE_URL_2   the two replicas' /v1 URLs
  SLUICE_MODEL                         a model the store sims serve
  SLUICE_CUT_MODEL                     a model whose only backend cuts streams mid-way
Prints one line per check and exits non-zero on the first failure.
"""

import os

import openai
from openai import OpenAI
from checks import check, done

model = os.environ["SLUICE_MODEL"]
cut_model = os.environ["SLUICE_CUT_MODEL"]
one = OpenAI(base_url=os.environ["SLUICE_BASE_URL"], api_key="sk-test", max_retries=0, timeout=30)
two = OpenAI(base_url=os.environ["SLUICE_BASE_URL_2"], api_key="sk-test", max_retries=0, timeout=30)


# Whole, through replica 1.
r = one.responses.create(model=model, input="Say hello", max_output_tokens=5)
check("create object", r.object == "response" and r.id.startswith("resp_"), r)
check("create model is the name asked for", r.model == model, r.model)
check("create text", bool(r.output_text), r)
check("create usage", r.usage is not None and r.usage.output_tokens == 5, r.usage)

# Retrieved and continued through replica 2.
got = two.responses.retrieve(r.id)
check("retrieve on the other replica", got.id == r.id and got.output_text == r.output_text, got)
nxt = two.responses.create(model=model, input="And again", previous_response_id=r.id, max_output_tokens=4)
check("previous_response_id on the other replica", nxt.previous_response_id == r.id, nxt)
check("continued response is retrievable", one.responses.retrieve(nxt.id).id == nxt.id)

# Streamed with the SDK's stream helper: typed events, a final response with usage.
with one.responses.stream(model=model, input="Tell me", max_output_tokens=6) as stream:
    kinds = [event.type for event in stream]
    final = stream.get_final_response()
check("stream events", kinds[0] == "response.created" and "response.output_text.delta" in kinds, kinds)
check("stream final usage", final.usage is not None and final.usage.output_tokens == 6, final.usage)
check("streamed response retrievable elsewhere", two.responses.retrieve(final.id).id == final.id)

# Raw stream: no [DONE], ends with the lifecycle event.
events = list(one.responses.create(model=model, input="Hi", max_output_tokens=3, stream=True))
check("raw stream ends completed", events[-1].type in ("response.completed", "response.incomplete"), events[-1])

# Background, cancelled through the other replica.
bg = one.responses.create(model=model, input="A long story", background=True, max_output_tokens=400)
check("background queued", bg.status in ("queued", "in_progress"), bg.status)
cancelled = two.responses.cancel(bg.id)
check("cancel on the other replica", cancelled.status == "cancelled" and cancelled.id == bg.id, cancelled)

# An id no backend has.
try:
    two.responses.retrieve("resp_doesnotexist")
    check("unknown id raises", False)
except openai.NotFoundError as err:
    check("unknown id raises NotFoundError", err.status_code == 404, err)

# A stream cut by the backend mid-way raises instead of returning a truncated answer.
try:
    got = ""
    for event in one.responses.create(model=cut_model, input="long story", max_output_tokens=50, stream=True):
        if event.type == "response.output_text.delta":
            got += event.delta
    check("cut stream raises", False, f"returned {got!r} without an error")
except openai.APIError as err:
    check("cut stream raises APIError", "incomplete" in str(err.message), err)

try:
    with one.responses.stream(model=cut_model, input="long story", max_output_tokens=50) as stream:
        for _ in stream:
            pass
    check("cut stream helper raises", False)
except openai.APIError as err:
    check("cut stream helper raises APIError", "incomplete" in str(err.message), err)

done()
