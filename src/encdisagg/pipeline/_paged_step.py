"""One batched decode step of a Qwen2-VL language model over paged KV.

Every request of the batch feeds in one token. The step writes each request's new keys and
values into its page at position ``kv_len``, then attends, per layer and for the whole batch
at once, over the KV gathered through the page tables (padded to the longest table, the
padding masked out). Norms, projections, rotary embeddings and the MLP are the model's own
modules, so the numbers are the model's; only the cache and the attention mask are ours.

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

__all__ = ["paged_decode_step"]


def paged_decode_step(
    model: Qwen2VLForConditionalGeneration,
    kv_pages: torch.Tensor,
    *,
    tokens: Sequence[int],
    kv_lens: Sequence[int],
    positions: Sequence[int],
    page_tables: Sequence[Sequence[int]],
) -> list[int]:
    """The greedy next token of every request of a batch. Blocks; call under inference mode.

    :param kv_pages: the page pool, ``[pages, layers, 2, kv_heads, page_tokens, head_dim]``.
    :param tokens: the token each request feeds in.
    :param kv_lens: tokens already in each request's KV (the new one lands at that index).
    :param positions: each new token's RoPE position (the same on all three M-RoPE axes).
    :param page_tables: each request's pages, in token order; they must hold ``kv_len + 1``.
    """
    batch = len(tokens)
    if not (batch == len(kv_lens) == len(positions) == len(page_tables)) or not batch:
        raise InternalError("a decode step needs one token, length, position and table each")
    page_tokens = int(kv_pages.shape[4])
    lens = torch.tensor(kv_lens, dtype=torch.long)
    widest = max(-(-(length + 1) // page_tokens) for length in kv_lens)
    padded = []
    for table, length in zip(page_tables, kv_lens, strict=True):
        if len(table) * page_tokens <= length:
            raise InternalError(f"{len(table)} pages cannot hold token {length}")
        row = list(table[:widest])
        padded.append(row + [row[0]] * (widest - len(row)))
    table_index = torch.tensor(padded, dtype=torch.long)
    # Where each new token's KV lands: its page, and its slot in that page.
    landing_page = table_index.gather(1, (lens // page_tokens).view(-1, 1)).view(-1)
    landing_slot = lens % page_tokens
    span = widest * page_tokens
    visible = torch.arange(span).view(1, -1) <= lens.view(-1, 1)
    mask = visible.view(batch, 1, 1, span)

    text: Any = model.model.language_model
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb

    hidden = text.embed_tokens(torch.tensor(tokens, dtype=torch.long).view(batch, 1))
    position_ids = torch.tensor(positions, dtype=torch.long).view(1, batch, 1).expand(3, -1, -1)
    cos, sin = text.rotary_emb(hidden, position_ids)
    for index, layer in enumerate(text.layers):
        attn = layer.self_attn
        head_dim = attn.head_dim
        normed = layer.input_layernorm(hidden)
        query = attn.q_proj(normed).view(batch, 1, -1, head_dim).transpose(1, 2)
        key = attn.k_proj(normed).view(batch, 1, -1, head_dim).transpose(1, 2)
        value = attn.v_proj(normed).view(batch, 1, -1, head_dim).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        kv_pages[landing_page, index, 0, :, landing_slot, :] = key[:, :, 0, :]
        kv_pages[landing_page, index, 1, :, landing_slot, :] = value[:, :, 0, :]
        # [batch, widest, 2, kv_heads, page_tokens, head_dim] -> [batch, kv_heads, span, dim]
        gathered = kv_pages[table_index, index]
        heads = gathered.shape[3]
        keys = gathered[:, :, 0].permute(0, 2, 1, 3, 4).reshape(batch, heads, span, head_dim)
        values = gathered[:, :, 1].permute(0, 2, 1, 3, 4).reshape(batch, heads, span, head_dim)
        out = functional.scaled_dot_product_attention(
            query,
            keys,
            values,
            attn_mask=mask,
            scale=attn.scaling,
            enable_gqa=query.shape[1] != heads,
        )
        hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch, 1, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    logits = model.lm_head(text.norm(hidden)[:, -1])
    return [int(t) for t in logits.argmax(-1).tolist()]
