"""Qwen2-Audio and Qwen2.5-Omni audio encoders behind the ``VisionModel`` protocol.

Both take Whisper log-mel features from transformers' ``WhisperFeatureExtractor`` (128 mel
bins, a 160-sample hop, 30 s windows padded to 3000 frames) and give one token per 40 ms:
a stride-2 convolution then a stride-2 pooling turn ``L`` feature frames into
``((L - 1) // 2 + 1 - 2) // 2 + 1`` tokens (:func:`~.._grids.qwen2_audio_output_length`,
the processors' own rule).

- Qwen2-Audio: ``Qwen2AudioEncoder`` over the whole padded window, padding frames masked
  out of attention, then ``Qwen2AudioMultiModalProjector`` to the LLM's width; only the
  first ``tokens`` rows of each window are kept, as ``Qwen2AudioModel`` keeps them.
- Qwen2.5-Omni: ``Qwen2_5OmniAudioEncoder`` over the valid frames only, packed, in
  100-frame attention windows; it projects to the LLM's width itself.

Each item's grid row is ``(L,)``: its valid feature frames (what the processors report as
``feature_attention_mask.sum(-1)``, ``audio_feature_lens_raw`` in SGLang), from which
the token count follows.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, final

import torch
from transformers import PreTrainedModel, WhisperFeatureExtractor
from transformers.masking_utils import create_bidirectional_mask

from ..._errors import BadRequestError, InternalError
from ..._modality import Modality
from .._grids import audio_output_length
from .._media._limits import MediaLimits
from .._media._policy import MediaPolicy, item_label
from .._media._waveforms import AudioBudget, AudioRules, load_audio
from .._protocol import Preprocessed
from ._tower import (
    Patches,
    PerThread,
    TowerModel,
    architecture_json,
    checked_request,
    identity_digest,
    settings_json,
    state_digest,
)

__all__ = ["AUDIO_ENCODER_FAMILIES", "QwenAudioModel"]

#: An encoder's ``model_type`` -> its family, the key of the token rule in ``_grids``.
AUDIO_ENCODER_FAMILIES: Final = {
    "qwen2_audio_encoder": "qwen2_audio",
    "qwen2_5_omni_audio_encoder": "qwen2_5_omni",
}

# Keys of ``Preprocessed.features`` this model writes and reads.
INPUT_FEATURES: Final = "input_features"
FEATURE_LENGTHS: Final = "feature_lengths"


def _extractor_from(config: Mapping[str, Any]) -> WhisperFeatureExtractor:
    built = WhisperFeatureExtractor.from_dict(dict(config))
    if not isinstance(built, WhisperFeatureExtractor):  # from_dict may return a tuple
        raise InternalError("WhisperFeatureExtractor.from_dict returned no extractor")
    return built


def _min_frames(family: str) -> int:
    frames = 1
    while audio_output_length(frames, family) < 1:
        frames += 1
    return frames


@final
class QwenAudioModel(TowerModel):
    """A Qwen2-Audio or Qwen2.5-Omni audio encoder with its feature extractor.

    Build one with :func:`~encdisagg.models.load_model`; the constructor takes the parts.
    ``preprocess`` is safe to call from several threads at once; ``forward`` must be
    called by one thread at a time, any thread.

    :param encoder: a ``Qwen2AudioEncoder`` or ``Qwen2_5OmniAudioEncoder`` on its device
        and dtype.
    :param feature_extractor: the ``WhisperFeatureExtractor`` whose settings fix the
        features and token counts.
    :param projector: Qwen2-Audio's ``Qwen2AudioMultiModalProjector`` (required for it;
        Qwen2.5-Omni's encoder projects by itself).
    :param checkpoint_config: the full model config the encoder came from (written back by
        :meth:`save_pretrained`); Qwen2-Audio only.
    :param name: the model's name (a built-in name or the checkpoint folder).
    :param media: which media items may be and where they may come from.
    :param limits: the budgets of a request whose caller passes none.
    :raises BadRequestError: naming ``model`` for an unsupported encoder, a missing
        projector, or a feature extractor that does not fit the encoder.
    """

    _feature_keys = (INPUT_FEATURES, FEATURE_LENGTHS)
    _MODALITIES = frozenset({Modality.AUDIO})
    _SHOWN = (("family", "_family"), ("hidden_size", "_hidden_size"))

    def __init__(
        self,
        encoder: PreTrainedModel,
        feature_extractor: WhisperFeatureExtractor,
        *,
        projector: torch.nn.Module | None = None,
        checkpoint_config: Mapping[str, Any] | None = None,
        name: str,
        media: MediaPolicy | None = None,
        limits: MediaLimits | None = None,
    ) -> None:
        model_type = getattr(encoder.config, "model_type", None)
        if model_type not in AUDIO_ENCODER_FAMILIES:
            raise BadRequestError(
                f"model: {name!r} is a {model_type!r} model; supported audio encoders are "
                f"{', '.join(AUDIO_ENCODER_FAMILIES)}"
            )
        family = AUDIO_ENCODER_FAMILIES[model_type]
        if family == "qwen2_audio" and projector is None:
            raise BadRequestError(f"model: {name!r} has no multi_modal_projector")
        mel_bins = int(encoder.config.num_mel_bins)
        if int(feature_extractor.feature_size) != mel_bins:
            raise BadRequestError(
                f"model: {name!r} has a feature extractor with feature_size="
                f"{feature_extractor.feature_size}, but its encoder has num_mel_bins={mel_bins}"
            )
        window = int(feature_extractor.nb_max_frames)
        if family == "qwen2_audio" and window != 2 * int(encoder.config.max_source_positions):
            raise BadRequestError(
                f"model: {name!r} has a feature extractor of {window}-frame windows, but its "
                f"encoder takes {2 * int(encoder.config.max_source_positions)} frames"
            )
        for module in (encoder, projector):
            if module is not None:
                module.train(False)  # eval mode, via the base class mypy sees
        self._encoder = encoder
        self._weights = encoder
        self._projector = projector
        self._checkpoint_config = dict(checkpoint_config or {})
        self._name = name
        self._family = family
        self._media = media or MediaPolicy()
        self._limits = limits or MediaLimits()
        self._extractor_config: dict[str, Any] = feature_extractor.to_dict()
        self._sampling_rate = int(feature_extractor.sampling_rate)
        self._window_seconds = float(feature_extractor.chunk_length)
        hop = int(feature_extractor.hop_length)
        self._min_samples = (_min_frames(family) - 1) * hop + 1
        if projector is not None:
            linear: Any = projector.linear
            self._hidden_size = int(linear.out_features)
        else:
            self._hidden_size = int(encoder.config.output_dim)
        extractor_config = dict(self._extractor_config)
        self._extractors = PerThread(feature_extractor, lambda: _extractor_from(extractor_config))
        self._identity = identity_digest(
            model_type,
            architecture_json(encoder.config.to_dict()),
            settings_json(self._extractor_config),
            *(state_digest(module) for module in (encoder, projector) if module is not None),
        )

    # --- identity and shape -------------------------------------------------------------

    @property
    def family(self) -> str:
        """``"qwen2_audio"`` or ``"qwen2_5_omni"``."""
        return self._family

    @property
    def sampling_rate(self) -> int:
        """The rate items are resampled to, in Hz."""
        return self._sampling_rate

    @property
    def min_samples(self) -> int:
        """The shortest item the model encodes (one token), in samples at :attr:`sampling_rate`."""
        return self._min_samples

    @property
    def window_seconds(self) -> float:
        """The longest item the model encodes: the extractor's window, in seconds."""
        return self._window_seconds

    @property
    def encoder(self) -> PreTrainedModel:
        """The underlying transformers audio encoder."""
        return self._encoder

    # --- preprocessing ------------------------------------------------------------------

    def audio_rules(self, limits: MediaLimits) -> AudioRules:
        """What ``limits`` allows one item of this model: the window caps the duration."""
        configured = limits.max_audio_seconds
        if configured is not None and configured <= self._window_seconds:
            seconds, named = float(configured), "max_audio_seconds"
        else:
            seconds, named = self._window_seconds, "the model's window"
        return AudioRules(
            sampling_rate=self._sampling_rate,
            max_seconds=seconds,
            seconds_limit=named,
            max_sample_rate=limits.max_audio_sample_rate,
            max_channels=limits.max_audio_channels,
        )

    def preprocess(
        self,
        items: Sequence[object],
        modality: Modality | str,
        *,
        limits: MediaLimits | None = None,
    ) -> Preprocessed:
        """Decode one request's audio items and extract their log-mel features. Blocks on
        CPU work, file reads and (when enabled) media downloads.

        Each item becomes one ``(frames,)`` grid row. The result's ``cache_key`` hashes
        the features, the grid and :attr:`identity`. The budgets (``limits``, else
        :attr:`media_limits`) are checked against each item's header before it is decoded.

        :raises BadRequestError: naming ``modality`` for one other than audio,
            ``mm_items`` if ``items`` is not a list or has more than ``max_items``, or
            ``mm_items[i]`` for an item that cannot be fetched or decoded, is too short for
            one token, or is over a budget.
        """
        checked_request(items, modality, self.modalities, self._name)
        limits = limits or self._limits
        limits.check_items(len(items))
        rules = self.audio_rules(limits)
        budget = AudioBudget(limits.max_request_audio_seconds)
        extractor = self._extractors.get()
        patches: list[Patches] = []
        # One extractor call per item: a batched call would hold every item's spectrogram
        # (a 30 s window's is ~5 MB) at once; the features are the same either way.
        for index, item in enumerate(items):
            wave = load_audio(item, index, self._media, rules, budget=budget)
            if len(wave) < self._min_samples:
                raise BadRequestError(
                    f"{item_label(index)}: audio is {len(wave)} samples at "
                    f"{self._sampling_rate} Hz, too short for one token (at least "
                    f"{self._min_samples})"
                )
            out = extractor(
                [wave],
                sampling_rate=self._sampling_rate,
                padding="max_length",
                return_attention_mask=True,
                return_tensors="pt",
            )
            del wave
            mask: torch.Tensor = out["attention_mask"]
            window: torch.Tensor = out[INPUT_FEATURES]
            if self._family == "qwen2_5_omni":
                # The encoder reads the valid frames only, packed along time: [mels, L].
                window = window[0][:, mask[0].bool()].contiguous()
            patches.append((window, mask.sum(-1).to(torch.int64), None))
        return self._result(
            patches,
            lambda row: audio_output_length(row[0], self._family),
            dim=1 if self._family == "qwen2_5_omni" else 0,
        )

    # --- forward ------------------------------------------------------------------------

    def _encode(self, firsts: list[torch.Tensor], seconds: list[torch.Tensor]) -> torch.Tensor:
        frame_counts = torch.cat(seconds).to(self.device)
        if self._family == "qwen2_audio":
            return self._qwen2_audio(torch.cat(firsts), frame_counts)
        output = self._encoder(
            torch.cat(firsts, dim=1).to(self.device, self.dtype),
            feature_lens=frame_counts,
            aftercnn_lens=(frame_counts - 1) // 2 + 1,
        )
        rows: torch.Tensor = output.last_hidden_state
        return rows

    def _qwen2_audio(self, values: torch.Tensor, frame_counts: torch.Tensor) -> torch.Tensor:
        """The rows ``Qwen2AudioModel`` scatters into the prompt: the encoder over padded
        windows with the padding masked out, projected, each window cut to its tokens."""
        assert self._projector is not None  # checked in __init__
        conv_lengths = (frame_counts - 1) // 2 + 1
        positions = (values.shape[-1] - 2) // 2 + 1
        steps = torch.arange(positions, device=self.device)
        valid = (steps[None, :] < conv_lengths[:, None]).to(torch.long)
        placeholder = torch.zeros((len(values), positions, 1), dtype=self.dtype, device=self.device)
        mask = create_bidirectional_mask(
            config=self._encoder.config, inputs_embeds=placeholder, attention_mask=valid
        )
        hidden = self._encoder(values.to(self.device, self.dtype), attention_mask=mask)
        projected: torch.Tensor = self._projector(hidden.last_hidden_state)
        tokens = (conv_lengths - 2) // 2 + 1
        keep = torch.arange(projected.shape[1], device=self.device)[None, :] < tokens[:, None]
        return projected[keep]

    # --- checkpoints --------------------------------------------------------------------

    def save_pretrained(self, folder: str | Path) -> None:
        """Write a checkpoint folder :func:`~encdisagg.models.load_model` loads back
        bit-identically, with ``preprocessor_config.json`` of the feature extractor.
        Blocks on disk I/O.

        Qwen2.5-Omni: the encoder's own ``config.json`` and ``model.safetensors``.
        Qwen2-Audio: the full model's ``config.json`` and a ``model.safetensors`` holding
        only ``audio_tower.*`` and ``multi_modal_projector.*``, the key layout of the
        published checkpoints (whose language model weights are not needed here).
        """
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        _extractor_from(self._extractor_config).save_pretrained(folder)
        if self._projector is None:
            self._encoder.save_pretrained(folder)
            return
        tensors = {
            f"audio_tower.{key}": value.detach().to("cpu").contiguous()
            for key, value in self._encoder.state_dict().items()
        }
        for key, value in self._projector.state_dict().items():
            tensors[f"multi_modal_projector.{key}"] = value.detach().to("cpu").contiguous()
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        config = {**self._checkpoint_config, "dtype": str(self.dtype).removeprefix("torch.")}
        (folder / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
