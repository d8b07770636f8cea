"""The one loader of the user's code (conveyor.user_code), through its three users: plugins, the custom reward
function and the tools of a tool YAML."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest

from conveyor.plugins import load_plugins
from conveyor.tools.base import load_tools
from conveyor.user_code import import_user_code, user_attribute
from conveyor.workers.ranks.reward import load_custom_reward_fn

COUNTING = """
import builtins
builtins.conveyor_test_imports = getattr(builtins, "conveyor_test_imports", 0) + 1


class Thing:
    def __init__(self, value=1):
        self.value = value

    def execute(self, instance_id, call):
        return str(self.value)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0
"""


def test_a_file_is_imported_once_per_process_whoever_names_it(tmp_path: Path, monkeypatch) -> None:
    import builtins

    monkeypatch.setattr(builtins, "conveyor_test_imports", 0, raising=False)
    file = tmp_path / "mine.py"
    file.write_text(COUNTING)
    monkeypatch.chdir(tmp_path)
    (tools_yaml := tmp_path / "tools.yaml").write_text(f"tools:\n  - name: t\n    path: {file}:Thing\n")
    [module] = load_plugins([str(file)])
    assert load_plugins(["./mine.py"]) == [module]  # the same file by another spelling: keyed by resolved path
    assert load_custom_reward_fn(str(file)) is module.compute_score
    assert type(load_tools(tools_yaml)["t"]) is module.Thing
    assert builtins.conveyor_test_imports == 1
    # In sys.modules under its own name, so what it defines pickles by reference (as Ray ships it).
    assert sys.modules[module.__name__] is module and module.__name__ != "mine"
    assert pickle.loads(pickle.dumps(module.Thing)) is module.Thing


def test_a_module_name_is_imported_like_any_module() -> None:
    import conveyor.tools.calculator as calculator

    assert import_user_code("conveyor.tools.calculator", key="k") is calculator
    assert user_attribute("conveyor.tools.calculator", "calculate", key="k") is calculator.calculate


@pytest.mark.parametrize(
    "body, what",
    [
        ("raise RuntimeError('boom')\n", "RuntimeError: boom"),
        ("import sys\nsys.exit(0)\n", r"it called sys.exit\(0\)"),
        ("import sys\nsys.exit('bye')\n", r"it called sys.exit\('bye'\)"),
        ("def broken(:\n", "SyntaxError: "),
    ],
)
def test_a_failing_import_is_one_line_naming_the_key_and_the_file(tmp_path: Path, body: str, what: str) -> None:
    file = tmp_path / "bad.py"
    file.write_text(body)
    for load, key in [
        (lambda: load_plugins([str(file)]), "trainer.plugins"),
        (lambda: load_custom_reward_fn(str(file)), "reward.custom_reward_function.path"),
    ]:
        with pytest.raises(ValueError, match=rf"^{key}: importing '.*bad\.py' failed: {what}") as info:
            load()
        assert "\n" not in str(info.value)
    # Not cached: fixing the file and loading it again works.
    file.write_text("x = 1\n")
    assert load_plugins([str(file)])[0].x == 1


def test_a_tool_module_that_exits_at_import_is_an_error_naming_the_tool_file(tmp_path: Path) -> None:
    (tmp_path / "quits.py").write_text("import sys\nsys.exit(0)\n\ndef f(text):\n    return text\n")
    tools_yaml = tmp_path / "tools.yaml"
    tools_yaml.write_text(f"tools:\n  - name: q\n    path: {tmp_path / 'quits.py'}:f\n")
    with pytest.raises(
        ValueError,
        match=r"tool_config_path: '.*tools\.yaml', tools\[0\]: importing '.*quits\.py' "
        r"failed: it called sys.exit\(0\)",
    ):
        load_tools(tools_yaml)
    tools_yaml.write_text("tools:\n  - name: c\n    path: conveyor.tools.calculator:nothing_here\n")
    with pytest.raises(
        ValueError,
        match=r"tools\[0\]: 'conveyor.tools.calculator' defines no attribute "
        r"'nothing_here'",
    ):
        load_tools(tools_yaml)


def test_a_tool_class_that_exits_in_its_constructor_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "ctor.py").write_text(
        "import sys\n\nclass T:\n    def __init__(self):\n        sys.exit(3)\n\n"
        "    def execute(self, instance_id, call):\n        return ''\n"
    )
    tools_yaml = tmp_path / "tools.yaml"
    tools_yaml.write_text(f"tools:\n  - name: t\n    path: {tmp_path / 'ctor.py'}:T\n")
    with pytest.raises(ValueError, match=r"tools\[0\]: building .* failed: it called sys.exit\(3\)"):
        load_tools(tools_yaml)


def test_keyboard_interrupt_while_importing_goes_through(tmp_path: Path) -> None:
    file = tmp_path / "interrupted.py"
    file.write_text("raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        load_plugins([str(file)])
    assert not any(getattr(m, "__file__", None) == str(file) for m in list(sys.modules.values()))


def test_missing_files_and_names_name_their_keys(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^trainer.plugins: no such file '.*nope\.py'$"):
        load_plugins([str(tmp_path / "nope.py")])
    with pytest.raises(
        ValueError,
        match=r"^trainer.plugins: importing module 'no_such_module_xyz' failed: "
        "ModuleNotFoundError",
    ):
        load_plugins(["no_such_module_xyz"])
    with pytest.raises(ValueError, match=r"^reward.custom_reward_function.path: no such file"):
        load_custom_reward_fn(str(tmp_path / "nope.py"))
    (tmp_path / "r.py").write_text("grade = 3\n")
    with pytest.raises(
        ValueError,
        match=r"^reward.custom_reward_function.name: '.*r\.py' defines no function "
        "'grade'",
    ):
        load_custom_reward_fn(str(tmp_path / "r.py"), "grade")
