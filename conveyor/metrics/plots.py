"""PNG plots of a finished (or running) run, from the files it wrote: `conveyor plot RUN_DIR`.

Reads `run_dir/metrics.jsonl` (the `jsonl` tracker) and, when present,
`run_dir/moe_expert_load.jsonl` (one `{"step", "num_experts", "counts":
[[count per expert] per layer]}` per line), and draws:

- `reward.png`: exact-match accuracy (held-out validation drawn bold over the
  training batch's), then the reward mean;
- `losses.png`: policy loss, value loss, KL loss; a distilling run's `distill/loss` first, and no policy loss
  when it distilled without task rewards (`distillation.distillation_loss.use_task_rewards=false`, read from
  the run's config.yaml: its `actor/pg_loss` is logged but trains nothing);
- `kl_entropy.png`: the KL metrics and the policy entropy;
- `response_length.png`: mean length with its min/max band; clip ratio;
- `throughput.png`: tokens/s; time per stage stacked, with the step time;
- `moe_ep_tokens.png` (under expert parallelism): per MoE layer, the most
  tokens an EP rank received over the mean across the EP group;
- `moe_router.png`: per MoE layer over the steps, the rollout's near-tie share
  (`rollout/moe/near_tie/layer_i`) and the trainer's top-k flip rate
  (`actor/moe/flip_rate/layer_i`);
- `moe_expert_load.png`: layers x experts heatmap of the latest record;
- `moe_expert_load_over_time.png`: experts x steps for the most imbalanced layer.

Per-step series are noisy (one batch each), so each is drawn as an
exponential moving average (`ema_smooth`) over its raw values, which stay
faint behind it. A min..max band is drawn only at the steps where it moves: a
bound that sits at one value for most of the run (the reward's 0 and 1 in a
binary task) says nothing there and would only stretch the axis, so the band
is drawn where a bound leaves that value, and one step with `reward/min` 0
does not draw a 0..1 band over the whole run. A
KL series that is float noise around 0 (an on-policy update) is left out.
A panel whose metrics were never logged is left out, and a figure with no
panels is not written. Drawing goes through matplotlib's object API on the Agg
canvas, so it never touches pyplot's global state or needs a display. This
module does not read TensorBoard, W&B or MLflow stores.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from conveyor.files import make_dir, read_jsonl_objects
from conveyor.metrics.trackers import read_metrics_jsonl

logger = logging.getLogger(__name__)

__all__ = [
    "plot_run",
    "ema_smooth",
    "read_moe_expert_load",
    "relative_expert_load",
    "most_imbalanced_layer",
    "FIG_WIDTH_IN",
    "PANEL_HEIGHT_IN",
    "DPI",
]

FIG_WIDTH_IN = 10.0
PANEL_HEIGHT_IN = 3.2
DPI = 100

# Reward metric families, first present wins (the trainer's name, then verl's).
_REWARD_PREFIXES = ("reward", "critic/score", "critic/rewards")
_LOSS_KEYS = (("actor/pg_loss", "policy loss"), ("critic/vf_loss", "value loss"), ("actor/kl_loss", "KL loss"))
_DISTILL_LOSS = ("distill/loss", "distillation loss")
_VAL_ACC = re.compile(r"^val[^/]*/.*acc", re.IGNORECASE)
# Below this a KL value is float rounding, not a divergence (an on-policy ratio is exactly 1).
_KL_NOISE = 1e-6
# Series shorter than this are drawn as they are, with markers: there is nothing to smooth.
_SMOOTH_MIN_POINTS = 20
_VAL_COLOR = "black"
# Heatmaps with at most this many cells get their values written in.
_ANNOTATE_MAX_CELLS = 128

Panel = Callable[[Any], None]


# --------------------------------------------------------------------------- reading


_MAX_PLOTTED = 1e100
"""The largest magnitude a metric may have to be drawn."""


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the records that hold a number for `key`."""
    steps, values = [], []
    for r in records:
        v = r.get(key)
        # A finite value beyond _MAX_PLOTTED makes an axis' span overflow a double, and matplotlib fails the
        # whole figure; it is left out (NaN and inf stay: they draw as gaps).
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not _MAX_PLOTTED < abs(v) < math.inf:
            steps.append(r["step"])
            values.append(float(v))
    return np.asarray(steps, dtype=float), np.asarray(values, dtype=float)


