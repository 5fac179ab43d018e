"""Vision models behind the ``VisionModel`` protocol.

- :class:`VisionModel` / :class:`Preprocessed`: what the Encoder drives (its optional
  members and their defaults: :class:`ModelOptions`), and what
  ``preprocess`` hands to ``forward``.
- :func:`load_model`: the built-in ``"tiny"`` (seeded Qwen2-VL architecture) and
  ``"tiny-qwen2.5-vl"``, or a local checkpoint folder; returns a :class:`QwenVisionModel`.
- :class:`NullVisionModel`: the protocol without compute, for benchmarks and tests.
- :class:`MediaPolicy`: which media items are accepted, and from where.
- :class:`Qwen3VisionModel`: Qwen3-VL towers (``"tiny-qwen3-vl"`` or a checkpoint), whose
  embeddings carry the deepstack feature maps beside the main one (``embedding_layout``).
- :class:`QwenAudioModel`: Qwen2-Audio / Qwen2.5-Omni audio encoders (``"tiny-qwen2-audio"``,
  ``"tiny-qwen2.5-omni-audio"`` or a checkpoint) over Whisper log-mel features.
- Grid helpers: token counts of Qwen ``(t, h, w)`` grids, Kimi ``[h, w]`` grids and Qwen audio.
- The tiny configs and builders, so a pipeline can build the matching tiny language model.
"""

from .._exports import claim_exports
from ._families._kimi import KimiVisionModel as KimiVisionModel
from ._families._qwen import QwenVisionModel as QwenVisionModel
from ._families._qwen3_vl import Qwen3VisionModel as Qwen3VisionModel
from ._families._qwen_audio import QwenAudioModel as QwenAudioModel
from ._grids import (
    audio_output_length as audio_output_length,
    grid_patches as grid_patches,
    grid_tokens as grid_tokens,
    kimi_grid_patches as kimi_grid_patches,
    kimi_grid_tokens as kimi_grid_tokens,
    qwen2_audio_output_length as qwen2_audio_output_length,
    qwen3_audio_output_length as qwen3_audio_output_length,
    select_grid as select_grid,
)
from ._loading import BUILTIN_MODELS as BUILTIN_MODELS, load_model as load_model
from ._media._pixels import load_image as load_image, load_video as load_video
from ._media._policy import (
    DEFAULT_MAX_MEDIA_BYTES as DEFAULT_MAX_MEDIA_BYTES,
    MediaPolicy as MediaPolicy,
)
from ._null import NullVisionModel as NullVisionModel
from ._protocol import (
    ModelOptions as ModelOptions,
    Preprocessed as Preprocessed,
    VisionModel as VisionModel,
    split_embedding as split_embedding,
)
from ._tiny._qwen3_vl import (
    build_tiny_qwen3_vl as build_tiny_qwen3_vl,
    qwen3_vl_image_processor as qwen3_vl_image_processor,
    tiny_qwen3_vl_config as tiny_qwen3_vl_config,
)
from ._tiny._qwen_vl import (
    build_tiny_qwen2_5_vl as build_tiny_qwen2_5_vl,
    build_tiny_qwen2_vl as build_tiny_qwen2_vl,
    tiny_qwen2_5_vl_config as tiny_qwen2_5_vl_config,
    tiny_qwen2_vl_config as tiny_qwen2_vl_config,
)
from ._tiny._seed import TINY_SEED as TINY_SEED, TINY_TEXT_HIDDEN_SIZE as TINY_TEXT_HIDDEN_SIZE

__all__ = (
    "VisionModel",
    "ModelOptions",
    "Preprocessed",
    "split_embedding",
    "load_model",
    "BUILTIN_MODELS",
    "QwenVisionModel",
    "NullVisionModel",
    "KimiVisionModel",
    "MediaPolicy",
    "DEFAULT_MAX_MEDIA_BYTES",
    "load_image",
    "load_video",
    "grid_patches",
    "grid_tokens",
    "kimi_grid_patches",
    "kimi_grid_tokens",
    "select_grid",
    "qwen2_audio_output_length",
    "qwen3_audio_output_length",
    "audio_output_length",
    "TINY_SEED",
    "TINY_TEXT_HIDDEN_SIZE",
    "tiny_qwen2_vl_config",
    "tiny_qwen2_5_vl_config",
    "build_tiny_qwen2_vl",
    "build_tiny_qwen2_5_vl",
    "Qwen3VisionModel",
    "tiny_qwen3_vl_config",
    "build_tiny_qwen3_vl",
    "qwen3_vl_image_processor",
    "QwenAudioModel",
)

claim_exports(globals())
