"""The Files and Batches APIs through the official OpenAI Python SDK, unchanged.

Run by tests/it/batch_sdk.rs, which starts simulated backends and a gateway with [batch] and
passes:
  SLUICE_BASE_URL    the gateway's /v1 URL
  SLUICE_MODEL       a fast model (chat and embeddings)
  SLUICE_SLOW_MODEL  a slow model (a batch of it is still running when it is cancelled)
Prints one line per check and exits non-zero on the first failure.
"""

import json
import os
import time

import openai
from openai import OpenAI
from checks import check, done, raises

client = OpenAI(
    base_url=os.environ["SLUICE_BASE_URL"], api_key="sk-test", max_retries=0, timeout=30
)
model = os.environ["SLUICE_MODEL"]
slow = os.environ["SLUICE_SLOW_MODEL"]


def jsonl(lines):
    return "\n".join(json.dumps(l) for l in lines).encode()


def chat(cid, m=model):
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": m, "max_tokens": 5,
                     "messages": [{"role": "user", "content": cid}]}}


def wait(batch_id, statuses, within=30.0):
    deadline = time.monotonic() + within
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in statuses or time.monotonic() > deadline:
            return b
        time.sleep(0.05)


# Files.
f = client.files.create(file=("requests.jsonl", jsonl([chat("a"), chat("b"), chat("a")])),
                        purpose="batch")
check("file object", f.object == "file" and f.purpose == "batch" and f.id.startswith("file-"), f)
check("file name", f.filename == "requests.jsonl", f.filename)
check("file retrieve", client.files.retrieve(f.id).bytes == f.bytes)
check("file list", any(x.id == f.id for x in client.files.list()))
check("file list by purpose", all(x.purpose == "batch" for x in client.files.list(purpose="batch")))
check("file content", json.loads(client.files.content(f.id).text.splitlines()[0])["custom_id"] == "a")
raises("wrong purpose", openai.BadRequestError,
       lambda: client.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune"))
raises("unknown file", openai.NotFoundError, lambda: client.files.retrieve("file-nope"))

# A chat batch: created validating, completed with counts, output and error files.
b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                          completion_window="24h", metadata={"team": "eval"})
check("batch created", b.object == "batch" and b.status == "validating", b)
check("batch metadata", b.metadata == {"team": "eval"}, b.metadata)
b = wait(b.id, {"completed", "failed"})
check("batch completed", b.status == "completed", b)
check("request counts", (b.request_counts.total, b.request_counts.completed,
                         b.request_counts.failed) == (3, 2, 1), b.request_counts)
check("timestamps", b.in_progress_at and b.finalizing_at and b.completed_at, b)
out = [json.loads(l) for l in client.files.content(b.output_file_id).text.splitlines()]
check("output lines", sorted(o["custom_id"] for o in out) == ["a", "b"], out)
check("output line shape", out[0]["response"]["status_code"] == 200
      and out[0]["response"]["body"]["object"] == "chat.completion"
      and out[0]["error"] is None, out[0])
err = [json.loads(l) for l in client.files.content(b.error_file_id).text.splitlines()]
check("duplicate custom_id in the error file",
      err[0]["error"]["code"] == "duplicate_custom_id" and err[0]["custom_id"] == "a", err)
check("output file object", client.files.retrieve(b.output_file_id).purpose == "batch_output")

# An embeddings batch.
e = client.files.create(file=("emb.jsonl", jsonl([
    {"custom_id": "e1", "method": "POST", "url": "/v1/embeddings",
     "body": {"model": model, "input": "hello"}}])), purpose="batch")
eb = client.batches.create(input_file_id=e.id, endpoint="/v1/embeddings", completion_window="24h")
eb = wait(eb.id, {"completed", "failed"})
emb = json.loads(client.files.content(eb.output_file_id).text)
check("embeddings batch", eb.status == "completed"
      and emb["response"]["body"]["data"][0]["object"] == "embedding", emb)

raises("endpoint not allowed", openai.BadRequestError,
       lambda: client.batches.create(input_file_id=f.id, endpoint="/v1/moderations",
                                     completion_window="24h"))

# Cancel a slow batch while it runs.
s = client.files.create(file=("slow.jsonl", jsonl([
    {"custom_id": f"s{i}", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": slow, "max_tokens": 50,
              "messages": [{"role": "user", "content": "x"}]}} for i in range(20)])),
    purpose="batch")
sb = client.batches.create(input_file_id=s.id, endpoint="/v1/chat/completions",
                           completion_window="24h")
wait(sb.id, {"in_progress"})
c = client.batches.cancel(sb.id)
check("cancelling", c.status in ("cancelling", "cancelled") and c.cancelling_at, c)
c = wait(sb.id, {"cancelled"})
check("cancelled", c.status == "cancelled" and c.cancelled_at, c)
check("cancelled early", c.request_counts.completed < 20, c.request_counts)
raises("cancel twice", openai.ConflictError, lambda: client.batches.cancel(sb.id))

# Pagination as OpenAI's: `after` and `limit`, newest first; the SDK follows pages.
first = client.batches.list(limit=1)
check("one per page", len(first.data) == 1 and first.data[0].id == sb.id, first)
ids = [x.id for x in client.batches.list(limit=1)]
check("auto-pagination walks every batch", ids == [sb.id, eb.id, b.id], ids)

deleted = client.files.delete(f.id)
check("file deleted", deleted.deleted and deleted.id == f.id, deleted)
raises("deleted file", openai.NotFoundError, lambda: client.files.retrieve(f.id))
done()
