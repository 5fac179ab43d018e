"""The audio encoders against Hugging Face's own processors and models, and checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from encdisagg import BadRequestError, InternalError
from encdisagg._modality import Modality
from encdisagg.models import (
    Preprocessed,
    QwenAudioModel,
    VisionModel,
    load_model,
    qwen2_audio_output_length,
)
from encdisagg.models._tiny._audio import (
    TINY_AUDIO_TOKEN_ID,
    build_tiny_qwen2_5_omni_thinker,
    build_tiny_qwen2_audio,
    tiny_audio_feature_extractor,
)

from ._audio_samples import RATE, clip, sine

pytest.importorskip("soundfile")

NAMES = ("tiny-qwen2-audio", "tiny-qwen2.5-omni-audio")
#: Several durations, from one token's worth to the whole 30 s window.
SECONDS = (0.5, 3.7, 12.0, 30.0)


@pytest.fixture(scope="module")
def qwen2() -> QwenAudioModel:
    model = load_model("tiny-qwen2-audio")
    assert isinstance(model, QwenAudioModel)
    return model


@pytest.fixture(scope="module")
def omni() -> QwenAudioModel:
    model = load_model("tiny-qwen2.5-omni-audio")
    assert isinstance(model, QwenAudioModel)
    return model


@pytest.fixture(scope="module", params=NAMES)
def audio_model(request: pytest.FixtureRequest) -> QwenAudioModel:
    model = load_model(request.param)
    assert isinstance(model, QwenAudioModel)
    return model


def waves() -> list[np.ndarray]:
    return [sine(seconds, hz=220.0 + 50 * number) for number, seconds in enumerate(SECONDS)]


def test_satisfies_the_protocol(qwen2: QwenAudioModel, omni: QwenAudioModel) -> None:
    assert isinstance(qwen2, VisionModel)
    assert qwen2.hidden_size == omni.hidden_size == 64
    assert qwen2.modalities == omni.modalities == frozenset({Modality.AUDIO})
    assert (qwen2.family, omni.family) == ("qwen2_audio", "qwen2_5_omni")
    assert qwen2.sampling_rate == 16_000
    assert qwen2.window_seconds == 30.0


# --- token counts against the processors --------------------------------------------------


def _qwen2_audio_processor() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2AudioProcessor

    vocab = {"<pad>": 0, "<unk>": 3, "hi": 5, "<|audio_bos|>": 505, "<|audio_eos|>": 506}
    vocab["<|AUDIO|>"] = TINY_AUDIO_TOKEN_ID
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words,
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"],
    )
    return Qwen2AudioProcessor(
        feature_extractor=tiny_audio_feature_extractor(), tokenizer=tokenizer
    )


def _omni_audio_processor() -> Any:
    """Qwen2.5-Omni's processor with only its audio half: the full one needs torchvision
    for its video processor, but its audio path reads nothing else."""
    from transformers import Qwen2_5OmniProcessor

    processor = Qwen2_5OmniProcessor.__new__(Qwen2_5OmniProcessor)
    processor.feature_extractor = tiny_audio_feature_extractor()
    processor.audio_token = "<|AUDIO|>"
    return processor


def _hf_counts(family: str, batch: list[np.ndarray]) -> tuple[list[int], list[int]]:
    """(tokens, feature frames) per clip, as the family's processor computes them."""
    if family == "qwen2_audio":
        processor = _qwen2_audio_processor()
        prompt = "hi <|audio_bos|> <|AUDIO|> <|audio_eos|>"
        out = processor(
            text=[prompt] * len(batch),
            audio=batch,
            sampling_rate=RATE,
            return_tensors="pt",
            padding=True,
        )
        tokens = (out["input_ids"] == TINY_AUDIO_TOKEN_ID).sum(-1).tolist()
    else:
        out, _ = _omni_audio_processor()._process_audio(
            batch, sampling_rate=RATE, return_attention_mask=True, return_tensors="pt"
        )
        tokens = out["num_audio_tokens"].tolist()
    return tokens, out["feature_attention_mask"].sum(-1).tolist()


