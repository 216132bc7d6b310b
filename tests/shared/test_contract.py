"""The job contract: versioned decode (this version, version 3 as the previous release wrote it,
older and newer versions refused), writing for older readers by the fields' versions, and one
engine request per content whichever entry point built the job."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.batches.validation import REQUEST_MODELS
from api.jobs.build import BATCH, CHARS_PER_TOKEN, chat_generate, make_job, prompt_token_estimate, tokenize_job
from api.tenancy import Tenant
from api.wire.anthropic import MessagesRequest
from api.wire.anthropic import to_chat_request as messages_to_chat
from api.wire.openai.chat_request import ChatCompletionRequest
from api.wire.openai.completion_request import CompletionRequest
from api.wire.openai.embeddings import EmbeddingRequest
from api.wire.responses import ResponsesRequest
from api.wire.responses import to_chat_request as responses_to_chat
from shared.contract import (
    CONTRACT_VERSION,
    OLDEST_VERSION,
    AnyJob,
    ChatJob,
    Delivery,
    Generate,
    ImagePart,
    ImageRef,
    NewerContract,
    TextPart,
    Tokenize,
    UnreadableJob,
    decode_job,
    encode_delivery,
    encode_job,
    images_of,
)
from shared.errors import RelayError

# Payloads the previous release wrote (version 3), each with the wire request it came from
# (fixtures/write_contract_v3_jobs.py).
V3_JOBS: dict[str, dict[str, Any]] = json.loads(
    (Path(__file__).parent / "fixtures" / "contract_v3_jobs.json").read_text()
)
_IDS = {"job_id": "j", "request_id": "r", "created": 1764000000, "tenant": "owner-1"}


def _job(kind: str, wire: dict[str, Any]) -> AnyJob:
    """The job today's API builds from the wire request the previous release turned into ``payload``."""
    if kind == "tokenize":
        chat = wire.get("chat")
        fields = {key: value for key, value in wire.items() if key != "chat"}
        request = Tokenize(**fields, chat=chat_generate(ChatCompletionRequest.model_validate(chat)) if chat else None)
        job: AnyJob = tokenize_job(request, "r", True, "owner-1")
    else:
        model = {"chat": ChatCompletionRequest, "completion": CompletionRequest, "embedding": EmbeddingRequest}[kind]
        job = make_job(model.model_validate(wire), "r", True, Tenant("owner-1", is_admin=False))
    return job.model_copy(update=_IDS)


@pytest.mark.parametrize("name", sorted(V3_JOBS))
def test_a_version_3_job_reads_as_the_job_this_api_builds(name: str) -> None:
    case = V3_JOBS[name]
    upgraded = decode_job(case["payload"].encode())
    assert upgraded.model_copy(update=_IDS) == _job(case["kind"], case["wire"])


@pytest.mark.parametrize("name", sorted(V3_JOBS))
def test_this_version_round_trips(name: str) -> None:
    case = V3_JOBS[name]
    job = _job(case["kind"], case["wire"])
    payload = encode_job(job)
    assert json.loads(payload)["version"] == CONTRACT_VERSION
    assert decode_job(payload, encode_delivery(job)) == job


def test_big_integers_in_tool_schemas_survive() -> None:
    job = decode_job(V3_JOBS["chat_json_schema"]["payload"].encode())
    assert isinstance(job, ChatJob) and job.request.output is not None
    schema = job.request.output.json_schema
    assert schema is not None and schema["properties"]["n"]["maximum"] == 123456789012345678901234567890


def test_a_newer_version_is_refused_not_misread() -> None:
    payload = json.loads(encode_job(_job("chat", V3_JOBS["chat_minimal"]["wire"])))
    with pytest.raises(NewerContract) as raised:
        decode_job(json.dumps({**payload, "version": CONTRACT_VERSION + 1}).encode())
    assert raised.value.version == CONTRACT_VERSION + 1


