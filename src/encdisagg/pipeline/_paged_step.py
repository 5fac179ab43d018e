"""Batched decode steps of a Qwen2-VL language model over paged KV.

Every request of the batch feeds in one token. A step gathers the batch's KV through its page
tables once (all layers in one gather, padded to the longest table, the padding masked out),
attends per layer over that KV plus each request's new key and value, and at the end writes
every layer's new keys and values into the pages in one scatter, at position ``kv_len``.
Norms, rotary embeddings and the MLP's activation are the model's own modules and functions;
the query/key/value projections and the MLP's gate and up projections run as one matrix
product each, on weights concatenated once. Few, large tensor operations keep a step short,
and each one lets go of the interpreter lock while it runs, so a step loses little to other
threads (prefill, encoders) working in the same process.

Blocking (torch); the decode worker calls it from a worker thread, one step at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import functional

from .._errors import InternalError

if TYPE_CHECKING:
    from transformers import Qwen2VLForConditionalGeneration

__all__ = ["PagedDecoder"]


class PagedDecoder:
    """One model's decode step over paged KV; build it once per model (it copies weights)."""

    def __init__(self, model: Qwen2VLForConditionalGeneration) -> None:
        text: Any = model.model.language_model
        self._text = text
        self._lm_head = model.lm_head
        self._layers = []
        for layer in text.layers:
            attn = layer.self_attn
            qkv_weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
            qkv_bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
            mlp = layer.mlp
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            self._layers.append((layer, attn, qkv_weight.detach(), qkv_bias.detach(), gate_up))
        first = text.layers[0].self_attn
        self._head_dim = int(first.head_dim)
        self._heads = int(first.q_proj.out_features) // self._head_dim
        self._kv_heads = int(first.k_proj.out_features) // self._head_dim
        self._intermediate = int(text.layers[0].mlp.intermediate_size)

    def step(
        self,
        kv_pages: torch.Tensor,
        *,
        tokens: Sequence[int],
        kv_lens: Sequence[int],
        positions: Sequence[int],
        page_tables: Sequence[Sequence[int]],
    ) -> list[int]:
        """The greedy next token of every request of a batch. Blocks; call under inference
        mode.

        :param kv_pages: the page pool, ``[pages, layers, 2, kv_heads, page_tokens, head_dim]``.
        :param tokens: the token each request feeds in.
        :param kv_lens: tokens already in each request's KV (the new one lands at that index).
        :param positions: each new token's RoPE position (the same on all three M-RoPE axes).
        :param page_tables: each request's pages, in token order; they must hold ``kv_len+1``.
        """
        from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb

        batch = len(tokens)
        if not (batch == len(kv_lens) == len(positions) == len(page_tables)) or not batch:
            raise InternalError("a decode step needs one token, length, position and table each")
        page_tokens = int(kv_pages.shape[4])
        widest = max(-(-length // page_tokens) for length in kv_lens) or 1
        padded = []
        landing = []
        for table, length in zip(page_tables, kv_lens, strict=True):
            if len(table) * page_tokens <= length:
                raise InternalError(f"{len(table)} pages cannot hold token {length}")
            row = list(table[:widest])
            padded.append(row + [table[0]] * (widest - len(row)))
            landing.append(table[length // page_tokens])
        lens = torch.tensor(kv_lens, dtype=torch.long)
        span = widest * page_tokens
        # Old KV of every layer at once: [layers, 2, batch, kv_heads, span, head_dim].
        old = kv_pages[torch.tensor(padded, dtype=torch.long)].permute(2, 3, 0, 4, 1, 5, 6)
        old = old.reshape(*old.shape[:4], span, self._head_dim)
        # Each request sees its own old tokens, then its new one (the last key).
        visible = torch.ones((batch, span + 1), dtype=torch.bool)
        visible[:, :span] = torch.arange(span).view(1, -1) < lens.view(-1, 1)
        mask = visible.view(batch, 1, 1, span + 1)

        text = self._text
        hidden = text.embed_tokens(torch.tensor(tokens, dtype=torch.long).view(batch, 1))
        position_ids = torch.tensor(positions, dtype=torch.long).view(1, batch, 1).expand(3, -1, -1)
        cos, sin = text.rotary_emb(hidden, position_ids)
        q_width = self._heads * self._head_dim
        kv_width = self._kv_heads * self._head_dim
        new_kv = []
        for index, (layer, attn, qkv_weight, qkv_bias, gate_up) in enumerate(self._layers):
            qkv = functional.linear(layer.input_layernorm(hidden), qkv_weight, qkv_bias)
            query = qkv[..., :q_width]
            key = qkv[..., q_width : q_width + kv_width]
            value = qkv[..., q_width + kv_width :]
            query = query.view(batch, 1, self._heads, self._head_dim).transpose(1, 2)
            key = key.view(batch, 1, self._kv_heads, self._head_dim).transpose(1, 2)
            value = value.view(batch, 1, self._kv_heads, self._head_dim).transpose(1, 2)
            query, key = apply_rotary_pos_emb(query, key, cos, sin)
            new_kv.append(torch.stack((key[:, :, 0], value[:, :, 0]), dim=1))
            out = functional.scaled_dot_product_attention(
                query,
                torch.cat((old[index, 0], key), dim=2),
                torch.cat((old[index, 1], value), dim=2),
                attn_mask=mask,
                scale=attn.scaling,
                enable_gqa=self._heads != self._kv_heads,
            )
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch, 1, q_width))
            gate_and_up = functional.linear(layer.post_attention_layernorm(hidden), gate_up)
            gate = gate_and_up[..., : self._intermediate]
            up = gate_and_up[..., self._intermediate :]
            hidden = hidden + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
        # Every layer's new key and value into its page: [batch, layers, 2, kv_heads, dim].
        kv_pages[torch.tensor(landing, dtype=torch.long), :, :, :, lens % page_tokens, :] = (
            torch.stack(new_kv, dim=1)
        )
        logits = self._lm_head(text.norm(hidden)[:, -1])
        return [int(t) for t in logits.argmax(-1).tolist()]
