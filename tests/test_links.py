"""Link profiles and unit parsing."""

from __future__ import annotations

import numpy as np
import pytest

from optcc_mpi import config
from optcc_mpi.links import Links, parse_duration, parse_rate, parse_size


def test_parse_and_vector() -> None:
    links = Links.parse("0:0.5, 3:0.75")
    assert links.degraded == (0, 3)
    np.testing.assert_array_equal(links.vector(4), [0.5, 1, 1, 0.75])
    assert str(links) == "0:0.5,3:0.75"
    assert Links.parse("2-4:0.5").degraded == (2, 3, 4)
    assert Links.parse("").healthy and Links.parse("none").healthy
    assert Links.parse("1:1").healthy  # a fraction of 1 is healthy


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("0:0", r"fraction 0\.0 for rank 0 is outside \(0, 1\]"),
        ("0:1.5", r"fraction 1\.5 for rank 0 is outside"),
        ("0:-0.5", "outside"),
        ("0:nan", "outside"),
        ("x:0.5", "cannot parse 'x:0.5'"),
        ("0:half", "fraction 'half'"),
        ("0:0.5,0:0.7", "rank 0 is named twice"),
        ("3-1:0.5", "empty rank range"),
    ],
)
def test_bad_profiles(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Links.parse(text)


def test_rank_outside_communicator() -> None:
    with pytest.raises(ValueError, match="names rank 4, outside the communicator of size 4"):
        Links.parse("4:0.5").vector(4)


def test_from_vector_normalises() -> None:
    links = Links.from_vector([2.0, 4.0, 4.0])
    np.testing.assert_allclose(links.vector(3), [0.5, 1, 1])
    with pytest.raises(ValueError):
        Links.from_vector([1.0, 0.0])


def test_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPTCC_LINKS", "1:0.25")
    config.reload()
    assert Links.coerce(None).degraded == (1,)
    monkeypatch.delenv("OPTCC_LINKS")
    config.reload()
    assert Links.coerce(None).healthy


def test_units() -> None:
    assert parse_size("256M") == 256 * 2**20
    assert parse_size("1GB") == 10**9
    assert parse_size(4096) == 4096
    assert parse_rate("25GB/s") == 25e9
    assert parse_rate("400mbit") == 50e6
    assert parse_duration("20us") == pytest.approx(20e-6)
    assert parse_duration("1.5ms") == pytest.approx(1.5e-3)
    for bad, fn in (("12Q", parse_size), ("fast", parse_rate), ("3 weeks", parse_duration)):
        with pytest.raises(ValueError, match="cannot parse"):
            fn(bad)
