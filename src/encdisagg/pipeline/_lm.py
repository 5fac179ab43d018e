"""The language model side of the pipeline: prompts, prefill, KV packing and greedy decode.

Everything here is synchronous and blocking (torch); the workers call it from worker threads.
The model is a Qwen2-VL or Qwen3-VL ``...ForConditionalGeneration``: by default the seeded
tiny one that ``"tiny"``'s (or ``"tiny-qwen3-vl"``'s) vision tower comes from (same builder,
same seed), so the encoder's embeddings are exactly what this model's own tower would compute.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import torch

from .._errors import BadRequestError
from ..decode import DraftLayout
from ..transfer import EmbeddingLayout, deepstack_layout

if TYPE_CHECKING:
    from PIL import Image
    from transformers import Qwen2VLForConditionalGeneration, Qwen3VLForConditionalGeneration

    from ..decode import DecodeBatch
    from ._paged_step import PagedDecoder

__all__ = [
    "BUILTIN_LANGUAGE_MODELS",
    "ByteTokenizer",
    "LanguageModel",
    "PrefillResult",
]

#: Ids below this are reserved (pad, bos, eos) in the byte tokenizer.
_FIRST_BYTE_ID: Final = 3

#: Candidates of the first token that prefill ships as its draft state.
DRAFT_TOP_K: Final = 4

#: The built-in models :meth:`LanguageModel.tiny` builds, by the encoder model's name.
BUILTIN_LANGUAGE_MODELS: Final = ("tiny", "tiny-qwen3-vl")
#: ``config.json`` model types of Qwen3-VL checkpoints (deepstack features) -> their
#: transformers class; any other checkpoint loads as Qwen2-VL.
_QWEN3_VL_CLASSES: Final = {
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
}


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
    #: The draft state shipped beside the first token: its top-k ids and log-probabilities
    #: (best first), and the final hidden state they come from (``[hidden_size]``).
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    hidden: torch.Tensor | None = None


class LanguageModel:
    """A Qwen2-VL or Qwen3-VL model used as a language model over spliced image embeddings
    (for Qwen3-VL, with the deepstack sections added after the first decoder layers).

    Build it with :meth:`tiny` or :meth:`from_pretrained`. ``prefill`` and ``decode`` must be
    called by one thread at a time (a lock enforces it); any thread.
    """

    def __init__(
        self,
        model: Qwen2VLForConditionalGeneration | Qwen3VLForConditionalGeneration,
        *,
        name: str,
    ) -> None:
        model.train(False)  # inference mode for dropout and norms
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
        # Qwen3-VL: deepstack feature maps arrive beside the embedding (one joint tensor, see
        # ``embedding_layout``) and are added after the first decoder layers.
        self.deepstack_layers = len(getattr(vision, "deepstack_visual_indexes", None) or ())
        self.embedding_layout: EmbeddingLayout | None = (
            deepstack_layout(self.hidden_size, self.deepstack_layers)
            if self.deepstack_layers
            else None
        )
        #: Columns of the embeddings this model takes: ``hidden_size * (1 + deepstack)``.
        self.embedding_width = self.hidden_size * (1 + self.deepstack_layers)
        self._processor_settings: dict[str, Any] = {}
        if self.deepstack_layers:
            from ..models import qwen3_vl_image_processor

            self._processor_settings = qwen3_vl_image_processor().to_dict()
        self._lock = threading.Lock()
        self._paged: PagedDecoder | None = None
        #: Whether a decode step takes long enough to belong in a worker thread. The tiny
        #: model's step is well under a millisecond: the decode worker runs it on the event
        #: loop's thread, where it neither pays a thread hop nor waits for the interpreter
        #: lock behind the loop's own Python work.
        self.blocking_steps = True

    @classmethod
    def tiny(cls, seed: int | None = None, *, name: str = "tiny") -> LanguageModel:
        """The seeded tiny model whose vision tower is the encoder's ``name`` (one of
        :data:`BUILTIN_LANGUAGE_MODELS`: ``"tiny"``, Qwen2-VL, or ``"tiny-qwen3-vl"``).
        Blocks ~20 ms.

        :raises BadRequestError: naming ``model`` for another name.
        """
        from ..models import TINY_SEED, build_tiny_qwen2_vl, build_tiny_qwen3_vl

        seed = TINY_SEED if seed is None else seed
        if name == "tiny":
            lm = cls(build_tiny_qwen2_vl(seed=seed), name=name)
        elif name == "tiny-qwen3-vl":
            lm = cls(build_tiny_qwen3_vl(seed=seed), name=name)
        else:
            raise BadRequestError(
                f"model: {name!r} is not one of {', '.join(BUILTIN_LANGUAGE_MODELS)}"
            )
        lm.blocking_steps = False
        return lm

    @classmethod
    def from_pretrained(cls, path: str | Path) -> LanguageModel:
        """A full Qwen2-VL checkpoint (safetensors) from a local folder. Blocks while loading.

        :raises BadRequestError: naming ``model`` if it cannot be loaded.
        """
        import transformers

        from ..models._checkpoint import model_type_of

        class_name = _QWEN3_VL_CLASSES.get(
            model_type_of(str(path)) or "", "Qwen2VLForConditionalGeneration"
        )
        model_class: Any = getattr(transformers, class_name)
        try:
            model = model_class.from_pretrained(
                str(path), local_files_only=True, use_safetensors=True
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BadRequestError(
                f"model: cannot load {str(path)!r} as {model_class.__name__}: {exc}"
            ) from exc
        lm = cls(model, name=str(path))
        if lm.deepstack_layers and (Path(path) / "preprocessor_config.json").is_file():
            from transformers import Qwen2VLImageProcessorPil

            processor = Qwen2VLImageProcessorPil.from_pretrained(str(path), local_files_only=True)
            lm._processor_settings = processor.to_dict()
        return lm

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
    def draft_layout(self) -> DraftLayout:
        """Where prefill's draft state (top-k of the first token, hidden state) sits in a
        metadata row."""
        return DraftLayout(DRAFT_TOP_K, self.hidden_size)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one token takes over all layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.kv_heads * self.head_dim * itemsize

    def kv_page_shape(self, page_tokens: int) -> tuple[int, int, int, int, int]:
        """One KV page as a tensor: ``[layers, 2 (keys, values), kv_heads, tokens, head_dim]``.

        Pages are token-major: page ``p`` holds tokens ``p*page_tokens ..`` of every layer,
        so a request's KV grows by whole pages and attention reads it through a page table.
        """
        return (self.num_layers, 2, self.kv_heads, page_tokens, self.head_dim)

    def pack_kv(self, result: PrefillResult, page_tokens: int) -> torch.Tensor:
        """The KV of ``result`` as flat bytes in :meth:`kv_page_shape` pages, zero-padded."""
        pages = -(-result.seq_len // page_tokens)
        paged = torch.zeros((pages, *self.kv_page_shape(page_tokens)), dtype=self.dtype)
        tokens = paged.permute(1, 2, 3, 0, 4, 5).reshape(
            self.num_layers, 2, self.kv_heads, pages * page_tokens, self.head_dim
        )
        for layer, (keys, values) in enumerate(result.kv):
            tokens[layer, 0, :, : result.seq_len] = keys
            tokens[layer, 1, :, : result.seq_len] = values
        # ``tokens`` is a copy (the permute is not contiguous); write it back page-major.
        paged.copy_(
            tokens.view(
                self.num_layers, 2, self.kv_heads, pages, page_tokens, self.head_dim
            ).permute(3, 0, 1, 2, 4, 5)
        )
        return paged.view(torch.uint8).reshape(-1)

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
        deepstack: dict[str, Any] = {}
        if image_embeds is not None and self.embedding_layout is not None:
            # One joint tensor: the embedding, then each deepstack map (column views).
            sections = list(self.embedding_layout.split(image_embeds).values())
            image_embeds = sections[0]
            if rows:
                deepstack = {
                    "visual_pos_masks": image_mask,
                    "deepstack_visual_embeds": sections[1:],
                }
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
                inputs_embeds=embeds, position_ids=positions, use_cache=True, **deepstack
            )
            hidden = out.last_hidden_state[0, -1]
            logits = model.lm_head(hidden)
            first = int(logits.argmax(-1))
            top = torch.log_softmax(logits.float(), -1).topk(DRAFT_TOP_K)
            kv = tuple(
                (layer.keys[0].clone(), layer.values[0].clone()) for layer in out.cache.layers
            )
        return PrefillResult(
            first_token=first,
            rope_delta=rope_delta,
            seq_len=int(ids.shape[1]),
            kv=kv,
            top_ids=top.indices.clone(),
            top_logprobs=top.values.clone(),
            hidden=hidden.float().clone(),
        )

    def paged_decode_step(self, kv_pages: torch.Tensor, batch: DecodeBatch) -> list[int]:
        """One batched greedy decode step of ``batch``'s requests over the paged KV
        ``kv_pages`` (see :class:`PagedDecoder`); returns each request's next token. Blocks."""
        from ._paged_step import PagedDecoder

        with self._lock, torch.inference_mode():
            if self._paged is None:
                self._paged = PagedDecoder(self.model)
            return self._paged.step(kv_pages, batch)

    def draft_top1(self, hidden: torch.Tensor) -> list[int]:
        """The token the model predicts from each row of final hidden states. Blocks."""
        with self._lock, torch.inference_mode():
            return [int(t) for t in self.model.lm_head(hidden.to(self.dtype)).argmax(-1).tolist()]

    def _process(self, images: Sequence[Image.Image]) -> Any:
        from transformers import Qwen2VLImageProcessorPil

        settings = self._processor_settings
        processor = (
            Qwen2VLImageProcessorPil.from_dict(dict(settings))
            if settings
            else Qwen2VLImageProcessorPil()
        )
        return processor(images=list(images), return_tensors="pt")

    def generate_colocated(
        self,
        prompt: str,
        images: Sequence[Image.Image],
        *,
        max_new_tokens: int,
        pixels: Mapping[str, torch.Tensor] | None = None,
    ) -> list[int]:
        """The reference run: the whole model, its own vision tower on the images, greedy
        ``generate``. Blocks.

        :param pixels: the images' ``pixel_values`` and ``image_grid_thw`` as the encoders
            preprocessed them, so that both runs see the same pixels; ``None``: the image
            processor's own.
        """
        kwargs: dict[str, Any] = {}
        counts: tuple[int, ...] = ()
        if images:
            pixels = pixels if pixels is not None else self._process(images)
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
