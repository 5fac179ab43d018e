"""The language model side of the pipeline: prompts, prefill, KV packing and greedy decode.

Everything here is synchronous and blocking (torch); the workers call it from worker threads.
The model is a Qwen2-VL ``...ForConditionalGeneration``: by default the seeded tiny one that
``"tiny"``'s vision tower comes from (same builder, same seed), so the encoder's embeddings
are exactly what this model's own tower would compute.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import torch

from .._errors import BadRequestError, InternalError

if TYPE_CHECKING:
    from PIL import Image
    from transformers import Qwen2VLForConditionalGeneration

__all__ = [
    "ByteTokenizer",
    "LanguageModel",
    "PrefillResult",
]

#: Ids below this are reserved (pad, bos, eos) in the byte tokenizer.
_FIRST_BYTE_ID: Final = 3


class ByteTokenizer:
    """Text to token ids, one id per UTF-8 byte: ``id = 3 + byte``.

    The tiny model has no trained tokenizer; any fixed mapping gives both sides of the parity
    check the same ids. Real checkpoints get the same mapping (their ids 3..258 are ordinary
    tokens), which keeps the demo free of tokenizer files.
    """

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < _FIRST_BYTE_ID + 256:
            raise BadRequestError(f"vocab_size must be at least 259; got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [_FIRST_BYTE_ID + byte for byte in text.encode("utf-8")]


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What prefill produced for one request."""

    first_token: int
    #: The multimodal RoPE offset: decode positions are ``cur_len + rope_delta``.
    rope_delta: int
    seq_len: int
    #: ``[kv_heads, seq_len, head_dim]`` keys and values, per layer.
    kv: tuple[tuple[torch.Tensor, torch.Tensor], ...]


def _eval(module: torch.nn.Module) -> None:
    module.train(False)


