"""``optcc-mpi bench`` says where the lower bound is the ring's own time (p = 2, or no
degraded rank), so that a ratio to the fault-free ring above 1 is not read as a defect."""

from __future__ import annotations

from optcc_mpi import model
from optcc_mpi.lab import bench


def _rows(p: int, links: str) -> list[dict]:
    return [
        {"algorithm": "ring (fault-free)", "p": p, "links": "healthy"},
        {"algorithm": "ring", "p": p, "links": links},
        {"algorithm": "optcc", "p": p, "links": links},
    ]


def test_two_ranks_the_bound_is_the_ring() -> None:
    (note,) = bench.notes(_rows(2, "0:0.5"))
    assert note.startswith("p = 2: the lower bound equals the ring's time")
    assert "2x the fault-free ring" in note and "cannot beat the ring" in note
    # What the note says, from the model itself.
    assert model.lower_bound(2, 1.0, 1.0, "0:0.5") == 2 * model.fault_free(2, 1.0, 1.0)
    assert "1.5x at 3 ranks" in note
    assert model.lower_bound(3, 1.0, 1.0, "0:0.5") == 1.5 * model.fault_free(3, 1.0, 1.0)
    (quarter,) = bench.notes(_rows(2, "1:0.25"))
    assert "4x the fault-free ring" in quarter


def test_no_degraded_rank_the_bound_is_the_fault_free_ring() -> None:
    (note,) = bench.notes(_rows(4, "healthy"))
    assert note.startswith("no degraded rank") and "--links" in note


def test_nothing_to_say_where_an_algorithm_can_beat_the_ring() -> None:
    assert bench.notes(_rows(3, "0:0.5")) == []
    assert bench.notes(_rows(8, "0:0.9")) == []
    # Several profiles in one table (a probe may change it): each said once.
    assert len(bench.notes(_rows(2, "0:0.5") + _rows(2, "0:0.5"))) == 1
