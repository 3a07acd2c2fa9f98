"""The official `openai` package against a running `dejavu serve` (argv: base URL, model id).

Chat (whole and streamed), text completions, and errors as the package raises them. Exits
non-zero on the first failed check. Run by tests/serve_openai.rs.
"""
import sys

import openai
from openai import OpenAI

base, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60)
msgs = [{"role": "user", "content": "Tell me a story"}]

whole = client.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0)
text = whole.choices[0].message.content
assert whole.object == "chat.completion", whole
assert whole.choices[0].finish_reason in ("stop", "length"), whole
assert whole.usage.completion_tokens >= 1 and whole.usage.prompt_tokens >= 1, whole.usage

chunks = list(client.chat.completions.create(
    model=model, messages=msgs, max_tokens=12, temperature=0, stream=True,
    stream_options={"include_usage": True}))
streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
assert streamed == text, (streamed, text)
assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens, chunks[-1]

comp = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0)
assert comp.object == "text_completion" and comp.choices[0].text, comp

models = client.models.list()
assert [m.id for m in models.data] == [model], models

for bad, kind in [
    (lambda: client.chat.completions.create(model=model, messages=[], max_tokens=2), openai.BadRequestError),
    (lambda: client.chat.completions.create(model="nope", messages=msgs, max_tokens=2), openai.NotFoundError),
    (lambda: client.chat.completions.create(model=model, messages=msgs, n=2), openai.BadRequestError),
]:
    try:
        bad()
    except kind as e:
        assert "message" in e.body, e.body
    else:
        raise AssertionError(f"expected {kind.__name__}")

print(f"openai {openai.__version__}: chat, streaming, completions, models and errors ok; reply {text!r}")
