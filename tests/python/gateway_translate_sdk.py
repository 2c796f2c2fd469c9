"""The Responses and Messages APIs with the official SDKs over a mixed fleet, natively or by
translation to chat completions, whichever backend answers.

Run by tests/it/api_translate.rs, which starts simulated backends and a gateway and passes:
  SLUICE_BASE_URL   the gateway's root URL
  SLUICE_MODEL      a model a vLLM, a TGI and an Ollama backend serve
  SLUICE_TOOL_MODEL a model only a TGI backend serves (it calls a tool when made to)
  SLUICE_CUT_MODEL  a model whose only backend (TGI) cuts streams mid-way
  SLUICE_SERVED_BY  comma-separated backend names allowed to answer SLUICE_MODEL
Prints one line per check and exits non-zero on the first failure.
"""

import json
import os

import anthropic
import openai
from anthropic import Anthropic
from openai import OpenAI
from checks import check, done, raises

base_url = os.environ["SLUICE_BASE_URL"]
model = os.environ["SLUICE_MODEL"]
tool_model = os.environ["SLUICE_TOOL_MODEL"]
cut_model = os.environ["SLUICE_CUT_MODEL"]
served_by = set(os.environ["SLUICE_SERVED_BY"].split(","))

oa = OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
an = Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=30)


def backend_of(raw):
    return raw.headers.get("x-sluice-backend")


weather = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}

# --- Responses API ---------------------------------------------------------------------------
raw = oa.responses.with_raw_response.create(
    model=model, instructions="Be terse.", input="Say hello", max_output_tokens=5
)
r = raw.parse()
check("responses.create served by an expected backend", backend_of(raw) in served_by, backend_of(raw))
check("responses.create output text", r.output_text != "" and r.output[0].type == "message", r)
check("responses.create usage", r.usage.output_tokens == 5 and r.usage.input_tokens > 0, r.usage)
# Ollama's own /v1/responses says "completed" even when the output limit cut the answer.
cut_status = "completed" if backend_of(raw) == "xl-f-ollama" else "incomplete"
check("responses.create status", r.status == cut_status, r.status)

history = [
    {"role": "user", "content": "Weather in Paris?"},
    {"type": "function_call", "call_id": "call_7", "name": "get_weather", "arguments": '{"city":"Paris","days":1}'},
    {"type": "function_call_output", "call_id": "call_7", "output": "Sunny"},
    {"role": "assistant", "content": "It is sunny."},
    {"role": "user", "content": "And tomorrow?"},
]
tools = [{"type": "function", "name": "get_weather", "parameters": weather}]
with oa.responses.stream(model=model, input=history, tools=tools, max_output_tokens=6) as s:
    kinds = [e.type for e in s]
    final = s.get_final_response()
check("responses.stream starts with response.created", kinds[0] == "response.created", kinds)
check("responses.stream ends with response.completed", kinds[-1] == "response.completed", kinds)
check("responses.stream text deltas", "response.output_text.delta" in kinds, kinds)
check("responses.stream final usage", final.usage.output_tokens == 6, final.usage)
check("responses.stream final text", final.output_text != "", final)

# A forced function call (TGI by translation) and its output sent back.
r = oa.responses.create(
    model=tool_model,
    input="Weather in Paris?",
    tools=tools,
    tool_choice={"type": "function", "name": "get_weather"},
    max_output_tokens=40,
)
call = r.output[0]
check("responses function_call item", call.type == "function_call" and call.name == "get_weather", r)
args = json.loads(call.arguments)
check("responses function_call arguments", isinstance(args["city"], str) and isinstance(args["days"], int), args)
with oa.responses.stream(
    model=tool_model, input="Weather?", tools=tools, tool_choice="required", max_output_tokens=40
) as s:
    kinds = [e.type for e in s]
    final = s.get_final_response()
