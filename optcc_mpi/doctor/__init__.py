"""Which node's link is slow? A bounded, repeated measurement of every link, and a verdict.

:func:`doctor` measures the send (egress) and receive (ingress) rate of every rank's and
every node's link and says which are degraded, relative to the median link (or to an
expected rate). ``optcc-mpi doctor`` is its command-line face; docs/doctor.md its guide.

Modules
-------
``rounds``      which ranks share a node (:class:`Layout`), who sends to whom in every
                round (:func:`plan`), and how long that takes (:func:`estimate`)
``expected``    the rate a link is judged against where the median cannot say: the
                interface's reported speed, an earlier healthy record
``diagnosis``   the verdicts from every rank's timings (:func:`diagnose`): the estimator,
                :class:`Diagnosis` with its table and summary, the exit statuses
``run``         :func:`doctor`: agree, measure, gather, judge, log (the only module that
                communicates)
``figure``      :func:`plot`, the figure of a diagnosis (matplotlib)

The names below are the doctor's public API, defined in those modules.
"""

from __future__ import annotations

from optcc_mpi.doctor.diagnosis import (
    CHECK_STATUSES,
    EXIT_DEGRADED,
    EXIT_ERROR,
    EXIT_HEALTHY,
    EXIT_INCONCLUSIVE,
    EXIT_STATUSES,
    RANK_VERDICTS,
    Diagnosis,
    NodeRow,
    RankRow,
    diagnose,
)
from optcc_mpi.doctor.expected import baseline_rate, interface_speed
from optcc_mpi.doctor.figure import plot
from optcc_mpi.doctor.rounds import (
    DEFAULT_PARTNERS,
    DEFAULT_REPEATS,
    DEFAULT_SIZE,
    Layout,
    Round,
    RoundPlan,
    estimate,
    plan,
)
from optcc_mpi.doctor.run import doctor

__all__ = [
    "DEFAULT_SIZE",
    "DEFAULT_PARTNERS",
    "DEFAULT_REPEATS",
    "EXIT_HEALTHY",
    "EXIT_ERROR",
    "EXIT_DEGRADED",
    "EXIT_INCONCLUSIVE",
    "EXIT_STATUSES",
    "CHECK_STATUSES",
    "RANK_VERDICTS",
    "interface_speed",
    "baseline_rate",
    "Layout",
    "Round",
    "RoundPlan",
    "RankRow",
    "NodeRow",
    "Diagnosis",
    "plan",
    "estimate",
    "diagnose",
    "doctor",
    "plot",
]
