"""The doctor's figure (:func:`plot`): every rank's egress and ingress fraction, the
threshold and the verdicts of a :class:`~optcc_mpi.doctor.diagnosis.Diagnosis`. Needs
matplotlib (imported when called).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from optcc_mpi.doctor.diagnosis import Diagnosis, Verdict

__all__ = ["plot"]


def plot(diag: Diagnosis, path: str | Path) -> Path:
    """Draw ``diag``: every rank's egress and ingress fraction, the threshold and the
    verdicts; nodes' aggregate fractions beside them where nodes hold several ranks.
    Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    multi = any(len(n.ranks) > 1 for n in diag.nodes)
    fig, axes = plt.subplots(
        1, 2 if multi else 1, figsize=(11 if multi else 8, 4.2), squeeze=False,
        gridspec_kw={"width_ratios": [3, 1]} if multi else None,
    )  # fmt: skip
    ax = axes[0][0]
    order = [r for node in diag.nodes for r in sorted(node.ranks)]
    by_rank = {r.rank: r for r in diag.ranks}
    x = np.arange(len(order))
    fe = [by_rank[r].fraction_egress for r in order]
    fi = [by_rank[r].fraction_ingress for r in order]
    colors = {
        "healthy": "tab:green",
        "degraded": "tab:red",
        "node": "tab:red",
        "intra": "tab:orange",
        "unresolved": "tab:gray",
        "unjudged": "tab:blue",
        "unmeasured": "0.85",
    }
    col = [colors.get(by_rank[r].verdict, "tab:gray") for r in order]
    ax.bar(x - 0.2, np.nan_to_num(fe), 0.4, color=col, alpha=0.9, label="egress")
    ax.bar(x + 0.2, np.nan_to_num(fi), 0.4, color=col, alpha=0.5, hatch="//", label="ingress")
    ax.axhline(diag.healthy_above, color="k", ls="--", lw=1)
    ax.set_xticks(x)
    ax.set_xticklabels([f"{r}\n{by_rank[r].node}" for r in order], fontsize=7)
    ax.set_ylim(0, 1.1)
    ax.set_ylabel(f"fraction of the {diag.reference}")
    ax.set_title(f"{diag.status.upper()}: rank links (one flow per NIC)")
    for xi, r in zip(x, order):
        v = by_rank[r].verdict
        if v != Verdict.HEALTHY:
            ax.annotate(v, (xi, 0.02), ha="center", fontsize=7, rotation=90, color="w")
    from matplotlib.patches import Patch

    handles = [
        Patch(facecolor="0.5", label="egress"),
        Patch(facecolor="0.8", hatch="//", label="ingress"),
        *(Patch(facecolor=c, label=v) for v, c in colors.items() if v != Verdict.NODE),
        plt.Line2D([], [], color="k", ls="--", label=f"threshold {diag.healthy_above:.2f}"),
    ]
    ax.legend(handles=handles, fontsize=7, loc="lower right", ncol=2)
    if multi:
        ax2 = axes[0][1]
        names = [n.name for n in diag.nodes]
        # A node whose link is fine but some of whose ranks' own paths are not: purple.
        ncol = [
            colors.get(n.verdict, "tab:gray") if n.verdict != Verdict.RANKS else "tab:purple"
            for n in diag.nodes
        ]
        xn = np.arange(len(names))
        ax2.bar(xn - 0.2, np.nan_to_num([n.fraction_egress for n in diag.nodes]), 0.4, color=ncol)
        ax2.bar(
            xn + 0.2,
            np.nan_to_num([n.fraction_ingress for n in diag.nodes]),
            0.4,
            color=ncol,
            alpha=0.5,
            hatch="//",
        )
        ax2.axhline(diag.healthy_above, color="k", ls="--", lw=1)
        ax2.set_xticks(xn)
        ax2.set_xticklabels(names, fontsize=7, rotation=45)
        ax2.set_ylim(0, 1.1)
        ax2.set_title("nodes (all ranks at once)")
        if any(n.verdict == Verdict.RANKS for n in diag.nodes):
            ax2.legend(
                handles=[Patch(facecolor="tab:purple", label="some ranks degraded")],
                fontsize=7,
                loc="lower right",
            )
    fig.suptitle(
        diag.summary if len(diag.summary) < 140 else diag.summary[:137] + "...", fontsize=8
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
