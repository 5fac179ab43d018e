"""Benchmark rows of the tiny audio models, for ``bench_models.py``: a typical 10 s clip.

For each tiny audio family (``tiny-qwen2-audio``, ``tiny-qwen2.5-omni-audio``) and batch size
(1 and 8 clips, one request each), timed on CPU:

- ``preprocess``: decoding 44.1 kHz stereo FLAC bytes (what a client uploads), averaging the
  channels, resampling to 16 kHz and running the real ``WhisperFeatureExtractor``, one
  request per clip, in one thread (as one worker thread would);
- ``forward``: one fused encoder call over the batch's preprocessed requests.

Each figure is the median of several repeats after one warm-up; min and max are kept too.
Run on its own with ``python benchmarks/_models_audio.py``; it prints the rows as JSON.
"""

from __future__ import annotations

import functools
import io
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from encdisagg._modality import Modality
from encdisagg.models import Preprocessed, QwenAudioModel, load_model

AUDIO_MODELS = ("tiny-qwen2-audio", "tiny-qwen2.5-omni-audio")
CLIP_SECONDS = 10.0
CLIP_RATE = 44_100
BATCHES = (1, 8)


def _flac(seconds: float, rate: int, seed: int) -> bytes:
    """A stereo clip of speech-band noise around a few tones, as FLAC bytes."""
    import soundfile

    generator = np.random.default_rng(seed)
    times = np.arange(round(seconds * rate)) / rate
    tones = sum(np.sin(2 * np.pi * hz * times) for hz in (180.0, 440.0, 1250.0)) / 6
    left = tones + 0.05 * generator.standard_normal(len(times))
    right = tones + 0.05 * generator.standard_normal(len(times))
    buffer = io.BytesIO()
    samples = np.stack([left, right], axis=1).astype(np.float32)
    soundfile.write(buffer, samples, rate, format="FLAC", subtype="PCM_16")
    return buffer.getvalue()


def _timed(action: Callable[[], object], repeats: int) -> dict[str, float]:
    action()  # warm-up: first calls allocate and pick kernels
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        seconds.append(time.perf_counter() - start)
    return {
        "median_s": statistics.median(seconds),
        "min_s": min(seconds),
        "max_s": max(seconds),
        "repeats": repeats,
    }


def _preprocess_each(model: QwenAudioModel, items: list[bytes]) -> list[Preprocessed]:
    return [model.preprocess([item], Modality.AUDIO) for item in items]


def audio_rows(repeats: int = 5) -> list[dict[str, Any]]:
    """One row per tiny audio model and batch size: tokens, grid, preprocess and forward
    timings (``median_s``, ``min_s``, ``max_s``) and forward tokens per second. Blocks for
    a few seconds per model."""
    clips = [_flac(CLIP_SECONDS, CLIP_RATE, seed) for seed in range(max(BATCHES))]
    rows: list[dict[str, Any]] = []
    for name in AUDIO_MODELS:
        start = time.perf_counter()
        model = load_model(name)
        build_s = time.perf_counter() - start
        assert isinstance(model, QwenAudioModel)
        for batch in BATCHES:
            items = clips[:batch]
            preprocessed = _preprocess_each(model, items)
            tokens = sum(pre.num_tokens for pre in preprocessed)
            preprocess = _timed(functools.partial(_preprocess_each, model, items), repeats)
            forward = _timed(functools.partial(model.forward, preprocessed), repeats)
            rows.append(
                {
                    "model": name,
                    "family": model.family,
                    "modality": "audio",
                    "input": f"{CLIP_SECONDS:g} s FLAC, {CLIP_RATE} Hz stereo",
                    "batch": batch,
                    "grid": list(preprocessed[0].grid[0]),
                    "tokens": tokens,
                    "model_build_s": build_s,
                    "preprocess": preprocess,
                    "forward": forward,
                    "forward_tokens_per_s": tokens / forward["median_s"],
                }
            )
    return rows


if __name__ == "__main__":
    print(json.dumps(audio_rows(), indent=2))
