"""``/v1/completions`` with the official openai client: text and token prompts, several prompts,
echo, logprobs, streaming, usage, and the refusals."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import TINY_MODEL
from tests.support.stack import Stack

IGNORE_EOS = {"ignore_eos": True}


def test_text_completion_non_stream(tiny_stack: Stack) -> None:
    response = tiny_stack.client().completions.create(
        model=TINY_MODEL, prompt="Once upon a time", max_tokens=5, extra_body=IGNORE_EOS
    )
    assert response.object == "text_completion" and response.id.startswith("cmpl-")
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 5 and response.usage.prompt_tokens > 0


def test_default_max_tokens_is_16(tiny_stack: Stack) -> None:
    response = tiny_stack.client().completions.create(model=TINY_MODEL, prompt="x", extra_body=IGNORE_EOS)
    assert response.usage.completion_tokens == 16


def test_stream_equals_non_stream_and_ends_with_usage(tiny_stack: Stack) -> None:
    client = tiny_stack.client()
    kwargs = {"model": TINY_MODEL, "prompt": "The sea", "max_tokens": 12, "temperature": 0, "extra_body": IGNORE_EOS}
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert all(chunk.object == "text_completion" for chunk in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_several_prompts_and_n_give_prompt_major_choices(tiny_stack: Stack) -> None:
    response = tiny_stack.client().completions.create(
        model=TINY_MODEL, prompt=["first", "second prompt"], n=2, max_tokens=3, extra_body=IGNORE_EOS
    )
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.usage.completion_tokens == 12


def test_token_id_prompts(tiny_stack: Stack) -> None:
    response = tiny_stack.client().completions.create(
        model=TINY_MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=2, extra_body=IGNORE_EOS
    )
    assert response.usage.prompt_tokens == 5 and len(response.choices) == 2


def test_echo_prepends_the_prompt(tiny_stack: Stack) -> None:
    client = tiny_stack.client()
    response = client.completions.create(
        model=TINY_MODEL, prompt="Echo me", echo=True, max_tokens=3, temperature=0, extra_body=IGNORE_EOS
    )
    assert response.choices[0].text.startswith("Echo me")
    streamed = client.completions.create(
        model=TINY_MODEL, prompt="Echo me", echo=True, max_tokens=3, temperature=0, stream=True, extra_body=IGNORE_EOS
    )
    assert "".join(c.choices[0].text for c in streamed) == response.choices[0].text


def test_logprobs_in_the_legacy_shape(tiny_stack: Stack) -> None:
    response = tiny_stack.client().completions.create(
        model=TINY_MODEL, prompt="abc", max_tokens=4, logprobs=2, temperature=0, extra_body=IGNORE_EOS
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"suffix": "tail"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"prompt": []}, "prompt"),
        ({"echo": True, "prompt": [1, 2]}, "echo"),
    ],
)
def test_unsupported_options_are_refused(tiny_stack: Stack, kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        tiny_stack.client().completions.create(**{"model": TINY_MODEL, "prompt": "x", **kwargs})  # type: ignore[call-overload]
    assert param in raised.value.message


def test_an_empty_prompt_is_a_400_not_a_worker_failure(tiny_stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        tiny_stack.client().completions.create(model=TINY_MODEL, prompt="")
    assert raised.value.body["param"] == "prompt"
    assert tiny_stack.client().completions.create(model=TINY_MODEL, prompt="ok", max_tokens=1).choices


def test_token_ids_outside_the_vocabulary_are_a_400(tiny_stack: Stack) -> None:
    for prompt in ([-5, 3], [10**9]):
        with pytest.raises(openai.BadRequestError) as raised:
            tiny_stack.client().completions.create(model=TINY_MODEL, prompt=prompt)
        assert raised.value.body["param"] == "prompt"
