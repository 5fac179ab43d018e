"""The embedded audio defaults: seeded, randomly initialised Qwen2-Audio and Qwen2.5-Omni.

Real architectures and the real Whisper feature extractor, tiny widths: token counts are
those of the real models, the embeddings are noise. As with ``"tiny"``, the audio encoder of
``"tiny-qwen2-audio"`` *is* the ``model.audio_tower`` (plus ``model.multi_modal_projector``)
of the full ``Qwen2AudioForConditionalGeneration`` that :func:`build_tiny_qwen2_audio`
builds, and that of ``"tiny-qwen2.5-omni-audio"`` the ``model.audio_tower`` of the
``Qwen2_5OmniThinkerForConditionalGeneration`` from :func:`build_tiny_qwen2_5_omni_thinker`;
the same seed gives the same weights in every process.

The encoders keep the real models' 128 mel bins and 1500 source positions: Qwen2-Audio's
encoder only accepts the Whisper extractor's full 30 s (3000-frame) window.
"""

from __future__ import annotations

from typing import Any

from transformers import (
    Qwen2AudioConfig,
    Qwen2AudioForConditionalGeneration,
    WhisperFeatureExtractor,
)
from transformers.models.qwen2_5_omni import (
    Qwen2_5OmniThinkerConfig,
    Qwen2_5OmniThinkerForConditionalGeneration,
)

from ._seed import TINY_SEED, TINY_TEXT_HIDDEN_SIZE, VISION_TOKEN_IDS, seeded_build, text_config

__all__ = [
    "TINY_AUDIO_TOKEN_ID",
    "build_tiny_qwen2_5_omni_thinker",
    "build_tiny_qwen2_audio",
    "tiny_audio_feature_extractor",
    "tiny_qwen2_5_omni_thinker_config",
    "tiny_qwen2_audio_config",
]

#: The audio placeholder id inside the tiny models' 512-token vocabulary.
TINY_AUDIO_TOKEN_ID = 504


def _audio_encoder() -> dict[str, Any]:
    return {
        "num_mel_bins": 128,
        "encoder_layers": 2,
        "encoder_attention_heads": 4,
        "encoder_ffn_dim": 64,
        "d_model": 32,
        "max_source_positions": 1500,
    }


def tiny_audio_feature_extractor() -> WhisperFeatureExtractor:
    """The feature extractor both tiny audio models use: the real models' settings
    (128 mel bins, 16 kHz, 30 s windows, a 160-sample hop). Returns a fresh object."""
    return WhisperFeatureExtractor(feature_size=128, return_attention_mask=True)  # type: ignore[no-untyped-call]


def tiny_qwen2_audio_config() -> Qwen2AudioConfig:
    """The full config of ``"tiny-qwen2-audio"``: a 2-layer, 32-wide Whisper-style encoder
    whose projector feeds a 2-layer, 64-wide Qwen2 text model; audio token id 504."""
    return Qwen2AudioConfig(
        audio_config=_audio_encoder(),
        text_config=text_config(),
        audio_token_index=TINY_AUDIO_TOKEN_ID,
    )


def tiny_qwen2_5_omni_thinker_config() -> Qwen2_5OmniThinkerConfig:
    """The thinker config of ``"tiny-qwen2.5-omni-audio"``: the same encoder sizes, with
    100-frame attention windows and 64-wide output tokens (the text model's hidden size);
    a one-block vision tower completes the thinker. Audio token id 504."""
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": TINY_TEXT_HIDDEN_SIZE,
        "fullatt_block_indexes": [0],
    }
    # Multimodal RoPE over (t, h, w); the sections sum to head_dim / 2 = 8.
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    return Qwen2_5OmniThinkerConfig(
        audio_config={**_audio_encoder(), "n_window": 100, "output_dim": TINY_TEXT_HIDDEN_SIZE},
        vision_config=vision,
        text_config=text_config(rope_parameters=rope),
        audio_token_index=TINY_AUDIO_TOKEN_ID,
        image_token_index=VISION_TOKEN_IDS["image_token_id"],
        video_token_index=VISION_TOKEN_IDS["video_token_id"],
    )


def build_tiny_qwen2_audio(*, seed: int = TINY_SEED) -> Qwen2AudioForConditionalGeneration:
    """Build the seeded full tiny Qwen2-Audio (float32, eval mode, CPU). Blocks ~20 ms.

    The global torch RNG state is saved and restored around the build.
    """
    return seeded_build(lambda: Qwen2AudioForConditionalGeneration(tiny_qwen2_audio_config()), seed)


def build_tiny_qwen2_5_omni_thinker(
    *, seed: int = TINY_SEED
) -> Qwen2_5OmniThinkerForConditionalGeneration:
    """Build the seeded tiny Qwen2.5-Omni thinker (float32, eval mode, CPU). Blocks ~50 ms;
    see :func:`build_tiny_qwen2_audio`."""
    return seeded_build(
        lambda: Qwen2_5OmniThinkerForConditionalGeneration(tiny_qwen2_5_omni_thinker_config()),
        seed,
    )
