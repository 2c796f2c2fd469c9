"""A stream continued on another backend, read through the official OpenAI Python SDK.

Run by tests/it/zero_resume.rs, which starts a backend that cuts every stream mid-way, a
healthy one, and a round-robin gateway over both, and passes:
  SLUICE_BASE_URL   the gateway's /v1 URL
  SLUICE_MODEL      the model both serve
  SLUICE_WANT_TEXT  the answer's text, produced without a break
Each of two streams (one of which starts on the cutting backend) must read as that answer:
no exception, one role, one finish_reason, the text, usage. Exits non-zero on a failure.
"""

import os
import sys

from openai import OpenAI

client = OpenAI(
    base_url=os.environ["SLUICE_BASE_URL"], api_key="sk-test", max_retries=0, timeout=30
)
model = os.environ["SLUICE_MODEL"]
want = os.environ["SLUICE_WANT_TEXT"]
passed = 0


def check(name, cond, detail=""):
    global passed
    if not cond:
        print(f"FAIL {name}: {detail}")
        sys.exit(1)
    passed += 1
    print(f"ok   {name}")


for attempt in range(2):
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell me about the sea."}],
        max_tokens=40,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, roles, finishes, ids, usage = "", 0, [], set(), None
    for chunk in stream:
        ids.add((chunk.id, chunk.created, chunk.model))
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles += 1
            text += choice.delta.content or ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    check(f"stream {attempt}: one id, created, model", len(ids) == 1, ids)
    check(f"stream {attempt}: one role", roles == 1, roles)
    check(f"stream {attempt}: the whole answer", text == want, f"{text!r} vs {want!r}")
    check(f"stream {attempt}: one finish", len(finishes) == 1, finishes)
    check(
        f"stream {attempt}: usage",
        usage is not None and usage.completion_tokens == len(want.split()),
        usage,
    )

print(f"{passed} passed, 0 failed")