class TestTokenCounts:
    def test_batched_equals_the_processor(self, audio_model: QwenAudioModel) -> None:
        batch = waves()
        pre = audio_model.preprocess([clip_bytes(wave) for wave in batch], "audio")
        tokens, frames = _hf_counts(audio_model.family, batch)
        assert pre.token_counts == tuple(tokens) == (12, 92, 300, 750)
        assert pre.grid == tuple((length,) for length in frames)
        assert pre.grid == ((50,), (370,), (1200,), (3000,))

    def test_unbatched_equals_the_processor(self, audio_model: QwenAudioModel) -> None:
        for wave in waves():
            pre = audio_model.preprocess([wave], Modality.AUDIO)
            tokens, frames = _hf_counts(audio_model.family, [wave])
            assert pre.token_counts == tuple(tokens)
            assert pre.grid == ((frames[0],),)

    @pytest.mark.parametrize("samples", [321, 480, 481, 16_001, 479_999, 480_000])
    def test_the_helper_agrees_at_the_edges(self, samples: int) -> None:
        wave = sine(samples / RATE)
        tokens, frames = _hf_counts("qwen2_audio", [wave])
        assert qwen2_audio_output_length(frames[0]) == tokens[0]

    def test_too_short_for_one_token(self, audio_model: QwenAudioModel) -> None:
        assert audio_model.min_samples == 321
        tokens, _ = _hf_counts(audio_model.family, [sine(320 / RATE)])
        assert tokens == [0]  # the processor would give the clip no token at all
        with pytest.raises(BadRequestError, match=r"mm_items\[0\].*too short for one token"):
            audio_model.preprocess([sine(320 / RATE)], "audio")

    def test_other_modalities_and_shapes_are_refused(self, qwen2: QwenAudioModel) -> None:
        with pytest.raises(BadRequestError, match="modality 'image' is not supported"):
            qwen2.preprocess([clip(1.0)], "image")
        with pytest.raises(BadRequestError, match="mm_items must be a list"):
            qwen2.preprocess(clip(1.0), "audio")  # type: ignore[arg-type]
        with pytest.raises(BadRequestError, match=r"mm_items\[0\].*1-D floats"):
            qwen2.preprocess([np.zeros((2, 16_000), np.float32)], "audio")
        assert qwen2.preprocess([], "audio").token_counts == ()


def clip_bytes(wave: np.ndarray) -> bytes:
    from ._audio_samples import encode

    return encode(wave, RATE, "flac")  # lossless: the same samples as the array


# --- embeddings against the models ------------------------------------------------------


def _hf_qwen2_audio_rows(batch: list[np.ndarray]) -> torch.Tensor:
    """The audio rows the full Qwen2-Audio scatters into its prompt, caught on the way
    into its language model."""
    full = build_tiny_qwen2_audio()
    processor = _qwen2_audio_processor()
    prompts = ["hi <|audio_bos|> <|AUDIO|> <|audio_eos|>"] * len(batch)
    out = processor(
        text=prompts, audio=batch, sampling_rate=RATE, return_tensors="pt", padding=True
    )
    caught: dict[str, torch.Tensor] = {}

    def catch(_module: object, _args: object, kwargs: dict[str, Any]) -> None:
        caught["embeds"] = kwargs["inputs_embeds"]

    full.model.language_model.register_forward_pre_hook(catch, with_kwargs=True)
    with torch.inference_mode():
        full.model(
            input_ids=out["input_ids"],
            attention_mask=out["attention_mask"],
            input_features=out["input_features"],
            feature_attention_mask=out["feature_attention_mask"],
        )
    return caught["embeds"][out["input_ids"] == TINY_AUDIO_TOKEN_ID]


def _hf_omni_rows(batch: list[np.ndarray]) -> torch.Tensor:
    thinker = build_tiny_qwen2_5_omni_thinker()
    out, _ = _omni_audio_processor()._process_audio(
        batch, sampling_rate=RATE, return_attention_mask=True, return_tensors="pt"
    )
    with torch.inference_mode():
        features = thinker.model.get_audio_features(
            out["input_features"], feature_attention_mask=out["feature_attention_mask"]
        )
    rows: torch.Tensor = features.last_hidden_state
    return rows


class TestForward:
    def test_rows_equal_what_the_model_feeds_its_llm(self, audio_model: QwenAudioModel) -> None:
        batch = waves()
        pre = audio_model.preprocess(batch, "audio")
        (rows,) = audio_model.forward([pre])
        assert rows.shape == (pre.num_tokens, 64)
        if audio_model.family == "qwen2_audio":
            expected = _hf_qwen2_audio_rows(batch)
        else:
            expected = _hf_omni_rows(batch)
        torch.testing.assert_close(rows, expected, rtol=1e-5, atol=1e-5)

    def test_mixed_lengths_split_back_per_item(self, audio_model: QwenAudioModel) -> None:
        clips = [audio_model.preprocess([wave], "audio") for wave in waves()]
        fused = audio_model.forward(clips)
        assert [piece.shape[0] for piece in fused] == [12, 92, 300, 750]
        for piece, single in zip(fused, clips, strict=True):
            (alone,) = audio_model.forward([single])
            torch.testing.assert_close(piece, alone, rtol=1e-5, atol=1e-5)
            assert piece.untyped_storage().nbytes() == piece.nbytes  # its own storage

    def test_qwen2_audio_batches_bit_identically(self, qwen2: QwenAudioModel) -> None:
        # Every window is padded to 30 s, so batching changes no arithmetic.
        clips = [qwen2.preprocess([wave], "audio") for wave in waves()[:2]]
        fused = qwen2.forward(clips)
        assert all(
            torch.equal(piece, qwen2.forward([single])[0])
            for piece, single in zip(fused, clips, strict=True)
        )

    def test_empty_and_foreign_elements(self, qwen2: QwenAudioModel) -> None:
        assert qwen2.forward([]) == []
        empty = qwen2.preprocess([], "audio")
        assert qwen2.forward([empty])[0].shape == (0, 64)
        foreign = Preprocessed(token_counts=(3,), grid=((9,),), features={})
        with pytest.raises(InternalError, match="was not preprocessed by model"):
            qwen2.forward([foreign])

    def test_cache_key_follows_the_content(self, qwen2: QwenAudioModel) -> None:
        first = qwen2.preprocess([clip(2.0)], "audio")
        assert first.cache_key == qwen2.preprocess([clip(2.0)], "audio").cache_key
        assert first.cache_key != qwen2.preprocess([clip(2.0, hz=500.0)], "audio").cache_key


