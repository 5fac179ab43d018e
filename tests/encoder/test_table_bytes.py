"""The request table's memory of ended and abandoned ids is bounded in bytes, not only in
count: a client's long ids (and the error messages quoting them) cannot pin memory."""

from __future__ import annotations

import sys

from hypothesis import given, strategies as st

from encdisagg import BadRequestError, EncodeRequest
from encdisagg.encoder._table import Phase, RequestTable

KIB = 1024


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_table(clock: FakeClock, byte_limit: int) -> RequestTable:
    return RequestTable(
        clock, remember_s=10.0, abandon_ttl_s=4.0, limit=1_000, byte_limit=byte_limit
    )


def fail_and_retire(table: RequestTable, req_id: str) -> None:
    record = table.admit(EncodeRequest(req_id, [1]))
    record.phase = Phase.FAILED
    record.error = BadRequestError(f"req_id {req_id!r}: cannot decode image", req_id=req_id)
    assert record.request_release()
    table.retire(record)


def test_an_id_larger_than_the_bound_is_not_remembered() -> None:
    clock = FakeClock()
    table = make_table(clock, byte_limit=64 * KIB)
    huge = "x" * (256 * KIB)
    fail_and_retire(table, huge)
    assert not table.ended(huge)
    assert (table.remembered, table.remembered_bytes) == (0, 0)
    table.abandon(huge)
    assert not table.abandoned(huge)
    assert table.remembered_bytes == 0


def test_the_oldest_go_once_the_bytes_are_full() -> None:
    clock = FakeClock()
    table = make_table(clock, byte_limit=64 * KIB)
    ids = [f"{n}-" + "y" * (10 * KIB) for n in range(10)]
    for req_id in ids:
        clock.now += 0.1
        fail_and_retire(table, req_id)
        assert table.remembered_bytes <= 64 * KIB
    kept = [req_id for req_id in ids if table.ended(req_id)]
    assert kept == ids[-len(kept) :], "the newest are kept"
    # Each entry holds the id and the message quoting it: about 20 KiB.
    assert len(kept) in (2, 3)
    assert table.ended_error(ids[-1]) is not None


def test_bytes_return_to_zero_once_everything_expired() -> None:
    clock = FakeClock()
    table = make_table(clock, byte_limit=1024 * KIB)
    for n in range(5):
        fail_and_retire(table, f"r{n}")
        table.abandon(f"a{n}")
    assert table.remembered == 10
    assert table.remembered_bytes >= 10 * (sys.getsizeof("r0"))
    clock.now += 11.0
    assert not table.ended("r0")
    assert (table.remembered, table.remembered_bytes) == (0, 0)


operations = st.lists(
    st.tuples(
        st.sampled_from(["fail", "abandon", "admit", "tick"]),
        st.sampled_from(["a", "b", "c" * 300, "d" * 3000, "e" * 9000]),
    ),
    max_size=40,
)


@given(operations)
def test_the_byte_count_matches_what_is_remembered(ops: list[tuple[str, str]]) -> None:
    clock = FakeClock()
    table = make_table(clock, byte_limit=12 * KIB)
    for op, req_id in ops:
        if op == "tick":
            clock.now += 3.0
        elif table.get(req_id) is not None or table.abandoned(req_id):
            # An abandoned id refuses its encode; a live one is not ours to retire here.
            if op == "abandon":
                table.abandon(req_id)
        elif op == "fail":
            fail_and_retire(table, req_id)
        elif op == "abandon":
            table.abandon(req_id)
        else:
            record = table.admit(EncodeRequest(req_id, [1]))
            record.phase = Phase.STAGED
            record.request_release()
            table.retire(record)
        table.ended("a")  # prunes what expired
        assert table.remembered_bytes >= 0
        assert table._retired_bytes == sum(e.nbytes for e in table._retired.values())
        assert table._retired_bytes <= 12 * KIB
        assert table._abandoned_bytes <= 12 * KIB
        if table.remembered == 0:
            assert table.remembered_bytes == 0
