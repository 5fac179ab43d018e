"""Audio items: every accepted form decodes to the right waveform; hostile ones are refused
from their headers, before their samples are decoded, with the limit named."""

from __future__ import annotations

import base64
import hashlib
import struct
from pathlib import Path

import numpy as np
import pytest

from encdisagg import BadRequestError
from encdisagg.models import MediaPolicy
from encdisagg.models._media._limits import MediaLimits
from encdisagg.models._media._waveforms import AudioBudget, AudioRules, load_audio, resample

from ._audio_samples import RATE, clip, encode, sine

soundfile = pytest.importorskip("soundfile")

POLICY = MediaPolicy()
RULES = AudioRules(
    sampling_rate=RATE,
    max_seconds=30.0,
    seconds_limit="the model's window",
    max_sample_rate=192_000,
    max_channels=8,
)


def decoded(item: object, rules: AudioRules = RULES, policy: MediaPolicy = POLICY) -> np.ndarray:
    return load_audio(item, 0, policy, rules)


class TestAcceptedForms:
    @pytest.mark.parametrize("codec", ["wav", "flac", "ogg", "mp3"])
    def test_each_container(self, codec: str) -> None:
        wave = decoded(clip(1.5, codec=codec))
        assert wave.dtype == np.float32
        # Lossy codecs may pad their last frame; never by more than a few ms.
        assert abs(len(wave) - 24_000) <= (0 if codec in ("wav", "flac") else 1200)
        assert 0.2 < float(np.abs(wave).max()) < 0.4

    def test_lossless_samples_survive_exactly(self) -> None:
        samples = sine(0.5)
        quantised = np.round(samples * 32767) / 32767
        np.testing.assert_allclose(decoded(encode(samples)), quantised, atol=1e-4)

    def test_stereo_is_averaged_and_44k1_resampled(self) -> None:
        wave = decoded(clip(2.0, 44_100, "flac", channels=2))
        assert len(wave) == 32_000  # ceil(88200 * 16000 / 44100)
        spectrum = np.abs(np.fft.rfft(wave))
        peaks = sorted(np.argsort(spectrum)[-2:] * RATE / len(wave))
        assert peaks == pytest.approx([440.0, 550.0], abs=1.0)  # the two channels' tones

    def test_data_urls_base64_and_hashed_urls(self, tmp_path: Path) -> None:
        data = clip(0.5, codec="ogg")
        expected = decoded(data)
        url = "data:audio/ogg;base64," + base64.b64encode(data).decode()
        path = tmp_path / "a.ogg"
        path.write_bytes(data)
        digest = hashlib.sha256(data).hexdigest()
        for item in (url, base64.b64encode(data).decode(), {"url": url}, str(path), path):
            np.testing.assert_array_equal(decoded(item), expected)
        np.testing.assert_array_equal(decoded({"url": url, "content_hash": digest}), expected)
        with pytest.raises(BadRequestError, match=r"mm_items\[0\]\.content_hash does not match"):
            decoded({"url": url, "content_hash": "0" * 64})
        with pytest.raises(BadRequestError, match="local file paths are not allowed"):
            decoded(str(path), policy=MediaPolicy(allow_local_files=False))

    def test_arrays_at_the_models_rate(self) -> None:
        wave = sine(0.25).astype(np.float64)
        np.testing.assert_array_equal(decoded(wave), wave.astype(np.float32))
        with pytest.raises(BadRequestError, match="must be finite"):
            decoded(np.full(400, np.nan, np.float32))


class TestResample:
    @pytest.mark.parametrize("rate", [8_000, 22_050, 48_000, 44_101])
    def test_keeps_the_tone_and_the_length_rule(self, rate: int) -> None:
        out = resample(sine(1.0, rate, hz=1000.0), rate, RATE)
        assert len(out) == 16_000
        assert np.argmax(np.abs(np.fft.rfft(out))) == 1000  # 1 Hz bins over one second
        assert out.dtype == np.float32

    def test_same_rate_is_untouched(self) -> None:
        wave = sine(0.1)
        assert resample(wave, RATE, RATE) is wave


def _wav_with_header(rate: int, channels: int) -> bytes:
    """A short valid WAV whose fmt chunk then claims ``rate`` Hz and ``channels``."""
    data = bytearray(clip(0.1))
    struct.pack_into("<H", data, 22, channels)
    struct.pack_into("<I", data, 24, rate)
    struct.pack_into("<I", data, 28, (rate * channels * 2) % 2**32)
    struct.pack_into("<H", data, 32, channels * 2)
    return bytes(data)


