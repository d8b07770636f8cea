"""The console's kl column and losses.png follow what the run trained on: a distilling run's KL and loss."""

from __future__ import annotations

import io
import json

import pytest

from conveyor.config import config_to_yaml, load_config
from conveyor.metrics import plots
from conveyor.metrics.console import CONSOLE_COLUMNS, ConsoleTracker


def _kl_cell(metrics: dict[str, float]) -> str:
    tracker = ConsoleTracker(stream=io.StringIO())
    labels = [label for label, _, _ in CONSOLE_COLUMNS]
    return tracker.format_line(metrics, 1).split()[1 + labels.index("kl")]


def test_the_kl_column_shows_the_distillation_kl_when_the_run_distills() -> None:
    noise = {"actor/ppo_kl": 3e-9, "actor/pg_loss": 0.01}
    assert _kl_cell(noise) == "3e-09"  # an RL run: its own KL metric, as before
    assert _kl_cell({**noise, "distill/kl_k1": 0.4, "distill/kl_k3": 0.25}) == "0.25"
    # The exact KL when the loss computes it, over the estimates and over a reference's KL loss.
    assert _kl_cell({**noise, "actor/kl_loss": 0.1, "distill/kl_k3": 0.25, "distill/kl_exact": 0.31}) == "0.31"


def _distill_run(tmp_path, use_task_rewards: bool) -> None:
    cfg = load_config(
        None,
        [
            "distillation.enabled=true",
            "distillation.teacher_models.teacher.model_path=/nowhere",
            f"distillation.distillation_loss.use_task_rewards={str(use_task_rewards).lower()}",
        ],
    )
    (tmp_path / "config.yaml").write_text(config_to_yaml(cfg))
    rows = [
        {"step": s, "actor/pg_loss": 1e-3 * s, "distill/loss": 1.0 / s, "distill/kl_exact": 0.5 / s}
        for s in range(1, 6)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _loss_titles(tmp_path, monkeypatch) -> list[str]:
    """The titles of the panels plot_run asks for in losses.png."""
    asked: list[str] = []
    draw = plots._lines_panel

    def spy(records, keys, title, ylabel):
        panel = draw(records, keys, title, ylabel)
        if ylabel == "loss" and panel is not None and "Distillation loss" not in title:
            asked.append(title)
        return panel

    monkeypatch.setattr(plots, "_lines_panel", spy)
    assert any(p.name == "losses.png" for p in plots.plot_run(tmp_path))
    return asked


@pytest.mark.parametrize("use_task_rewards", [False, True])
def test_losses_png_draws_the_distillation_loss(tmp_path, monkeypatch, use_task_rewards) -> None:
    pytest.importorskip("matplotlib")
    _distill_run(tmp_path, use_task_rewards)
    titles = _loss_titles(tmp_path, monkeypatch)
    assert titles[0] == "distillation loss (distill/loss)"
    # Distilling alone, the policy loss is logged but trains nothing: not drawn; with task rewards it trains.
    assert any("actor/pg_loss" in t for t in titles) == use_task_rewards


def test_losses_png_of_a_run_without_distillation_is_unchanged(tmp_path, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    rows = [{"step": s, "actor/pg_loss": 0.1 * s} for s in range(1, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _loss_titles(tmp_path, monkeypatch) == ["policy loss (actor/pg_loss)"]


def test_a_row_and_a_log_line_clear_the_bar_and_draw_it_again_below(monkeypatch) -> None:
    import logging

    from tqdm import tqdm

    from conveyor.metrics.console import BarAwareStreamHandler

    screen = io.StringIO()  # one terminal behind stdout and stderr
    monkeypatch.setattr("sys.stdout", screen)
    monkeypatch.setattr("sys.stderr", screen)
    bar = tqdm(total=4, desc="train", file=screen, mininterval=0)
    bar.update(1)
    ConsoleTracker().log({"reward/mean": 0.5}, step=1)
    handler = BarAwareStreamHandler()
    handler.emit(logging.LogRecord("x", logging.INFO, __file__, 1, "a log line", None, None))
    bar.close()
    text = screen.getvalue()
    for written in ("step    reward", "   1     0.500", "a log line"):
        at = text.index(written)
        before = text[text.rindex("\n", 0, at) + 1 : at] if "\n" in text[:at] else text[:at]
        # What precedes it on its line is the bar's text and then a carriage return to overwrite it: nothing visible.
        assert before.split("\r")[-1].strip() == "", repr(before)
        assert "train:" in text[at:], "the bar is drawn again after it"
