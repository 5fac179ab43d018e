"""Turning request items into waveforms: WAV, FLAC, OGG and MP3 bytes, within budgets.

An audio item is anything :func:`~._bytes.item_bytes` reads (raw bytes, a file path, a
``data:`` URL, base64, an allow-listed URL, ``{"url", "content_hash"}``) or a 1-D float NumPy
array already at the model's sampling rate. It becomes one mono ``float32`` waveform at that
rate: channels are averaged, other rates resampled.

Budgets are decided from the file's header before its samples are decoded (sample rate,
channel count, duration), and again while decoding, block by block, so a header that lies
about its length cannot make the decoder produce more than the budget. Every function here
blocks (file reads, decoding, fetches) and raises :class:`~encdisagg.BadRequestError` naming
the item, as ``mm_items[i]``, and the limit it broke.
"""

from __future__ import annotations

import base64
import io
import math
import struct
import wave
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch

from ..._errors import BadRequestError
from ._bytes import item_bytes
from ._policy import MediaPolicy, decoder_error, item_label

__all__ = [
    "MIN_AUDIO_SAMPLE_RATE",
    "AudioBudget",
    "AudioRules",
    "load_audio",
    "probe_wav",
    "resample",
]

#: Below this a "sample rate" is a malformed header, not audio.
MIN_AUDIO_SAMPLE_RATE: Final = 1000
#: Frames decoded per read: bounds the overshoot past a duration budget.
_BLOCK_FRAMES: Final = 65_536
#: Container formats handed to libsndfile, by their leading bytes; anything else is refused
#: before a decoder sees it (libsndfile reads two dozen rarer formats we do not need).
_WAV_MAGIC: Final = (b"RIFF", b"RIFX", b"RF64")
#: A WAV ``data`` chunk of these sizes says "length unknown" (streamed writers use them).
_UNKNOWN_WAV_SIZES: Final = frozenset({0, 0xFFFFFFFF})


@dataclass(frozen=True, slots=True)
class AudioRules:
    """What one audio item may be, and the waveform the model wants.

    :param sampling_rate: the model's rate; items are resampled to it.
    :param max_seconds: longest item, in seconds.
    :param seconds_limit: how refusals name ``max_seconds`` (the config field, or the
        model's window when that is the tighter bound).
    :param max_sample_rate: highest source sample rate, in Hz.
    :param max_channels: most source channels.
    """

    sampling_rate: int
    max_seconds: float
    seconds_limit: str
    max_sample_rate: int
    max_channels: int

    def check_header(self, label: str, rate: int, channels: int, frames: int) -> None:
        """Refuse a source whose header breaks a budget. Does not block.

        :raises BadRequestError: naming ``label`` and the limit.
        """
        if rate > self.max_sample_rate:
            raise BadRequestError(
                f"{label}: audio sample rate is {rate} Hz, more than max_audio_sample_rate "
                f"({self.max_sample_rate})"
            )
        if rate < MIN_AUDIO_SAMPLE_RATE:
            raise BadRequestError(
                f"{label}: audio sample rate is {rate} Hz, less than the minimum "
                f"({MIN_AUDIO_SAMPLE_RATE})"
            )
        if channels > self.max_channels:
            raise BadRequestError(
                f"{label}: audio has {channels} channels, more than max_audio_channels "
                f"({self.max_channels})"
            )
        if channels < 1:
            raise BadRequestError(f"{label}: audio has no channels")
        if frames > self.max_frames(rate):
            self.refuse_duration(label, frames / rate)

    def max_frames(self, rate: int) -> int:
        """Most frames an item at ``rate`` Hz may have."""
        return math.floor(self.max_seconds * rate)

    def refuse_duration(self, label: str, seconds: float) -> None:
        """:raises BadRequestError: always, naming the duration limit."""
        raise BadRequestError(
            f"{label}: audio is {seconds:.2f} s long, more than {self.seconds_limit} "
            f"({self.max_seconds:g} s)"
        )


