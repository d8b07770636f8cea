"""plot_run on a synthetic run directory: the right PNGs, of the right size, with something drawn in them."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip("matplotlib")
from PIL import Image  # noqa: E402  (a matplotlib dependency)

from conveyor.metrics.plots import (  # noqa: E402
    DPI,
    FIG_WIDTH_IN,
    PANEL_HEIGHT_IN,
    most_imbalanced_layer,
    plot_run,
    read_moe_expert_load,
    relative_expert_load,
)
from conveyor.metrics.trackers import JsonlTracker, read_metrics_jsonl  # noqa: E402

NUM_LAYERS, NUM_EXPERTS = 3, 4


def _write_run(run_dir, steps=12, with_moe=True):
    tracker = JsonlTracker(run_dir / "metrics.jsonl")
    for s in range(1, steps + 1):
        m = {
            "reward/mean": s / steps,
            "reward/min": 0.0,
            "reward/max": 1.0,
            "reward/accuracy": s / (2 * steps),
            "actor/pg_loss": 0.1 * math.sin(s),
            "critic/vf_loss": 1.0 / s,
            "actor/kl_loss": 0.01 * s,
            "actor/ppo_kl": 1e-3 * s,
            "actor/entropy": 2.0 - s / steps,
            "response_length/mean": 20.0 + s,
            "response_length/min": 4.0,
            "response_length/max": 40.0,
            "perf/throughput": 1000.0 + 25 * s,
            "timing_s/gen": 1.0,
            "timing_s/update_actor": 0.5 + 0.01 * s,
            "timing_s/step": 1.7,
        }
        if s % 4 == 0:
            m["val/accuracy"] = s / (2 * steps)
        tracker.log(m, s)
    tracker.close()
    if with_moe:
        with (run_dir / "moe_expert_load.jsonl").open("w") as f:
            for s in range(1, steps + 1):
                counts = [[10 + (s + e) % 3 for e in range(NUM_EXPERTS)] for _ in range(NUM_LAYERS)]
                counts[1][2] += 40  # layer 1 is the imbalanced one
                f.write(json.dumps({"step": s, "num_experts": NUM_EXPERTS, "counts": counts}) + "\n")


def _check_png(path, panels=None, height_px=None):
    img = Image.open(path)
    img.load()
    width, height = img.size
    assert width == round(FIG_WIDTH_IN * DPI)
    if panels is not None:
        assert height == round(PANEL_HEIGHT_IN * panels * DPI)
    if height_px is not None:
        assert height == height_px
    pixels = np.asarray(img.convert("RGB"), dtype=float)
    assert pixels.std() > 0
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 1


def test_plot_run_writes_every_figure(tmp_path):
    _write_run(tmp_path)
    paths = plot_run(tmp_path)
    names = [p.name for p in paths]
    assert names == [
        "reward.png",
        "losses.png",
        "kl_entropy.png",
        "response_length.png",
        "throughput.png",
        "moe_expert_load.png",
        "moe_expert_load_over_time.png",
    ]
    assert all(p.parent == tmp_path / "plots" and p.is_file() for p in paths)
    panels = {"reward.png": 2, "losses.png": 3, "kl_entropy.png": 2, "response_length.png": 1, "throughput.png": 2}
    for p in paths:
        _check_png(p, panels=panels.get(p.name))


def test_missing_metrics_drop_their_panels_and_figures(tmp_path):
    tracker = JsonlTracker(tmp_path / "metrics.jsonl")
    for s in range(1, 4):
        tracker.log({"critic/score/mean": 0.1 * s, "actor/pg_loss": -0.1 * s}, s)
    tracker.close()
    out = tmp_path / "figs"
    paths = plot_run(tmp_path, out_dir=out)
    assert [p.name for p in paths] == ["reward.png", "losses.png"]
    assert sorted(p.name for p in out.iterdir()) == ["losses.png", "reward.png"]
    # One panel each: the reward without validation, the policy loss alone.
    _check_png(out / "reward.png", panels=1)
    _check_png(out / "losses.png", panels=1)


def test_ep_straggler_figure_draws_each_layer_when_logged(tmp_path):
    tracker = JsonlTracker(tmp_path / "metrics.jsonl")
    for s in range(1, 6):
        tracker.log(
            {
                "actor/pg_loss": -0.1 * s,
                "actor/moe/ep_tokens_received_max_over_mean": 1.3,
                **{f"actor/moe/ep_tokens_received_max_over_mean/layer_{i}": 1.0 + 0.1 * i + 0.01 * s for i in range(3)},
            },
            s,
        )
    tracker.close()
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == ["losses.png", "moe_ep_tokens.png"]
    _check_png(tmp_path / "plots" / "moe_ep_tokens.png", panels=1)  # the actor's; no critic panel


def test_router_health_figure_draws_near_ties_and_flips_per_layer(tmp_path):
    tracker = JsonlTracker(tmp_path / "metrics.jsonl")
    for s in range(1, 31):
        m = {"actor/pg_loss": -0.1 * s}
        if s % 10 == 0:  # logged at the load-balance interval only
            m.update({f"rollout/moe/near_tie/layer_{i}": 0.1 * (i + 1) + 0.001 * s for i in range(12)})
            m.update({f"actor/moe/flip_rate/layer_{i}": 0.01 * (i + 1) for i in range(12)})
            m["rollout/moe/near_tie/max"] = 9.0  # a summary, not a layer: not drawn
        tracker.log(m, s)
    tracker.close()
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == ["losses.png", "moe_router.png"]
    _check_png(tmp_path / "plots" / "moe_router.png", panels=2)
    # One line per layer, in layer order (layer_10 after layer_9), the summary keys left out.
    from conveyor.metrics import plots

    panel = plots._per_layer_panel(read_metrics_jsonl(tmp_path / "metrics.jsonl"), "rollout/moe/near_tie", "t", "y")
    _, axes = plots._figure(1)
    panel(axes[0])
    assert axes[0].get_legend_handles_labels()[1] == [f"rollout/moe/near_tie/layer_{i}" for i in range(12)]


def test_relative_load_and_most_imbalanced_layer_by_hand():
    counts = np.array([[2, 2, 2, 2], [8, 0, 0, 0], [0, 0, 0, 0], [3, 1, 2, 2]])
    rel = relative_expert_load(counts)
    # Even share per layer: 2, 2, (empty), 2.
    np.testing.assert_allclose(rel[0], [1, 1, 1, 1])
    np.testing.assert_allclose(rel[1], [4, 0, 0, 0])
    assert np.isnan(rel[2]).all()
    np.testing.assert_allclose(rel[3], [1.5, 0.5, 1.0, 1.0])
    assert most_imbalanced_layer(counts) == 1
    assert most_imbalanced_layer(np.zeros((2, 3))) is None


def test_moe_reader_keeps_last_record_per_step_and_skips_bad_lines(tmp_path):
    path = tmp_path / "moe_expert_load.jsonl"
    path.write_text(
        json.dumps({"step": 2, "num_experts": 2, "counts": [[1, 1]]})
        + "\n"
        + json.dumps({"step": 1, "num_experts": 2, "counts": [[5, 0]]})
        + "\n"
        + json.dumps({"step": 2, "num_experts": 2, "counts": [[0, 7]]})
        + "\n"
        + json.dumps({"step": 3, "num_experts": 3, "counts": [[1, 1]]})
        + "\n"  # wrong width
        + '{"step": 4, "num_e'  # torn by a crash
    )
    records = read_moe_expert_load(path)
    assert [r["step"] for r in records] == [1, 2]
    np.testing.assert_array_equal(records[1]["counts"], [[0, 7]])


def test_plot_run_errors_name_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        plot_run(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"metrics.jsonl .*trainer.logger"):
        plot_run(tmp_path)


def _axes():
    from matplotlib.figure import Figure

    return Figure().subplots()


def _long_run(steps=200, reward_band=(0.0, 1.0), kl=1e-8):
    """Records like the default run's: per-step noise, a 0..1 reward band at every step, validation every 50."""
    rng = np.random.default_rng(0)
    records = []
    for s in range(steps + 1):
        r = {"step": s}
        if s:
            r.update(
                {
                    "reward/mean": 0.3 + 0.002 * s + 0.05 * rng.standard_normal(),
                    "reward/min": reward_band[0],
                    "reward/max": reward_band[1],
                    "reward/accuracy": 0.1 + 0.002 * s,
                    "actor/ppo_kl": kl * (-1) ** s,
                }
            )
        if s % 50 == 0:
            r["val/accuracy"] = 0.1 + 0.003 * s
        records.append(r)
    return records