def _has(records: Sequence[dict[str, Any]], key: str) -> bool:
    return _series(records, key)[0].size > 0


def _all_keys(records: Sequence[dict[str, Any]]) -> list[str]:
    keys: set[str] = set()
    for r in records:
        keys.update(r)
    keys.discard("step")
    return sorted(keys)


def read_moe_expert_load(path: str | Path) -> list[dict[str, Any]]:
    """Records of a `moe_expert_load.jsonl` sorted by step (last wins per step), counts as (layers, experts) arrays."""
    path = Path(path)
    by_step: dict[int, dict[str, Any]] = {}
    for lineno, rec in read_jsonl_objects(path, "expert-load file"):
        try:
            step, num_experts = int(rec["step"]), int(rec["num_experts"])
            counts = np.asarray(rec["counts"], dtype=float)
        except (KeyError, TypeError, ValueError, OverflowError) as err:
            logger.warning("%s:%d is not a valid expert-load record (%s); skipped", path, lineno, err)
            continue
        if counts.ndim != 2 or counts.shape[1] != num_experts or not 0 <= step < 2**53:
            logger.warning(
                "%s:%d counts have shape %s, expected (layers, %d), or its step is out of range; skipped",
                path,
                lineno,
                counts.shape,
                num_experts,
            )
            continue
        by_step[step] = {"step": step, "num_experts": num_experts, "counts": counts}
    return [by_step[s] for s in sorted(by_step)]


def relative_expert_load(counts: np.ndarray) -> np.ndarray:
    """counts: (L, E) -> load relative to an even split per layer (1 = balanced); NaN for empty layers."""
    totals = counts.sum(axis=-1, keepdims=True)
    even = totals / counts.shape[-1]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(even > 0, counts / np.where(even > 0, even, 1.0), np.nan)


def most_imbalanced_layer(counts: np.ndarray) -> int | None:
    """counts: (L, E) -> the layer whose busiest expert is furthest above an even share (max_vio); None if all empty."""
    rel = relative_expert_load(np.asarray(counts, dtype=float))
    busiest = np.where(np.isfinite(rel), rel, -np.inf).max(axis=1)
    if not np.isfinite(busiest).any():
        return None
    return int(np.argmax(busiest))


# --------------------------------------------------------------------------- drawing


def _figure(n_panels: int, height_in: float | None = None):
    """A Figure on an Agg canvas with `n_panels` stacked axes sharing the step axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(FIG_WIDTH_IN, height_in or PANEL_HEIGHT_IN * n_panels), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(n_panels, 1, sharex=True, squeeze=False)[:, 0]
    return fig, axes


def _save_panels(path: Path, title: str, panels: list[Panel]) -> Path | None:
    """Draw each panel on its own axes and save; nothing is written when there are no panels."""
    if not panels:
        return None
    fig, axes = _figure(len(panels))
    fig.suptitle(title)
    for panel, ax in zip(panels, axes):
        panel(ax)
        ax.grid(True, alpha=0.3)
        if ax.get_legend() is None and ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize="small")
    axes[-1].set_xlabel("step")
    fig.savefig(path)
    return path


def ema_smooth(values: Sequence[float], span: float | None = None) -> np.ndarray:
    """Exponential moving average of `values` (debiased, NaNs skipped); `span` points, default 1/50 of the series."""
    x = np.asarray(values, dtype=float)
    if span is None:
        span = max(1.0, x.size / 50)
    if span <= 1 or x.size == 0:
        return x.copy()
    weight = 1.0 - 2.0 / (span + 1.0)
    out = np.empty_like(x)
    acc, norm = 0.0, 0.0
    for i, v in enumerate(x):
        if math.isfinite(v):
            # Dividing by the accumulated weight removes the pull towards 0 at the start.
            acc = weight * acc + (1 - weight) * v
            norm = weight * norm + (1 - weight)
        out[i] = acc / norm if norm > 0 else np.nan
    return out


def _smoothed(ax, steps: np.ndarray, values: np.ndarray, label: str, color: Any = None, zorder: float = 2) -> Any:
    """The raw series faint, its EMA on top in the same colour (a short series as points); returns the line's colour."""
    if steps.size < _SMOOTH_MIN_POINTS:
        (line,) = ax.plot(steps, values, marker="o", markersize=3, color=color, label=label, zorder=zorder)
        return line.get_color()
    (raw,) = ax.plot(steps, values, color=color, alpha=0.2, linewidth=0.8, zorder=zorder)
    ax.plot(steps, ema_smooth(values), color=raw.get_color(), linewidth=1.8, label=f"{label} (EMA)", zorder=zorder)
    return raw.get_color()


