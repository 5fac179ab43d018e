"""Real audio made in the tests: sine waves written as WAV, FLAC, OGG or MP3 by soundfile."""

from __future__ import annotations

import io

import numpy as np

RATE = 16_000
#: soundfile's (format, subtype) per container the encoders accept.
CODECS = {
    "wav": ("WAV", "PCM_16"),
    "flac": ("FLAC", "PCM_16"),
    "ogg": ("OGG", "VORBIS"),
    "mp3": ("MP3", "MPEG_LAYER_III"),
}


def sine(seconds: float, rate: int = RATE, *, channels: int = 1, hz: float = 440.0) -> np.ndarray:
    """``seconds`` of a 0.3-amplitude sine at ``hz``: ``[frames]``, or ``[frames, channels]``
    with each channel a little higher in pitch."""
    times = np.arange(round(seconds * rate)) / rate
    waves = [0.3 * np.sin(2 * np.pi * (hz + 110 * number) * times) for number in range(channels)]
    stacked = waves[0] if channels == 1 else np.stack(waves, axis=1)
    return stacked.astype(np.float32)


def encode(samples: np.ndarray, rate: int = RATE, codec: str = "wav") -> bytes:
    """``samples`` written as a ``codec`` file, in memory."""
    import soundfile

    file_format, subtype = CODECS[codec]
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=file_format, subtype=subtype)
    return buffer.getvalue()


def clip(seconds: float, rate: int = RATE, codec: str = "wav", **kwargs: object) -> bytes:
    """A sine clip of ``seconds`` as ``codec`` bytes."""
    return encode(sine(seconds, rate, **kwargs), rate, codec)  # type: ignore[arg-type]
