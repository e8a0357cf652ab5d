"""Reasoning parsers: the split of a finished reply, and a stream cut at any points sends exactly that split."""

import types

import pytest

from seeds import seeded_rng
from zipage_jax.engine.engine_core import Reported, output_delta
from zipage_jax.engine.messages import Accepted
from zipage_jax.engine.outputs import CompletionOutput, RequestOutput
from zipage_jax.engine.request_group import ChoiceOutput
from zipage_jax.entrypoints.serving_chat import ChatView
from zipage_jax.entrypoints.protocol import ChatCompletionRequest
from zipage_jax.entrypoints.reasoning import ReasoningParser

CASES = [  # (parser, prompt ends with an open <think>, reply, reasoning, content)
    ("qwen3", False, "<think>\nsum the lines\n</think>\n\nThe answer is 42.", "\nsum the lines\n",
     "\n\nThe answer is 42."),
    ("qwen3", False, "  <think>a</think>b", "a", "b"),
    ("qwen3", False, "No thinking here <think> inline", None, "No thinking here <think> inline"),
    ("qwen3", False, "<think>cut off mid-thought", "cut off mid-thought", None),
    ("qwen3", True, "thinking opened by the template</think>answer", "thinking opened by the template", "answer"),
    ("qwen3", False, "<b>bold</b>", None, "<b>bold</b>"),
    ("deepseek_r1", False, "first I think</think>then I answer", "first I think", "then I answer"),
    ("deepseek_r1", False, "<think>tagged</think>answer", "tagged", "answer"),
    ("deepseek_r1", False, "never stops thinking", "never stops thinking", None),
    ("deepseek_r1", False, "</think>", "", ""),
]


@pytest.mark.parametrize("name,opened,reply,reasoning,content", CASES)
def test_split_of_a_finished_reply(name, opened, reply, reasoning, content):
    parser = ReasoningParser(name)
    prompt = "<|im_start|>assistant\n" + ("<think>\n" if opened else "")
    assert parser.opens_thinking(prompt) == (opened or name == "deepseek_r1")
    assert parser.split(reply, parser.opens_thinking(prompt)) == (reasoning, content)


def stream_chunks(parser_name: str, prompt: str, reply: str, cuts: list[int], stop=None):
    """The chat deltas of ``reply`` arriving cut at ``cuts``, through the server's streaming code."""
    serving = types.SimpleNamespace(reasoning=ReasoningParser(parser_name), token_text=str)
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "q"}], stop=stop)
    stream = ChatView(serving, body, [Accepted(2)], prompt).stream(0)
    output, deltas, reported = ChoiceOutput(), [], Reported()
    for i, end in enumerate(cuts + [len(reply)]):
        last = i == len(cuts)
        completion = CompletionOutput(0, reply[:end], list(range(end)), None, None, "stop" if last else None)
        output.apply(output_delta(RequestOutput("r", None, [1, 2], [completion], last), reported))
        chunk = stream.chunk(output)
        if chunk is not None:
            deltas.append(chunk["delta"])
    return ("".join(d.get("reasoning_content", "") for d in deltas), "".join(d.get("content", "") for d in deltas))


@pytest.mark.parametrize("name,opened,reply,reasoning,content", CASES)
def test_a_stream_cut_anywhere_sends_the_same_split(name, opened, reply, reasoning, content):
    rng = seeded_rng()
    prompt = "<|im_start|>assistant\n" + ("<think>\n" if opened else "")
    want = (reasoning or "", content or "")
    for cut in range(len(reply) + 1):  # every single cut, then random multi-cut streams
        assert stream_chunks(name, prompt, reply, [cut]) == want, cut
    for _ in range(20):
        cuts = sorted(rng.choice(len(reply) + 1, size=min(5, len(reply)), replace=False).tolist())
        assert stream_chunks(name, prompt, reply, cuts) == want, cuts
    every = list(range(len(reply) + 1))
    assert stream_chunks(name, prompt, reply, every) == want


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="reasoning_parser"):
        ReasoningParser("mistral")