@pytest.mark.parametrize(
    "payload",
    [
        b"not json",
        b"[1, 2]",
        b'{"version": 0, "kind": "chat"}',
        b'{"version": "2", "kind": "chat"}',
        b'{"kind": "nonsense", "request": {}}',
        b'{"kind": "chat", "job_id": "j", "created": 1}',
    ],
)
def test_what_is_not_a_job_is_unreadable(payload: bytes) -> None:
    with pytest.raises(UnreadableJob):
        decode_job(payload)


def test_a_field_this_version_does_not_have_is_refused() -> None:
    """Within a version nothing is ignored: a payload with an unknown field is not read at all."""
    payload = json.loads(encode_job(_job("chat", V3_JOBS["chat_minimal"]["wire"])))
    payload["request"]["sampling"]["typical_p"] = 0.5
    with pytest.raises(UnreadableJob):
        decode_job(json.dumps(payload).encode())


# -- every entry point, one engine request --------------------------------------------------------

_SYSTEM = "Answer in one word."
_QUESTION = "Which city is the capital of France?"
_CHAT = {
    "model": "m",
    "messages": [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _QUESTION}],
    "temperature": 0.5,
    "top_p": 0.9,
    "max_completion_tokens": 32,
    "stop": ["\n\n"],
    "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}],
}


def _generate(job: AnyJob) -> Generate:
    assert isinstance(job, ChatJob)
    return job.request


def test_chat_responses_messages_batch_and_background_build_the_same_engine_request() -> None:
    chat = make_job(ChatCompletionRequest.model_validate(_CHAT), "r", True)
    background = make_job(ChatCompletionRequest.model_validate({**_CHAT, "background": True}), "r", True)
    batch_line = make_job(REQUEST_MODELS["/v1/chat/completions"].model_validate(_CHAT), "r", True, priority=BATCH)  # type: ignore[arg-type]
    responses = ResponsesRequest.model_validate(
        {
            "model": "m", "instructions": _SYSTEM, "input": _QUESTION, "temperature": 0.5, "top_p": 0.9,
            "max_output_tokens": 32,
            "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}],
        }
    )  # fmt: skip
    messages = MessagesRequest.model_validate(
        {
            "model": "m", "system": _SYSTEM, "messages": [{"role": "user", "content": _QUESTION}], "temperature": 0.5,
            "top_p": 0.9, "max_tokens": 32, "stop_sequences": ["\n\n"],
            "tools": [{"name": "lookup", "input_schema": {"type": "object"}}],
        }
    )  # fmt: skip
    expected = _generate(chat)
    assert _generate(background) == expected
    assert _generate(batch_line) == expected.model_copy(update={"priority": BATCH})
    via_responses = _generate(make_job(responses_to_chat(responses, []), "r", True))
    via_messages = _generate(make_job(messages_to_chat(messages), "r", True))
    # Each protocol names its stops and token limit its own way; the rest is the same request.
    sampling = {"max_tokens_param": expected.sampling.max_tokens_param}
    assert (
        via_responses.model_copy(
            update={"sampling": via_responses.sampling.model_copy(update={**sampling, "stop": ["\n\n"]})}
        )
        == expected
    )
    assert via_messages.model_copy(update={"sampling": via_messages.sampling.model_copy(update=sampling)}) == expected
    assert background.delivery.background and not chat.delivery.background


def test_a_completion_batch_line_builds_the_completion_request() -> None:
    body = {"model": "m", "prompt": ["a", "b"], "max_tokens": 8, "seed": 3}
    direct = make_job(CompletionRequest.model_validate(body), "r", True)
    line = make_job(REQUEST_MODELS["/v1/completions"].model_validate(body), "r", True, priority=BATCH)  # type: ignore[arg-type]
    assert line.request == direct.request.model_copy(update={"priority": BATCH})  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
        ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens"),
    ],
)
def test_what_needs_no_tokenizer_is_refused_at_the_edge(fields: dict[str, Any], param: str) -> None:
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
    )
    with pytest.raises(RelayError) as raised:
        chat_generate(request)
    assert raised.value.param == param


