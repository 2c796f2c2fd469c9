"""A stream continued on another backend, read through the official OpenAI Python SDK.

Run by tests/it/zero_resume.rs, which starts a backend that cuts every stream mid-way, a
healthy one, and a round-robin gateway over both, and passes:
  SLUICE_BASE_URL   the gateway's /v1 URL
  SLUICE_MODEL      the model both serve
  SLUICE_WANT_TEXT  the answer's text, produced without a break
  SLUICE_CUT_BACKEND the name of the cutting backend (the gateway names the backend of each
                    answer in x-sluice-backend)
Each of two streams (one of which starts on the cutting backend) must read as that answer:
no exception, one role, one finish_reason, the text, usage.
A structured-output stream (response_format json_object) cannot be continued: when it starts
on the cutting backend, iterating it must raise openai.APIError (the gateway's terminal error
event) after part of the answer, never end as a silently short answer. Exits non-zero on a
failure.
"""

import os

from openai import APIConnectionError, APIError, APIStatusError, OpenAI
from checks import check, done

client = OpenAI(
    base_url=os.environ["SLUICE_BASE_URL"], api_key="sk-test", max_retries=0, timeout=30
)
model = os.environ["SLUICE_MODEL"]
want = os.environ["SLUICE_WANT_TEXT"]
cut_backend = os.environ["SLUICE_CUT_BACKEND"]


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



def structured_stream():
    """One json_object stream: the backend it started on, the text read, the error raised."""
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": "Describe the sea as a JSON object."}],
        max_tokens=40,
        seed=7,
        stream=True,
        response_format={"type": "json_object"},
    )
    backend = raw.headers.get("x-sluice-backend")
    text, error = "", None
    try:
        for chunk in raw.parse():
            for choice in chunk.choices:
                text += choice.delta.content or ""
    except APIError as e:
        error = e
    return backend, text, error


# Round-robin over two backends: one of two consecutive requests starts on the cutting one.
backends = []
for attempt in range(4):
    backend, text, error = structured_stream()
    backends.append(backend)
    if backend != cut_backend:
        check(f"structured {attempt} on {backend}: no error", error is None, error)
        check(f"structured {attempt} on {backend}: an answer", text != "", text)
        continue
    check("structured on the cut backend: raises APIError", error is not None, repr(text))
    check(
        "structured on the cut backend: the terminal error event, not a transport error",
        not isinstance(error, (APIConnectionError, APIStatusError)),
        repr(error),
    )
    code = error.body.get("code") if isinstance(error.body, dict) else None
    check(
        "structured on the cut backend: says the stream broke",
        code == "backend_stream_interrupted",
        error.body,
    )
    check("structured on the cut backend: raised mid-answer", text != "", repr(text))
    break
else:
    check("a structured stream started on the cut backend", False, backends)

done()
