"""Batched decode steps of a Qwen2-VL or Qwen3-VL language model over paged KV.

Every request of the batch feeds in one token. A step gathers the batch's KV through its page
tables once (all layers in one gather, padded to the longest table, the padding masked out),
attends per layer over that KV plus each request's new key and value, and at the end writes
every layer's new keys and values into the pages in one scatter, at position ``kv_len``.

The arithmetic is the model's, bit for bit where it matters for greedy parity: its weights,
its rotary embedding, its RMSNorm (``rms_norm`` computes it identically), ``rotate_half`` as
an exact signed permutation. What differs is how few tensor operations a layer takes: the
query/key/value projections run as one matrix product, the MLP's gate and up projections as
another, RoPE rotates queries and keys together. Each operation lets other threads (prefill,
encoders working in the same process) take the interpreter lock, and a step loses the time
it waits to get it back, so fewer operations mean a step that other work stretches less.

Blocking (torch); the decode worker calls it from a worker thread (or inline), one step at a
time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import functional

from .._errors import InternalError

if TYPE_CHECKING:
    from transformers import Qwen2VLForConditionalGeneration, Qwen3VLForConditionalGeneration

    from ..decode import DecodeBatch

__all__ = ["PagedDecoder"]


class PagedDecoder:
    """One model's decode step over paged KV; build it once per model (it copies weights)."""

    def __init__(
        self, model: Qwen2VLForConditionalGeneration | Qwen3VLForConditionalGeneration
    ) -> None:
        text: Any = model.model.language_model
        self._text = text
        self._lm_head = model.lm_head
        first = text.layers[0]
        self._head_dim = int(first.self_attn.head_dim)
        self._heads = int(first.self_attn.q_proj.out_features) // self._head_dim
        self._kv_heads = int(first.self_attn.k_proj.out_features) // self._head_dim
        self._intermediate = int(first.mlp.intermediate_size)
        self._hidden = int(first.self_attn.q_proj.in_features)
        self._eps = float(first.input_layernorm.variance_epsilon)
        self._scaling = float(first.self_attn.scaling)
        self._act = first.mlp.act_fn
        self._layers = []
        for layer in text.layers:
            attn, mlp = layer.self_attn, layer.mlp
            biases = (attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)
            self._layers.append(
                (
                    layer.input_layernorm.weight.detach(),
                    torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                    None if biases[0] is None else torch.cat(biases),
                    attn.o_proj.weight.detach(),
                    layer.post_attention_layernorm.weight.detach(),
                    torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                    mlp.down_proj.weight.detach(),
                )
            )
        # Qwen3-VL's text model normalises each query and key head (RMSNorm over head_dim)
        # before RoPE, with one weight for queries and one for keys; Qwen2-VL's does not.
        self._qk_norms = [
            (layer.self_attn.q_norm.weight.detach(), layer.self_attn.k_norm.weight.detach())
            for layer in text.layers
            if hasattr(layer.self_attn, "q_norm")
        ]
        # ``x @ rotation`` is the model's ``rotate_half(x)``: ``(-x2, x1)``. Each output is one
        # input times +-1 plus exact zeros, so the product is exact.
        half = self._head_dim // 2
        rotation = torch.zeros((self._head_dim, self._head_dim), dtype=model.dtype)
        rotation[half:, :half] = -torch.eye(half)
        rotation[:half, half:] = torch.eye(half)
        self._rotation = rotation
        rotary = text.rotary_emb
        # With the same position on all three M-RoPE axes, the sections the model interleaves
        # are equal, so cos and sin are plain RoPE's: computed here in a few operations, with
        # the model's own frequencies and scaling (the same arithmetic, in the same order).
        self._rotary = rotary
        self._plain_rope = getattr(rotary, "rope_type", None) == "default"

    def _rope(self, hidden: torch.Tensor, positions: Sequence[int]) -> tuple[Any, Any]:
        batch = len(positions)
        if not self._plain_rope:
            ids = torch.tensor(positions, dtype=torch.long).view(1, batch, 1).expand(3, -1, -1)
            return self._rotary(hidden, ids)  # type: ignore[no-any-return]
        rotary = self._rotary
        freqs = torch.tensor(positions, dtype=torch.long).view(batch, 1, 1).float() * (
            rotary.inv_freq.float()
        )
        freqs = torch.cat((freqs, freqs), dim=-1)
        scaling = rotary.attention_scaling
        return (freqs.cos() * scaling).to(hidden.dtype), (freqs.sin() * scaling).to(hidden.dtype)

    def step(self, kv_pages: torch.Tensor, running: DecodeBatch) -> list[int]:
        """The greedy next token of every request of a batch. Blocks; call under inference
        mode.

        Each request feeds in its last output token, at its next RoPE position (the same on
        all three M-RoPE axes); its new key and value land at index ``kv_len`` of its pages,
        which are in token order and must hold ``kv_len+1`` tokens.

        :param kv_pages: the page pool, ``[pages, layers, 2, kv_heads, page_tokens, head_dim]``.
        """
        reqs = running.reqs
        batch = len(reqs)
        if not batch:
            raise InternalError("a decode step needs at least one request")
        tokens = [rr.output[-1] for rr in reqs]
        kv_lens = [rr.kv_len for rr in reqs]
        positions = [rr.next_position for rr in reqs]
        page_tokens = int(kv_pages.shape[4])
        widest = max(-(-length // page_tokens) for length in kv_lens) or 1
        padded = []
        landing = []
        for table, length in zip((rr.req.pages for rr in reqs), kv_lens, strict=True):
            if len(table) * page_tokens <= length:
                raise InternalError(f"{len(table)} pages cannot hold token {length}")
            row = list(table[:widest])
            padded.append(row + [table[0]] * (widest - len(row)))
            landing.append(table[length // page_tokens])
        lens = torch.tensor(kv_lens, dtype=torch.long)
        span = widest * page_tokens
        heads, kv_heads, dim = self._heads, self._kv_heads, self._head_dim
        # Old KV of every layer at once: [layers, 2, batch, kv_heads, span, head_dim].
        old = kv_pages[torch.tensor(padded, dtype=torch.long)].permute(2, 3, 0, 4, 1, 5, 6)
        old = old.reshape(*old.shape[:4], span, dim)
        # Each request sees its own old tokens, then its new one (the last key).
        visible = torch.ones((batch, span + 1), dtype=torch.bool)
        visible[:, :span] = torch.arange(span).view(1, -1) < lens.view(-1, 1)
        mask = visible.view(batch, 1, 1, span + 1)

        text = self._text
        hidden = text.embed_tokens(torch.tensor(tokens, dtype=torch.long).view(batch, 1))
        # [batch, 1, head_dim]: broadcasts over the heads of [batch, heads, head_dim].
        cos, sin = self._rope(hidden, positions)
        shape = (self._hidden,)
        rotated = heads + kv_heads
        new_kv: list[torch.Tensor] = []
        for index, (norm1, qkv_w, qkv_b, o_w, norm2, gate_up_w, down_w) in enumerate(self._layers):
            normed = functional.rms_norm(hidden, shape, norm1, self._eps)
            qkv = functional.linear(normed, qkv_w, qkv_b).view(batch, rotated + kv_heads, dim)
            qk = qkv[:, :rotated]
            if self._qk_norms:
                q_norm, k_norm = self._qk_norms[index]
                qk = torch.cat(
                    (
                        functional.rms_norm(qk[:, :heads], (dim,), q_norm, self._eps),
                        functional.rms_norm(qk[:, heads:], (dim,), k_norm, self._eps),
                    ),
                    dim=1,
                )
            qk = qk * cos + (qk @ self._rotation) * sin
            key = qk[:, heads:].unsqueeze(2)
            value = qkv[:, rotated:].unsqueeze(2)
            new_kv += (key, value)
            out = functional.scaled_dot_product_attention(
                qk[:, :heads].unsqueeze(2),
                torch.cat((old[index, 0], key), dim=2),
                torch.cat((old[index, 1], value), dim=2),
                attn_mask=mask,
                scale=self._scaling,
                enable_gqa=heads != kv_heads,
            )
            hidden = hidden + functional.linear(out.view(batch, 1, heads * dim), o_w)
            normed = functional.rms_norm(hidden, shape, norm2, self._eps)
            gate_up = functional.linear(normed, gate_up_w)
            gated = (
                self._act(gate_up[..., : self._intermediate]) * gate_up[..., self._intermediate :]
            )
            hidden = hidden + functional.linear(gated, down_w)
        # Every layer's new key and value into its page: [batch, layers, 2, kv_heads, dim].
        stacked = torch.stack(new_kv).view(len(self._layers), 2, batch, kv_heads, dim)
        kv_pages[torch.tensor(landing, dtype=torch.long), :, :, :, lens % page_tokens, :] = (
            stacked.permute(2, 0, 1, 3, 4)
        )
        logits = self._lm_head(text.norm(hidden)[:, -1])
        return [int(t) for t in logits.argmax(-1).tolist()]
