"""A Responses stream continued on another backend, read through the official `openai` SDK.

Run by tests/it/zero_resume.rs, which starts a vLLM backend that cuts every stream mid-way, a
healthy one, and a round-robin gateway over both, and passes:
  SLUICE_BASE_URL   the gateway's /v1 URL
  SLUICE_MODEL      the model both serve
  SLUICE_WANT_TEXT  the answer's text, produced without a break
Streams through `responses.stream(...)` and `responses.create(stream=True)` (of which some start
on the cutting backend) must read as that answer: no exception, one response whose
`output_text` is the whole answer, usage. Exits non-zero on a failure.
"""

import os

from openai import OpenAI
from checks import check, done

client = OpenAI(base_url=os.environ["SLUICE_BASE_URL"], api_key="sk-test", max_retries=0, timeout=30)
model = os.environ["SLUICE_MODEL"]
want = os.environ["SLUICE_WANT_TEXT"]
request = dict(
    model=model,
    max_output_tokens=40,
    instructions="Be brief.",
    input=[{"role": "user", "content": [{"type": "input_text", "text": "Tell me about the sea."}]}],
)


for attempt in range(2):
    with client.responses.stream(**request) as s:
        text = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        final = s.get_final_response()
    check(f"stream {attempt}: the whole answer", text == want, f"{text!r} vs {want!r}")
    check(f"stream {attempt}: output_text", final.output_text == want, final)
    check(f"stream {attempt}: one message", len(final.output) == 1, final.output)
    check(
        f"stream {attempt}: usage",
        final.usage is not None
        and final.usage.output_tokens == len(want.split())
        and final.usage.input_tokens > 0
        and final.usage.total_tokens == final.usage.input_tokens + final.usage.output_tokens,
        final.usage,
    )

for attempt in range(2):
    events = list(client.responses.create(stream=True, **request))
    kinds = [e.type for e in events]
    check(f"create {attempt}: one created, one completed", kinds.count("response.created") == 1
          and kinds[-1] == "response.completed" and kinds.count("response.completed") == 1, kinds)
    seqs = [e.sequence_number for e in events]
    check(f"create {attempt}: sequence numbers", seqs == list(range(len(events))), seqs)
    last = events[-1].response
    check(f"create {attempt}: same response", last.id == events[0].response.id, (last.id, events[0].response.id))
    check(f"create {attempt}: output_text", last.output_text == want, f"{last.output_text!r} vs {want!r}")

done()
