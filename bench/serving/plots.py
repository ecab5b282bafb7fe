"""PNG plots of serving sweeps (matplotlib, Agg backend, small files for docs/benchmarks/img/)."""
from __future__ import annotations

import math

MARKERS = {"disaggregated": "o", "colocated": "s", "colocated-chunked": "^", "server": "o"}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _finite(xs: list, ys: list) -> tuple[list, list]:
    pairs = [(x, y) for x, y in zip(xs, ys) if y is not None and not (isinstance(y, float) and math.isnan(y))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _save(plt, fig, path: str, title: str) -> str:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_latency_sweep(points: dict[str, list[dict]], variable: str, path: str, title: str) -> str:
    """TTFT and TPOT (p50 solid, p99 dashed) against the swept variable, one line per variant."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), dpi=80)
    for ax, metric, label in ((axes[0], "ttft", "TTFT (ms)"), (axes[1], "tpot", "TPOT (ms)")):
        for color, (variant, rows) in enumerate(points.items()):
            xs = [r["x"] for r in rows]
            for p, style in (("p50", "-"), ("p99", "--")):
                x, y = _finite(xs, [r[f"{metric}_{p}_s"] * 1e3 if r[f"{metric}_{p}_s"] is not None else None
                                    for r in rows])
                ax.plot(x, y, style, color=f"C{color}", marker=MARKERS.get(variant, "o"), markersize=4,
                        label=f"{variant} {p}")
        ax.set_xlabel(variable)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if variable == "concurrency":
            ax.set_xscale("log", base=2)
    axes[1].legend(fontsize=7)
    return _save(plt, fig, path, title)


def plot_slo_attainment(points: dict[str, list[dict]], path: str, title: str) -> str:
    """SLO attainment (%) and goodput against the offered request rate, one line per variant."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), dpi=80)
    for variant, rows in points.items():
        xs = [r["x"] for r in rows]
        m = MARKERS.get(variant, "o")
        axes[0].plot(*_finite(xs, [r["slo_attainment"] * 100 for r in rows]), marker=m, markersize=4, label=variant)
        axes[1].plot(*_finite(xs, [r["goodput_rps"] for r in rows]), marker=m, markersize=4, label=variant)
    axes[0].axhline(90, color="grey", linewidth=0.8, linestyle=":")
    axes[0].set_ylabel("SLO attainment (%)")
    axes[1].set_ylabel("goodput (req/s)")
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return _save(plt, fig, path, title)


def plot_phases(roles: list[dict], attainment: list[tuple[float, float]], shifts: list[float], path: str,
                title: str) -> str:
    """Actors per role (steps) and SLO attainment per window (by send time) over the run; dotted lines
    where the workload shifts."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(8, 4.4), dpi=80, sharex=True)
    ts = [r["t"] for r in roles]
    for role in ("prefill", "decode", "colocated"):
        if any(r[role] for r in roles):
            axes[0].step(ts, [r[role] for r in roles], where="post", label=role)
    axes[0].set_ylabel("actors")
    axes[0].legend(fontsize=7)
    axes[1].plot([t for t, _ in attainment], [a * 100 for _, a in attainment], marker="o", markersize=3)
    axes[1].set_ylabel("SLO attainment (%)")
    axes[1].set_xlabel("time (s)")
    for ax in axes:
        for t in shifts:
            ax.axvline(t, color="grey", linewidth=0.8, linestyle=":")
        ax.grid(alpha=0.3)
    return _save(plt, fig, path, title)
