"""Link utilisation from per-message records (``bench --trace``): definitions on synthetic
traces, and the records the executor keeps on every call."""

from __future__ import annotations

import json

import numpy as np
import pytest

from optcc_mpi.lab import bench


def test_union_length_counts_overlaps_once() -> None:
    assert bench.union_length([]) == 0.0
    assert bench.union_length([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert bench.union_length([(2, 3), (0, 1), (0.2, 0.4)]) == pytest.approx(2.0)
    assert bench.union_length([(1, 1), (2, 1)]) == 0.0  # empty intervals


def _two_ranks() -> list[dict]:
    # Rank 0 starts at clock 10.0, rank 1 at 10.5; the run spans 10.0 .. 14.0.
    return [
        {
            "start": 10.0,
            "seconds": 4.0,
            # op, peer, bytes, posted, completed (relative to start)
            "sends": [(0, 1, 100, 0.0, 1.0), (1, 1, 100, 0.5, 2.0)],
            "recvs": [(2, 1, 100, 0.0, 3.0)],
            "chan": {0: 0, 1: 0, 2: 0},
        },
        {
            "start": 10.5,
            "seconds": 3.5,
            "sends": [(0, 0, 100, 1.5, 2.5)],  # posted at clock 12.0
            "recvs": [(1, 0, 100, 0.0, 1.0), (2, 0, 100, 0.0, 2.0)],
            "chan": {0: 0, 1: 0, 2: 0},
        },
    ]


def test_busy_fractions_from_a_synthetic_trace() -> None:
    util = bench.utilisation(_two_ranks())
    assert [u["seconds"] for u in util] == [4.0, 4.0]
    # Rank 0 sends over clock 10..12 (two overlapping messages): 2 of 4 s.
    assert util[0]["send_busy"] == pytest.approx(0.5)
    # Rank 0's receive was posted at 10.0 but rank 1 sent only at 12.0; done at 13.0.
    assert util[0]["recv_busy"] == pytest.approx(0.25)
    # Rank 1 sends over 12.0..13.0.
    assert util[1]["send_busy"] == pytest.approx(0.25)
    # Rank 1's receives: first matched with rank 0's send at 10.0 -> 10.5..11.5 (its
    # receive was posted at 10.5); second with the send at 10.5 -> 10.5..12.5.
    assert util[1]["recv_busy"] == pytest.approx(0.5)
    assert util[0]["messages_sent"] == 2 and util[1]["messages_received"] == 2


def test_receives_match_sends_per_channel() -> None:
    ranks = _two_ranks()
    # Put rank 0's second send on channel 1 and rank 1's first receive on channel 1: the
    # receive on channel 0 now meets the send posted at 10.0.
    ranks[0]["chan"][1] = 1
    ranks[1]["chan"][1] = 1
    util = bench.utilisation(ranks)
    # ch1: send posted 10.5, receive posted 10.5, done 11.5; ch0: 10.5 .. 12.5.
    assert util[1]["recv_busy"] == pytest.approx(0.5)
    ranks[1]["chan"][2] = 2  # unmatched: counted from its own posting, 10.5 .. 12.5
    assert bench.utilisation(ranks)[1]["recv_busy"] == pytest.approx(0.5)


def test_timeline_plot_is_written(tmp_path) -> None:
    path = tmp_path / "t.png"
    bench.plot_timeline(_two_ranks(), 0, path, "synthetic")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trace_columns_only_when_traced() -> None:
    row = {k: 1.0 for k, _, _ in bench.COLUMNS} | {"algorithm": "ring", "size": 1, "count": 1}
    row |= {"type": "float32", "redop": "sum", "wrong": 0}
    assert "snd busy" not in bench.rows_table([row])
    assert "snd busy" in bench.rows_table([row | {"send_busy": 0.5, "recv_busy": 0.25}])
    json.dumps(row)


MPI = pytest.importorskip("mpi4py.MPI")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_bench_trace_reports_every_rank(tmp_path_factory) -> None:
    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    out = comm.bcast(str(tmp_path_factory.mktemp("trace")) if comm.rank == 0 else None)
    cfg = bench.BenchConfig(
        sizes=[1 << 16], algorithms=["ring"], iters=1, warmup=0, links="0:0.5", trace=out
    )
    rows = bench.run(cfg, comm)
    assert [r["wrong"] for r in rows] == [0, 0]
    if comm.rank == 0:
        for r in rows:
            assert len(r["busy"]) == p
            busy = np.array(r["busy"])
            assert np.all((busy > 0) & (busy <= 1 + 1e-9))
            assert r["busy_rank"] == 0
            with open(r["timeline"], "rb") as fh:
                assert fh.read(4) == b"\x89PNG"