# --- checkpoints ------------------------------------------------------------------------


class TestCheckpoints:
    @pytest.mark.parametrize("dtype", [None, "bfloat16"])
    def test_round_trip_is_bit_identical(
        self, audio_model: QwenAudioModel, tmp_path: Path, dtype: str | None
    ) -> None:
        model = audio_model if dtype is None else load_model(audio_model.name, dtype=dtype)
        assert isinstance(model, QwenAudioModel)
        model.save_pretrained(tmp_path)
        back = load_model(tmp_path)
        assert isinstance(back, QwenAudioModel)
        assert back.dtype == model.dtype
        assert back.identity == model.identity
        pre = model.preprocess([clip(4.2)], "audio")
        assert torch.equal(back.forward([pre])[0], model.forward([pre])[0])

    def test_published_full_checkpoints_load_their_encoder(
        self, audio_model: QwenAudioModel, tmp_path: Path
    ) -> None:
        # A whole model (language model included), saved as transformers saves it.
        if audio_model.family == "qwen2_audio":
            full: Any = build_tiny_qwen2_audio()
        else:
            full = build_tiny_qwen2_5_omni_thinker()
        full.save_pretrained(tmp_path)
        tiny_audio_feature_extractor().save_pretrained(tmp_path)
        back = load_model(tmp_path)
        assert isinstance(back, QwenAudioModel)
        assert back.identity == audio_model.identity
        pre = audio_model.preprocess([clip(1.5)], "audio")
        assert torch.equal(back.forward([pre])[0], audio_model.forward([pre])[0])

    def test_a_published_omni_layout_loads_its_audio_tower(
        self, omni: QwenAudioModel, tmp_path: Path
    ) -> None:
        # Qwen/Qwen2.5-Omni-7B as transformers 4 wrote it: the thinker's tower under
        # ``thinker.audio_tower.*`` beside everything else, its config nested twice.
        from safetensors.torch import save_file

        encoder = omni.encoder
        weights = {f"thinker.audio_tower.{k}": v for k, v in encoder.state_dict().items()}
        weights["thinker.model.embed_tokens.weight"] = torch.zeros(4, 4)
        save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
        config = {
            "model_type": "qwen2_5_omni",
            "thinker_config": {"audio_config": encoder.config.to_dict()},
            "torch_dtype": "float32",
        }
        (tmp_path / "config.json").write_text(json.dumps(config))
        tiny_audio_feature_extractor().save_pretrained(tmp_path)
        back = load_model(tmp_path)
        assert isinstance(back, QwenAudioModel)
        assert back.identity == omni.identity

    def test_folders_missing_parts_are_refused(self, qwen2: QwenAudioModel, tmp_path: Path) -> None:
        qwen2.save_pretrained(tmp_path)
        (tmp_path / "preprocessor_config.json").unlink()
        with pytest.raises(BadRequestError, match=r"has no preprocessor_config\.json"):
            load_model(tmp_path)
        tiny_audio_feature_extractor().save_pretrained(tmp_path)
        from safetensors.torch import load_file, save_file

        weights = load_file(tmp_path / "model.safetensors")
        kept = {k: v for k, v in weights.items() if not k.startswith("multi_modal_projector.")}
        save_file(kept, tmp_path / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(BadRequestError, match="lacks multi_modal_projector weights"):
            load_model(tmp_path)
        save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((tmp_path / "preprocessor_config.json").read_text())
        (tmp_path / "preprocessor_config.json").write_text(
            json.dumps({**config, "feature_size": 80})
        )
        with pytest.raises(BadRequestError, match="feature_size=80"):
            load_model(tmp_path)


_PROBE = """
import hashlib, json, sys
import numpy as np
from encdisagg.models import load_model
from tests.models._audio_samples import clip
out = {}
for name in sys.argv[1:]:
    model = load_model(name)
    rows = model.forward([model.preprocess([clip(1.0)], "audio")])[0]
    out[name] = [model.identity, hashlib.sha256(rows.numpy().tobytes()).hexdigest()]
print(json.dumps(out))
"""


def test_tiny_audio_models_are_deterministic_across_processes(
    qwen2: QwenAudioModel, omni: QwenAudioModel
) -> None:
    import hashlib

    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, *NAMES],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
        timeout=120,
    )
    there = json.loads(result.stdout.strip().splitlines()[-1])
    for model in (qwen2, omni):
        rows = model.forward([model.preprocess([clip(1.0)], "audio")])[0]
        here = [model.identity, hashlib.sha256(rows.numpy().tobytes()).hexdigest()]
        assert there[model.name] == here
