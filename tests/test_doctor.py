"""``optcc-mpi doctor``: the plan, its cost, the verdicts and the command (serial).

The verdicts are tested on synthetic records: the seconds every message would take on
links of a known truth (a message moves at the slower of its two ends; the ranks of a
node share its NIC in the all-at-once rounds), with noise that only ever slows a message
down, as on a real network. The MPI runs under emulation are in tests/test_doctor_mpi.py,
the runs on real shaped links in tests/test_testbed.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from optcc_mpi import doctor as dr
from optcc_mpi.cli import main as cli_main
from optcc_mpi.doctor.expected import reference
from optcc_mpi.errors import ArgumentError
from optcc_mpi.links import Links
from optcc_mpi.schedule import RECV, SEND
from optcc_mpi.simulate import simulate

MiB = 1 << 20
BW = 50e6  # bytes/s: 400 Mbit/s, as on the testbed


def synthetic(
    the_plan: dr.RoundPlan,
    truth: dict[int, float],
    *,
    node_truth: dict[int, float] | None = None,
    noise: float = 0.0,
    rng: np.random.Generator | None = None,
) -> list[dict]:
    """Every rank's record as :func:`optcc_mpi.doctor.run._measure` returns it: a message
    ``s -> d`` of an ``inter`` or ``intra`` round takes ``size / (BW * min(f_s, f_d))``;
    in a ``node`` round a node's NIC is shared by its flows. ``noise``: each message
    slowed by up to that fraction (uniform)."""
    lay = the_plan.layout
    f = np.ones(lay.p)
    for r, v in truth.items():
        f[r] = v
    nf = np.ones(lay.n_nodes)
    for a, v in (node_truth or {}).items():
        nf[a] = v
        for r in lay.members[a]:
            f[r] = min(f[r], v)
    rng = rng or np.random.default_rng(0)
    rows: list[list[tuple[int, int, float]]] = [[] for _ in range(lay.p)]
    size = the_plan.size
    for i, rnd in enumerate(the_plan.rounds):
        out = np.bincount(lay.node[rnd.src], minlength=lay.n_nodes)
        inn = np.bincount(lay.node[rnd.dst], minlength=lay.n_nodes)
        for s, d in zip(rnd.src.tolist(), rnd.dst.tolist()):
            if rnd.phase == "intra":
                rate = 20 * BW
            elif rnd.phase == "node":
                a, b = lay.node[s], lay.node[d]
                rate = BW * min(nf[a] / out[a], nf[b] / inn[b], f[s], f[d])
            else:
                rate = BW * min(f[s], f[d])
            t = size / rate * (1 + noise * rng.random())
            rows[d].append((i, s, t))
    return [{"rows": np.array(r, dtype=float).reshape(-1, 3)} for r in rows]


def verdicts(diag: dr.Diagnosis) -> dict[int, str]:
    return {r.rank: r.verdict for r in diag.ranks}


# ----------------------------------------------------------------------------- the plan


def test_layout_groups_ranks_by_host() -> None:
    lay = dr.Layout(("a", "b", "a", "c", "b", "a"))
    assert lay.names == ("a", "b", "c")
    assert lay.members == ((0, 2, 5), (1, 4), (3,))
    assert lay.node.tolist() == [0, 1, 0, 2, 1, 0]
    assert lay.local.tolist() == [0, 0, 1, 0, 1, 2]
    alone = dr.Layout(("a", "a", "a"), "rank")
    assert alone.n_nodes == 3 and alone.per_node == 1
    with pytest.raises(ArgumentError, match="group"):
        dr.Layout(("a",), "switch")


@pytest.mark.parametrize("p,per_node", [(3, 1), (8, 1), (64, 1), (8, 2), (12, 4)])
def test_plan_bytes_and_rounds_follow_the_stated_formula(p: int, per_node: int) -> None:
    """What the docs and --help state per rank: size * R * k with one rank per node;
    size * R * (2k + min(partners, L - 1)) and R * (2 k L ... ) rounds otherwise."""
    size, partners, repeats = 2 * MiB, 3, 4
    lay = dr.Layout.uniform(p, per_node)
    the_plan = dr.plan(lay, size=size, partners=partners, repeats=repeats)
    k = min(partners, lay.n_nodes - 1)
    assert len(the_plan.shifts) == k
    if per_node == 1:
        want = size * repeats * k
        assert len(the_plan.rounds) == repeats * k
    else:
        kt = min(partners, per_node - 1)
        want = size * repeats * (2 * k + kt)
        assert len(the_plan.rounds) == repeats * (k * per_node + k + kt)
    assert (the_plan.bytes_sent() == want).all()
    assert (the_plan.bytes_received() == want).all()
    # Every round: each sender sends once, no rank sends to itself, and in the inter
    # rounds every node carries exactly one flow out and one in.
    for rnd in the_plan.rounds:
        assert not np.any(rnd.src == rnd.dst)
        assert len(set(rnd.src.tolist())) == len(rnd.src)
        if rnd.phase == "inter":
            assert len(set(lay.node[rnd.dst].tolist())) == len(rnd.dst)
            assert np.all(lay.local[rnd.src] == rnd.local)
        if rnd.phase == "intra":
            assert np.all(lay.node[rnd.src] == lay.node[rnd.dst])
        else:
            assert np.all(lay.node[rnd.src] != lay.node[rnd.dst])


def test_plan_schedules_say_what_the_round_sends() -> None:
    """The schedule of a round is its messages and nothing else: one send and one receive
    per pair, the receives in distinct slots away from what is sent."""
    lay = dr.Layout(("a", "a", "b", "c", "c", "c"))  # nodes of 2, 1 and 3 ranks
    the_plan = dr.plan(lay, size=1000, partners=2, repeats=1)
    for rnd in the_plan.rounds:
        s = rnd.schedule
        sends = s.kind == SEND
        recvs = s.kind == RECV
        assert sends.sum() == recvs.sum() == len(rnd.src) and s.n_ops == 2 * len(rnd.src)
        assert sorted(zip(s.rank[sends].tolist(), s.peer[sends].tolist())) == sorted(
            zip(rnd.src.tolist(), rnd.dst.tolist())
        )
        assert np.all(s.lo[sends] == 0) and np.all(s.hi[sends] == 1000)
        for d in set(rnd.dst.tolist()):
            mine = recvs & (s.rank == d)
            lo = np.sort(s.lo[mine])
            assert lo[0] >= 1000 and np.all(np.diff(lo) >= 1000)  # no overlap
        assert s.count >= int(s.hi.max())


def test_plan_rejects_bad_parameters() -> None:
    lay = dr.Layout.uniform(4)
    for kw in ({"size": 0}, {"partners": 0}, {"repeats": -1}, {"size": 1.5}, {"repeats": True}):
        with pytest.raises(ArgumentError, match="must be a whole number"):
            dr.plan(lay, **kw)


def test_default_takes_under_30_s_at_p64_on_10_gbit() -> None:
    """The issue's bound, by the simulator: the default plan at p = 64 on a 10 Gbit/s
    network (5 us per message), one rank per node and eight."""
    bw = 10e9 / 8
    one = dr.estimate(dr.plan(dr.Layout.uniform(64)), bw, 5e-6)
    eight = dr.estimate(dr.plan(dr.Layout.uniform(64, 8)), bw, 5e-6)
    print(f"p=64 at 10 Gbit/s: {one['seconds']:.3f} s (1 per node), {eight['seconds']:.3f} s (8)")
    assert one["seconds"] < 30 and eight["seconds"] < 30
    # One rank per node: every round is one message per NIC each way, so the simulated
    # transfer time is exactly rounds * (size / bw + latency) (the formula in --help).
    rounds = dr.DEFAULT_REPEATS * dr.DEFAULT_PARTNERS
    assert one["rounds"] == rounds
    want = rounds * (dr.DEFAULT_SIZE / bw + 5e-6)
    assert one["transfer_seconds"] == pytest.approx(want, rel=1e-9)
    assert one["bytes_per_rank"] == rounds * dr.DEFAULT_SIZE


def test_estimate_follows_the_slow_link() -> None:
    """A degraded rank makes the rounds it takes part in slower: its two messages per
    shift take size / (f bw)."""
    the_plan = dr.plan(dr.Layout.uniform(6), size=MiB, partners=2, repeats=1)
    healthy = dr.estimate(the_plan, BW)["transfer_seconds"]
    slow = dr.estimate(the_plan, BW, links="2:0.5")["transfer_seconds"]
    assert healthy == pytest.approx(2 * MiB / BW)
    assert slow == pytest.approx(2 * MiB / (0.5 * BW))
    for r in the_plan.rounds:  # the simulator agrees with size / (bw min(f))
        t = simulate(r.schedule, Links.parse("2:0.5"), bw=BW, itemsize=1).time
        assert t == pytest.approx(MiB / (0.5 * BW))


# ----------------------------------------------------------------------------- verdicts


@pytest.mark.parametrize("p", [3, 4, 5, 8, 16])
def test_healthy_network_flags_nothing(p: int, rng: np.random.Generator) -> None:
    the_plan = dr.plan(dr.Layout.uniform(p), size=MiB)
    diag = dr.diagnose(the_plan, synthetic(the_plan, {}, noise=0.3, rng=rng))
    assert diag.status == "healthy" and diag.exit_status == dr.EXIT_HEALTHY
    assert set(verdicts(diag).values()) == {"healthy"}
    assert diag.links.healthy
    assert diag.summary.startswith("HEALTHY")


@pytest.mark.parametrize("p", [3, 4, 5, 8, 16])
def test_one_half_rate_rank_is_found(p: int, rng: np.random.Generator) -> None:
    slow = p // 2
    the_plan = dr.plan(dr.Layout.uniform(p), size=MiB)
    diag = dr.diagnose(the_plan, synthetic(the_plan, {slow: 0.5}, noise=0.3, rng=rng))
    assert diag.status == "degraded" and diag.exit_status == dr.EXIT_DEGRADED
    assert diag.flagged == [slow]
    row = diag.ranks[slow]
    assert row.fraction == pytest.approx(0.5, abs=0.1)
    # The spread: every repeat's own fraction, none above the best of them all.
    assert row.spread[0] <= row.spread[1] <= row.fraction + 1e-9
    assert list(diag.links.fractions) == [slow]
    # The slowest node comes first, and the summary names it.
    assert diag.nodes[0].ranks == [slow] and diag.nodes[0].verdict == "degraded"
    assert f"node n{slow} (rank {slow})" in diag.summary


@pytest.mark.parametrize("p,slow", [(5, (0, 3)), (8, (0, 1)), (8, (2, 6)), (16, (5, 6))])
def test_two_ranks_at_different_fractions_are_both_found(
    p: int, slow: tuple[int, int], rng: np.random.Generator
) -> None:
    """Also when the two are neighbours in the ring of nodes (0 and 1): the spread
    shifts give each a healthy partner."""
    truth = {slow[0]: 0.5, slow[1]: 0.7}
    the_plan = dr.plan(dr.Layout.uniform(p), size=MiB)
    diag = dr.diagnose(the_plan, synthetic(the_plan, truth, noise=0.1, rng=rng))
    assert diag.flagged == [slow[0], slow[1]]  # slowest first
    for r, f in truth.items():
        assert diag.ranks[r].fraction == pytest.approx(f, abs=0.1)
        assert diag.ranks[r].verdict == "degraded"


def test_a_slow_node_is_named_not_its_ranks(rng: np.random.Generator) -> None:
    """Two ranks per node sharing one NIC at half rate: the node is degraded, its ranks
    say "node", and the summary names the node."""
    lay = dr.Layout.uniform(8, 2)
    the_plan = dr.plan(lay, size=MiB)
    diag = dr.diagnose(the_plan, synthetic(the_plan, {}, node_truth={1: 0.5}, noise=0.2, rng=rng))
    assert diag.status == "degraded"
    assert verdicts(diag) == {r: "node" if r in (2, 3) else "healthy" for r in range(8)}
    node = diag.nodes[0]
    assert node.name == "n1" and node.verdict == "degraded"
    assert node.fraction == pytest.approx(0.5, abs=0.1)
    assert "node n1 (2 ranks: 2,3)" in diag.summary
    assert diag.links == Links({2: node_round(node.fraction), 3: node_round(node.fraction)})
    table = diag.table()
    assert table.index("n1") < table.index("n0")  # slowest first


def node_round(f: float) -> float:
    return round(f, 2)


def test_one_rail_of_a_node_is_blamed_alone(rng: np.random.Generator) -> None:
    """A rank with its own slow path on an otherwise healthy node (one NIC per GPU):
    the rank is degraded, its node is not."""
    lay = dr.Layout.uniform(12, 3)
    the_plan = dr.plan(lay, size=MiB)
    diag = dr.diagnose(the_plan, synthetic(the_plan, {4: 0.5}, noise=0.1, rng=rng))
    assert diag.flagged == [4] and diag.ranks[4].verdict == "degraded"
    assert {n.name: n.verdict for n in diag.nodes}["n1"] == "ranks"
    assert "rank 4 (node n1, local rank 1)" in diag.summary


def test_a_rank_whose_partners_were_all_as_slow_is_unresolved() -> None:
    """With one partner, rank 0's only measurements are with ranks 1 and 9, as slow as
    itself: the doctor says it cannot tell which end is slow rather than blaming rank 0
    (a slow link all the same: status degraded)."""
    the_plan = dr.plan(dr.Layout.uniform(10), size=MiB, partners=1, repeats=2)
    recs = synthetic(the_plan, {0: 0.5, 1: 0.5, 9: 0.5})
    diag = dr.diagnose(the_plan, recs)
    assert diag.ranks[0].verdict == "unresolved"
    assert diag.ranks[4].verdict == "healthy"
    assert diag.status == "degraded"
    assert "rank 0 (node n0) at 0.50, but every partner was as slow" in diag.summary
    # With the default three partners each of them meets healthy ones: all three found.
    the_plan = dr.plan(dr.Layout.uniform(10), size=MiB, repeats=2)
    diag = dr.diagnose(the_plan, synthetic(the_plan, {0: 0.5, 1: 0.5, 9: 0.5}))
    assert verdicts(diag) == {r: "degraded" if r in (0, 1, 9) else "healthy" for r in range(10)}


def test_a_rank_slow_in_one_direction_only_is_named(rng: np.random.Generator) -> None:
    """A rank whose messages out take twice as long and whose messages in do not (a link
    shaped one way only) is degraded at its slow direction: the doctor rates a rank by
    the smaller of its directions, where the watch's and the probes' estimator
    (:func:`optcc_mpi.linkrates.rank_rates`, the faster) would call it healthy."""
    from optcc_mpi import linkrates

    slow = 3
    the_plan = dr.plan(dr.Layout.uniform(8), size=MiB)
    recs = synthetic(the_plan, {}, noise=0.1, rng=rng)
    for rec in recs:
        rows = rec["rows"]  # (round, sender, seconds)
        rows[rows[:, 1] == slow, 2] *= 2
    diag = dr.diagnose(the_plan, recs)
    assert diag.flagged == [slow] and diag.status == "degraded"
    row = diag.ranks[slow]
    assert row.verdict == "degraded"
    assert row.fraction_egress == pytest.approx(0.5, abs=0.1)
    assert row.fraction_ingress > 0.8
    assert row.fraction == row.fraction_egress
    faster = linkrates.rank_rates(np.array([row.fraction_egress]), np.array([row.fraction_ingress]))
    assert faster[0] > 0.8


def test_noise_alone_is_not_a_degraded_link(rng: np.random.Generator) -> None:
    """Each repeat of every round slowed at random by up to 40% (and one repeat of one
    rank by 60%): the best of the repeats stays above the threshold."""
    the_plan = dr.plan(dr.Layout.uniform(8), size=MiB)
    recs = synthetic(the_plan, {}, noise=0.4, rng=rng)
    first = [i for i, r in enumerate(the_plan.rounds) if r.repeat == 0]
    rows = recs[3]["rows"]
    rows[np.isin(rows[:, 0], first), 2] *= 2.5
    diag = dr.diagnose(the_plan, recs)
    assert diag.status == "healthy", diag.table()
    assert diag.ranks[3].spread[0] < 0.5  # the bad repeat shows in the spread


def test_too_few_nodes_is_inconclusive_without_an_expected_rate() -> None:
    the_plan = dr.plan(dr.Layout.uniform(2), size=MiB)
    recs = synthetic(the_plan, {0: 0.5})
    diag = dr.diagnose(the_plan, recs)
    assert diag.status == "inconclusive" and diag.exit_status == dr.EXIT_INCONCLUSIVE
    assert "--expect" in diag.summary
    judged = dr.diagnose(the_plan, recs, expect=BW)
    assert judged.status == "degraded"
    # Against the expected rate both ends of the slow link measure 0.5, and neither can
    # be told from the other: both unresolved.
    assert [r.fraction for r in judged.ranks] == pytest.approx([0.5, 0.5])
    assert set(verdicts(judged).values()) == {"unresolved"}


def test_an_expected_rate_finds_a_cluster_that_is_slow_everywhere() -> None:
    the_plan = dr.plan(dr.Layout.uniform(4), size=MiB)
    recs = synthetic(the_plan, dict.fromkeys(range(4), 0.6))
    assert dr.diagnose(the_plan, recs).status == "healthy"  # relative: all alike
    diag = dr.diagnose(the_plan, recs, expect=BW)
    assert diag.status == "degraded"
    assert all(r.fraction == pytest.approx(0.6) for r in diag.ranks)
    assert "every link is slow (0.60-0.60)" in diag.summary
    # Nodes of two ranks sharing a NIC: a node's aggregate is judged against the same
    # rate (the NIC's), so healthy nodes are at 1 and the slow one at its fraction.
    the_plan = dr.plan(dr.Layout.uniform(8, 2), size=MiB)
    diag = dr.diagnose(the_plan, synthetic(the_plan, {}, node_truth={3: 0.5}), expect=BW)
    assert [n.fraction for n in diag.nodes] == pytest.approx([0.5, 1, 1, 1])
    assert diag.flagged == [6, 7] and diag.nodes[0].name == "n3"


def test_intra_node_rates_are_reported_and_judged_on_request() -> None:
    lay = dr.Layout.uniform(6, 2)
    the_plan = dr.plan(lay, size=MiB)
    recs = synthetic(the_plan, {})
    intra = [i for i, r in enumerate(the_plan.rounds) if r.phase == "intra"]
    rows = recs[5]["rows"]  # rank 5 receives slowly inside its node
    rows[np.isin(rows[:, 0], intra), 2] *= 4
    diag = dr.diagnose(the_plan, recs)
    assert diag.status == "healthy"
    assert diag.ranks[5].intra_fraction == pytest.approx(0.25)
    judged = dr.diagnose(the_plan, recs, judge_intra=True)
    assert judged.status == "degraded" and judged.flagged == [4, 5]  # both ends of it
    assert {r.verdict for r in judged.ranks if r.rank in (4, 5)} == {"intra"}


def test_diagnosis_json_round_trips_and_plots(tmp_path: Path) -> None:
    lay = dr.Layout.uniform(8, 2)
    the_plan = dr.plan(lay, size=MiB)
    diag = dr.diagnose(the_plan, synthetic(the_plan, {}, node_truth={2: 0.5}))
    data = json.loads(json.dumps(diag.to_dict()))
    assert data["status"] == "degraded" and data["exit_status"] == 3
    assert data["links"] == str(diag.links)
    assert [n["name"] for n in data["nodes"]][0] == "n2"
    assert data["ranks"][4]["verdict"] == "node"
    png = dr.plot(diag, tmp_path / "doctor.png")
    assert png.stat().st_size > 10_000


# ----------------------------------------------------------------------------- the command


def test_help_says_what_it_sends_and_how_long(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_main(["doctor", "--help"])
    text = capsys.readouterr().out
    assert "120 MiB" in text and "0.1 s at 10 Gbit/s" in text
    for status in ("0  healthy", "3  a link is degraded", "4  inconclusive", "2  an error"):
        assert status in text


def test_estimate_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["doctor", "--estimate", "--p", "64", "--bw", "10gbit"]) == 0
    out = capsys.readouterr().out
    assert "64 ranks on 64 nodes; 15 rounds" in out and "120 MiB sent" in out
    assert "simulated at 10 Gbit/s" in out
    assert cli_main(["doctor", "--estimate", "--p", "10", "--ranks-per-node", "4"]) == 2
    assert "not a multiple" in capsys.readouterr().err


def test_bad_arguments_are_refused_before_mpi(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--threshold", "1.5"], ["--repeats", "0"], ["--size", "0"], ["--expect", "x"]):
        with pytest.raises(SystemExit) as exc:
            cli_main(["doctor", *argv])
        assert exc.value.code == 2
    assert "fraction must be in (0, 1]" in capsys.readouterr().err


def test_check_reads_a_verdict_for_one_host(tmp_path: Path, capsys) -> None:
    lay = dr.Layout(("n0", "n1", "n2", "n3"))
    the_plan = dr.plan(lay, size=MiB)
    diag = dr.diagnose(the_plan, synthetic(the_plan, {2: 0.5}))
    path = tmp_path / "d.json"
    path.write_text(json.dumps(diag.to_dict()))
    assert cli_main(["doctor", "--check", str(path), "--host", "n2"]) == dr.EXIT_DEGRADED
    assert "n2: DEGRADED" in capsys.readouterr().out
    assert cli_main(["doctor", "--check", str(path), "--host", "n1"]) == dr.EXIT_HEALTHY
    assert cli_main(["doctor", "--check", str(path), "--host", "elsewhere"]) == 4
    path.write_text("{}")
    assert cli_main(["doctor", "--check", str(path)]) == 2
    assert "not the --json of optcc-mpi doctor" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_command_under_mpiexec_prints_json_alone_and_exits_degraded(tmp_path: Path) -> None:
    """The command as a job: 3 ranks under the library's own launcher, emulated links
    with rank 1 at half rate; `--json -` puts the JSON alone on standard output, the
    plot is drawn, and the exit status says degraded."""
    import subprocess
    import sys

    from optcc_mpi.lab import launch

    png = tmp_path / "d.png"
    cmd = [*launch.launcher_argv(3), sys.executable, "-m", "optcc_mpi", "doctor"]
    cmd += ["--emulate", "bw=50MB/s,degrade=1:0.5", "--size", "1M", "--repeats", "2"]
    cmd += ["--json", "-", "--plot", str(png), "--no-progress"]
    env = {**launch.clean_env(), "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == dr.EXIT_DEGRADED, done.stderr[-2000:]
    data = json.loads(done.stdout)
    assert data["status"] == "degraded" and data["links"].startswith("1:")
    assert "DEGRADED: node" in done.stderr and png.stat().st_size > 10_000


# ------------------------------------------------------------ fewer than 3 nodes, one node


def test_the_header_counts_the_partners_that_ran() -> None:
    """One partner node where only one exists; none, and one inside its node, on a
    single host (the issue's `mpiexec -n 2` on one machine)."""

    def header(lay: dr.Layout, expect: float | None = BW) -> str:
        the_plan = dr.plan(lay, size=MiB)
        return dr.diagnose(the_plan, synthetic(the_plan, {}), expect=expect).header()

    assert "2 ranks on 2 nodes" in header(dr.Layout.uniform(2))
    assert "(1 partner node; 5 repeats)" in header(dr.Layout.uniform(2))
    assert "(3 partner nodes; 5 repeats)" in header(dr.Layout.uniform(8))
    alone = header(dr.Layout(("h", "h")))
    assert "2 ranks on 1 node," in alone
    assert "(no partner node, 1 partner inside its node; 5 repeats)" in alone


def test_a_node_alone_is_unmeasured_not_healthy() -> None:
    the_plan = dr.plan(dr.Layout(("h", "h", "h")), size=MiB)
    diag = dr.diagnose(the_plan, synthetic(the_plan, {}))
    assert set(verdicts(diag).values()) == {"unmeasured"} and diag.nodes[0].verdict == "unmeasured"
    assert diag.status == "inconclusive" and diag.exit_status == dr.EXIT_INCONCLUSIVE
    assert diag.flagged == [] and diag.links.healthy
    assert diag.summary.startswith("INCONCLUSIVE: 1 node (h, 3 ranks): no link between nodes")
    assert "--emulate" in diag.summary and "\n" not in diag.summary
    assert "UNMEASURED" in diag.table() and "healthy" not in diag.table().split("\n", 2)[2]
    # With --judge-intra the intra-node paths are still judged (against their median).
    recs = synthetic(the_plan, {})
    rows = recs[2]["rows"]
    rows[:, 2] *= 4
    judged = dr.diagnose(the_plan, recs, judge_intra=True)
    assert verdicts(judged)[2] == "intra" and judged.status == "degraded"


def test_two_nodes_with_nothing_to_judge_against_say_what_to_pass_in_one_line() -> None:
    the_plan = dr.plan(dr.Layout.uniform(2), size=MiB)
    diag = dr.diagnose(the_plan, synthetic(the_plan, {1: 0.5}))
    assert set(verdicts(diag).values()) == {"unjudged"}
    assert diag.status == "inconclusive" and diag.exit_status == dr.EXIT_INCONCLUSIVE
    assert diag.reference_source == "none"
    assert "\n" not in diag.summary and diag.summary.startswith("INCONCLUSIVE: 2 nodes")
    assert "--expect RATE" in diag.summary and "--baseline FILE" in diag.summary
    # No fraction of the median of two links, which would read as a verdict.
    assert all(r.fraction != r.fraction for r in diag.ranks)  # NaN
    assert diag.ranks[0].egress == pytest.approx(BW / 2)  # the rates are still shown


def test_two_nodes_against_an_expected_rate() -> None:
    """Judged healthy or degraded against the rate; a slow link's end cannot be told from
    the messages (both cross both ends): both unresolved, the link named, exit 3."""
    the_plan = dr.plan(dr.Layout.uniform(2), size=MiB)
    fine = dr.diagnose(the_plan, synthetic(the_plan, {}), expect=BW, source="the emulated rate")
    assert fine.status == "healthy" and fine.exit_status == dr.EXIT_HEALTHY
    assert "(the emulated rate)" in fine.summary
    diag = dr.diagnose(the_plan, synthetic(the_plan, {1: 0.5}), expect=BW, source="--expect")
    assert set(verdicts(diag).values()) == {"unresolved"}
    assert diag.status == "degraded" and diag.exit_status == dr.EXIT_DEGRADED
    assert diag.summary.startswith("DEGRADED: the link between node n0 (rank 0) and node n1")
    assert "which end is slow cannot be measured" in diag.summary and "\n" not in diag.summary


@pytest.mark.parametrize("slow", [0, 1])
def test_two_nodes_the_interfaces_reported_speeds_name_the_slow_end(slow: int) -> None:
    """One interface reporting less than the other's (a link that came up at a lower
    speed) is the end named; the other end is healthy, held back only by it."""
    the_plan = dr.plan(dr.Layout.uniform(2), size=MiB)
    speeds = [BW, BW]
    speeds[slow] = BW / 2
    ref, source = reference(2, speeds=speeds, ifaces=["eth1", "eth1"])
    assert ref == BW and source == "the speed eth1 reports"
    diag = dr.diagnose(
        the_plan, synthetic(the_plan, {slow: 0.5}), expect=ref, source=source,
        speeds=speeds, ifaces=["eth1", "eth1"],
    )  # fmt: skip
    assert verdicts(diag) == {slow: "degraded", 1 - slow: "healthy"}
    assert diag.flagged == [slow] and diag.exit_status == dr.EXIT_DEGRADED
    assert f"node n{slow} (rank {slow}) at 0.50" in diag.summary
    assert "eth1 reports 200 Mbit/s" in diag.summary
    assert diag.to_dict()["nodes"][0]["reported"] in (BW / 2, BW)


def test_where_the_expected_rate_comes_from() -> None:
    speeds, names = [BW, 2 * BW], ["eth0", "eth0"]
    assert reference(5) == (None, "median")
    assert reference(5, speeds=speeds, baseline=3.0) == (None, "median")
    assert reference(5, expect=7.0) == (7.0, "--expect")
    assert reference(2, expect=7.0, emulated=9.0, speeds=speeds) == (7.0, "--expect")
    assert reference(2, emulated=9.0, speeds=speeds) == (9.0, "the emulated rate")
    assert reference(2, speeds=speeds, ifaces=names, baseline=3.0)[0] == 2 * BW
    # Every node must report a speed; else the baseline, else nothing.
    assert reference(2, speeds=[BW, np.nan], baseline=3.0) == (3.0, "an earlier healthy record")
    assert reference(2, speeds=[BW, np.nan]) == (None, "none")


def test_interface_speed_reads_what_a_physical_device_reports(tmp_path: Path) -> None:
    net = tmp_path / "sys/class/net"
    for name, speed, physical in (("eth0", "10000", True), ("veth1", "10000", False),
                                  ("eth2", "-1", True), ("ib0", "100000", True)):  # fmt: skip
        (net / name).mkdir(parents=True)
        (net / name / "speed").write_text(speed + "\n")
        if physical:
            (net / name / "device").mkdir()
    (tmp_path / "proc/net").mkdir(parents=True)
    route = "Iface\tDestination\tGateway\nib0\t000200C0\t0\neth0\t00000000\t010200C0\n"
    (tmp_path / "proc/net/route").write_text(route)

    def speed(**kw: object) -> tuple:
        return dr.interface_speed(root=tmp_path, **kw)  # type: ignore[arg-type]

    assert speed(env={}) == ("eth0", 10e9 / 8)  # the default route's
    assert speed(env={"GLOO_SOCKET_IFNAME": "ib0"}) == ("ib0", 100e9 / 8)
    assert speed(env={"UCX_NET_DEVICES": "mlx5_0:1", "OMPI_MCA_btl_tcp_if_include": "ib0"}) == (
        "ib0", 100e9 / 8,
    )  # fmt: skip
    assert speed(env={"NCCL_SOCKET_IFNAME": "^lo"})[0] == "eth0"  # an exclusion names none
    name, rate = speed(iface="veth1", env={})  # virtual: its figure means nothing
    assert name == "veth1" and rate != rate
    assert speed(iface="eth2", env={})[1] != speed(iface="eth2", env={})[1]  # -1: none
    assert speed(iface="nothere", env={})[0] == "nothere"


def test_baseline_is_an_earlier_healthy_run(tmp_path: Path) -> None:
    the_plan = dr.plan(dr.Layout.uniform(4), size=MiB)
    healthy = dr.diagnose(the_plan, synthetic(the_plan, {}))
    path = tmp_path / "h.json"
    path.write_text(json.dumps(healthy.to_dict()))
    assert dr.baseline_rate(path) == pytest.approx(BW, rel=1e-5)
    bad = dr.diagnose(the_plan, synthetic(the_plan, {1: 0.5}))
    path.write_text(json.dumps(bad.to_dict()))
    with pytest.raises(ArgumentError, match="that run was degraded, not healthy"):
        dr.baseline_rate(path)
    with pytest.raises(ArgumentError, match="no such file"):
        dr.baseline_rate(tmp_path / "none.json")
    path.write_text("{}")
    with pytest.raises(ArgumentError, match="not a doctor's --json"):
        dr.baseline_rate(path)


# ------------------------------------------------------------------- the command's words


def test_check_reports_each_verdict_as_it_is(tmp_path: Path, capsys) -> None:
    """--check: named degraded 3, healthy 0; unresolved, unmeasured, unjudged and a host
    not in the file 4 (neither named nor cleared), each said as such."""
    path = tmp_path / "d.json"

    def check(diag: dr.Diagnosis, host: str) -> tuple[int, str]:
        path.write_text(json.dumps(diag.to_dict()))
        status = cli_main(["doctor", "--check", str(path), "--host", host])
        return status, capsys.readouterr().out

    two = dr.plan(dr.Layout.uniform(2), size=MiB)
    unresolved = dr.diagnose(two, synthetic(two, {1: 0.5}), expect=BW)
    status, out = check(unresolved, "n0")
    assert status == dr.EXIT_INCONCLUSIVE and out.startswith("n0: UNRESOLVED (rank 0 unresolved")
    status, out = check(dr.diagnose(two, synthetic(two, {1: 0.5})), "n1")
    assert status == dr.EXIT_INCONCLUSIVE and out.startswith("n1: UNJUDGED")
    alone = dr.plan(dr.Layout(("h", "h")), size=MiB)
    status, out = check(dr.diagnose(alone, synthetic(alone, {})), "h")
    assert status == dr.EXIT_INCONCLUSIVE and out.startswith("h: UNMEASURED")
    four = dr.plan(dr.Layout.uniform(4), size=MiB)
    degraded = dr.diagnose(four, synthetic(four, {2: 0.5}))
    assert check(degraded, "n2")[0] == dr.EXIT_DEGRADED
    assert check(degraded, "n1") == (dr.EXIT_HEALTHY, f"n1: healthy in {path} (1 ranks)\n")
    # A record written before "unmeasured" existed called such ranks healthy.
    data = dr.diagnose(alone, synthetic(alone, {})).to_dict()
    for r in data["ranks"]:
        r["verdict"] = "healthy"
    path.write_text(json.dumps(data))
    assert cli_main(["doctor", "--check", str(path), "--host", "h"]) == dr.EXIT_INCONCLUSIVE


def test_help_docs_and_code_agree_on_every_exit_status(capsys) -> None:
    with pytest.raises(SystemExit):
        cli_main(["doctor", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    docs = (Path(__file__).resolve().parents[1] / "docs" / "doctor.md").read_text()
    for table in (dr.EXIT_STATUSES, dr.CHECK_STATUSES):
        for code, meaning in table.items():
            assert f"{code} {meaning}" in text, meaning
            assert f"| {code} | {meaning} |" in docs, meaning
    for name, meaning in dr.RANK_VERDICTS.items():
        assert f"{name} {meaning}" in text
        assert f"| `{name}` | {meaning} |" in docs, name
    # What the code returns for each status is the table's.
    assert {dr.EXIT_HEALTHY, dr.EXIT_ERROR, dr.EXIT_DEGRADED, dr.EXIT_INCONCLUSIVE} == set(
        dr.EXIT_STATUSES
    )


def test_rates_need_a_unit(capsys) -> None:
    for argv in (["--expect", "100"], ["--estimate", "--bw", "10"]):
        with pytest.raises(SystemExit) as exc:
            cli_main(["doctor", *argv])
        assert exc.value.code == 2
        assert "has no unit; a rate needs one" in capsys.readouterr().err
    assert cli_main(["doctor", "--estimate", "--p", "8", "--bw", "100gbit"]) == 0


def _alone(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    from optcc_mpi.lab import launch

    cmd = [sys.executable, "-m", "optcc_mpi", "doctor", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env={**launch.clean_env(), **env}
    )


@pytest.mark.timeout(300)
def test_a_world_of_one_is_named_with_what_to_run_instead() -> None:
    """No launcher: exit 2 and the launchers to use. srun without --mpi (SLURM_NTASKS=4,
    each task an MPI job of one): named as such, and said once (by task 0)."""
    plain = _alone({})
    assert plain.returncode == dr.EXIT_ERROR
    assert plain.stderr.count("error: 1 rank: no link to measure") == 1, plain.stderr
    assert "srun --mpi=pmi2" in plain.stderr and "--emulate" in plain.stderr
    srun = _alone({"SLURM_NTASKS": "4", "SLURM_PROCID": "0"})
    assert srun.returncode == dr.EXIT_ERROR
    assert "srun started 4 tasks (SLURM_NTASKS=4), but each is an MPI job of one" in srun.stderr
    other = _alone({"SLURM_NTASKS": "4", "SLURM_PROCID": "2"})
    assert other.returncode == dr.EXIT_ERROR and other.stderr == ""


@pytest.mark.timeout(300)
def test_two_ranks_output_checked_first_then_judged_against_the_emulated_rate(
    tmp_path: Path,
) -> None:
    """At 2 ranks: an output path that cannot be written fails before anything is
    measured (once, exit 2); then the issue's case, rank 1 at half of the emulated rate:
    judged against that rate, the link between the two degraded, exit 3."""
    from optcc_mpi.lab import launch

    env = {**launch.clean_env(), "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1"}
    cmd = [*launch.launcher_argv(2), sys.executable, "-m", "optcc_mpi", "doctor", "--no-progress"]
    cmd += ["--emulate", "bw=50MB/s,degrade=1:0.5", "--size", "1M", "--repeats", "2"]
    bad = subprocess.run(
        [*cmd, "--json", str(tmp_path / "no" / "d.json")], capture_output=True, text=True,
        timeout=240, env=env,
    )  # fmt: skip
    assert bad.returncode == dr.EXIT_ERROR, bad.stderr
    assert bad.stderr.count("--json") == 1 and "nothing measured" in bad.stderr
    assert "rounds" not in bad.stdout
    out = tmp_path / "d.json"
    done = subprocess.run(
        [*cmd, "--json", str(out)], capture_output=True, text=True, timeout=240, env=env
    )
    assert done.returncode == dr.EXIT_DEGRADED, done.stdout + done.stderr
    data = json.loads(out.read_text())
    assert data["reference_source"] == "the emulated rate" and data["node_partners"] == 1
    assert {r["verdict"] for r in data["ranks"]} == {"unresolved"}
    assert "DEGRADED: the link between node" in done.stdout
    assert "(1 partner node; 2 repeats)" in done.stdout


def test_the_job_script_defaults_to_enough_nodes_for_an_answer() -> None:
    """jobs/doctor.sbatch as submitted without -N: one task on each of 3 nodes, the
    fewest whose median names a slow one (and 3 ranks by hand, without Slurm); at that
    layout a half-rate node is named and a healthy one cleared."""
    import re

    text = (Path(__file__).resolve().parents[1] / "jobs" / "doctor.sbatch").read_text()
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", text, re.M).group(1))
    per_node = int(re.search(r"^#SBATCH --ntasks-per-node=(\d+)$", text, re.M).group(1))
    by_hand = int(re.search(r"OPTCC_RANKS:-(\d+)", text).group(1))
    assert nodes >= 3 and per_node == 1 and by_hand >= 3
    the_plan = dr.plan(dr.Layout.uniform(nodes), size=MiB)
    assert dr.diagnose(the_plan, synthetic(the_plan, {})).exit_status == dr.EXIT_HEALTHY
    named = dr.diagnose(the_plan, synthetic(the_plan, {nodes - 1: 0.5}))
    assert named.exit_status == dr.EXIT_DEGRADED and named.flagged == [nodes - 1]
