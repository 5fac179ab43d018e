"""Errors at the Encoder's edges: what leaves ``async with Encoder(...)`` (DESIGN.md §4.5),
and what a failed encode leaves behind for its id (§6 rules 4, 5 and 11)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from encdisagg import (
    BadRequestError,
    EncdisaggError,
    Encoder,
    EncodeRequest,
    InternalError,
    NotFoundError,
    RequestNotActiveError,
    ZmqDestination,
)

from .fakes import ScriptedModel

pytestmark = pytest.mark.anyio

MakeEncoder = Callable[..., Encoder]


def request(req_id: str, item: object = 4) -> EncodeRequest:
    return EncodeRequest(req_id, [item])


# -- finding 4: the caller's own error leaves the block as itself --------------------------


async def test_an_encoder_error_from_the_block_leaves_as_itself(make_encoder: MakeEncoder) -> None:
    raised: list[NotFoundError] = []
    left_with: BaseException | None = None
    try:
        async with make_encoder() as encoder:
            # Live work at the time, so leaving the block releases something.
            await encoder.encode(request("live"))
            try:
                await encoder.send("unknown", ZmqDestination("tcp://127.0.0.1:9"))
            except NotFoundError as exc:
                raised.append(exc)
                raise
    except BaseException as exc:
        left_with = exc
    assert type(left_with) is NotFoundError
    assert left_with is raised[0]
    assert left_with.status == 404


@pytest.mark.parametrize(
    "make_error",
    [
        pytest.param(lambda: ValueError("the caller's own bug"), id="plain"),
        pytest.param(lambda: NotFoundError("no such thing", req_id="x"), id="encdisagg"),
    ],
)
async def test_an_error_raised_in_the_block_keeps_its_type_and_cause(
    make_encoder: MakeEncoder, make_error: Callable[[], Exception]
) -> None:
    error = make_error()
    cause = KeyError("what led to it")
    left_with: BaseException | None = None
    try:
        async with make_encoder() as encoder:
            await encoder.encode(request("live"))
            raise error from cause
    except BaseException as exc:
        left_with = exc
    assert type(left_with) is type(error)
    assert left_with is error
    assert left_with.__cause__ is cause


class InlineScriptedModel(ScriptedModel):
    """The scripted model, called inline (on the event loop) instead of in threads."""

    blocking = False


# -- what preprocessing raised reaches the caller mapped, with its cause -------------------


@pytest.mark.parametrize(
    "model_type", [ScriptedModel, InlineScriptedModel], ids=["thread", "inline"]
)
@pytest.mark.parametrize(
    ("item", "failure", "cause"),
    [
        pytest.param("bad", BadRequestError, ValueError, id="bad-media"),
        pytest.param("crash", InternalError, RuntimeError, id="preprocess-raises"),
    ],
)
async def test_a_preprocessing_failure_is_mapped_and_keeps_its_cause(
    make_encoder: MakeEncoder,
    model_type: type[ScriptedModel],
    item: str,
    failure: type[EncdisaggError],
    cause: type[Exception],
) -> None:
    async with make_encoder(model=model_type()) as encoder:
        with pytest.raises(failure) as caught:
            await encoder.encode(request("r1", item))
        assert caught.value.req_id == "r1"
        assert "'r1'" in caught.value.message
        assert type(caught.value.__cause__) is cause
        assert caught.value.__suppress_context__
        assert encoder.stats().live_requests == 0


# -- finding 5: a failed encode's id can be encoded afresh ---------------------------------


@pytest.mark.parametrize("late_call", ["release", "abandon"])
@pytest.mark.parametrize(
    ("item", "failure"),
    [
        pytest.param("bad", BadRequestError, id="bad-media"),
        pytest.param("crash", InternalError, id="preprocess-raises"),
    ],
)
async def test_a_failed_encode_can_be_retried_after_a_late_release(
    make_encoder: MakeEncoder, item: str, failure: type[EncdisaggError], late_call: str
) -> None:
    async with make_encoder() as encoder:
        with pytest.raises(failure):
            await encoder.encode(request("r1", item))
        # A client that saw the failure cleans up, late: the id is gone already.
        if late_call == "release":
            await encoder.release("r1")
        else:
            await encoder.abandon("r1")
        result = await encoder.encode(request("r1", 6))
        assert result.num_tokens == 6
        # The fresh lifecycle's metadata, not the failed one's error.
        assert await encoder.wait_metadata("r1") == result
        await encoder.release("r1")


async def test_abandon_of_an_unseen_id_still_refuses_its_encode(make_encoder: MakeEncoder) -> None:
    model = ScriptedModel()
    async with make_encoder(model=model) as encoder:
        await encoder.abandon("early")
        with pytest.raises(RequestNotActiveError, match="abandoned"):
            await encoder.encode(request("early"))
        assert model.forward_batches == []
        # Refused once: the abandon is used up.
        await encoder.encode(request("early"))
        await encoder.release("early")


# -- a failed encode keeps nothing of its request alive ------------------------------------


class _Bulky:
    """Stands in for a large decoded item (weakly referenceable, unlike bytes)."""


class _RefusesBulky(ScriptedModel):
    # Called inline: an idle worker thread keeps its last call's outcome (and so that
    # call's error and traceback) until its next call, which is AnyIO's, not the table's.
    blocking = False

    def preprocess(self, items, modality):  # type: ignore[no-untyped-def]
        if any(isinstance(item, _Bulky) for item in items):
            raise ValueError("mm_items[0]: too large")
        return super().preprocess(items, modality)


async def test_a_remembered_failure_does_not_keep_its_request_alive(
    make_encoder: MakeEncoder,
) -> None:
    import gc
    import weakref

    bulky = _Bulky()
    watch = weakref.ref(bulky)
    async with make_encoder(model=_RefusesBulky()) as encoder:
        with pytest.raises(BadRequestError, match="too large"):
            await encoder.encode(EncodeRequest("big", [bulky]))
        del bulky
        gc.collect()
        # The id is still remembered (a late waiter gets the error) ...
        with pytest.raises(BadRequestError, match="too large"):
            await encoder.wait_metadata("big")
        # ... but not through the raised error's traceback, which held the request's items.
        assert watch() is None