def test_ema_smooth_is_debiased_skips_nan_and_follows_a_step():
    from conveyor.metrics.plots import ema_smooth

    np.testing.assert_allclose(ema_smooth([2.0] * 100), 2.0)  # no pull towards 0 at the start
    out = ema_smooth([1.0, float("nan"), 1.0, 3.0], span=3)
    assert out[0] == 1.0 and out[1] == 1.0 and out[2] == 1.0 and 1.0 < out[3] < 3.0
    step = ema_smooth([0.0] * 50 + [1.0] * 50)  # default span: 1/50 of the series, 2 points
    assert step[49] == 0.0 and 0.5 < step[50] < 1.0 and step[-1] == pytest.approx(1.0)
    np.testing.assert_array_equal(ema_smooth([3.0, 1.0, 2.0]), [3.0, 1.0, 2.0])  # too short to smooth


def test_reward_band_only_when_it_moves_and_raw_series_faint_behind_the_ema():
    from conveyor.metrics.plots import _band_panel

    ax = _axes()
    _band_panel(_long_run(), "reward", "Reward", "reward")(ax)
    assert not ax.collections  # min 0, max 1 at every step: no band
    raw, smooth = ax.lines
    assert raw.get_alpha() == pytest.approx(0.2) and smooth.get_alpha() is None
    assert smooth.get_label() == "reward/mean (EMA)" and smooth.get_color() == raw.get_color()
    assert np.std(np.diff(smooth.get_ydata())) < np.std(np.diff(raw.get_ydata())) / 3

    records = _long_run()
    for i, r in enumerate(records[1:]):
        r["reward/min"] = 0.1 * (i % 3)  # a band that moves is drawn
    ax = _axes()
    _band_panel(records, "reward", "Reward", "reward")(ax)
    assert len(ax.collections) == 1


