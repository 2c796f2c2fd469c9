"""A Messages stream continued on another backend, read through the official `anthropic` SDK.

Run by tests/it/zero_resume.rs, which starts a vLLM backend that cuts every stream mid-way, a
healthy one, and a round-robin gateway over both, and passes:
  SLUICE_BASE_URL   the gateway's root URL (the SDK appends /v1/messages)
  SLUICE_MODEL      the model both serve
  SLUICE_WANT_TEXT  the answer's text, produced without a break
Each of two streams (one of which starts on the cutting backend) must read as that answer:
no exception, the text, one text block, a stop reason and usage. Exits non-zero on a failure.
"""

import os

from anthropic import Anthropic
from checks import check, done

client = Anthropic(base_url=os.environ["SLUICE_BASE_URL"], api_key="sk-test", max_retries=0, timeout=30)
model = os.environ["SLUICE_MODEL"]
want = os.environ["SLUICE_WANT_TEXT"]


for attempt in range(2):
    with client.messages.stream(
        model=model,
        max_tokens=40,
        system="Be brief.",
        messages=[{"role": "user", "content": "Tell me about the sea."}],
    ) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    check(f"stream {attempt}: the whole answer", text == want, f"{text!r} vs {want!r}")
    check(f"stream {attempt}: one text block", len(final.content) == 1, final.content)
    check(f"stream {attempt}: stop reason", final.stop_reason in ("end_turn", "max_tokens"), final.stop_reason)
    check(
        f"stream {attempt}: usage",
        final.usage.output_tokens == len(want.split()) and final.usage.input_tokens > 0,
        final.usage,
    )

done()