def _pinned(values: np.ndarray) -> float | None:
    """The value a band's bound sits at for more than half the steps (a task's floor or ceiling), or None."""
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return None
    uniques, counts = np.unique(finite, return_counts=True)
    most = int(counts.argmax())
    return float(uniques[most]) if 2 * counts[most] > finite.size else None


def _band_steps(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per step, whether the min..max band says something there: a bound that moves, or leaves the value it is
    pinned at."""
    lo_pin, hi_pin = _pinned(lo), _pinned(hi)
    off_lo = np.ones(lo.shape, dtype=bool) if lo_pin is None else lo != lo_pin
    off_hi = np.ones(hi.shape, dtype=bool) if hi_pin is None else hi != hi_pin
    return off_lo | off_hi


def _band_panel(records, prefix: str, title: str, ylabel: str) -> Panel | None:
    """`{prefix}/mean` smoothed, over the smoothed `{prefix}/min`..`{prefix}/max` band where that band moves."""
    steps, mean = _series(records, f"{prefix}/mean")
    if steps.size == 0:
        return None

    def draw(ax) -> None:
        lo_s, lo = _series(records, f"{prefix}/min")
        hi_s, hi = _series(records, f"{prefix}/max")
        color = _smoothed(ax, steps, mean, f"{prefix}/mean")
        if lo_s.size and hi_s.size:
            common, i_lo, i_hi = np.intersect1d(lo_s, hi_s, return_indices=True)
            where = _band_steps(lo[i_lo], hi[i_hi])
            # fill_between fills from one step to the next where both are marked: a lone step would draw nothing.
            if (where[:-1] & where[1:]).any():
                smooth = steps.size >= _SMOOTH_MIN_POINTS
                lo_c = ema_smooth(lo[i_lo]) if smooth else lo[i_lo]
                hi_c = ema_smooth(hi[i_hi]) if smooth else hi[i_hi]
                ax.fill_between(
                    common,
                    lo_c,
                    hi_c,
                    where=where,
                    color=color,
                    alpha=0.12,
                    linewidth=0,
                    label="min..max" + (" (EMA)" if smooth else ""),
                )
        ax.set_title(title)
        ax.set_ylabel(ylabel)

    return draw


def _lines_panel(records, keys: Sequence[str], title: str, ylabel: str) -> Panel | None:
    """One smoothed line per key that was logged."""
    present = [k for k in keys if _has(records, k)]
    if not present:
        return None

    def draw(ax) -> None:
        for key in present:
            steps, values = _series(records, key)
            _smoothed(ax, steps, values, key)
        ax.set_title(title)
        ax.set_ylabel(ylabel)

    return draw


def _accuracy_panel(records, val_keys: Sequence[str], train_key: str) -> Panel | None:
    """Held-out accuracy bold, with points and its first and last values written, over the smoothed batch accuracy."""
    val_present = [k for k in val_keys if _has(records, k)]
    has_train = _has(records, train_key)
    if not val_present and not has_train:
        return None

    def draw(ax) -> None:
        if has_train:
            steps, values = _series(records, train_key)
            _smoothed(ax, steps, values, f"{train_key} (training batch, sampled)", color="tab:orange", zorder=2)
        for i, key in enumerate(val_present):
            steps, values = _series(records, key)
            main = i == 0
            ax.plot(
                steps,
                values,
                marker="o",
                markersize=6 if main else 4,
                linewidth=2.5 if main else 1.5,
                color=_VAL_COLOR if main else None,
                label=f"{key} (held-out, greedy)" if main else key,
                zorder=5 if main else 4,
            )
            if main:
                ends = [(0, "left"), (values.size - 1, "right")] if values.size > 1 else [(0, "center")]
                for j, align in ends:
                    ax.annotate(
                        f"{values[j]:.3f}",
                        (steps[j], values[j]),
                        textcoords="offset points",
                        xytext=(0, 8),
                        ha=align,
                        fontsize="small",
                        fontweight="bold",
                        zorder=6,
                    )
        ax.set_ylim(0, 1.05)
        ax.set_title("Exact-match accuracy")
        ax.set_ylabel("accuracy")

    return draw


def _kl_panel(records) -> Panel | None:
    """The KL metrics that are more than float noise around 0; None when none is."""
    keys = [k for k in _all_keys(records) if k.startswith("actor/") and "kl" in k and "coef" not in k]
    present = []
    for key in keys:
        values = _series(records, key)[1]
        finite = values[np.isfinite(values)]
        if finite.size and np.abs(finite).max() >= _KL_NOISE:
            present.append(key)
    if len(present) < len(keys):
        logger.info(
            "KL metrics below %g at every step (float noise: the update is on-policy) not drawn: %s",
            _KL_NOISE,
            [k for k in keys if k not in present],
        )
    return _lines_panel(records, present, "KL", "KL")


def _throughput_panels(records) -> list[Panel]:
    panels: list[Panel] = []
    tput = _lines_panel(records, ["perf/throughput"], "Throughput", "tokens / s")
    if tput:
        panels.append(tput)
    stage_keys = [k for k in _all_keys(records) if k.startswith("timing_s/") and k != "timing_s/step"]
    has_step = _has(records, "timing_s/step")
    if stage_keys or has_step:

        def draw(ax) -> None:
            if stage_keys:
                rows = [r for r in records if any(k in r for k in stage_keys)]
                steps = np.asarray([r["step"] for r in rows], dtype=float)
                stacks = [[_num_or_zero(r.get(k)) for r in rows] for k in stage_keys]
                if steps.size >= _SMOOTH_MIN_POINTS:
                    stacks = [ema_smooth(stack) for stack in stacks]
                ax.stackplot(steps, stacks, labels=[k.removeprefix("timing_s/") for k in stage_keys], alpha=0.8)
            if has_step:
                steps, values = _series(records, "timing_s/step")
                _smoothed(ax, steps, values, "step (total)", color="black")
            ax.set_title("Time per step, by stage" + (" (EMA)" if steps.size >= _SMOOTH_MIN_POINTS else ""))
            ax.set_ylabel("seconds")
            # Many stages: a legend beside the axes hides no data.
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")

        panels.append(draw)
    return panels


def _ep_tokens_panel(records, role: str) -> Panel | None:
    """Under expert parallelism: per MoE layer, the most tokens an EP rank received over the mean (1 = even)."""
    prefix = f"{role}/moe/ep_tokens_received_max_over_mean/layer_"
    layers = sorted((k for k in _all_keys(records) if k.startswith(prefix)), key=lambda k: int(k[len(prefix) :]))
    panel = _lines_panel(records, layers, f"{role}: tokens received per EP rank, max / mean, by layer", "max / mean")
    if panel is None:
        return None

    def draw(ax) -> None:
        panel(ax)
        ax.axhline(1.0, color="0.6", linewidth=0.8, linestyle="--", zorder=1)  # an even split

    return draw


def _per_layer_panel(records, family: str, title: str, ylabel: str) -> Panel | None:
    """One line per MoE layer of the `{family}/layer_i` metrics, in layer order."""
    prefix = f"{family}/layer_"
    layers = sorted((k for k in _all_keys(records) if k.startswith(prefix)), key=lambda k: int(k[len(prefix) :]))
    return _lines_panel(records, layers, title, ylabel)


def _num_or_zero(value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return 0.0


def _plot_moe_latest(path: Path, record: dict[str, Any]) -> Path:
    from matplotlib.colors import TwoSlopeNorm

    rel = relative_expert_load(record["counts"])
    num_layers, num_experts = rel.shape
    fig, axes = _figure(1, height_in=min(12.0, max(3.5, 1.5 + 0.35 * num_layers)))
    ax = axes[0]
    vmax = max(2.0, float(np.nanmax(rel)) if np.isfinite(rel).any() else 2.0)
    im = ax.imshow(
        np.ma.masked_invalid(rel),
        aspect="auto",
        cmap=_load_cmap(),
        norm=TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=vmax),
        interpolation="nearest",
    )
    fig.colorbar(im, ax=ax, label="load / even share (1 = balanced)")
    if rel.size <= _ANNOTATE_MAX_CELLS:
        # Few cells: write each value, so the heatmap reads without matching colours to the bar.
        for (layer, expert), value in np.ndenumerate(rel):
            if np.isfinite(value):
                shade = im.norm(value)
                ax.text(
                    expert,
                    layer,
                    f"{value:.2f}",
                    ha="center",
                    va="center",
                    fontsize="small",
                    color="white" if shade < 0.2 or shade > 0.8 else "black",
                )
    empty = " (grey: no tokens)" if np.isnan(rel).any() else ""
    ax.set_title(f"MoE expert load at step {record['step']} (tokens routed per expert, per layer){empty}")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    _integer_ticks(ax.xaxis, num_experts)
    _integer_ticks(ax.yaxis, num_layers)
    fig.savefig(path)
    return path


def _plot_moe_over_time(path: Path, records: list[dict[str, Any]]) -> Path | None:
    from matplotlib.colors import TwoSlopeNorm

    latest = records[-1]
    shape = latest["counts"].shape
    same = [r for r in records if r["counts"].shape == shape]
    layer = most_imbalanced_layer(latest["counts"])
    if layer is None:
        return None
    steps = np.asarray([r["step"] for r in same], dtype=float)
    load = np.stack([relative_expert_load(r["counts"])[layer] for r in same], axis=1)  # (E, S)
    fig, axes = _figure(1, height_in=min(12.0, max(3.5, 1.5 + 0.25 * shape[1])))
    ax = axes[0]
    vmax = max(2.0, float(np.nanmax(load)) if np.isfinite(load).any() else 2.0)
    mesh = ax.pcolormesh(
        steps,
        np.arange(shape[1]),
        np.ma.masked_invalid(load),
        shading="nearest",
        cmap=_load_cmap(),
        norm=TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=vmax),
    )
    fig.colorbar(mesh, ax=ax, label="load / even share (1 = balanced)")
    ax.set_title(f"MoE expert load over steps, layer {layer} (the most imbalanced at step {latest['step']})")
    ax.set_xlabel("step")
    ax.set_ylabel("expert")
    _integer_ticks(ax.yaxis, shape[1])
    fig.savefig(path)
    return path


def _load_cmap():
    """Blue (starved) - white (even share) - red (overloaded); grey where a layer saw no tokens."""
    import matplotlib

    return matplotlib.colormaps["RdBu_r"].with_extremes(bad="0.8")


def _integer_ticks(axis, n: int) -> None:
    from matplotlib.ticker import MaxNLocator

    if n <= 32:
        axis.set_ticks(range(n))
    else:
        axis.set_major_locator(MaxNLocator(nbins=16, integer=True))


def _distills_alone(run_dir: Path) -> bool:
    """Whether the run's saved config.yaml says it distilled without task rewards (False when it cannot be read)."""
    import yaml

    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
        distillation = config["distillation"]
        return bool(distillation["enabled"]) and not distillation["distillation_loss"]["use_task_rewards"]
    except (OSError, ValueError, yaml.YAMLError, KeyError, TypeError):
        return False  # no config to say: keep every loss the run logged


def _loss_keys(run_dir: Path, records: Sequence[dict[str, Any]]) -> tuple[tuple[str, str], ...]:
    """The losses panels of `losses.png`, (key, label): a distilling run's loss first; the policy loss left out
    when the run distilled alone (its actor/pg_loss is logged but trains nothing)."""
    if not _has(records, _DISTILL_LOSS[0]):
        return _LOSS_KEYS
    alone = _distills_alone(run_dir)
    return (_DISTILL_LOSS,) + tuple(k for k in _LOSS_KEYS if not (alone and k[0] == "actor/pg_loss"))


# --------------------------------------------------------------------------- entry point


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the PNGs of a run into `out_dir` (default `run_dir/plots`); returns the paths written."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("plotting needs matplotlib, which is not installed: pip install 'conveyor[plot]'") from None
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(
            f"run directory {run_dir} " + ("is a file, not a run directory" if run_dir.exists() else "does not exist")
        )
    metrics_path = run_dir / "metrics.jsonl"
    moe_path = run_dir / "moe_expert_load.jsonl"
    records = read_metrics_jsonl(metrics_path) if metrics_path.is_file() else []
    moe_records = read_moe_expert_load(moe_path) if moe_path.is_file() else []
    if not records and not moe_records:
        if metrics_path.is_file() and metrics_path.stat().st_size:
            raise ValueError(
                f"nothing to plot in {run_dir}: {metrics_path} holds no line that is a metrics record (each bad line "
                "is named above); it was damaged or is not a conveyor metrics file"
            )
        raise ValueError(
            f"nothing to plot in {run_dir}: {metrics_path.name} is missing or empty "
            "(add 'jsonl' to trainer.logger to write it)"
        )
    out = make_dir(
        Path(out_dir) if out_dir is not None else run_dir / "plots",
        "--out" if out_dir is not None else "the plots folder",
    )

    figures: list[tuple[str, str, list[Panel | None]]] = []
    reward_prefix = next((p for p in _REWARD_PREFIXES if _has(records, f"{p}/mean")), None)
    val_keys = sorted((k for k in _all_keys(records) if _VAL_ACC.search(k)), key=lambda k: (k != "val/accuracy", k))
    figures.append(
        (
            "reward.png",
            "Accuracy and reward",
            [
                # reward/accuracy: the training batch's accuracy, when the task reports one.
                _accuracy_panel(records, val_keys, "reward/accuracy"),
                _band_panel(records, reward_prefix, f"Reward ({reward_prefix}/mean)", "reward")
                if reward_prefix
                else None,
            ],
        )
    )
    figures.append(
        (
            "losses.png",
            "Losses",
            [_lines_panel(records, [k], f"{label} ({k})", "loss") for k, label in _loss_keys(run_dir, records)],
        )
    )
    figures.append(
        (
            "kl_entropy.png",
            "KL and entropy",
            [
                _kl_panel(records),
                _lines_panel(records, ["actor/entropy"], "Policy entropy (actor/entropy)", "nats / token"),
            ],
        )
    )
    figures.append(
        (
            "response_length.png",
            "Response length",
            [
                _band_panel(records, "response_length", "Response length (response_length)", "tokens"),
                _lines_panel(records, ["response_length/clip_ratio"], "Responses cut at max length", "fraction"),
            ],
        )
    )
    figures.append(
        (
            "distillation.png",
            "On-policy distillation: the student against its teachers",
            [
                _lines_panel(
                    records,
                    ["distill/kl_exact", "distill/kl_k3", "distill/kl_k1"],
                    "Student's KL to the teacher on its own samples (distill/kl_*)",
                    "nats / token",
                ),
                _lines_panel(records, ["distill/loss"], "Distillation loss (distill/loss)", "loss"),
                _lines_panel(
                    records,
                    ["distill/moe/routing_agreement"],
                    "Student and teacher pick the same experts (distill/moe/routing_agreement)",
                    "fraction",
                ),
            ],
        )
    )
    figures.append(("throughput.png", "Throughput and step time", list(_throughput_panels(records))))
    figures.append(
        (
            "moe_ep_tokens.png",
            "All-to-all straggler: tokens received per EP rank, max / mean",
            [_ep_tokens_panel(records, role) for role in ("actor", "critic")],
        )
    )

    figures.append(
        (
            "moe_router.png",
            "MoE router health by layer: near ties at the rollout, flips at the trainer",
            [
                _per_layer_panel(
                    records, "rollout/moe/near_tie", "Near ties (margin < eps) at the rollout, by layer", "share"
                ),
                _per_layer_panel(
                    records, "actor/moe/flip_rate", "Top-k flips, trainer vs rollout (actor/moe/flip_rate)", "share"
                ),
            ],
        )
    )

    written: list[Path] = []
    for name, title, panels in figures:
        path = _save_panels(out / name, title, [p for p in panels if p is not None])
        if path is not None:
            written.append(path)
        else:
            logger.info("%s: no metrics for it in %s; skipped", name, metrics_path)
    if moe_records:
        written.append(_plot_moe_latest(out / "moe_expert_load.png", moe_records[-1]))
        path = _plot_moe_over_time(out / "moe_expert_load_over_time.png", moe_records)
        if path is not None:
            written.append(path)
    return written