def test_one_step_off_the_rewards_bounds_draws_no_band_over_the_whole_run():
    from conveyor.metrics.plots import _band_panel

    records = _long_run(reward_band=(0.1, 1.0))
    records[1]["reward/min"] = 0.0  # one step: a band that "moves", pinned at 0.1..1 everywhere else
    ax = _axes()
    _band_panel(records, "reward", "Reward", "reward")(ax)
    assert not ax.collections
    assert ax.get_ylim()[0] > 0.1 and ax.get_ylim()[1] < 1.0  # the axis follows the mean, not a 0..1 band

    for r in records[100:151]:
        r["reward/min"] = 0.3  # a stretch off the pinned bound: the band is drawn there, and only there
    ax = _axes()
    _band_panel(records, "reward", "Reward", "reward")(ax)
    (band,) = ax.collections
    spans = [(p.vertices[:, 0].min(), p.vertices[:, 0].max()) for p in band.get_paths()]
    assert [span for span in spans if span[1] > span[0]] == [(100, 150)]  # (the lone step 1 fills nothing)


def test_validation_accuracy_drawn_on_top_and_kl_noise_left_out():
    from conveyor.metrics.plots import _accuracy_panel, _kl_panel

    ax = _axes()
    _accuracy_panel(_long_run(), ["val/accuracy"], "reward/accuracy")(ax)
    val = next(ln for ln in ax.lines if ln.get_label().startswith("val/accuracy"))
    train = [ln for ln in ax.lines if ln is not val]
    assert val.get_marker() == "o" and val.get_linewidth() > max(ln.get_linewidth() for ln in train)
    assert val.get_zorder() > max(ln.get_zorder() for ln in train)
    assert list(val.get_xdata()) == [0, 50, 100, 150, 200]
    # First and last held-out values are written on the plot.
    assert [t.get_text() for t in ax.texts] == ["0.100", "0.700"]

    assert _kl_panel(_long_run(kl=1e-8)) is None  # float noise of an on-policy update
    assert _kl_panel(_long_run(kl=1e-3)) is not None
