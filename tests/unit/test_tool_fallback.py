"""worker/tool_fallback.py on the real tokenizers and chat templates of two families whose templates write no tools
(make-model's `llama`, a minimal ChatML, and `gemma3`, Gemma 3's own): the worker writes the tools and the tool
turns into the messages, prefix-stable from one turn to the next, parsed back as calls; a request without tools or
tool history renders exactly as the template alone renders it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer

from protocol.messages import Submit
from worker.chat_format import family_of, grammar_for, parser_for
from worker.mlx_engine.make_model import make_model
from worker.mlx_engine.prompt import Prompts, shared_prefix
from worker.output_parser import Out

TOOLS = [{"name": "get_weather", "description": "The weather in a city",  # Submit's neutral shape
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
# a reply as the model writes two calls under the grammar (chat_format._tool_grammar, parallel)
REPLY = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zoë"}}\n</tool_call>')


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    for arch in ("llama", "gemma3"):
        make_model(root / arch, "tiny", seed=0, arch=arch)
    return root


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def prompts(models: Path, request: pytest.FixtureRequest) -> Prompts:
    path = models / request.param
    stops = json.loads((path / "config.json").read_text())["eos_token_id"]  # the worker's stop tokens, as mlx-lm's load
    return Prompts(load_tokenizer(path, eos_token_ids=stops), 0, 8192, False)


def test_a_tool_turn_s_prompt_and_reply_begin_the_next_turn_s_prompt(prompts: Prompts) -> None:
    tok = prompts.tokenizer
    turn = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris and Zoë?"}]
    first = prompts.encode(Submit(rid="1", max_tokens=8, messages=turn, tools=TOOLS))
    assert '"name":"get_weather"' in tok.decode(first) and "Be brief." in tok.decode(first)  # the tools are shown

    family = family_of(tok)
    parser = parser_for(family, chat=True, tools=True, in_think=False)
    out = Out()
    for k in range(0, len(REPLY), 7):  # streamed in pieces, as the worker feeds it
        out.extend(parser.feed(REPLY[k:k + 7]))
    out.extend(parser.finish())
    assert out.content == "" and parser.calls_made == 2, out
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "", "arguments": ""}} for i in range(2)]
    for index, _id, name, piece in out.calls:  # assembled as the gateway assembles the deltas
        fn = calls[index]["function"]
        fn["name"] += name
        fn["arguments"] += piece
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Zoë"}]
    assert {c["function"]["name"] for c in calls} == {"get_weather"}

    # turn 2: the reply as the API gave it back, both results (consecutive user-side messages: Gemma's template
    # raises unless roles alternate), and the user's next words
    turn += [{"role": "assistant", "content": "", "tool_calls": calls},
             {"role": "tool", "tool_call_id": "c0", "content": "18 C"},
             {"role": "tool", "tool_call_id": "c1", "content": "12 C"},
             {"role": "user", "content": "Which is warmer?"}]
    second = prompts.encode(Submit(rid="2", max_tokens=8, messages=turn, tools=TOOLS))
    reply = tok.encode(REPLY, add_special_tokens=False)
    assert second[:len(first) + len(reply)] == first + reply, (tok.decode(first), tok.decode(second))
    assert second[len(first) + len(reply)] in tok.eos_token_ids  # then the end of turn the model stopped with
    assert "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n12 C\n</tool_response>\nWhich is warmer?" \
        in tok.decode(second)
    grammar = grammar_for(family, {"type": "tool", "names": ["get_weather"], "parallel": True}, TOOLS, False)
    assert '"<tool_call>" "\\n{\\"name\\": " "\\"get_weather\\", \\"arguments\\": "' in grammar  # the reply's form


def test_a_request_without_tools_or_tool_turns_renders_as_the_template_alone(prompts: Prompts) -> None:
    conversations = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"}],
    ]
    if "<|im_start|>" in prompts.tokenizer.get_vocab():  # ChatML takes any roles in any order: nothing merged
        conversations.append([{"role": "system", "content": "a"}, {"role": "system", "content": "b"},
                              {"role": "user", "content": "one"}, {"role": "user", "content": "two"}])
    for messages in conversations:
        ids = prompts.encode(Submit(rid="r", max_tokens=8, messages=messages))
        assert ids == list(prompts.tokenizer.apply_chat_template(messages, add_generation_prompt=True)), messages


@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no-tools"])
def test_a_system_message_inside_the_conversation_leaves_the_prompt_before_it_alone(prompts: Prompts,
                                                                                    tools: list | None) -> None:
    """An agent's system message a few turns in (Claude Code sends them) is written where it stands: the prompt
    before it is the last turn's, so the caches keep hitting. Gemma 3's template refuses one there: it gets it as
    user text (it raised before: a 400); the ChatML template writes it as a system turn of its own."""
    tok = prompts.tokenizer
    call = {"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    turn = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
            *([{"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c0", "content": "sunny"}] if tools else
              [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And tomorrow?"}])]
    before = prompts.encode(Submit(rid="1", max_tokens=8, messages=turn, tools=tools))
    later = [*turn, {"role": "system", "content": "Keep them posted."}, {"role": "assistant", "content": "Rain."},
             {"role": "user", "content": "Thanks."}]
    after = prompts.encode(Submit(rid="2", max_tokens=8, messages=later, tools=tools))
    assert len(before) - shared_prefix(before, after) <= 8  # at most the end of turn and the generation prompt
    text = tok.decode(after)
    assert text.index("Be brief.") < text.index("Weather in Oslo?")
    assert text.index("sunny" if tools else "And tomorrow?") < text.index("Keep them posted.") < text.index("Rain.")


def test_user_messages_in_a_row_are_served(prompts: Prompts) -> None:
    """opencode's title request sends two user messages in a row: Gemma 3's template raised on them (a 400); they are
    joined into one for it, and a template that writes them in a row (the ChatML one) gets them as they are."""
    msg = Submit(rid="t", max_tokens=8, messages=[{"role": "system", "content": "Title this."},
                                                  {"role": "user", "content": "First."},
                                                  {"role": "user", "content": "Second."}])
    text = prompts.tokenizer.decode(prompts.encode(msg))
    assert text.index("Title this.") < text.index("First.") < text.index("Second.")
