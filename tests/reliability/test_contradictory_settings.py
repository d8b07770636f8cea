"""Settings that contradict each other are refused before anything is built, saying what to change."""

from __future__ import annotations

import pytest

CONTRADICTIONS = {
    "resume_from_path_with_auto": (
        ["trainer.resume_from_path=/runs/a/checkpoints/global_step_2"],
        (
            "trainer.resume_from_path",
            "trainer.resume_mode=auto ignores it",
            "trainer.resume_mode=resume_path",
            "trainer.resume_from_path=null",
        ),
    ),
    "resume_from_path_with_disable": (
        ["trainer.resume_mode=disable", "trainer.resume_from_path=/x"],
        ("trainer.resume_mode=disable ignores it",),
    ),
    "dump_num_zero_with_dumps_on": (
        ["trainer.dump_freq=5", "trainer.dump_num=0"],
        ("trainer.dump_num", "trainer.dump_freq=5", "trainer.dump_freq=0"),
    ),
}


@pytest.mark.parametrize("case", sorted(CONTRADICTIONS))
def test_a_contradiction_is_one_error_line_saying_what_to_change(rel, case: str, capsys) -> None:
    overrides, needles = CONTRADICTIONS[case]
    status, err = rel.main_in_process(["config", *overrides], capsys)
    rel.assert_usage_error(status, err, needles)


@pytest.mark.parametrize(
    "overrides",
    [["trainer.dump_freq=0", "trainer.dump_num=0"], ["trainer.resume_mode=resume_path", "trainer.resume_from_path=/x"]],
)
def test_the_consistent_forms_are_accepted(rel, overrides: list[str], capsys) -> None:
    assert rel.main_in_process(["config", *overrides], capsys)[0] == 0
