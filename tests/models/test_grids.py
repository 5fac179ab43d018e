from __future__ import annotations

import logging
from typing import ClassVar

import pytest
from hypothesis import given, strategies as st

from encdisagg._modality import Modality
from encdisagg.models import (
    audio_output_length,
    grid_patches,
    grid_tokens,
    kimi_grid_patches,
    kimi_grid_tokens,
    qwen2_audio_output_length,
    qwen3_audio_output_length,
    select_grid,
)


class TestQwenGrids:
    @pytest.mark.parametrize(
        ("grid", "tokens"),
        [
            ((1, 32, 32), 256),  # 448x448
            ((1, 52, 92), 1196),  # 1280x720, resized to 1288x728
            ((2, 24, 24), 288),  # four 336x336 frames
            ((1, 2, 2), 1),
        ],
    )
    def test_tokens_of_known_inputs(self, grid: tuple[int, int, int], tokens: int) -> None:
        assert grid_tokens(grid, 2) == tokens

    def test_patches_are_the_grid_volume(self) -> None:
        assert grid_patches((1, 52, 92)) == 4784
        assert grid_patches([3, 4, 6]) == 72

    @given(
        t=st.integers(1, 8),
        h=st.integers(1, 40),
        w=st.integers(1, 40),
        merge=st.integers(1, 4),
    )
    def test_merging_divides_patches_by_merge_squared(
        self, t: int, h: int, w: int, merge: int
    ) -> None:
        grid = (t, h * merge, w * merge)
        assert grid_tokens(grid, merge) * merge * merge == grid_patches(grid)

    @pytest.mark.parametrize(
        "grid", [(1, 32), (1, 2, 3, 4), (0, 2, 2), (1, -2, 2), (1, 2.5, 2), (True, 2, 2)]
    )
    def test_malformed_grids_are_rejected(self, grid: tuple[object, ...]) -> None:
        with pytest.raises(ValueError, match="grid"):
            grid_tokens(grid, 2)  # type: ignore[arg-type]

    def test_a_grid_the_merger_cannot_fold_is_rejected(self) -> None:
        with pytest.raises(ValueError, match="merge_size 2"):
            grid_tokens((1, 3, 4), 2)
        with pytest.raises(ValueError, match="merge_size"):
            grid_tokens((1, 2, 2), 0)


class TestKimiGrids:
    def test_two_dimensional_grids(self) -> None:
        assert kimi_grid_patches([28, 42]) == 28 * 42
        assert kimi_grid_tokens([28, 42], [2, 2]) == 28 * 42 // 4

    def test_temporal_rows_add_patches_but_not_tokens(self) -> None:
        assert kimi_grid_patches([4, 28, 42]) == 4 * 28 * 42
        assert kimi_grid_tokens([4, 28, 42], [2, 2]) == kimi_grid_tokens([28, 42], [2, 2])

    def test_rectangular_merge_kernel(self) -> None:
        assert kimi_grid_tokens([12, 12], [3, 2]) == 144 // 6

    def test_kernel_must_divide_the_grid(self) -> None:
        with pytest.raises(ValueError, match="merge_kernel_size"):
            kimi_grid_tokens([13, 12], [2, 2])
        with pytest.raises(ValueError, match="entries"):
            kimi_grid_tokens([12, 12], [2])
        with pytest.raises(ValueError, match="entries"):
            kimi_grid_patches([12])


class TestSelectGrid:
    both: ClassVar[dict[str, str]] = {
        "image_grid_thw": "thw",
        "image_grid_hws": "hws",
        "grid_thws": "thws",
    }

    def test_qwen_takes_thw_first(self) -> None:
        assert select_grid(self.both, Modality.IMAGE) == ("image_grid_thw", "thw")
        assert select_grid(self.both, Modality.IMAGE, model_type="qwen2_vl")[0] == (
            "image_grid_thw"
        )

    def test_kimi_vl_prefers_hws_over_thw(self) -> None:
        assert select_grid(self.both, Modality.IMAGE, model_type="kimi_vl") == (
            "image_grid_hws",
            "hws",
        )

    @pytest.mark.parametrize("model_type", ["kimi_k25", "kimi_k3"])
    def test_kimi_k25_keeps_grid_thws(self, model_type: str) -> None:
        assert select_grid(self.both, Modality.IMAGE, model_type=model_type)[0] == "grid_thws"

    def test_falls_back_to_what_is_present(self) -> None:
        assert select_grid({"image_grid_hws": 1}, Modality.IMAGE)[0] == "image_grid_hws"
        assert select_grid({"grid_thws": 1}, Modality.IMAGE, model_type="kimi_vl")[0] == (
            "grid_thws"
        )
        # None counts as absent, as a processor that fills unused outputs with None.
        assert select_grid({"image_grid_thw": None, "grid_thws": 2}, Modality.IMAGE) == (
            "grid_thws",
            2,
        )

    def test_video_and_audio(self) -> None:
        assert select_grid({"video_grid_thw": 1, **self.both}, Modality.VIDEO)[0] == (
            "video_grid_thw"
        )
        assert select_grid({"audio_feature_lens_raw": 3}, Modality.AUDIO) == (
            "audio_feature_lens_raw",
            3,
        )

    def test_missing_grid_is_an_error(self) -> None:
        with pytest.raises(ValueError, match="no video grid"):
            select_grid(self.both, Modality.VIDEO)


class TestAudioLengths:
    @pytest.mark.parametrize(
        ("frames", "tokens"),
        [(3000, 750), (1, 0), (2, 0), (3, 1), (6, 1), (7, 2), (100, 25), (101, 25), (103, 26)],
    )
    def test_qwen2_audio(self, frames: int, tokens: int) -> None:
        # Conv stride 2 then pool stride 2: L1 = (L-1)//2 + 1, tokens = (L1-2)//2 + 1.
        assert qwen2_audio_output_length(frames) == tokens

    @pytest.mark.parametrize(
        ("frames", "tokens"),
        [(100, 13), (200, 26), (1, 1), (8, 1), (9, 2), (99, 13), (150, 13 + 7), (3000, 390)],
    )
    def test_qwen3_audio_chunks(self, frames: int, tokens: int) -> None:
        assert qwen3_audio_output_length(frames) == tokens

    @given(st.integers(1, 10_000))
    def test_qwen3_is_chunk_tokens_plus_the_tail(self, frames: int) -> None:
        full, tail = divmod(frames, 100)
        expected_tail = 0 if tail == 0 else qwen3_audio_output_length(tail)
        assert qwen3_audio_output_length(frames) == 13 * full + expected_tail

    def test_dispatch_by_model_type(self, caplog: pytest.LogCaptureFixture) -> None:
        assert audio_output_length(3000, "qwen2_audio") == 750
        assert audio_output_length(3000, "qwen2_5_omni") == 750
        assert audio_output_length(3000, "qwen3_asr") == 390
        assert audio_output_length(3000, "qwen3_omni_moe") == 390
        assert audio_output_length(3000, "mimo_v2") == 3000
        assert not caplog.records
        with caplog.at_level(logging.WARNING):
            assert audio_output_length(3000, "whisper") == 750
        assert "whisper" in caplog.text

    @pytest.mark.parametrize("frames", [0, -3, True, 2.5])
    def test_lengths_must_be_positive_integers(self, frames: object) -> None:
        with pytest.raises(ValueError, match="positive integer"):
            qwen2_audio_output_length(frames)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="positive integer"):
            qwen3_audio_output_length(frames)  # type: ignore[arg-type]
