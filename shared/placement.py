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

from shared.contract import AnyJob, ChatJob

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


def prefix_keys(job: AnyJob) -> list[str]:
    """The job's keys: its first message's, its affinity names', then those of its longer
    prefixes in order; none for a job without chat messages."""
    if not isinstance(job, ChatJob) or not job.request.messages:
        return []
    generate = job.request
    messages = generate.messages or []
    head = json.dumps(
        {
            "model": generate.model,
            "tools": [tool.model_dump(mode="json") for tool in generate.tools],
            "template": generate.chat_template_kwargs,
            # A LoRA adapter's prompts are cached apart from the base model's (a base job's key stays as it was).
            **({"adapter": generate.adapter} if generate.adapter is not None else {}),
        },
        sort_keys=True,
        ensure_ascii=False,
    )
    chain = _digest("", head)
    keys = []
    for message in messages:
        chain = _digest(chain, message.model_dump_json())
        keys.append(chain)
    names = job.affinity[: MAX_KEYS // 2]
    named = [AFFINITY_MARK + _digest(json.dumps([generate.model, job.tenant, name]), "affinity") for name in names]
    if generate.adapter is not None:  # the workers that served the adapter hold it ready: tried after the names
        named.insert(0, adapter_key(generate.model, generate.adapter))
    room = MAX_KEYS - len(named)
    longer = keys[1:] if len(keys) <= room else keys[-(room - 1) :]
    return [keys[0], *named, *longer]
