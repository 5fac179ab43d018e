"""RegionTable against a brute-force model."""

from __future__ import annotations

from hypothesis import given, strategies as st

from encdisagg.transfer._regions import RegionTable

ranges = st.tuples(st.integers(1, 200), st.integers(1, 40))


@given(st.lists(st.tuples(st.booleans(), ranges), max_size=60), st.lists(ranges, max_size=20))
def test_matches_a_brute_force_model(
    ops: list[tuple[bool, tuple[int, int]]], probes: list[tuple[int, int]]
) -> None:
    table = RegionTable()
    model: dict[int, int] = {}
    for remove, (ptr, nbytes) in ops:
        if remove:
            if ptr in model:
                assert table.remove(ptr) == model.pop(ptr)
            continue
        clash = table.overlapping(ptr, nbytes)
        expected = [(s, n) for s, n in model.items() if s < ptr + nbytes and ptr < s + n]
        assert (clash is None) == (not expected)
        if clash is None:
            table.add(ptr, nbytes)
            model[ptr] = nbytes
        else:
            assert clash in expected
    assert table.items() == sorted(model.items())
    assert len(table) == len(model)
    for ptr, nbytes in probes:
        inside = any(s <= ptr and ptr + nbytes <= s + n for s, n in model.items())
        assert table.covers(ptr, nbytes) == inside