class TestHostile:
    @pytest.fixture
    def no_sample_reads(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Fail the test if any sample is decoded: refusals must come from the header."""

        def refuse(*_args: object, **_kwargs: object) -> None:
            pytest.fail("samples were decoded before the budget was checked")

        monkeypatch.setattr(soundfile.SoundFile, "read", refuse)

    @pytest.mark.usefixtures("no_sample_reads")
    def test_an_hour_of_flac_silence_is_refused_unread(self) -> None:
        # 180 KB that would decode to 57.6 million samples.
        hour = encode(np.zeros(RATE * 3600, np.float32), codec="flac")
        assert len(hour) < 400_000
        with pytest.raises(
            BadRequestError,
            match=r"mm_items\[0\]: audio is 3600\.00 s long, more than the model's window",
        ):
            decoded(hour)

    @pytest.mark.usefixtures("no_sample_reads")
    def test_a_configured_limit_is_named(self) -> None:
        rules = AudioRules(RATE, 5.0, "max_audio_seconds", 192_000, 8)
        with pytest.raises(BadRequestError, match=r"more than max_audio_seconds \(5 s\)"):
            decoded(clip(6.0), rules)

    @pytest.mark.usefixtures("no_sample_reads")
    def test_an_absurd_sample_rate_is_refused(self) -> None:
        with pytest.raises(
            BadRequestError, match=r"2000000000 Hz, more than max_audio_sample_rate"
        ):
            decoded(_wav_with_header(2_000_000_000, 1))
        with pytest.raises(BadRequestError, match=r"100 Hz, less than the minimum \(1000\)"):
            decoded(_wav_with_header(100, 1))

    @pytest.mark.usefixtures("no_sample_reads")
    def test_too_many_channels_are_refused(self) -> None:
        with pytest.raises(BadRequestError, match=r"64 channels, more than max_audio_channels"):
            decoded(_wav_with_header(RATE, 64))

    def test_truncated_files_are_refused(self) -> None:
        wav = clip(2.0)
        with pytest.raises(BadRequestError, match=r"mm_items\[0\].*the file is truncated"):
            decoded(wav[: len(wav) // 2])
        flac = clip(2.0, codec="flac")
        with pytest.raises(BadRequestError, match=r"mm_items\[0\]: cannot decode audio"):
            decoded(flac[: len(flac) // 2])
        ogg = clip(2.0, codec="ogg")
        with pytest.raises(BadRequestError, match=r"cannot decode audio: .*malformed") as caught:
            decoded(ogg[: len(ogg) // 2])
        assert " at 0x" not in str(caught.value)  # no addresses of ours reach a client

    def test_not_audio_is_refused_before_any_decoder(self) -> None:
        from ._media_samples import encode as encode_image, make_image

        for item in (b"just some text, not a sound", encode_image(make_image(8, 8))):
            with pytest.raises(BadRequestError, match="not an audio format this server reads"):
                decoded(item)

    def test_a_header_that_understates_is_caught_while_decoding(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # As if the header check had passed (MP3 lengths are estimates): decoding still
        # stops within one block of the budget.
        monkeypatch.setattr(AudioRules, "check_header", lambda *_args: None)
        rules = AudioRules(RATE, 1.0, "max_audio_seconds", 192_000, 8)
        with pytest.raises(BadRequestError, match=r"audio is 4\.10 s long, more than max_audio"):
            decoded(clip(10.0), rules)


class TestRequestBudget:
    @pytest.mark.usefixtures("no_sample_reads")
    def test_an_item_past_what_is_left_is_refused_unread(self) -> None:
        budget = AudioBudget(20.0)
        budget.spend("mm_items[0]", 15.0)
        with pytest.raises(
            BadRequestError,
            match=r"mm_items\[0\]: the request's audio items last 21\.00 s, more than "
            r"max_request_audio_seconds \(20 s\)",
        ):
            load_audio(clip(6.0), 0, POLICY, RULES, budget=budget)

    @pytest.fixture
    def no_sample_reads(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def refuse(*_args: object, **_kwargs: object) -> None:
            pytest.fail("samples were decoded before the budget was checked")

        monkeypatch.setattr(soundfile.SoundFile, "read", refuse)

    def test_the_model_counts_the_whole_request(self) -> None:
        from encdisagg.models import load_model

        model = load_model("tiny-qwen2.5-omni-audio")
        limits = MediaLimits(max_request_audio_seconds=5.0)
        three = [clip(2.0), clip(2.0), clip(2.0)]
        with pytest.raises(BadRequestError, match=r"mm_items\[2\]: the request's audio"):
            model.preprocess(three, "audio", limits=limits)
        assert model.preprocess(three[:2], "audio", limits=limits).token_counts == (50, 50)


class TestLimits:
    def test_defaults_and_validation(self) -> None:
        limits = MediaLimits()
        assert limits.max_audio_seconds is None
        assert (limits.max_audio_sample_rate, limits.max_audio_channels) == (192_000, 8)
        for bad in (0, -1.0, float("inf"), float("nan"), True):
            with pytest.raises(BadRequestError, match="max_audio_seconds must be"):
                MediaLimits(max_audio_seconds=bad)
        with pytest.raises(BadRequestError, match="max_audio_channels must be"):
            MediaLimits(max_audio_channels=0)
        assert limits.max_request_audio_seconds == 600.0
        with pytest.raises(BadRequestError, match="max_request_audio_seconds must be"):
            MediaLimits(max_request_audio_seconds=0)

    def test_the_model_window_caps_a_larger_setting(self) -> None:
        from encdisagg.models import load_model

        model = load_model("tiny-qwen2.5-omni-audio")
        capped = model.audio_rules(MediaLimits(max_audio_seconds=120))  # type: ignore[union-attr]
        assert (capped.max_seconds, capped.seconds_limit) == (30.0, "the model's window")
        tighter = model.audio_rules(MediaLimits(max_audio_seconds=2.5))  # type: ignore[union-attr]
        assert (tighter.max_seconds, tighter.seconds_limit) == (2.5, "max_audio_seconds")

    def test_the_config_fields_reach_preprocess(self) -> None:
        from encdisagg import EncoderConfig
        from encdisagg.encoder._compute._inputs import media_limits

        config = EncoderConfig(
            max_audio_seconds=4.0, max_audio_sample_rate=48_000, max_request_audio_seconds=60.0
        )
        limits = media_limits(config)
        assert (limits.max_audio_seconds, limits.max_audio_sample_rate) == (4.0, 48_000)
        assert limits.max_request_audio_seconds == 60.0
        with pytest.raises(BadRequestError, match="max_audio_seconds must be"):
            EncoderConfig(max_audio_seconds=0)
