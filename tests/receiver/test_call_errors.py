"""The receiver's call errors survive a copy across a process boundary we own."""

from __future__ import annotations

import pickle

from encdisagg import ServiceUnavailableError
from encdisagg.receiver import EncoderLeftError


def test_an_encoder_left_error_pickles_with_its_url_and_request() -> None:
    error = EncoderLeftError("http://10.0.0.7:30000", "r-1")
    copy = pickle.loads(pickle.dumps(error))
    assert isinstance(copy, EncoderLeftError)
    assert isinstance(copy, ServiceUnavailableError)
    assert (copy.url, copy.req_id, str(copy)) == (error.url, "r-1", str(error))