class AudioBudget:
    """What is left of one request's audio seconds while its items are decoded in order.

    Not thread-safe: one per ``preprocess`` call.

    :param max_seconds: most seconds of all the request's audio items.
    """

    __slots__ = ("_max_seconds", "_spent")

    def __init__(self, max_seconds: float) -> None:
        self._max_seconds = max_seconds
        self._spent = 0.0

    def check(self, label: str, seconds: float) -> None:
        """:raises BadRequestError: ``seconds`` more would pass the request's limit."""
        if self._spent + seconds > self._max_seconds:
            raise BadRequestError(
                f"{label}: the request's audio items last {self._spent + seconds:.2f} s, more "
                f"than max_request_audio_seconds ({self._max_seconds:g} s)"
            )

    def spend(self, label: str, seconds: float) -> None:
        """Count ``seconds`` more. :raises BadRequestError: past the request's limit."""
        self.check(label, seconds)
        self._spent += seconds


def _sniffed_format(data: bytes) -> str | None:
    if data[:4] in _WAV_MAGIC and data[8:12] == b"WAVE":
        return "WAV"
    if data[:4] == b"fLaC":
        return "FLAC"
    if data[:4] == b"OggS":
        return "OGG"
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "MP3"
    return None


def _check_wav_complete(data: bytes, label: str) -> None:
    """Refuse a RIFF WAV whose ``data`` chunk declares more bytes than the file holds.

    libsndfile would quietly decode the part that arrived; a cut-off upload should fail
    loudly instead of being encoded as a shorter clip.
    """
    if data[:4] != b"RIFF":
        return  # RF64 and big-endian RIFX keep their sizes elsewhere; libsndfile checks them
    offset = 12
    while offset + 8 <= len(data):
        kind = data[offset : offset + 4]
        (size,) = struct.unpack_from("<I", data, offset + 4)
        if kind == b"data":
            if size not in _UNKNOWN_WAV_SIZES and offset + 8 + size > len(data):
                raise BadRequestError(
                    f"{label}: cannot decode audio: the file is truncated (its data chunk "
                    f"declares {size} bytes, {len(data) - offset - 8} arrived)"
                )
            return
        offset += 8 + size + (size & 1)  # chunks are padded to even sizes


def _decode(
    data: bytes, label: str, rules: AudioRules, budget: AudioBudget | None
) -> tuple[np.ndarray, int]:
    """Mono float32 samples and their rate; budgets checked on the header, then per block."""
    import soundfile  # type: ignore[import-untyped,unused-ignore]  # optional (the "audio" extra)

    blocks: list[np.ndarray] = []
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as source:
            rate, channels, frames = int(source.samplerate), int(source.channels), source.frames
            rules.check_header(label, rate, channels, max(int(frames), 0))
            if budget is not None:
                budget.check(label, max(int(frames), 0) / rate)
            limit = rules.max_frames(rate)
            decoded = 0
            while True:
                block: Any = source.read(frames=_BLOCK_FRAMES, dtype="float32", always_2d=True)
                if len(block) == 0:
                    break
                decoded += len(block)
                if decoded > limit:  # the header understated the length
                    rules.refuse_duration(label, decoded / rate)
                blocks.append(block.mean(axis=1, dtype=np.float32) if channels > 1 else block[:, 0])
    except BadRequestError:
        raise
    except Exception as exc:  # LibsndfileError, RuntimeError, and whatever a codec raises
        raise BadRequestError(f"{label}: cannot decode audio: {decoder_error(exc)}") from exc
    if not blocks:
        raise BadRequestError(f"{label}: audio has no samples")
    if budget is not None:
        budget.spend(label, decoded / rate)
    return np.concatenate(blocks) if len(blocks) > 1 else np.array(blocks[0]), rate


