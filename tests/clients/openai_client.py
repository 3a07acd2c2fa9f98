"""The official `openai` package against a running `dejavu serve` (argv: base URL, model id).

Chat (whole and streamed), text completions, log-probabilities, logit bias, the penalties,
llama-server's extensions (`extra_body`), and errors as the package raises them. Exits non-zero
on the first failed check. Run by tests/serve_openai.rs.
"""
import math
import re
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

# Log-probabilities: greedy picks the most likely token, so each chosen token is its own first
# alternative; the streamed chunks carry the same entries as the whole reply.
lp = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0,
                                    logprobs=True, top_logprobs=3)
content = lp.choices[0].logprobs.content
assert len(content) == lp.usage.completion_tokens, (len(content), lp.usage)
assert "".join(c.token for c in content) == lp.choices[0].message.content, content
for c in content:
    assert c.logprob <= 0 and len(c.top_logprobs) == 3, c
    assert c.top_logprobs[0].token == c.token and abs(c.top_logprobs[0].logprob - c.logprob) < 1e-6, c
    assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True), c
    assert bytes(c.bytes) == c.token.encode(), c
    assert sum(math.exp(t.logprob) for t in c.top_logprobs) <= 1 + 1e-4, c
chunks = list(client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0,
                                             logprobs=True, top_logprobs=3, stream=True))
streamed_lp = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
assert [(e.token, round(e.logprob, 4)) for e in streamed_lp] == [(e.token, round(e.logprob, 4)) for e in content]
assert lp.choices[0].logprobs is not None and whole.choices[0].logprobs is None
clp = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2)
L = clp.choices[0].logprobs
assert len(L.tokens) == len(L.token_logprobs) == len(L.top_logprobs) == len(L.text_offset) == clp.usage.completion_tokens, L
assert "".join(L.tokens) == clp.choices[0].text and L.text_offset[0] == 0, L
assert all(len(t) <= 2 and max(t.values()) >= p - 1e-6 for t, p in zip(L.top_logprobs, L.token_logprobs)), L

# logit_bias: +100 on one token makes greedy decoding repeat it; its raw log-probability (the
# model's own, before the bias) stays what the model gave it.
forced = 300
b = client.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0,
                                   logit_bias={str(forced): 100}, logprobs=True)
toks = [c.token for c in b.choices[0].logprobs.content]
assert len(set(toks)) == 1 and len(toks) == 4, toks
assert b.choices[0].message.content == toks[0] * 4, (b.choices[0].message.content, toks)
# Banning that token (-100) keeps it out of a greedy reply that would take it.
ban = client.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0,
                                     logit_bias={str(forced): -100, "301": 100}, logprobs=True)
assert toks[0] not in [c.token for c in ban.choices[0].logprobs.content], ban

# Penalties (OpenAI's) and llama-server's extensions are accepted and change greedy text that
# repeats: the forced token's run breaks under a frequency penalty past the bias.
pen = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0,
                                     logit_bias={str(forced): 3}, frequency_penalty=2.0,
                                     presence_penalty=2.0, logprobs=True)
ptoks = [c.token for c in pen.choices[0].logprobs.content]
assert ptoks.count(toks[0]) <= 2, ptoks
ext = client.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0.7, seed=5,
                                     extra_body={"min_p": 0.1, "repeat_penalty": 1.1, "repeat_last_n": 16,
                                                 "top_k": 20, "ignore_eos": True, "cache_prompt": False})
assert ext.usage.completion_tokens == 12 and ext.choices[0].finish_reason == "length", ext
again = client.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0.7, seed=5,
                                       extra_body={"min_p": 0.1, "repeat_penalty": 1.1, "repeat_last_n": 16,
                                                   "top_k": 20, "ignore_eos": True})
assert again.choices[0].message.content == ext.choices[0].message.content, "same seed, same text"

# Embeddings: the package asks for base64 unless told otherwise; both give the same unit
# vectors, in input order.
emb = client.embeddings.create(model=model, input=["a cat sat", "the compiler"])
flt = client.embeddings.create(model=model, input=["a cat sat", "the compiler"], encoding_format="float")
assert [e.index for e in emb.data] == [0, 1] and emb.usage.prompt_tokens >= 4, emb.usage
for a, b in zip(emb.data, flt.data):
    assert len(a.embedding) == len(b.embedding) and max(abs(x - y) for x, y in zip(a.embedding, b.embedding)) < 1e-6
    assert abs(sum(x * x for x in a.embedding) - 1) < 1e-3
assert emb.data[0].embedding != emb.data[1].embedding

# n choices from one prompt: each choice i samples with seed + i (so choice 0 is the n = 1
# reply of that seed), usage counts every choice's tokens, and the stream carries each chunk's
# choice index. The server runs --parallel 3 with batching: the choices beside the first run as
# rows of the first's steps on idle slots' sequences, forked from the prompt (each row bit for
# bit its own step on the CPU, so choice 0 still equals the n = 1 reply), and /metrics counts them.
import urllib.request
def batched_choices():
    page = urllib.request.urlopen(base.rsplit("/v1", 1)[0] + "/metrics", timeout=10).read().decode()
    return int(re.search(r"^dejavu_choices_batched_total (\d+)$", page, re.M).group(1))
