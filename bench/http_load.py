"""(c) The full stack: N concurrent streaming clients over HTTP (API + Redis + worker)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from bench.stats import StreamTrace


async def _one_stream(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> StreamTrace:
    trace = StreamTrace(sent_at=time.perf_counter())
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                trace.num_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    trace.token_times.append(time.perf_counter())
    trace.finished_at = time.perf_counter()
    return trace


def request_body(model: str, user_text: str, output_tokens: int) -> dict[str, object]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": user_text}],
        "max_tokens": output_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def run_streams(base_url: str, model: str, user_texts: list[str], output_tokens: int) -> list[StreamTrace]:
    url = f"{base_url}/v1/chat/completions"
    limits = httpx.Limits(max_connections=len(user_texts) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        tasks = [_one_stream(client, url, request_body(model, text, output_tokens)) for text in user_texts]
        return list(await asyncio.gather(*tasks))


async def run_sequential(base_url: str, model: str, user_texts: list[str], output_tokens: int) -> list[StreamTrace]:
    url = f"{base_url}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=600) as client:
        return [await _one_stream(client, url, request_body(model, text, output_tokens)) for text in user_texts]