def resample(wave: np.ndarray, source_rate: int, target_rate: int) -> np.ndarray:
    """``wave`` (1-D float32) resampled from ``source_rate`` to ``target_rate`` Hz.

    Band-limited resampling in the frequency domain (``scipy.signal.resample``'s method):
    the spectrum is cut (or zero-extended) at the new Nyquist frequency.
    The result has ``ceil(len(wave) * target_rate / source_rate)`` samples, the length
    librosa gives. Does not block beyond its compute (O(n log n)).
    """
    if source_rate == target_rate:
        return wave
    count = len(wave)
    wanted = max(1, math.ceil(count * target_rate / source_rate))
    spectrum = torch.fft.rfft(torch.from_numpy(np.ascontiguousarray(wave, dtype=np.float32)))
    kept = torch.zeros(wanted // 2 + 1, dtype=spectrum.dtype)
    bins = min(len(kept), len(spectrum))
    kept[:bins] = spectrum[:bins]
    if wanted < count and wanted % 2 == 0:
        # The new Nyquist bin folds the energy of both signs of that frequency; keep its
        # real part only, as a real signal's Nyquist bin must be.
        kept[-1] = kept[-1].real.clone()
    out = torch.fft.irfft(kept, n=wanted) * (wanted / count)
    result: np.ndarray = out.numpy().astype(np.float32, copy=False)
    return result


def _array_wave(
    item: np.ndarray, label: str, rules: AudioRules, budget: AudioBudget | None
) -> np.ndarray:
    if item.ndim != 1 or not np.issubdtype(item.dtype, np.floating):
        raise BadRequestError(
            f"{label}: an audio array must be 1-D floats at {rules.sampling_rate} Hz; "
            f"got {item.dtype} of shape {tuple(item.shape)}"
        )
    if len(item) > rules.max_frames(rules.sampling_rate):
        rules.refuse_duration(label, len(item) / rules.sampling_rate)
    if len(item) == 0:
        raise BadRequestError(f"{label}: audio has no samples")
    if budget is not None:
        budget.spend(label, len(item) / rules.sampling_rate)
    wave = np.ascontiguousarray(item, dtype=np.float32)
    if not np.isfinite(wave).all():
        raise BadRequestError(f"{label}: audio samples must be finite numbers")
    return wave


def load_audio(
    item: object,
    index: int,
    policy: MediaPolicy,
    rules: AudioRules,
    *,
    budget: AudioBudget | None = None,
) -> np.ndarray:
    """Decode one audio item into a mono float32 waveform at ``rules.sampling_rate``.
    Blocks on reads, fetches, decoding and resampling.

    With a ``budget``, the item's duration (from its header) is checked against what is
    left of the request's seconds before it is decoded, and spent once it is.

    :raises BadRequestError: naming ``mm_items[index]`` for an item that is not WAV, FLAC,
        OGG (Vorbis, Opus) or MP3, is truncated or undecodable, has no samples, or whose
        sample rate, channel count or duration is over its budget (or the request's).
    """
    label = item_label(index)
    if isinstance(item, np.ndarray):
        return _array_wave(item, label, rules, budget)
    data = item_bytes(item, label, policy)
    kind = _sniffed_format(data)
    if kind is None:
        raise BadRequestError(
            f"{label}: cannot decode audio: not an audio format this server reads "
            "(WAV, FLAC, OGG, MP3)"
        )
    if kind == "WAV":
        _check_wav_complete(data, label)
    try:
        import soundfile  # type: ignore[import-untyped,unused-ignore]  # noqa: F401
    except ImportError:
        raise BadRequestError(
            f"{label}: audio needs the soundfile package, which is not installed "
            "(pip install 'encdisagg[audio]')"
        ) from None
    wave, rate = _decode(data, label, rules, budget)
    return resample(wave, rate, rules.sampling_rate)


def probe_wav(index: int, rate: int = 16_000) -> str:
    """A 0.1 s mono WAV data URL whose samples differ per ``index``, so no cache answers
    it: the health probe of an audio model. Does not block."""
    samples = np.random.default_rng(index).integers(-3000, 3000, rate // 10, dtype=np.int16)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(samples.astype("<i2").tobytes())
    return "data:audio/wav;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
