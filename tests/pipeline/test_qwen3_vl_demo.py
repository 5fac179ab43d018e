"""The pipeline over Qwen3-VL: prefill consumes the deepstack sections, the demo keeps parity."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from encdisagg._cli import main
from encdisagg.models import load_model
from encdisagg.pipeline import DecodeStatus, DemoOptions, LanguageModel, run_demo


@pytest.fixture(scope="module")
def lm() -> LanguageModel:
    return LanguageModel.tiny(name="tiny-qwen3-vl")


def test_prefill_with_deepstack_equals_the_whole_hf_model(lm: LanguageModel) -> None:
    assert lm.deepstack_layers == 2
    assert lm.embedding_width == 3 * lm.hidden_size
    # The processor-exact path: the reference below preprocesses with HF's own processor.
    encoder = load_model("tiny-qwen3-vl", preprocess="reference")
    assert lm.embedding_layout == getattr(encoder, "embedding_layout", None)
    pixels = np.random.default_rng(3).integers(0, 256, (70, 100, 3), dtype=np.uint8)
    image = Image.fromarray(pixels, "RGB")
    pre = encoder.preprocess([image], "image")
    (joint,) = encoder.forward([pre])
    ids = lm.prompt_ids("Describe the picture.", pre.token_counts)
    result = lm.prefill(ids, joint, pre.grid)

    # The reference: the whole model on the raw image (its own tower, its own deepstack).
    processed = lm._process([image])
    tokens = torch.tensor([ids])
    with torch.inference_mode():
        logits = lm.model(
            input_ids=tokens,
            pixel_values=processed["pixel_values"],
            image_grid_thw=processed["image_grid_thw"],
            mm_token_type_ids=(tokens == lm.image_token_id).int(),
        ).logits[0, -1]
    top = torch.log_softmax(logits.float(), -1).topk(4)
    assert result.first_token == int(logits.argmax())
    assert result.top_ids is not None
    assert result.top_logprobs is not None
    assert torch.equal(result.top_ids, top.indices)
    assert torch.equal(result.top_logprobs, top.values)

    # Without the deepstack sections the hidden state differs: prefill really adds them.
    main_only = joint.clone()
    main_only[:, lm.hidden_size :] = 0
    without = lm.prefill(ids, main_only, pre.grid)
    assert result.hidden is not None
    assert without.hidden is not None
    assert not torch.equal(result.hidden, without.hidden)


def test_the_cli_demo_keeps_parity_with_tiny_qwen3_vl(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--model", "tiny-qwen3-vl", "--requests", "4", "--new-tokens", "6"]
    status = main([*argv, "--quiet"])
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert status == 0, summary
    assert summary.startswith("demo: requests=4 completed=4 ")
    assert "leaked_pages=0 leaked_slots=0 kv_corrupt=0" in summary
    assert summary.endswith("parity=ok")


@pytest.mark.anyio
async def test_the_qwen3_vl_demo_keeps_parity_over_mooncake_with_aborts() -> None:
    options = DemoOptions(
        model="tiny-qwen3-vl",
        requests=6,
        transfer="mooncake",
        encoders=1,
        new_tokens=4,
        abort_rate=0.3,
        seed=3,
        verbose=False,
    )
    report = await run_demo(options, err=io.StringIO())
    completed = [o for o in report.outcomes if o.status is DecodeStatus.COMPLETED]
    assert completed
    assert all(o.parity and o.kv_intact for o in completed)
    assert report.ok, report.summary_line()


def test_an_unknown_built_in_name_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--model", "tiny-qwen9"]) == 2
    assert "tiny-qwen3-vl" in capsys.readouterr().err
