import math

import pytest

from encdisagg._errors import BadRequestError
from encdisagg._numbers import real, whole


@pytest.mark.parametrize(
    ("value", "least", "words"),
    [
        (True, 0, "a non-negative integer"),
        (-1, 0, "a non-negative integer"),
        (0, 1, "a positive integer"),
        (1.0, 1, "a positive integer"),
        ("3", 1, "a positive integer"),
        (1, 2, "an integer >= 2"),
    ],
)
def test_whole_refuses_with_the_field_named(value: object, least: int, words: str) -> None:
    with pytest.raises(ValueError, match=f"^count must be {words}; got "):
        whole("count", value, least=least)


def test_whole_passes_the_value_through() -> None:
    assert whole("count", 7, least=1) == 7


def test_refusals_take_the_callers_error() -> None:
    with pytest.raises(BadRequestError, match="size must be a positive integer"):
        whole("size", False, least=1, error=BadRequestError)
    with pytest.raises(BadRequestError, match="wait_s must be a finite positive number"):
        real("wait_s", 0, above=0, error=BadRequestError)


@pytest.mark.parametrize(
    ("value", "bounds", "words"),
    [
        (True, {}, "a finite number"),
        (math.nan, {"finite": False}, "a number"),
        (math.inf, {"above": 0}, "a finite positive number"),
        (-0.5, {"least": 0, "finite": False}, "a non-negative number"),
        (1, {"above": 1}, "a finite number > 1"),
    ],
)
def test_real_refuses_with_the_field_named(
    value: object, bounds: dict[str, object], words: str
) -> None:
    with pytest.raises(ValueError, match=f"^wait must be {words}; got "):
        real("wait", value, **bounds)  # type: ignore[arg-type]


def test_real_lets_infinity_through_where_asked() -> None:
    assert real("wait", math.inf, above=0, finite=False) == math.inf
    assert real("wait", 2, least=0) == 2