check("responses.stream function call events", "response.function_call_arguments.delta" in kinds, kinds)
check("responses.stream function call item", final.output[0].type == "function_call", final)
r = oa.responses.create(
    model=tool_model,
    input=[
        {"role": "user", "content": "Weather in Paris?"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"},
    ],
    tools=tools,
    max_output_tokens=5,
)
check("responses after the tool's output: text", r.output[0].type == "message" and r.output_text != "", r)

e = raises(
    "responses previous_response_id on a translated-only model is BadRequestError",
    openai.BadRequestError,
    lambda: oa.responses.create(model=tool_model, input="hi", previous_response_id="resp_x"),
)
check("names previous_response_id", e.body.get("param") == "previous_response_id", e.body)


def cut_responses():
    with oa.responses.stream(model=cut_model, input="hi", max_output_tokens=50) as s:
        for _ in s:
            pass


raises("responses mid-stream failure raises", openai.APIError, cut_responses)

# --- Messages API ----------------------------------------------------------------------------
say = [{"role": "user", "content": "Say hello"}]
raw = an.messages.with_raw_response.create(model=model, max_tokens=5, system="Be terse.", messages=say)
m = raw.parse()
check("messages.create served by an expected backend", backend_of(raw) in served_by, backend_of(raw))
check("messages.create text", m.content[0].type == "text" and m.content[0].text != "", m)
check("messages.create stop_reason", m.stop_reason == "max_tokens", m.stop_reason)
check("messages.create usage", m.usage.output_tokens == 5 and m.usage.input_tokens > 0, m.usage)

turns = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_9", "name": "get_weather", "input": {"city": "Paris", "days": 1}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "Sunny"}, {"type": "text", "text": "And tomorrow?"}]},
]
atools = [{"name": "get_weather", "description": "Weather", "input_schema": weather}]
with an.messages.stream(model=model, max_tokens=6, messages=turns, tools=atools) as s:
    kinds = [e.type for e in s]
    final = s.get_final_message()
check("messages.stream starts with message_start", kinds[0] == "message_start", kinds)
check("messages.stream ends with message_stop", kinds[-1] == "message_stop", kinds)
check("messages.stream usage", final.usage.output_tokens == 6 and final.usage.input_tokens > 0, final.usage)
check("messages.stream text", final.content[0].type == "text" and final.content[0].text != "", final)

# Tool use (TGI by translation): whole, streamed (input_json_delta accumulated by the SDK), and
# the conversation continued with the tool's result.
m = an.messages.create(
    model=tool_model, max_tokens=40, messages=say, tools=atools, tool_choice={"type": "tool", "name": "get_weather"}
)
block = m.content[0]
check("messages tool_use block", block.type == "tool_use" and block.name == "get_weather", m)
check("messages tool_use input", isinstance(block.input["city"], str) and isinstance(block.input["days"], int), block)
check("messages tool_use stop_reason", m.stop_reason == "tool_use", m.stop_reason)
with an.messages.stream(
    model=tool_model, max_tokens=40, messages=say, tools=atools, tool_choice={"type": "any"}
) as s:
    final = s.get_final_message()
check("messages.stream tool_use accumulated", final.content[0].type == "tool_use" and final.content[0].input == block.input, final)
check("messages.stream tool_use stop_reason", final.stop_reason == "tool_use", final.stop_reason)
m = an.messages.create(
    model=tool_model,
    max_tokens=5,
    tools=atools,
    messages=say
    + [
        {"role": "assistant", "content": [block.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "Sunny"}]},
    ],
)
check("messages after the tool's result: text", m.content[0].type == "text" and m.stop_reason == "max_tokens", m)

e = raises(
    "messages extended thinking on a translated-only model is BadRequestError",
    anthropic.BadRequestError,
    lambda: an.messages.create(
        model=tool_model, max_tokens=2048, messages=say, thinking={"type": "enabled", "budget_tokens": 1024}
    ),
)
check("names thinking", "`thinking`" in e.message, e.message)


def cut_messages():
    with an.messages.stream(model=cut_model, max_tokens=50, messages=say) as s:
        for _ in s:
            pass


raises("messages mid-stream failure raises", anthropic.APIStatusError, cut_messages)

done()
