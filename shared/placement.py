"""Prefix keys: what a chat job's prompt starts with, named without a tokenizer, so the claim can
hand a conversation's next turn to the worker that holds its earlier turns in its prefix cache.

A key names the conversation up to the end of one message: a chain hash over the model, the
tools and the chat template's arguments (what comes before the first message in the rendered
prompt), then each message in order. Two jobs share a key exactly when their conversations are
the same up to that message, so a follow-up turn (the earlier messages, the answer, a new
message) holds every key of the turn before it. Keys are computed the same way by every API
process; a worker holds the keys of the jobs it claimed (``shared.job_lifecycle``) while its
prefix cache holds their prompts, and the claim prefers, for a bounded window, the live worker
that holds a job's longest key.

A job of a LoRA adapter adds the adapter's key after the first message's: the workers that ran
a job of the adapter hold it ready, so a job that finds no held conversation goes to one of
them rather than to a worker that must fetch the adapter and make it ready first (a worker holds
the key as it holds affinity names).

A completion's prompt has no messages: its keys are those of its first prompt's text up to the
end of each block of ``TEXT_BLOCK_CHARS`` characters (``TOKEN_BLOCK`` ids for a prompt of token
ids), the last one ending where the prompt does. A prompt that extends an earlier one (a
pipeline's growing document, a client's own conversation format) holds the keys of the earlier
one's whole blocks.

Where messages cannot tell, the client can: a job's ``affinity`` (OpenAI's ``prompt_cache_key``
or ``user``; in the Responses API, the response it continues and its own) adds a key per name,
so a conversation's second turn finds the worker of its first even when the first was one
message. Those keys come right after the first message's: the claim tries a job's keys from the
last to the second, so a held message prefix is preferred, then a named affinity. A worker
holds a name's key as long as it holds any key (a name asks for the same worker, cached or not).
"""

from __future__ import annotations

import hashlib
import json

from shared.contract import AnyJob, ChatJob, CompletionJob, Generate

AFFINITY_MARK = "~"
"""Begins an affinity name's key (message keys are hex digests)."""
MAX_KEYS = 32
"""A job's keys at most: the first message's, then those of its last messages (the longest
prefixes are the ones worth finding, the first is the one most often shared)."""


def _digest(previous: str, part: str) -> str:
    return hashlib.sha256(f"{previous}\n{part}".encode()).hexdigest()[:20]


def follows_cache(key: str) -> bool:
    """Whether a worker holds ``key`` only while its prefix cache holds a prompt that has it."""
    return not key.startswith(AFFINITY_MARK)


def adapter_key(model: str, adapter: str) -> str:
    """The key of the workers that claimed a job of a LoRA adapter (they made it ready then)."""
    return AFFINITY_MARK + _digest(json.dumps([model, adapter]), "adapter")


TEXT_BLOCK_CHARS = 1024
"""A completion's text prompt is keyed at the end of every block of this many characters."""
TOKEN_BLOCK = 256
"""A completion's token-id prompt is keyed at the end of every block of this many ids."""


def _head(generate: Generate, **extra: object) -> str:
    """What precedes the prompt's parts: the model, and a LoRA adapter's name (its prompts are
    cached apart from the base model's; a base job's key stays as it was)."""
    adapter = {"adapter": generate.adapter} if generate.adapter is not None else {}
    return _digest("", json.dumps({"model": generate.model, **extra, **adapter}, sort_keys=True, ensure_ascii=False))


def _parts(job: AnyJob) -> tuple[str, list[str]] | None:
    """The chain's start and the parts whose ends are keyed; None for a job nothing places."""
    if isinstance(job, ChatJob) and job.request.messages:
        generate = job.request
        tools = [tool.model_dump(mode="json") for tool in generate.tools]
        head = _head(generate, tools=tools, template=generate.chat_template_kwargs)
        return head, [message.model_dump_json() for message in generate.messages or []]
    if isinstance(job, CompletionJob) and job.request.prompts:
        prompt = job.request.prompts[0]
        if isinstance(prompt, str):
            blocks = [prompt[i : i + TEXT_BLOCK_CHARS] for i in range(0, len(prompt), TEXT_BLOCK_CHARS)]
        else:
            blocks = [json.dumps(prompt[i : i + TOKEN_BLOCK]) for i in range(0, len(prompt), TOKEN_BLOCK)]
        if not blocks:
            return None
        return _head(job.request, completion="text" if isinstance(prompt, str) else "tokens"), blocks
    return None


def prefix_keys(job: AnyJob) -> list[str]:
    """The job's keys: its first part's (a chat's first message, a completion prompt's first
    block), its affinity names', then those of its longer prefixes in order; none for a job
    without chat messages or a prompt."""
    parts = _parts(job)
    if parts is None:
        return []
    chain, pieces = parts
    generate = job.request
    assert isinstance(generate, Generate)
    keys = []
    for piece in pieces:
        chain = _digest(chain, piece)
        keys.append(chain)
    names = job.affinity[: MAX_KEYS // 2]
    named = [AFFINITY_MARK + _digest(json.dumps([generate.model, job.tenant, name]), "affinity") for name in names]
    if generate.adapter is not None:  # the workers that served the adapter hold it ready: tried after the names
        named.insert(0, adapter_key(generate.model, generate.adapter))
    room = MAX_KEYS - len(named)
    longer = keys[1:] if len(keys) <= room else keys[-(room - 1) :]
    return [keys[0], *named, *longer]
