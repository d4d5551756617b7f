"""The reference engine adapter: transformers' ``LlamaForCausalLM`` (DESIGN.md section 8).

The model's own modules do the arithmetic (token embedding, rotary embedding, decoder layers,
final norm, LM head), but this adapter runs them in order itself rather than calling the model's
forward. That lets it wait for layer l of a layer-wise import just before running layer l
(spec 4.3), and keep the cache as one pair of tensors per layer that it hands out as blocks.
Prefill, extend and decode, with or without imported blocks, all take this one path, so a
cache imported from another instance yields logits bit-identical to the cache it was exported
from.

The cache of a layer is K and V shaped [1, kv_heads, tokens, head_dim], contiguous, the shape
transformers' attention consumes; keys are stored after RoPE, at absolute positions. Attention is
torch's scaled_dot_product_attention (transformers' "sdpa"): it picks a fused kernel by shape,
dtype and device, so the same shapes on the same device always run the same kernel. A prefill
from position 0 passes no mask and lets the kernel apply causality itself (the fused causal
kernel never materialises the tokens x tokens scores, which on a 2,048-token prompt is most of
the difference from eager attention's 6x); an extend after cached tokens passes an explicit mask.

No process-wide torch setting is changed. Bit-identical results are promised only where the
arithmetic is the same: the same tensors, shapes, kernels and thread count. A cache recomputed
from scratch multiplies matrices of other shapes and may differ in the last bits (on float32,
below 1e-6 here), which is why 4.4 calls a sampler deterministic only with batch-invariant
kernels.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence as SequenceOf
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import LlamaForCausalLM

from kvsp.compat import descriptor_from_model_dir
from kvsp.problems import ProtocolError
from kvsp.tensors import kv_dtype_of
from workers.engines.base import EngineAdapter, Sequence
from workers.engines.modeldir import REFERENCE_MODEL, TOKENIZER_FILE


class _LayerStep:
    """Stands in for a transformers ``Cache`` while one decoder layer runs: the attention hands
    it the new keys (after RoPE) and values and gets back the layer's whole cache."""

    __slots__ = ("past", "updated")

    def __init__(self, past: tuple[torch.Tensor, torch.Tensor] | None):
        self.past = past
        self.updated: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.past is None:
            # A new cache is made contiguous so that every cache, computed here or imported,
            # has one memory layout and attention over it runs the same kernels.
            key_states, value_states = key_states.contiguous(), value_states.contiguous()
        else:
            key_states = torch.cat((self.past[0], key_states), dim=2)
            value_states = torch.cat((self.past[1], value_states), dim=2)
        self.updated = (key_states, value_states)
        return key_states, value_states


class ReferenceEngine(EngineAdapter):
    """An engine adapter on a Hugging Face style Llama model directory.

    ``dtype`` is the dtype of the weights and therefore of the cache (``kv_dtype``); ``device``
    defaults to CUDA when present, else the CPU. ``model`` is the descriptor's model name, the
    same string on every instance (4.1).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        block_tokens: int = 16,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        model: str = REFERENCE_MODEL,
    ):
        self.model_dir = Path(model_dir)
        self.dtype = dtype
        self.device = torch.device(
            device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        self._descriptor = descriptor_from_model_dir(
            self.model_dir, model=model, kv_dtype=kv_dtype_of(dtype), block_tokens=block_tokens
        )
        self._model = LlamaForCausalLM.from_pretrained(
            self.model_dir, dtype=dtype, attn_implementation="sdpa", local_files_only=True
        )
        self._model.to(self.device).eval()
        config = self._model.config
        self.vocab_size = config.vocab_size
        self.max_positions = config.max_position_embeddings
        eos = config.eos_token_id
        self._eos_token_id = eos[0] if isinstance(eos, list) and eos else eos
        self._tokenizer = Tokenizer.from_file(str(self.model_dir / TOKENIZER_FILE))

    @property
    def descriptor(self) -> dict:
        return dict(self._descriptor)

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def detokenize(self, tokens: SequenceOf[int]) -> str:
        return self._tokenizer.decode([int(token) for token in tokens])

    def _checked_tokens(self, tokens: SequenceOf[int]) -> list[int]:
        token_list = [int(token) for token in tokens]
        if not token_list:
            raise ValueError("extend needs at least one token")
        for token in token_list:
            if not 0 <= token < self.vocab_size:
                raise ProtocolError(
                    "kvsp-invalid-record",
                    f"token {token} is outside this model's vocabulary of {self.vocab_size}",
                )
        return token_list

    def _causal_mask(self, start: int, count: int) -> torch.Tensor | None:
        """Additive mask [1, 1, count, start+count]: query i (at position start+i) sees the
        keys at positions 0..start+i. A single new token sees everything, and a prefill from
        position 0 is plain causal attention, which the kernel applies itself: neither needs one."""
        if count == 1 or start == 0:
            return None
        blocked = torch.ones(count, start + count, dtype=torch.bool, device=self.device)
        blocked = blocked.triu(diagonal=start + 1)
        mask = torch.zeros(count, start + count, dtype=self.dtype, device=self.device)
        return mask.masked_fill(blocked, torch.finfo(self.dtype).min)[None, None]

    def extend(self, sequence: Sequence, tokens: SequenceOf[int]) -> torch.Tensor:
        self._check_sequence(sequence)
        token_list = self._checked_tokens(tokens)
        start, count = sequence.length, len(token_list)
        if start + count > self.max_positions:
            raise ValueError(f"{start + count} positions exceed the model's {self.max_positions}")
        body = self._model.model
        started: list[float] = []
        updated: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.inference_mode():
            ids = torch.tensor([token_list], dtype=torch.long, device=self.device)
            hidden = body.embed_tokens(ids)
            positions = torch.arange(start, start + count, device=self.device).unsqueeze(0)
            position_embeddings = body.rotary_emb(hidden, position_ids=positions)
            mask = self._causal_mask(start, count)
            for index, layer in enumerate(body.layers):
                past = self._layer_cache(sequence, index) if start else None
                step = _LayerStep(past)
                started.append(time.monotonic())
                hidden = layer(
                    hidden,
                    attention_mask=mask,
                    position_ids=positions,
                    cache=step,
                    position_embeddings=position_embeddings,
                )
                updated.append(step.updated)
            logits = self._model.lm_head(body.norm(hidden[:, -1:, :]))[0, -1]
        # Nothing above touched the sequence but the imported layers it installed, so an error
        # anywhere leaves it as it was.
        sequence.cache = updated
        sequence.length = start + count
        if sequence.tokens is not None:
            sequence.tokens.extend(token_list)
        sequence.logits = logits
        sequence.layer_started = started
        self._count_forward_pass()
        return logits

    def block_tensors(
        self, sequence: Sequence, block: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self._check_sequence(sequence)
        if not 0 <= block < sequence.complete_blocks:
            raise ValueError(f"block {block} is not a complete block of the sequence")
        first = block * self.block_tokens
        last = first + self.block_tokens
        tensors = []
        for layer in range(self.layers):
            k, v = self._layer_cache(sequence, layer)
            tensors.append(
                (
                    k[0, :, first:last, :].permute(1, 0, 2).contiguous(),
                    v[0, :, first:last, :].permute(1, 0, 2).contiguous(),
                )
            )
        return tensors

    def _cache_layer(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            k.to(self.device).permute(1, 0, 2).unsqueeze(0).contiguous(),
            v.to(self.device).permute(1, 0, 2).unsqueeze(0).contiguous(),
        )
