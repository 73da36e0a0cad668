"""Tool-call outputs as OpenAI `tool_calls` (services/gateway/structured.py, openai_format.py):
parsed from the constrained text, streamed as one delta when the choice finishes, and left as
text when the output was cut; the tools reach the chat template."""
import json

from gateway_utils import tiny_tokenizer
from kvmesh.services.gateway.openai_format import Formatter
from kvmesh.services.gateway.prompts import PromptBuilder
from kvmesh.services.gateway.spec import ChatTurn, ChoiceDelta, Usage
from kvmesh.services.gateway.structured import ToolCallOutput, parse_tool_calls

REQUIRED = '[{"name":"add","parameters":{"a":1,"b":2}},{"name":"now","parameters":{}}]'


def _fmt(tool_calls):
    return Formatter("chat", "id", 0, "m", logprobs=False, include_usage=False, tool_calls=tool_calls)


def test_required_output_parses_into_calls_with_ids_and_json_arguments():
    calls = parse_tool_calls(REQUIRED, ToolCallOutput())
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("add", {"a": 1, "b": 2}), ("now", {})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_a_named_function_output_is_its_arguments():
    [call] = parse_tool_calls('{"x":[1]}', ToolCallOutput("f"))
    assert call["function"] == {"name": "f", "arguments": '{"x": [1]}'}
    assert parse_tool_calls('{"x":[1', ToolCallOutput("f")) is None


def test_response_has_tool_calls_null_content_and_finish_reason_tool_calls():
    fmt = _fmt(ToolCallOutput())
    fmt.add(ChoiceDelta(0, REQUIRED[:10], first=True))
    fmt.add(ChoiceDelta(0, REQUIRED[10:], finish_reason="stop"))
    [choice] = fmt.response(Usage())["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["add", "now"]


def test_a_cut_output_stays_text_with_its_finish_reason():
    fmt = _fmt(ToolCallOutput("f"))
    fmt.add(ChoiceDelta(0, '{"a":', first=True, finish_reason="length"))
    [choice] = fmt.response(Usage())["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == '{"a":'
    assert "tool_calls" not in choice["message"]


def test_streamed_tool_calls_come_as_one_delta_at_the_end():
    fmt = _fmt(ToolCallOutput("f"))
    first = fmt.chunks(ChoiceDelta(0, '{"a":', first=True))
    assert [c["choices"][0]["delta"] for c in first] == [{"role": "assistant", "content": None}]
    last = fmt.chunks(ChoiceDelta(0, "1}", finish_reason="stop"))
    [call] = last[0]["choices"][0]["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert last[1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_the_tools_go_to_the_chat_template_as_vllm_passes_them():
    template = "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    builder = PromptBuilder(tiny_tokenizer().with_chat_template(template))
    tools = ({"type": "function", "function": {"name": "f"}},)
    assert (await builder.chat((ChatTurn("user", "hi"),), tools)).text == "[f]hi"
    assert (await builder.chat((ChatTurn("user", "hi"),))).text == "hi"


async def test_a_tool_conversation_reaches_the_template_with_calls_as_objects():
    from kvmesh.services.gateway.openai_schema import chat_request, parse_body

    body = {"model": "m", "messages": [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}]}
    req = chat_request(parse_body(json.dumps(body).encode(), "chat"))
    template = ("{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %}[{{ c.function.name }}({{ c.function.arguments.a }})]{% endfor %}"
                "{% if m.tool_call_id %}<{{ m.tool_call_id }}>{% endif %};{% endfor %}")
    prompt = await PromptBuilder(tiny_tokenizer().with_chat_template(template)).chat(req.messages)
    assert prompt.text == "user:add;assistant:[add(1)];tool:3<c1>;"
