"""Tensors in, logits out: one decode forward over the running slots, one prefill forward over
prompt chunks, with the slot cache and an explicit 4D mask. The forward is relaylm's native
decoder (worker/native) or, for other architectures, a transformers model's own layers: every
architecture transformers implements with ``update()``-style caches works.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Protocol, cast

import torch

from worker.engine.scheduler import PrefillChunk
from worker.engine.sequence import Sequence
from worker.native.decoder import Deepstack, NativeCausalLM
from worker.native.kv_cache import SharedGroup, SlotKVCache
from worker.native.lora import JoinCache, LoraModel, LoraStep
from worker.native.model_config import text_config

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from worker.native.compiled_decode import CompiledDecode

SharedPrefix = tuple[int, int]  # (prefix slot, length) a row reads before its own keys; length 0: none
NO_PREFIX: SharedPrefix = (-1, 0)


def prefix_of(seq: Sequence) -> SharedPrefix:
    prefix = seq.prefix.shared
    return (prefix.slot, seq.prefix.shared_len) if prefix is not None else NO_PREFIX


class StepForward(Protocol):
    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        cache: SlotKVCache,
        inputs_embeds: torch.Tensor | None = None,
        rope_position_ids: torch.Tensor | None = None,
        deepstack: Deepstack | None = None,
        lora: LoraStep | None = None,
    ) -> torch.Tensor: ...

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class TransformersForward:
    """A transformers causal LM driven through its decoder with our cache and mask."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        cache: SlotKVCache,
        inputs_embeds: torch.Tensor | None = None,
        rope_position_ids: torch.Tensor | None = None,
        deepstack: Deepstack | None = None,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        assert rope_position_ids is None and deepstack is None, "vision-language models run on the native decoder"
        assert lora is None, "adapters run on the native decoder"
        ids = {"input_ids": input_ids} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
        output = self.decoder(
            **ids, position_ids=position_ids, attention_mask=mask, past_key_values=cache, use_cache=True
        )
        return output.last_hidden_state

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeddings: torch.Tensor = self.decoder.get_input_embeddings()(input_ids)
        return embeddings

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: SlotKVCache) -> None:
        self.model = model
        self.forward: StepForward = (
            model if isinstance(model, NativeCausalLM) else TransformersForward(cast("PreTrainedModel", model))
        )
        self.cache = cache
        self.device = cache.layout.device
        config = text_config(model.config)
        self.vocab_size: int = config.vocab_size
        self._logit_softcap: float | None = getattr(config, "final_logit_softcapping", None)
        self.compiled: CompiledDecode | None = None  # one stream's step, compiled (set by the worker)
        self.lora_joins = JoinCache()  # LoRA adapters' updates joined, by the set a step holds

    @torch.inference_mode()
    def decode(
        self,
        token_ids: list[int],
        positions: list[int],
        prefixes: Seq[SharedPrefix] | None = None,
        rope_deltas: list[int] | None = None,
        adapters: list[LoraModel | None] | None = None,
    ) -> torch.Tensor:
        """Rows ``0..len(token_ids)-1``: one token each at ``positions``; returns [rows, vocab] fp32.
        ``prefixes``: each row's shared prefix (``(prefix slot, length)``; length 0: none);
        ``rope_deltas``: each row's RoPE shift past a multimodal prompt (None: none shifted);
        ``adapters``: each row's LoRA adapter (None: the base model's)."""
        device = self.device
        kv_len = max(positions) + 1
        compiled = self.compiled
        lora = LoraStep.of_rows(adapters, device, self.lora_joins) if adapters is not None else None
        plain = not any(n for _, n in prefixes or ()) and rope_deltas is None and lora is None
        if compiled is not None and compiled.runs(len(token_ids), kv_len) and plain:
            return self._softcapped(compiled(token_ids[0], positions[0]))
        position_t = torch.tensor(positions, dtype=torch.long, device=device)
        read_start, groups, own_start = self._shared_groups(prefixes)
        self.cache.begin_decode(len(token_ids), position_t, kv_len, read_start, groups)
        key_positions = torch.arange(read_start, kv_len, device=device)
        mask = key_positions[None, :] <= position_t[:, None]
        if own_start is not None:
            mask &= key_positions[None, :] >= own_start[:, None]
        mask = mask[:, None, None, :]
        rope = None
        if rope_deltas is not None:
            rope = (position_t + torch.tensor(rope_deltas, dtype=torch.long, device=device))[:, None]
        ids = torch.tensor(token_ids, dtype=torch.long, device=device)[:, None]
        hidden = self.forward.hidden_states(
            ids, position_t[:, None], mask, self.cache, rope_position_ids=rope, lora=lora
        )
        return self._logits(hidden[:, 0])

    @torch.inference_mode()
    def prefill(self, chunks: Seq[PrefillChunk]) -> torch.Tensor:
        """Compute chunks into their slots; returns fp32 logits of each chunk's last token, or of
        every token of a drafted chunk (``PrefillChunk.num_logit_rows``), in chunk order."""
        device = self.device
        query_len = max(chunk.length for chunk in chunks)
        token_rows, lengths = [], []
        for chunk in chunks:
            token_rows.append(chunk.token_ids + [0] * (query_len - chunk.length))
            lengths.append(chunk.length)
        slots = torch.tensor([chunk.seq.sched.slot for chunk in chunks], dtype=torch.long, device=device)
        starts = torch.tensor([chunk.start for chunk in chunks], dtype=torch.long, device=device)
        length_t = torch.tensor(lengths, dtype=torch.long, device=device)
        offsets = torch.arange(query_len, device=device)[None, :]
        positions = starts[:, None] + offsets
        is_padding = offsets >= length_t[:, None]
        write_slots = torch.where(is_padding, self.cache.scratch_slot, slots[:, None])
        write_positions = torch.where(is_padding, offsets, positions)
        kv_len = int((starts + length_t).max())
        prefixes = [prefix_of(chunk.seq) for chunk in chunks]
        read_start, groups, own_start = self._shared_groups(prefixes)
        self.cache.begin_prefill(slots, write_slots, write_positions, kv_len, read_start, groups)
        key_positions = torch.arange(read_start, kv_len, device=device)
        mask = key_positions[None, None, :] <= positions[:, :, None]
        if own_start is not None:
            mask &= key_positions[None, None, :] >= own_start[:, None, None]
        mask = mask[:, None]
        input_ids = torch.tensor(token_rows, dtype=torch.long, device=device)
        embeds, deepstack = self._with_images(input_ids, chunks)
        rope = self._multimodal_positions(positions, chunks)
        lora = LoraStep.of_rows([chunk.seq.request.adapter for chunk in chunks], device, self.lora_joins)
        hidden = self.forward.hidden_states(input_ids, positions, mask, self.cache, embeds, rope, deepstack, lora)
        rows = [row for row, chunk in enumerate(chunks) for _ in range(chunk.num_logit_rows)]
        offsets_out = [chunk.length - chunk.num_logit_rows + i for chunk in chunks for i in range(chunk.num_logit_rows)]
        picked = hidden[torch.tensor(rows, device=device), torch.tensor(offsets_out, device=device)]
        return self._logits(picked)

    def _with_images(
        self, input_ids: torch.Tensor, chunks: Seq[PrefillChunk]
    ) -> tuple[torch.Tensor | None, Deepstack | None]:
        """The step's input embeddings with every image placeholder's row replaced by its image
        embedding (the model's own merge, done per chunk), and the deepstack features of those
        rows; None where no chunk holds image tokens."""
        embeds = None
        rows: list[torch.Tensor] = []
        cols: list[torch.Tensor] = []
        layers: list[list[torch.Tensor]] = []
        for row, chunk in enumerate(chunks):
            images = chunk.seq.request.images
            found = images.rows_in(chunk.start, chunk.length) if images is not None else None
            if found is None:
                continue
            assert images is not None and images.features is not None, "the engine encodes images on admission"
            if embeds is None:
                embeds = self.forward.embed(input_ids)
            offsets, indices = found
            offsets, features = offsets.to(self.device), images.features
            embeds[row, offsets] = features.embeds[indices.to(features.embeds.device)].to(embeds.dtype)
            if features.deepstack:
                rows.append(torch.full_like(offsets, row))
                cols.append(offsets)
                layers.append([layer[indices.to(layer.device)].to(embeds.dtype) for layer in features.deepstack])
        if not layers:
            return embeds, None
        per_layer = [torch.cat(parts) for parts in zip(*layers, strict=True)]
        return embeds, Deepstack(torch.cat(rows), torch.cat(cols), per_layer)

    def _multimodal_positions(self, positions: torch.Tensor, chunks: Seq[PrefillChunk]) -> torch.Tensor | None:
        """RoPE's temporal, height and width positions of the step, ``[3, rows, query_len]``,
        where a chunk's prompt has images and the model rotates by them; None where none does."""
        rope = None
        for row, chunk in enumerate(chunks):
            images = chunk.seq.request.images
            if images is None or images.rope_positions is None:
                continue
            if rope is None:
                rope = positions[None].expand(3, -1, -1).clone()
            prompt_len = images.rope_positions.shape[1]
            index = torch.arange(chunk.start, chunk.start + chunk.length)
            in_prompt = index < prompt_len
            values = (index + images.rope_delta)[None].expand(3, -1).clone()  # outputs resumed after the prompt
            values[:, in_prompt] = images.rope_positions[:, index[in_prompt]]
            rope[:, row, : chunk.length] = values.to(rope.device)
        return rope

    def _shared_groups(
        self, prefixes: Seq[SharedPrefix] | None
    ) -> tuple[int, tuple[SharedGroup, ...], torch.Tensor | None]:
        """Where rows' own keys start (the first position any row reads), the rows of each shared
        prefix, and each row's first own position (None when no row has a prefix)."""
        if not prefixes or not any(length for _, length in prefixes):
            return 0, (), None
        rows_of: dict[SharedPrefix, list[int]] = {}
        for row, prefix in enumerate(prefixes):
            if prefix[1]:
                rows_of.setdefault(prefix, []).append(row)
        groups = tuple(
            SharedGroup(torch.tensor(rows, dtype=torch.long, device=self.device), slot, length)
            for (slot, length), rows in rows_of.items()
        )
        lengths = [length for _, length in prefixes]
        return min(lengths), groups, torch.tensor(lengths, dtype=torch.long, device=self.device)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._softcapped(self.forward.logits(hidden).float())

    def _softcapped(self, logits: torch.Tensor) -> torch.Tensor:
        if self._logit_softcap:
            logits = torch.tanh(logits / self._logit_softcap) * self._logit_softcap
        return logits