before = batched_choices()
many = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=1.0, seed=7,
                                      n=3, logprobs=True)
assert [c.index for c in many.choices] == [0, 1, 2], many
assert many.usage.completion_tokens == sum(len(c.logprobs.content) for c in many.choices), many.usage
one = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=1.0, seed=7)
assert many.choices[0].message.content == one.choices[0].message.content, (many, one)
assert len({c.message.content for c in many.choices}) > 1, "three draws, one text"
parts = {}
for ch in client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=1.0, seed=7,
                                         n=3, stream=True):
    for c in ch.choices:
        parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
assert [parts[i] for i in range(3)] == [c.message.content for c in many.choices], parts
cm = client.completions.create(model=model, prompt="Once upon a time", max_tokens=4, temperature=0, n=2)
assert [c.index for c in cm.choices] == [0, 1] and cm.choices[0].text == cm.choices[1].text, cm
assert batched_choices() - before == 2 + 2 + 1, (before, batched_choices())

# Structured output: a JSON schema (strict, with bounds so a tiny model's reply ends), any JSON
# object, and a Lark grammar (llama-server's `grammar` field); each reply parses and matches.
import json
schema = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok", "tag"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}, "tag": {"enum": ["red", "green"]}}}
for temperature in (0, 1.0):
    js = client.chat.completions.create(model=model, messages=msgs, max_tokens=80, temperature=temperature, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
    doc = json.loads(js.choices[0].message.content)
    assert js.choices[0].finish_reason == "stop", js
    assert set(doc) == {"name", "age", "ok", "tag"} and isinstance(doc["name"], str) and len(doc["name"]) <= 8, doc
    assert isinstance(doc["age"], int) and 0 <= doc["age"] <= 120 and isinstance(doc["ok"], bool), doc
    assert doc["tag"] in ("red", "green"), doc
yn = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=1.0, seed=1,
                                    extra_body={"grammar": 'start: "yes" | "no"'})
assert yn.choices[0].message.content in ("yes", "no") and yn.choices[0].finish_reason == "stop", yn
# The same field in GBNF, as llama-server takes it (converted to Lark): a rule per line, a
# character class, a bounded repeat, a comment.
gb = client.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0,
                                    extra_body={"grammar": 'root ::= answer " " num # two parts\n'
                                                           'answer ::= "yes" | "no"\nnum ::= [1-9] [0-9]{0,2}'})
assert re.fullmatch(r"(yes|no) [1-9][0-9]{0,2}", gb.choices[0].message.content), gb
obj = client.chat.completions.create(model=model, messages=msgs, max_tokens=120, temperature=0,
                                     response_format={"type": "json_object"})
assert obj.choices[0].finish_reason == "stop", obj
assert isinstance(json.loads(obj.choices[0].message.content), dict), obj

models = client.models.list()
assert [m.id for m in models.data] == [model], models

for bad, kind in [
    (lambda: client.chat.completions.create(model=model, messages=[], max_tokens=2), openai.BadRequestError),
    (lambda: client.chat.completions.create(model="nope", messages=msgs, max_tokens=2), openai.NotFoundError),
    (lambda: client.chat.completions.create(model=model, messages=msgs, n=17), openai.BadRequestError),
    (lambda: client.chat.completions.create(model=model, messages=msgs, logprobs=True, top_logprobs=21), openai.BadRequestError),
    (lambda: client.chat.completions.create(model=model, messages=msgs, top_logprobs=2), openai.BadRequestError),
    (lambda: client.chat.completions.create(model=model, messages=msgs, logit_bias={"99999": 1}), openai.BadRequestError),
    (lambda: client.chat.completions.create(model=model, messages=msgs, logit_bias={"5": 101}), openai.BadRequestError),
    (lambda: client.chat.completions.create(model=model, messages=msgs, presence_penalty=2.5), openai.BadRequestError),
    (lambda: client.completions.create(model=model, prompt="x", logprobs=21), openai.BadRequestError),
    (lambda: client.chat.completions.create(model=model, messages=msgs, extra_body={"min_p": 2}), openai.BadRequestError),
    (lambda: client.chat.completions.create(model=model, messages=msgs, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}), openai.BadRequestError),
    (lambda: client.chat.completions.create(model=model, messages=msgs, extra_body={"grammar": "start: ???"}), openai.BadRequestError),
    (lambda: client.chat.completions.create(model=model, messages=msgs, extra_body={"grammar": "root ::= undefined-rule"}), openai.BadRequestError),
    # This fixture's chat template renders no tools.
    (lambda: client.chat.completions.create(model=model, messages=msgs, tools=[{"type": "function", "function": {"name": "f"}}]), openai.BadRequestError),
]:
    try:
        bad()
    except kind as e:
        assert "message" in e.body, e.body
    else:
        raise AssertionError(f"expected {kind.__name__}")

print(f"openai {openai.__version__}: chat, streaming, completions, logprobs, logit_bias, penalties, "
      f"extensions, embeddings, n choices, structured output, models and errors ok; reply {text!r}")