@given(
    temperature=st.floats(0.0, 2.0),
    top_k=st.integers(-1, 100),
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    stop=st.one_of(st.none(), st.text(min_size=1, max_size=5), st.lists(st.text(min_size=1, max_size=5), max_size=4)),
    max_tokens=st.one_of(st.none(), st.integers(1, 10_000)),
    content=st.text(max_size=40),
)
def test_any_sampling_round_trips_and_reads_back_from_the_previous_version(
    temperature: float, top_k: int, seed: int | None, stop: Any, max_tokens: int | None, content: str
) -> None:
    """Property: whatever the sampling fields, this version's encoding reads back as itself, and
    so does the encoding for a reader of the previous release."""
    wire = {"model": "m", "messages": [{"role": "user", "content": content}], "temperature": temperature,
            "top_k": top_k, "seed": seed, "stop": stop, "max_tokens": max_tokens}  # fmt: skip
    job = make_job(ChatCompletionRequest.model_validate(wire), "r", True).model_copy(update=_IDS)
    assert decode_job(encode_job(job), encode_delivery(job)) == job
    assert decode_job(encode_job(job, CONTRACT_VERSION - 1), encode_delivery(job)) == job


# -- writing for readers of older releases ------------------------------------------------------


@pytest.mark.parametrize("version", range(OLDEST_VERSION, CONTRACT_VERSION))
@pytest.mark.parametrize("name", sorted(V3_JOBS))
def test_a_text_job_is_written_for_an_older_reader_and_read_back_as_itself(name: str, version: int) -> None:
    job = _job(V3_JOBS[name]["kind"], V3_JOBS[name]["wire"])
    payload = json.loads(encode_job(job, version))
    assert payload["version"] == version
    assert decode_job(json.dumps(payload).encode(), encode_delivery(job)) == job


@pytest.mark.parametrize("name", sorted(V3_JOBS))
def test_written_for_version_3_it_is_what_the_previous_release_wrote(name: str) -> None:
    """Field for field, so a worker of that release reads it as its own, but for the API's
    delivery options, which that release's API wrote into the payload and this one keeps beside
    it (workers never read them: the field's default is what such a worker sees)."""
    case = V3_JOBS[name]
    job = decode_job(case["payload"].encode())
    written = json.loads(case["payload"])
    assert job.delivery.model_dump(mode="json") == written.pop("delivery", Delivery().model_dump(mode="json"))
    assert json.loads(encode_job(job, 3)) == written


def test_the_delivery_options_are_kept_beside_the_payload_not_in_it() -> None:
    """A change to how the API renders a job never changes what its worker reads."""
    wire = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": True, "resumable": True}
    job = make_job(ChatCompletionRequest.model_validate(wire), "r", True)
    assert job.delivery == Delivery(stream=True, resumable=True)
    for version in range(OLDEST_VERSION, CONTRACT_VERSION + 1):
        assert "delivery" not in json.loads(encode_job(job, version))
    assert decode_job(encode_job(job)).delivery == Delivery()  # what a worker reads
    assert decode_job(encode_job(job), encode_delivery(job)) == job  # what an API process reads
    # A payload of an API that kept them inside it is read with them.
    older = {**json.loads(encode_job(job)), "delivery": {"stream": True, "resumable": True}}
    assert decode_job(json.dumps(older).encode()) == job


def test_a_conversations_name_is_the_apis_alone_and_prompt_cache_key_comes_before_user() -> None:
    wire = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "user": "alice"}
    by_user = make_job(ChatCompletionRequest.model_validate(wire), "r", True)
    keyed = make_job(ChatCompletionRequest.model_validate({**wire, "prompt_cache_key": "agent-7"}), "r", True)
    assert by_user.affinity == ("user:alice",) and keyed.affinity == ("prompt_cache_key:agent-7",)
    for version in range(OLDEST_VERSION, CONTRACT_VERSION + 1):
        assert "affinity" not in json.loads(encode_job(keyed, version))


