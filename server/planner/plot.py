"""Time-versus-dollars plot of the scored candidates with the Pareto front (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

from boinc_dl.server.planner.search import Scored, pareto


def plot_plan(path: Path | str, scored: list[Scored], chosen: Scored | None, title: str,
              deadline_s: float | None = None, budget: float | None = None) -> Path:
    """Write a PNG: every candidate, its Pareto front, the goal's line and the choice."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for market, colour in (("spot", "tab:blue"), ("on-demand", "tab:orange")):
        pts = [s for s in scored if s.cand.market == market]
        if pts:
            ax.scatter([s.hours for s in pts], [s.dollars for s in pts], s=8, alpha=0.35, c=colour, label=market)
    front = pareto(scored)
    ax.plot([s.hours for s in front], [s.dollars for s in front], "k-", lw=1.2, label="Pareto front")
    if deadline_s is not None:
        ax.axvline(deadline_s / 3600, color="tab:red", ls="--", lw=1, label="deadline")
    if budget is not None:
        ax.axhline(budget, color="tab:red", ls="--", lw=1, label="budget")
    if chosen is not None:
        ax.scatter([chosen.hours], [chosen.dollars], marker="*", s=180, c="tab:red", zorder=5, label="recommended")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted job time (h)")
    ax.set_ylabel("predicted cost (USD)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out
