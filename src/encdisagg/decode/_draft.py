"""The speculative draft state a prefill rank ships in a request's metadata row.

Beside the first output token, a prefill rank ships what a speculative decoder starts from:
the first token's top-k candidates (ids and log-probabilities) and the hidden state that
produced them. They travel in the metadata row's extra words (the writer puts them there
before the room tag, so a tagged row carries a complete draft state), and the decode side
reads them *in place*: a :class:`DraftState` holds views into the slot's memory. That is why
the slot must stay allocated until the first decode step consumed the state: a freed slot is
zeroed and handed to the next transfer, which would overwrite the views under the reader.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._errors import InternalError
from .._numbers import whole

__all__ = ["DraftLayout", "DraftState"]


@dataclass(eq=False, slots=True)
class DraftState:
    """The draft state of one request: views into its metadata row (or copies of them)."""

    #: ``int64 [top_k]``: the first token's most likely ids, best first.
    top_ids: torch.Tensor
    #: ``float32 [top_k]``: their log-probabilities.
    top_logprobs: torch.Tensor
    #: ``float32 [hidden_size]``: the final hidden state the first token was predicted from.
    hidden: torch.Tensor

    def copy(self) -> DraftState:
        """A copy that owns its memory (safe to keep once the slot is freed)."""
        return DraftState(self.top_ids.clone(), self.top_logprobs.clone(), self.hidden.clone())


@dataclass(frozen=True, slots=True)
class DraftLayout:
    """Where a draft state sits in a metadata row's extra words (int64 words)."""

    top_k: int
    hidden_size: int

    def __post_init__(self) -> None:
        whole("top_k", self.top_k, least=1)
        whole("hidden_size", self.hidden_size, least=1)

    @property
    def words(self) -> int:
        """Extra int64 words a row needs: ids, then float32 pairs for log-probs and hidden."""
        return self.top_k + -(-self.top_k // 2) + -(-self.hidden_size // 2)

    def views(self, extra: torch.Tensor) -> DraftState:
        """The draft state inside ``extra`` (a row's extra words), as views of that memory."""
        if extra.dtype != torch.int64 or extra.numel() < self.words:
            raise InternalError(
                f"a draft state of top-{self.top_k} and {self.hidden_size} hidden values needs "
                f"{self.words} int64 words; the row has {extra.numel()}"
            )
        k = self.top_k
        ids = extra[:k]
        floats = extra[k : self.words].view(torch.float32)
        return DraftState(ids, floats[:k], floats[2 * -(-k // 2) :][: self.hidden_size])

    def write(
        self,
        extra: torch.Tensor,
        top_ids: torch.Tensor,
        top_logprobs: torch.Tensor,
        hidden: torch.Tensor,
    ) -> None:
        """Write a draft state into ``extra`` (the writer's side)."""
        state = self.views(extra)
        state.top_ids.copy_(top_ids.reshape(-1)[: self.top_k])
        state.top_logprobs.copy_(top_logprobs.reshape(-1)[: self.top_k].float())
        state.hidden.copy_(hidden.reshape(-1).float())