def test_a_prompts_size_is_estimated_from_its_text_and_counted_from_its_token_ids() -> None:
    chat = make_job(ChatCompletionRequest.model_validate(_CHAT), "r", True)
    generate = chat.request
    assert isinstance(generate, Generate) and generate.tools
    text = sum(len(part.model_dump_json()) for part in [*(generate.messages or []), *generate.tools])
    assert prompt_token_estimate(chat) == text // CHARS_PER_TOKEN > 0
    tokens = {"model": "m", "prompt": [[1, 2, 3], [4, 5]]}
    completion = make_job(REQUEST_MODELS["/v1/completions"].model_validate(tokens), "r", True)
    assert prompt_token_estimate(completion) == 5


def test_a_field_newer_than_the_reader_is_written_only_at_its_default() -> None:
    """``include_stop_str_in_output`` exists since version 4: left out for a version-3 reader while
    false, and a job that sets it is not written for that reader (its text would differ)."""
    wire = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stop": ["."]}
    plain = make_job(ChatCompletionRequest.model_validate(wire), "r", True)
    assert "include_stop_str_in_output" not in json.loads(encode_job(plain, 3))["request"]["sampling"]
    included = make_job(ChatCompletionRequest.model_validate({**wire, "include_stop_str_in_output": True}), "r", True)
    assert _generate(included).sampling.include_stop_str_in_output
    assert decode_job(encode_job(included), encode_delivery(included)) == included
    with pytest.raises(ValueError, match="include_stop_str_in_output"):
        encode_job(included, 3)


def test_a_jobs_lora_adapter_needs_a_version_5_reader() -> None:
    """``Generate.adapter`` exists since version 5: a base-model job is written for a version-4
    worker as it always was; an adapter's job is not (that worker would run the base model)."""
    wire = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    plain = make_job(ChatCompletionRequest.model_validate(wire), "r", True)
    assert "adapter" not in json.loads(encode_job(plain, 4))["request"]
    generate = _generate(plain).model_copy(update={"adapter": "sql"})
    adapted = plain.model_copy(update={"request": generate})
    assert adapted.served_name == "sql" and adapted.model == "m"
    assert decode_job(encode_job(adapted), encode_delivery(adapted)) == adapted
    with pytest.raises(ValueError, match="adapter"):
        encode_job(adapted, 4)


def test_versions_outside_the_supported_range_are_neither_read_nor_written() -> None:
    job = _job("chat", V3_JOBS["chat_minimal"]["wire"])
    for version in (OLDEST_VERSION - 1, CONTRACT_VERSION + 1):
        with pytest.raises(ValueError, match="cannot write"):
            encode_job(job, version)
    # A version-1 payload (the OpenAI request itself, no version): older than this release reads.
    with pytest.raises(UnreadableJob, match="version 1"):
        decode_job(json.dumps({**_IDS, "kind": "chat", "request": V3_JOBS["chat_minimal"]["wire"]}).encode())


_IMAGE = ImageRef(sha256="ab" * 32, media_type="image/png", width=64, height=48)


def _image_chat_job() -> ChatJob:
    text = _job("chat", V3_JOBS["chat_minimal"]["wire"])
    assert isinstance(text, ChatJob) and text.request.messages
    content = [TextPart(text="Look:"), ImagePart(image=_IMAGE), TextPart(text="What is it?")]
    messages = [text.request.messages[0].model_copy(update={"content": content})]
    return text.model_copy(update={"request": text.request.model_copy(update={"messages": messages})})


def test_an_image_job_round_trips_and_older_versions_refuse_to_carry_it() -> None:
    job = _image_chat_job()
    assert images_of(job) == [_IMAGE]
    assert decode_job(encode_job(job), encode_delivery(job)) == job
    with pytest.raises(ValueError, match="images"):
        encode_job(job, 2)
    assert decode_job(encode_job(job, 3), encode_delivery(job)) == job


def test_a_version_2_reader_could_not_misread_an_image_job() -> None:
    """Images change the shape of a message: a version-2 reader refuses such a payload by its version."""
    payload = json.loads(encode_job(_image_chat_job()))
    assert payload["version"] == CONTRACT_VERSION
    assert isinstance(payload["request"]["messages"][0]["content"], list)
