"""Messages → chat template → tokens, and request → sampling parameters with context checks."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from api.jobs.build import chat_generate
from api.wire.openai.chat_request import ChatCompletionRequest
from shared.contract import Generate
from shared.errors import ErrorKind, RelayError
from worker.requests.params import RequestLimits, build_sampling_params
from worker.requests.prompt import render_prompt, to_template_message

LIMITS = RequestLimits(max_choices=4)
STRICT = RequestLimits(max_choices=4, max_tokens_over_context="error")


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(default_model_path)


def _request(**fields: object) -> Generate:
    return chat_generate(
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})
    )


def test_prompt_uses_the_chat_template_with_generation_prompt(tokenizer: PreTrainedTokenizerBase) -> None:
    request = _request(messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    token_ids, text = render_prompt(tokenizer, request)
    assert tokenizer.decode(token_ids) == text
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_text_parts_are_joined_with_newlines(tokenizer: PreTrainedTokenizerBase) -> None:
    request = _request(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    )
    assert "a\nb" in render_prompt(tokenizer, request)[1]


def test_tool_call_arguments_reach_templates_as_a_mapping() -> None:
    request = _request(
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ]
    )
    assistant = to_template_message(request.messages[1])
    assert assistant["content"] == ""
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert to_template_message(request.messages[2]) == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}


def test_default_max_tokens_fills_the_context() -> None:
    params = build_sampling_params(_request().sampling, num_prompt_tokens=10, max_model_len=100, limits=LIMITS)
    assert params.max_new_tokens == 90


@pytest.mark.parametrize(
    ("fields", "param"), [({"max_tokens": 91}, "max_tokens"), ({"max_completion_tokens": 95}, "max_completion_tokens")]
)
def test_max_tokens_beyond_the_context_is_a_400_when_strict(fields: dict[str, object], param: str) -> None:
    with pytest.raises(RelayError) as raised:
        build_sampling_params(_request(**fields).sampling, num_prompt_tokens=10, max_model_len=100, limits=STRICT)
    assert raised.value.kind is ErrorKind.CONTEXT_LENGTH_EXCEEDED and raised.value.param == param


@pytest.mark.parametrize("fields", [{"max_tokens": 32_768}, {"max_completion_tokens": 95}])
def test_max_tokens_beyond_the_context_is_clamped_to_the_room_left_by_default(fields: dict[str, object]) -> None:
    params = build_sampling_params(_request(**fields).sampling, num_prompt_tokens=10, max_model_len=100, limits=LIMITS)
    assert params.max_new_tokens == 90
    within = build_sampling_params(
        _request(max_tokens=20).sampling, num_prompt_tokens=10, max_model_len=100, limits=LIMITS
    )
    assert within.max_new_tokens == 20


def test_a_prompt_filling_the_context_is_refused() -> None:
    with pytest.raises(RelayError) as raised:
        build_sampling_params(_request().sampling, num_prompt_tokens=16_100, max_model_len=8192, limits=LIMITS)
    assert raised.value.status == 400
    # What an agent's user needs to act: the prompt's size, the limit, and the way out.
    message = raised.value.message
    assert "16100 tokens" in message and "8192 tokens" in message and "longer context" in message


def test_sampling_fields_are_carried_over() -> None:
    request = _request(temperature=0.5, top_p=0.9, top_k=-1, seed=3, stop=["x"], logit_bias={"7": 2.5}, n=2)
    params = build_sampling_params(request.sampling, num_prompt_tokens=1, max_model_len=100, limits=LIMITS)
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.5, 0.9, 0, 3)
    assert params.stop_strings == ("x",) and params.logit_bias == ((7, 2.5),)
    with pytest.raises(RelayError):
        build_sampling_params(_request(n=5).sampling, num_prompt_tokens=1, max_model_len=100, limits=LIMITS)


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"logit_bias": {"99999999": 1.0}}, "logit_bias"), ({"stop_token_ids": [100]}, "stop_token_ids")],
)
def test_a_token_id_outside_the_vocabulary_is_a_400_naming_its_field(fields: dict[str, object], param: str) -> None:
    with pytest.raises(RelayError) as raised:
        build_sampling_params(
            _request(**fields).sampling, num_prompt_tokens=1, max_model_len=100, limits=LIMITS, vocab_size=100
        )
    assert raised.value.status == 400 and raised.value.param == param
    inside = {"logit_bias": {"99": 1.0}} if param == "logit_bias" else {"stop_token_ids": [99]}
    build_sampling_params(
        _request(**inside).sampling, num_prompt_tokens=1, max_model_len=100, limits=LIMITS, vocab_size=100
    )
