"""``ORG/NAME`` models from the local Hugging Face cache, offline; full checkpoints load
their vision tower alone, without a report about the language model's weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from encdisagg import BadRequestError
from encdisagg._cli import build_parser, main
from encdisagg._cli._serve import resolve
from encdisagg._hub import hub_cache_dir, looks_like_hub_id, resolve_hub_model
from encdisagg._modality import Modality
from encdisagg.models import QwenVisionModel, build_tiny_qwen2_vl, load_model

from ._media_samples import make_image

_COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory, tiny: QwenVisionModel) -> Path:
    """A Hub cache folder holding ``Org/Tiny-Qwen2-VL``: a full checkpoint (language model
    included) in the layout ``hf download`` writes (``refs/main`` naming a snapshot)."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--Org--Tiny-Qwen2-VL"
    snapshot = repo / "snapshots" / _COMMIT
    build_tiny_qwen2_vl().save_pretrained(snapshot)
    tiny.save_pretrained(snapshot / "processor")
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        (snapshot / name).write_bytes((snapshot / "processor" / name).read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(_COMMIT)
    return cache


@pytest.fixture
def offline_cache(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_cache


def test_the_cache_folder_follows_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub_cache_dir() == tmp_path / "cache"


@pytest.mark.parametrize(
    ("name", "is_id"),
    [
        ("Qwen/Qwen2-VL-2B-Instruct", True),
        ("Org/Name@v1.0", True),
        ("tiny", False),
        ("/abs/path", False),
        ("a/b/c", False),
        ("./rel", False),
    ],
)
def test_what_reads_as_a_hub_id(name: str, is_id: bool) -> None:
    assert looks_like_hub_id(name) is is_id


@pytest.mark.usefixtures("offline_cache")
def test_a_cached_id_loads_offline_without_the_language_model_report(
    tiny: QwenVisionModel, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    capfd.readouterr()
    loaded = load_model("Org/Tiny-Qwen2-VL")
    output = capfd.readouterr()
    assert "UNEXPECTED" not in output.err + output.out + caplog.text
    assert "LOAD REPORT" not in output.err + output.out + caplog.text
    assert loaded.identity == tiny.identity
    probe = tiny.preprocess([make_image(224, 168, seed=3)], Modality.IMAGE)
    assert torch.equal(loaded.forward([probe])[0], tiny.forward([probe])[0])


def test_an_absent_id_names_the_cache_folder(offline_cache: Path) -> None:
    with pytest.raises(BadRequestError) as caught:
        resolve_hub_model("Org/Absent")
    message = caught.value.message
    assert message.startswith("model: 'Org/Absent' is not in the local Hugging Face cache")
    assert str(offline_cache) in message
    with pytest.raises(BadRequestError, match="Org/Absent"):
        load_model("Org/Absent")


def test_serve_resolves_the_id_before_starting(
    offline_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    options = resolve(build_parser().parse_args(["serve", "--model", "Org/Tiny-Qwen2-VL"]))
    assert options.config.model == "Org/Tiny-Qwen2-VL", "the id is kept (workers resolve it)"
    assert main(["serve", "--model", "Qwen/Qwen2-VL-2B-Instruct"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("encdisagg serve: error: --model: 'Qwen/Qwen2-VL-2B-Instruct' is not")
    assert str(offline_cache) in err
    assert err.count("\n") == 1
