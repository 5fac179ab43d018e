"""Every error of the hierarchy survives a copy across a process boundary we own, with the
attributes its constructor set, whatever that constructor's arguments."""

from __future__ import annotations

import copy
import pickle

import pytest

import encdisagg
from encdisagg import EncdisaggError, TransferTimeoutError
from encdisagg.receiver import EncoderCallError, EncoderLeftError

_PLAIN = [
    cls
    for cls in vars(encdisagg).values()
    if isinstance(cls, type) and issubclass(cls, EncdisaggError)
]


@pytest.mark.parametrize("cls", _PLAIN, ids=lambda cls: cls.__name__)
def test_a_public_error_copies_with_its_message_request_and_status(
    cls: type[EncdisaggError],
) -> None:
    error = cls("field x is wrong", req_id="r-1")
    for copied in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
        assert type(copied) is cls
        assert (str(copied), copied.message, copied.req_id) == (str(error), error.message, "r-1")
        assert copied.status == error.status
        assert copied.args == error.args


def test_a_call_error_keeps_its_own_status_and_fields() -> None:
    error = EncoderCallError(
        "encoder answered 400", url="http://e:1", route="/encode", status=400, part_idx=2
    )
    copied = pickle.loads(pickle.dumps(error))
    assert (copied.url, copied.route, copied.status, copied.part_idx) == (
        "http://e:1",
        "/encode",
        400,
        2,
    )
    assert EncoderCallError.status == 502  # the instance's status did not leak to the class


def test_a_left_error_copies_without_calling_its_constructor() -> None:
    error = EncoderLeftError("http://10.0.0.7:30000", "r-1")
    copied = pickle.loads(pickle.dumps(error))
    assert (type(copied), copied.url, copied.req_id, str(copied)) == (
        EncoderLeftError,
        error.url,
        "r-1",
        str(error),
    )


def test_a_timeout_copy_leaves_the_live_hold_behind() -> None:
    hold = object()  # stands in for the engine's live Hold
    error = TransferTimeoutError("write of r-1 outlived its bound", req_id="r-1", hold=hold)
    copied = pickle.loads(pickle.dumps(error))
    assert copied.hold is None
    assert error.hold is hold
    assert (copied.message, copied.req_id) == (error.message, "r-1")
