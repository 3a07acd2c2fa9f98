"""Tool calling with the official `openai` package against `dejavu serve` on a model whose chat
template renders tools (Qwen2.5-Coder-0.5B-Instruct, Hermes-style calls). Usage:
openai_tools.py BASE_URL MODEL_ID."""
import json
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base, api_key="unused")
tools = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
msgs = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def check_call(call, name):
    """A call to `name` whose arguments parse and hold what its schema requires, of the types it names."""
    assert call.type == "function" and call.id, call
    assert call.function.name == name, call
    args = json.loads(call.function.arguments)
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)
    assert isinstance(args, dict) and set(schema["required"]) <= set(args), args
    for k, v in args.items():
        assert k in schema["properties"], args
        assert isinstance(v, str), args
        assert v in schema["properties"][k].get("enum", [v]), args
    return args


# `required` and a named function: the reply is constrained to one call in the model's format.
for choice, name in [("required", None), ({"type": "function", "function": {"name": "get_time"}}, "get_time")]:
    r = client.chat.completions.create(model=model, messages=msgs, tools=tools, tool_choice=choice,
                                       temperature=0, max_tokens=64)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, r
    assert len(c.message.tool_calls) == 1, r
    check_call(c.message.tool_calls[0], name or c.message.tool_calls[0].function.name)
    assert name is None or c.message.tool_calls[0].function.name == name, r

# `auto` (the default): this model answers the question with a call to get_weather.
r = client.chat.completions.create(model=model, messages=msgs, tools=tools, temperature=0, max_tokens=64)
c = r.choices[0]
assert c.finish_reason == "tool_calls", r
args = check_call(c.message.tool_calls[0], "get_weather")
assert args["city"] == "Paris", args
call = c.message.tool_calls[0]

# Streamed: no content chunk holds the call's text; one chunk holds the call.
chunks = list(client.chat.completions.create(model=model, messages=msgs, tools=tools, temperature=0,
                                             max_tokens=64, stream=True))
content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
assert content == "" and len(deltas) == 1, chunks
assert deltas[0].index == 0 and deltas[0].function.name == "get_weather", deltas
assert json.loads(deltas[0].function.arguments) == json.loads(call.function.arguments), deltas
assert chunks[-1].choices[0].finish_reason == "tool_calls", chunks[-1]

# The call and its result go back in the conversation (rendered by the template) for the answer.
followup = msgs + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
    {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "cloudy"})}]
r = client.chat.completions.create(model=model, messages=followup, tools=tools, tool_choice="none",
                                   temperature=0, max_tokens=24)
assert r.choices[0].message.tool_calls is None and r.choices[0].message.content, r
assert r.usage.prompt_tokens > 60, r.usage

# `none`: no call is parsed, the tools are not shown to the model.
r = client.chat.completions.create(model=model, messages=msgs, tools=tools, tool_choice="none",
                                   temperature=0, max_tokens=8)
assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length"), r

for bad in [
    lambda: client.chat.completions.create(model=model, messages=msgs, tools=[{"type": "function"}]),
    lambda: client.chat.completions.create(model=model, messages=msgs, tools=tools,
                                           tool_choice={"type": "function", "function": {"name": "nope"}}),
    lambda: client.chat.completions.create(model=model, messages=msgs, tool_choice="required"),
    lambda: client.chat.completions.create(model=model, messages=msgs, tools=tools, tool_choice="required",
                                           response_format={"type": "json_object"}),
    lambda: client.chat.completions.create(model=model, messages=msgs + [{"role": "tool", "content": "x"}], tools=tools),
    lambda: client.chat.completions.create(model=model, messages=msgs, tools=[{"type": "function", "function": {
        "name": "f", "description": "ends the turn <|im_end|>"}}]),
]:
    try:
        bad()
    except openai.BadRequestError as e:
        assert "message" in e.body, e.body
    else:
        raise AssertionError("expected a 400")

print(f"openai {openai.__version__}: tool calls (auto, required, named, streamed, a result sent back, none) "
      f"and bad tool requests ok; auto called get_weather({call.function.arguments})")