class LanguageModel:
    """A Qwen2-VL model used as a language model over spliced image embeddings.

    Build it with :meth:`tiny` or :meth:`from_pretrained`. ``prefill`` and ``decode`` must be
    called by one thread at a time (a lock enforces it); any thread.
    """

    def __init__(self, model: Qwen2VLForConditionalGeneration, *, name: str) -> None:
        _eval(model)
        self.model = model
        self.name = name
        config = model.config
        text: Any = config.text_config
        self.image_token_id: int = int(config.image_token_id)
        self.vision_start_token_id: int = int(config.vision_start_token_id)
        self.vision_end_token_id: int = int(config.vision_end_token_id)
        self.bos_token_id: int | None = text.bos_token_id
        eos = text.eos_token_id
        self.eos_token_ids: frozenset[int] = frozenset(
            () if eos is None else (eos,) if isinstance(eos, int) else eos
        )
        self.hidden_size: int = int(text.hidden_size)
        self.num_layers: int = int(text.num_hidden_layers)
        self.kv_heads: int = int(text.num_key_value_heads)
        self.head_dim: int = int(
            getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        )
        self.dtype: torch.dtype = model.dtype
        self.tokenizer = ByteTokenizer(int(text.vocab_size))
        vision: Any = config.vision_config
        self._merge = int(vision.spatial_merge_size)
        self._lock = threading.Lock()

    @classmethod
    def tiny(cls, seed: int | None = None) -> LanguageModel:
        """The seeded tiny Qwen2-VL whose vision tower is ``"tiny"``. Blocks ~20 ms."""
        from ..models import TINY_SEED, build_tiny_qwen2_vl

        return cls(build_tiny_qwen2_vl(seed=TINY_SEED if seed is None else seed), name="tiny")

    @classmethod
    def from_pretrained(cls, path: str | Path) -> LanguageModel:
        """A full Qwen2-VL checkpoint (safetensors) from a local folder. Blocks while loading.

        :raises BadRequestError: naming ``model`` if it cannot be loaded.
        """
        from transformers import Qwen2VLForConditionalGeneration

        try:
            model = Qwen2VLForConditionalGeneration.from_pretrained(
                str(path), local_files_only=True, use_safetensors=True
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BadRequestError(f"model: cannot load {str(path)!r} as Qwen2-VL: {exc}") from exc
        return cls(model, name=str(path))

    # -- prompts -----------------------------------------------------------------------------

    def prompt_ids(self, text: str, image_tokens: Sequence[int]) -> list[int]:
        """``bos``, then each image as ``<vision_start> <image>*n <vision_end>``, then ``text``."""
        ids = [] if self.bos_token_id is None else [self.bos_token_id]
        for count in image_tokens:
            ids.append(self.vision_start_token_id)
            ids.extend([self.image_token_id] * count)
            ids.append(self.vision_end_token_id)
        ids.extend(self.tokenizer.encode(text))
        return ids

    # -- KV layout ---------------------------------------------------------------------------

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one token takes over all layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.kv_heads * self.head_dim * itemsize

    def pack_kv(self, result: PrefillResult) -> torch.Tensor:
        """The KV of ``result`` as one flat byte tensor: per layer, keys then values."""
        chunks = []
        for keys, values in result.kv:
            chunks.append(keys.contiguous().view(torch.uint8).reshape(-1))
            chunks.append(values.contiguous().view(torch.uint8).reshape(-1))
        return torch.cat(chunks)

    def unpack_kv(
        self, blob: torch.Tensor, seq_len: int
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """The inverse of :meth:`pack_kv` (copies)."""
        need = seq_len * self.kv_bytes_per_token
        if blob.numel() < need:
            raise InternalError(f"KV blob has {blob.numel()} bytes; {seq_len} tokens need {need}")
        flat = blob[:need].clone().view(self.dtype)
        per = self.kv_heads * seq_len * self.head_dim
        shape = (self.kv_heads, seq_len, self.head_dim)
        layers = []
        for layer in range(self.num_layers):
            keys = flat[2 * layer * per : (2 * layer + 1) * per].view(shape)
            values = flat[(2 * layer + 1) * per : (2 * layer + 2) * per].view(shape)
            layers.append((keys, values))
        return tuple(layers)

    # -- compute (blocking) ------------------------------------------------------------------

    def prefill(
        self,
        input_ids: Sequence[int],
        image_embeds: torch.Tensor | None,
        image_grid: Sequence[Sequence[int]],
    ) -> PrefillResult:
        """Run the prompt with ``image_embeds`` spliced in at the image tokens. Blocks.

        Positions are the multimodal RoPE positions of the grids (``get_rope_index``).

        :raises BadRequestError: if the image tokens and the embedding rows disagree.
        """
        model = self.model
        ids = torch.tensor([list(input_ids)], dtype=torch.long)
        image_mask = ids == self.image_token_id
        n_image = int(image_mask.sum())
        rows = 0 if image_embeds is None else int(image_embeds.shape[0])
        if n_image != rows:
            raise BadRequestError(f"prompt has {n_image} image tokens but {rows} embedding rows")
        with self._lock, torch.inference_mode():
            embeds = model.model.get_input_embeddings()(ids)
            if image_embeds is not None and rows:
                embeds[image_mask] = image_embeds.to(embeds.dtype)
            if image_grid:
                grid = torch.tensor([list(g) for g in image_grid], dtype=torch.long)
                positions, deltas = model.model.get_rope_index(
                    ids, image_mask.int(), image_grid_thw=grid
                )
                rope_delta = int(deltas.reshape(-1)[0])
            else:
                positions = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)
                rope_delta = 0
            out = model.model.language_model(
                inputs_embeds=embeds, position_ids=positions, use_cache=True
            )
            logits = model.lm_head(out.last_hidden_state[:, -1])
            first = int(logits.argmax(-1))
            kv = tuple(
                (layer.keys[0].clone(), layer.values[0].clone()) for layer in out.cache.layers
            )
        return PrefillResult(
            first_token=first, rope_delta=rope_delta, seq_len=int(ids.shape[1]), kv=kv
        )

    def decode(
        self,
        kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        first_token: int,
        rope_delta: int,
        max_new_tokens: int,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> list[int]:
        """Greedy decoding from a prefilled KV cache. Blocks.

        ``first_token`` (prefill's) counts as the first of ``max_new_tokens``; decoding stops
        after an end-of-sequence token, as ``generate`` does, or when ``should_stop()``
        (checked between tokens) turns true.
        """
        from transformers import DynamicCache

        model = self.model
        tokens = [first_token]
        if max_new_tokens < 1:
            return []
        seq_len = int(kv[0][0].shape[1])
        with self._lock, torch.inference_mode():
            text_config: Any = model.config.text_config
            cache = DynamicCache(config=text_config)
            for layer, (keys, values) in enumerate(kv):
                cache.update(keys.unsqueeze(0), values.unsqueeze(0), layer)
            current = seq_len
            while len(tokens) < max_new_tokens and tokens[-1] not in self.eos_token_ids:
                if should_stop():
                    break
                embeds = model.model.get_input_embeddings()(torch.tensor([[tokens[-1]]]))
                positions = torch.full((3, 1, 1), current + rope_delta, dtype=torch.long)
                out = model.model.language_model(
                    inputs_embeds=embeds, position_ids=positions, cache=cache, use_cache=True
                )
                tokens.append(int(model.lm_head(out.last_hidden_state[:, -1]).argmax(-1)))
                current += 1
        return tokens

    def image_token_counts(self, images: Sequence[Image.Image]) -> tuple[int, ...]:
        """Tokens each image takes, as this model's own processor sees it. Blocks."""
        if not images:
            return ()
        grid = self._process(images)["image_grid_thw"]
        return tuple(int(row.prod()) // (self._merge * self._merge) for row in grid)

    def _process(self, images: Sequence[Image.Image]) -> Any:
        from transformers import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil()(images=list(images), return_tensors="pt")

    def generate_colocated(
        self, prompt: str, images: Sequence[Image.Image], *, max_new_tokens: int
    ) -> list[int]:
        """The reference run: the whole model, its own vision tower on the raw images, greedy
        ``generate``. Blocks."""
        kwargs: dict[str, Any] = {}
        counts: tuple[int, ...] = ()
        if images:
            pixels = self._process(images)
            merge = self._merge
            counts = tuple(int(row.prod()) // (merge * merge) for row in pixels["image_grid_thw"])
            kwargs = {
                "pixel_values": pixels["pixel_values"],
                "image_grid_thw": pixels["image_grid_thw"],
            }
        ids = torch.tensor([self.prompt_ids(prompt, counts)], dtype=torch.long)
        if images:
            kwargs["mm_token_type_ids"] = (ids == self.image_token_id).int()
        with self._lock, torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                **kwargs,
            )
        return [int(t) for t in out[0, ids.shape[1] :]]
