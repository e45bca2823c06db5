"""Plots of the GLM lab: the projected speedup against P (:mod:`optcc_mpi.lab.glm_projection`).

matplotlib is imported when a plot is drawn, not with this module.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from .glm_measure import bw_text
from .glm_projection import Projection

__all__ = ["plot_projection"]


def plot_projection(projections: Sequence[Projection], path: str | os.PathLike, title: str) -> None:
    """Speedup against P, one line per solver and network, log-log; saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = ["-", "--", ":", "-."]
    for i, proj in enumerate(projections):
        net = f"{proj.latency * 1e6:g} us, {bw_text(proj.bw)}"
        for j, (label, sp) in enumerate(proj.speedup.items()):
            ax.plot(
                proj.p_values,
                sp,
                styles[i % len(styles)],
                marker="os^v"[j % 4],
                color=f"C{j}",
                label=f"{label} ({net})",
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks P (columns split over P; strong scaling)")
    ax.set_ylabel("speedup over fp32 SGD on 1 rank")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
