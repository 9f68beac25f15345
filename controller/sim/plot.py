"""PNG plots of simulation runs (`phalanx simulate --plot DIR`): ETTR over time, losses by cause, a sweep."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from controller.sim import report
from controller.sim.engine import CAUSES
from phalanx.errors import ConfigError


def write(runs: list[tuple[str, dict[str, Any]]], directory: str | Path) -> list[Path]:
    """One PNG per view of `runs` (name, results) in `directory`; the paths written. Raises ConfigError when
    matplotlib is missing or the directory cannot be written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install matplotlib (or phalanx[plot])") from None
    out = Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--plot {directory}: cannot create the directory: {e.strerror}") from None
    s = runs[0][1]["scenario"]
    title = f"{s['gpus']:,} GPUs, {report.shapes_text(s)}, {s['days']:g} days"
    paths = []

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for name, r in runs:
        days = [0.0] + [p[0] for p in r["timeline"]]
        ettr = [0.0] + [p[1] * 100 for p in r["timeline"]]
        ax.plot(days[1:], ettr[1:], label=f"{name} ({r['ettr'] * 100:.1f} %)")
    ax.set(xlabel="day", ylabel="ETTR so far (%)", title=f"ETTR over time: {title}")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out / "ettr_over_time.png", plt))

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    width = 0.8 / len(runs)
    for i, (name, r) in enumerate(runs):
        xs = [k + i * width for k in range(len(CAUSES))]
        ax.bar(xs, [r["gpu_hours_lost"][c] for c in CAUSES], width, label=name)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(CAUSES))], CAUSES)
    ax.set(ylabel="GPU-hours lost", title=f"Losses by cause: {title}")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    paths.append(_save(fig, out / "losses_by_cause.png", plt))

    if len(runs) > 1:
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
        names = [name for name, _ in runs]
        values = [r["ettr"] * 100 for _, r in runs]
        bars = ax.bar(names, values)
        ax.bar_label(bars, [f"{v:.1f} %" for v in values])
        ax.set(ylabel="ETTR (%)", ylim=(min(values) * 0.95, 100), title=f"ETTR by run: {title}")
        ax.grid(alpha=0.3, axis="y")
        paths.append(_save(fig, out / "sweep.png", plt))
    return paths


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        raise ConfigError(f"--plot: cannot write {path}: {e.strerror}") from None
    finally:
        plt.close(fig)
    return path
