"""Tests of the configuration: defaults, YAML file + dotted overrides, parsing, error messages and the YAML dump."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest
import yaml

from conveyor.config import (
    REMOVED_KEYS,
    Config,
    ConfigError,
    config_to_dict,
    config_to_yaml,
    load_config,
    parse_overrides,
)

NEW_MOE_KEY = "actor_rollout_ref.rollout.moe_load_balance_metrics_interval"


def write_yaml(tmp_path: Path, data: dict | str, name: str = "run.yaml") -> Path:
    """Write `data` (a mapping, or YAML text as is) to a file under `tmp_path`."""
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


# --------------------------------------------------------------------------- defaults and precedence
def test_defaults_load() -> None:
    cfg = load_config()
    assert cfg == Config()
    assert cfg.data.train_batch_size == 32
    assert cfg.actor_rollout_ref.rollout.n == 8
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.trainer.logger == ["console", "jsonl"]
    assert cfg.transfer_queue.backend == "memory"
    assert cfg.transfer_queue.metrics.enabled is False and cfg.transfer_queue.metrics.port == 0
    # Off by default (the SPEC's contract); the default run's config file turns it on.
    assert cfg.actor_rollout_ref.rollout.moe_load_balance_metrics_interval == 0
    assert cfg.actor_rollout_ref.model.tiny.warmstart_until_accuracy == 0.45 and cfg.trainer.console_every == 0
    from conveyor.trainer.plan import build_run_plan

    plan = build_run_plan(cfg, "cpu")
    assert plan.use_critic is False and plan.use_reference is False


def test_defaults_are_not_shared_between_instances() -> None:
    a, b = Config(), Config()
    a.trainer.logger.append("wandb")
    a.actor_rollout_ref.actor.optim.betas[0] = 0.5
    assert b.trainer.logger == ["console", "jsonl"]
    assert b.actor_rollout_ref.actor.optim.betas == [0.9, 0.99]


def test_yaml_then_overrides_precedence(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path,
        {
            "trainer": {"total_training_steps": 7, "experiment_name": "from-yaml"},
            "actor_rollout_ref": {"rollout": {"temperature": 0.5, "n": 4}},
        },
    )
    cfg = load_config(
        path, ["trainer.total_training_steps=9", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.n=3"]
    )
    assert cfg.trainer.total_training_steps == 9  # override beats the file
    assert cfg.actor_rollout_ref.rollout.n == 3  # the last override wins
    assert cfg.trainer.experiment_name == "from-yaml"  # file beats the default
    assert cfg.actor_rollout_ref.rollout.temperature == 0.5
    # untouched siblings keep their defaults (the merge is deep, not per section)
    assert cfg.actor_rollout_ref.rollout.top_p == Config().actor_rollout_ref.rollout.top_p
    assert cfg.trainer.logger == Config().trainer.logger
    assert cfg.data == Config().data


def test_empty_yaml_file_is_the_defaults(tmp_path: Path) -> None:
    assert load_config(write_yaml(tmp_path, "")) == Config()


# --------------------------------------------------------------------------- parsing
def test_values_are_parsed(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            "trainer.logger=[console,jsonl,tensorboard]",
            "data.shuffle=false",
            "trainer.val_before_train=True",
            "actor_rollout_ref.actor.optim.lr=1e-5",
            "critic.optim.lr=3e-4",
            "data.train_files=[a.parquet,b.parquet]",
            "trainer.default_local_dir=null",
            "actor_rollout_ref.model.tiny.warmstart_lr=1",
            "trainer.experiment_name=42",
        ],
    )
    assert cfg.trainer.logger == ["console", "jsonl", "tensorboard"]
    assert cfg.data.shuffle is False and cfg.trainer.val_before_train is True
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-5
    assert isinstance(cfg.actor_rollout_ref.actor.optim.lr, float)
    assert cfg.critic.optim.lr == 3e-4
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.trainer.default_local_dir is None
    assert cfg.actor_rollout_ref.model.tiny.warmstart_lr == 1.0
    assert isinstance(cfg.actor_rollout_ref.model.tiny.warmstart_lr, float)
    assert cfg.trainer.experiment_name == "42"


def test_bool_keys_read_zero_and_one_as_omegaconf_does() -> None:
    assert load_config(None, ["data.shuffle=0"]).data.shuffle is False
    assert load_config(None, ["data.shuffle=1"]).data.shuffle is True


def test_single_item_list_and_yaml_exponent(tmp_path: Path) -> None:
    assert load_config(None, ["trainer.logger=console"]).trainer.logger == ["console"]
    # PyYAML reads 1e-5 (no dot) as a string; the float field still gets a float
    path = write_yaml(tmp_path, "actor_rollout_ref:\n  actor:\n    optim:\n      lr: 1e-5\n")
    assert load_config(path).actor_rollout_ref.actor.optim.lr == 1e-5


def test_passthrough_section_takes_any_keys() -> None:
    cfg = load_config(
        None,
        [
            "transfer_queue.backend=transferqueue",
            "transfer_queue.transferqueue.storage_backend=MooncakeStore",
            "transfer_queue.transferqueue.segment_size=1024",
        ],
    )
    assert cfg.transfer_queue.transferqueue == {"storage_backend": "MooncakeStore", "segment_size": 1024}


def test_parse_overrides_builds_nested_dicts() -> None:
    assert parse_overrides(["a.b.c=1", "a.b.d=[x, y]", "+e=true"]) == {"a": {"b": {"c": 1, "d": ["x", "y"]}}, "e": True}
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["trainer.total_training_steps"])
    with pytest.raises(ConfigError, match="empty key"):
        parse_overrides(["trainer..x=1"])


# --------------------------------------------------------------------------- errors
def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("trainer.totl_training_steps=3", "trainer.total_training_steps"),
        ("temperature=0.7", "actor_rollout_ref.rollout.temperature"),
        ("actor_rollout_ref.rollout.temprature=0.7", "actor_rollout_ref.rollout.temperature"),
        ("data.train_batchsize=8", "data.train_batch_size"),
        ("algorithm.adv_estimater=gae", "algorithm.adv_estimator"),
    ],
)
def test_unknown_key_suggests_the_nearest(override: str, suggestion: str) -> None:
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert str(info.value) == f"unknown config key {key}; did you mean {suggestion}?"


def test_unknown_key_without_a_near_one_lists_the_valid_keys() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["trainer.zzzzzzzz=1"])
    msg = str(info.value)
    assert "trainer.zzzzzzzz" in msg and "total_training_steps" in msg and "logger" in msg


def test_unknown_key_in_a_file(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"trainer": {"totl_training_steps": 3}})
    with pytest.raises(ConfigError, match="did you mean trainer.total_training_steps"):
        load_config(path)


@pytest.mark.parametrize(
    ("override", "key", "expected"),
    [
        ("trainer.total_training_steps=abc", "trainer.total_training_steps", "int"),
        ("data.max_prompt_length=1.5", "data.max_prompt_length", "int"),
        ("data.shuffle=maybe", "data.shuffle", "bool"),
        ("data.shuffle=[true]", "data.shuffle", "bool"),
        ("actor_rollout_ref.actor.optim.lr=fast", "actor_rollout_ref.actor.optim.lr", "float"),
        ("trainer.logger=5", "trainer.logger", "list"),
        ("trainer.total_training_steps=true", "trainer.total_training_steps", "int"),
        ("data.val_batch_size=many", "data.val_batch_size", "int or null"),
        ("trainer.project_name=null", "trainer.project_name", "str"),
    ],
)
def test_wrong_type_names_key_and_expected_type(override: str, key: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert str(info.value).startswith(f"{key}: expected {expected}, got ")


def test_section_given_a_value_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trainer: expected a mapping"):
        load_config(write_yaml(tmp_path, {"trainer": 5}))


@pytest.mark.parametrize(
    "where",
    [
        ["moe_load_balance_monitor_interval=5"],
        ["actor_rollout_ref.rollout.moe_load_balance_monitor_interval=5"],
        ["actor_rollout_ref.rollout.engine_kwargs.vllm.moe_load_balance_monitor_interval=5"],
        ["transfer_queue.transferqueue.moe_load_balance_monitor_interval=5"],
    ],
)
def test_removed_key_names_the_new_key(where: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, where)
    msg = str(info.value)
    assert "moe_load_balance_monitor_interval" in msg and NEW_MOE_KEY in msg
    assert msg.startswith(where[0].split("=")[0] + ":")  # the full path of the offending key


def test_removed_key_in_a_file(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"actor_rollout_ref": {"rollout": {"moe_load_balance_monitor_interval": 10}}})
    with pytest.raises(ConfigError, match=NEW_MOE_KEY):
        load_config(path)
    assert "moe_load_balance_monitor_interval" in REMOVED_KEYS


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["actor_rollout_ref.actor.optim.lr=-1e-5"], "actor_rollout_ref.actor.optim.lr"),
        (["critic.optim.lr=0"], "critic.optim.lr"),
        (["actor_rollout_ref.actor.clip_ratio=0"], "actor_rollout_ref.actor.clip_ratio"),
        (["actor_rollout_ref.actor.clip_ratio=-0.2"], "actor_rollout_ref.actor.clip_ratio"),
        (["actor_rollout_ref.actor.clip_ratio_high=0"], "actor_rollout_ref.actor.clip_ratio_high"),
        (["actor_rollout_ref.actor.clip_ratio_c=1"], "actor_rollout_ref.actor.clip_ratio_c"),
        (
            ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=5"],
            "actor_rollout_ref.actor.ppo_mini_batch_size",
        ),
        (["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=3"], "critic.ppo_mini_batch_size"),
        (["data.train_batch_size=0"], "data.train_batch_size"),
        (["actor_rollout_ref.rollout.n=0"], "actor_rollout_ref.rollout.n"),
        (["actor_rollout_ref.rollout.temperature=0"], "actor_rollout_ref.rollout.temperature"),
        (["actor_rollout_ref.rollout.top_p=1.5"], "actor_rollout_ref.rollout.top_p"),
        (["actor_rollout_ref.rollout.moe_load_balance_metrics_interval=-1"], NEW_MOE_KEY),
        (["actor_rollout_ref.rollout.moe_near_tie_eps=0"], "actor_rollout_ref.rollout.moe_near_tie_eps"),
        (["algorithm.gamma=1.5"], "algorithm.gamma"),
        (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator"),
        (["actor_rollout_ref.actor.loss_agg_mode=mean"], "actor_rollout_ref.actor.loss_agg_mode"),
        (["trainer.total_training_steps=0"], "trainer.total_training_steps"),
        (["trainer.logger=[console,jsnl]"], "trainer.logger"),
        (["transfer_queue.backend=redis"], "transfer_queue.backend"),
        (["actor_rollout_ref.model.forward_impl=fast"], "actor_rollout_ref.model.forward_impl"),
        (["transfer_queue.metrics.port=70000"], "transfer_queue.metrics.port"),
        (["trainer.resume_mode=resume_path"], "trainer.resume_from_path"),
    ],
)
def test_out_of_range_values(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert str(info.value).startswith(f"{key}: ")


def test_out_of_range_messages_say_what_to_change() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["actor_rollout_ref.actor.ppo_mini_batch_size=5"])
    assert "data.train_batch_size=32 must be divisible by it (got 5)" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(None, ["trainer.logger=[console,jsnl]"])
    assert "did you mean 'jsonl'" in str(info.value)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write_yaml(tmp_path, "trainer: [unclosed", "bad.yaml"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write_yaml(tmp_path, "- a\n- b\n", "list.yaml"))


# --------------------------------------------------------------------------- YAML dump
CHANGED = [
    "trainer.total_training_steps=3",
    "trainer.logger=[console]",
    "actor_rollout_ref.actor.optim.lr=1e-5",
    "actor_rollout_ref.rollout.temperature=0.7",
    "algorithm.adv_estimator=gae",
    "data.train_files=[x.parquet]",
    "data.synthetic.ops=['+', '*']",
    "transfer_queue.transferqueue.storage_backend=SimpleStorage",
    f"{NEW_MOE_KEY}=5",
]


@pytest.mark.parametrize("with_help", [False, True])
def test_yaml_roundtrip(tmp_path: Path, with_help: bool) -> None:
    cfg = load_config(None, CHANGED)
    text = config_to_yaml(cfg, with_help=with_help)
    path = write_yaml(tmp_path, text)
    back = load_config(path)
    assert back == cfg
    assert config_to_dict(back) == config_to_dict(cfg)
    assert load_config(write_yaml(tmp_path, config_to_yaml(Config(), with_help=with_help), "d.yaml")) == Config()


def test_yaml_dump_is_plain_nested_mappings() -> None:
    data = yaml.safe_load(config_to_yaml(Config()))
    assert list(data) == [f.name for f in dataclasses.fields(Config)]
    assert data["actor_rollout_ref"]["rollout"]["temperature"] == 1.0
    assert data["trainer"]["logger"] == ["console", "jsonl"]


def test_describe_comments_every_line() -> None:
    text = config_to_yaml(Config(), with_help=True)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == len(config_leaf_and_section_paths(Config))
    for line in lines:
        assert "  # " in line and line.split("  # ", 1)[1].strip(), line
    assert "temperature: 1.0  # sampling temperature" in text


# --------------------------------------------------------------------------- documentation
def config_leaf_and_section_paths(cls: type, prefix: str = "") -> list[str]:
    """Every dotted path of `cls`, sections included, in field order."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        out.append(prefix + f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            out.extend(config_leaf_and_section_paths(hints[f.name], f"{prefix}{f.name}."))
    return out


def walk_fields(cls: type, prefix: str = ""):
    """(dotted path, dataclass field) for every field of `cls` and of its nested sections."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        yield prefix + f.name, f
        if dataclasses.is_dataclass(hints[f.name]):
            yield from walk_fields(hints[f.name], f"{prefix}{f.name}.")


def test_every_field_has_help() -> None:
    seen = 0
    for path, f in walk_fields(Config):
        help_ = f.metadata.get("help")
        assert isinstance(help_, str) and help_.strip(), f"{path} has no help string"
        seen += 1
    assert seen > 100  # the walk reached the nested sections


def test_every_section_has_a_docstring() -> None:
    hints = typing.get_type_hints(Config)
    sections = {Config} | {hints[f.name] for f in dataclasses.fields(Config)}
    for cls in sections:
        assert cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("), cls.__name__


# --------------------------------------------------------------------------- interpolation, registries, plugins
VERL_STYLE = """
data:
  max_prompt_length: 48
  max_response_length: 8
  train_batch_size: 16
actor_rollout_ref:
  actor:
    ppo_mini_batch_size: ${data.train_batch_size}
    ppo_micro_batch_size_per_gpu: ${oc.env:CONVEYOR_TEST_MICRO,64}
  rollout:
    log_prob_micro_batch_size_per_gpu: ${actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu}
trainer:
  experiment_name: run-${data.max_prompt_length}-${oc.env:CONVEYOR_TEST_TAG}
  default_local_dir: /tmp/ckpts/${trainer.experiment_name}
"""


def test_verl_style_yaml_with_interpolations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_TEST_TAG", "a1")
    monkeypatch.setenv("CONVEYOR_TEST_MICRO", "12")
    cfg = load_config(write_yaml(tmp_path, VERL_STYLE), ["data.train_batch_size=8"])
    # Interpolations resolve after the overrides are merged: they follow the override.
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 8
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 12
    assert isinstance(cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, int)
    assert cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == 12
    assert cfg.trainer.experiment_name == "run-48-a1"
    assert cfg.trainer.default_local_dir == "/tmp/ckpts/run-48-a1"
    # The printed config is resolved: it loads back to the same config without the environment.
    monkeypatch.delenv("CONVEYOR_TEST_TAG")
    assert load_config(write_yaml(tmp_path, config_to_yaml(cfg), "resolved.yaml")) == cfg


def test_interpolation_errors_name_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONVEYOR_TEST_TAG", raising=False)
    with pytest.raises(ConfigError) as info:
        load_config(None, ["trainer.experiment_name=${oc.env:CONVEYOR_TEST_TAG}"])
    assert str(info.value).startswith("trainer.experiment_name: cannot resolve")
    with pytest.raises(ConfigError) as info:
        load_config(None, ["data.max_prompt_length=${data.no_such_key}"])
    assert str(info.value).startswith("data.max_prompt_length: ")
    with pytest.raises(ConfigError) as info:
        load_config(None, ["data.max_prompt_length=${trainer.experiment_name}"])
    assert str(info.value).startswith("data.max_prompt_length: ")


def test_choices_come_from_the_registries() -> None:
    from conveyor.algos.advantages import ADV_ESTIMATORS, NEEDS_CRITIC
    from conveyor.algos.kl import KL_KINDS
    from conveyor.algos.losses import LOSS_AGG_MODES, POLICY_LOSSES
    from conveyor.data_plane import BACKENDS
    from conveyor.metrics.trackers import VALID_LOGGERS
    from conveyor.tasks.dataset import TRUNCATION_MODES
    from conveyor.trainer.plan import build_run_plan

    for name in ADV_ESTIMATORS:
        cfg = load_config(None, [f"algorithm.adv_estimator={name}"])
        assert build_run_plan(cfg, "cpu").use_critic == (name in NEEDS_CRITIC)
    # dro has no default coefficient (as in verl): it is selectable with one.
    own_keys = {"dro": ["actor_rollout_ref.actor.policy_loss.dro_beta=0.1"]}
    for name in POLICY_LOSSES:
        load_config(None, [f"actor_rollout_ref.actor.policy_loss.loss_mode={name}", *own_keys.get(name, [])])
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.actor.policy_loss.dro_beta: loss_mode=dro"):
        load_config(None, ["actor_rollout_ref.actor.policy_loss.loss_mode=dro"])
    for name in LOSS_AGG_MODES:
        load_config(None, [f"actor_rollout_ref.actor.loss_agg_mode={name}", f"critic.loss_agg_mode={name}"])
    for name in KL_KINDS:
        load_config(None, [f"actor_rollout_ref.actor.kl_loss_type={name}", f"algorithm.kl_penalty={name}"])
    for name in VALID_LOGGERS:
        load_config(None, [f"trainer.logger=[{name}]"])
    for name in BACKENDS:
        load_config(None, [f"transfer_queue.backend={name}"])
    for name in TRUNCATION_MODES:
        load_config(None, [f"data.truncation={name}"])
    with pytest.raises(
        ConfigError,
        match=r"^actor_rollout_ref.actor.policy_loss.loss_mode: unknown 'vanila' "
        r"\(did you mean 'vanilla'\?\)",
    ):
        load_config(None, ["actor_rollout_ref.actor.policy_loss.loss_mode=vanila"])


@pytest.mark.parametrize(
    ("override", "key"),
    [
        (
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=0",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        ),
        (
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=-1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        ),
        ("actor_rollout_ref.rollout.val_kwargs.n=0", "actor_rollout_ref.rollout.val_kwargs.n"),
        ("actor_rollout_ref.rollout.val_kwargs.top_p=0", "actor_rollout_ref.rollout.val_kwargs.top_p"),
        ("actor_rollout_ref.rollout.val_kwargs.temperature=-1", "actor_rollout_ref.rollout.val_kwargs.temperature"),
        ("actor_rollout_ref.rollout.val_kwargs.top_k=-1", "actor_rollout_ref.rollout.val_kwargs.top_k"),
    ],
)
def test_keys_checked_when_built(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert str(info.value).startswith(f"{key}: ")


PLUGIN = '''
import torch
from conveyor.algos.advantages import register_adv_estimator, compute_grpo_advantage


@register_adv_estimator("{name}")
def my_estimator(token_level_rewards, response_mask, **kwargs):
    """GRPO without the std, under a new name."""
    kwargs["norm_adv_by_std"] = False
    return compute_grpo_advantage(token_level_rewards, response_mask, **kwargs)
'''


def test_plugin_registers_a_selectable_estimator(tmp_path: Path) -> None:
    plugin = tmp_path / "my_algos.py"
    plugin.write_text(PLUGIN.format(name="config_test_estimator"))
    with pytest.raises(ConfigError, match="algorithm.adv_estimator: unknown 'config_test_estimator'"):
        load_config(None, ["algorithm.adv_estimator=config_test_estimator"])
    cfg = load_config(None, [f"trainer.plugins=[{plugin}]", "algorithm.adv_estimator=config_test_estimator"])
    from conveyor.trainer.plan import build_run_plan

    assert cfg.algorithm.adv_estimator == "config_test_estimator" and build_run_plan(cfg, "cpu").use_critic is False
    # Loaded once per process: a second load does not re-register (which would clash).
    load_config(None, [f"trainer.plugins=[{plugin}]"])
    assert "config_test_estimator" in config_to_yaml(cfg, with_help=True)


def test_bad_plugin_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="trainer.plugins: no such file"):
        load_config(None, [f"trainer.plugins=[{tmp_path / 'missing.py'}]"])
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match="trainer.plugins: importing .* failed: RuntimeError: boom"):
        load_config(None, [f"trainer.plugins=[{broken}]"])


# --------------------------------------------------------------------------- every number of every section is checked
def _numeric_keys(cls: type = Config, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted key, int or float) of every numeric field, nested sections included."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            out.extend(_numeric_keys(t, f"{prefix}{f.name}."))
            continue
        args = [a for a in typing.get_args(t) if a is not type(None)] or [t]
        if args[0] in (int, float):
            out.append((f"{prefix}{f.name}", args[0]))
    return out


_FLOAT_KEYS = [k for k, t in _numeric_keys() if t is float]
# Keys where a negative value means something: seeds, and an entropy coefficient (< 0 penalises entropy).
_SIGNED_KEYS = {
    "data.seed",
    "actor_rollout_ref.model.tiny.seed",
    "trainer.seed",
    "actor_rollout_ref.actor.entropy_coeff",
    # clip_cov bounds a covariance, which may be negative.
    "actor_rollout_ref.actor.policy_loss.clip_cov_lb",
    "actor_rollout_ref.actor.policy_loss.clip_cov_ub",
    # A judgement that stays unparsable may be punished below any parsed score.
    "reward_model.judge.unparsable_score",
    # So may an agent session that failed.
    "actor_rollout_ref.rollout.agent.failure_reward",
}


@pytest.mark.parametrize("key", _FLOAT_KEYS)
@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "1e39"])
def test_every_float_key_refuses_nan_inf_and_float32_overflow(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: "):
        load_config(None, [f"{key}={value}"])


@pytest.mark.parametrize("key", [k for k, _ in _numeric_keys()])
def test_every_numeric_key_refuses_an_int_beyond_int64(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: an integer of 31 digits is too large"):
        load_config(None, [f"{key}={'9' * 31}"])


@pytest.mark.parametrize("key", [k for k, _ in _numeric_keys() if k not in _SIGNED_KEYS])
def test_every_size_count_and_rate_refuses_a_negative_value(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: "):
        load_config(None, [f"{key}=-1"])


def test_numeric_keys_are_found() -> None:
    keys = dict(_numeric_keys())
    assert keys["actor_rollout_ref.actor.entropy_coeff"] is float and keys["data.train_batch_size"] is int
    assert keys["reward.timeout_s"] is float and "actor_rollout_ref.actor.optim.lr" in keys


# --------------------------------------------------------------------------- declarations: ranges, choices, resume
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("actor_rollout_ref.rollout.n=0", "actor_rollout_ref.rollout.n: must be > 0, got 0"),
        (
            "actor_rollout_ref.actor.optim.weight_decay=-1",
            "actor_rollout_ref.actor.optim.weight_decay: must be >= 0, got -1.0",
        ),
        ("algorithm.lam=1.5", "algorithm.lam: must be in [0, 1], got 1.5"),
        ("actor_rollout_ref.rollout.top_p=0", "actor_rollout_ref.rollout.top_p: must be in (0, 1], got 0.0"),
        ("data.synthetic.max_operand=0", "data.synthetic.max_operand: must be >= 1, got 0"),
        ("trainer.max_ckpt_to_keep=0", "trainer.max_ckpt_to_keep: must be > 0 or null (all), got 0"),
        ("critic.optim.lr=0", "critic.optim.lr: must be > 0, got 0.0"),
        ("transfer_queue.metrics.port=65536", "transfer_queue.metrics.port: must be in [0, 65535], got 65536"),
        ("reward.timeout_s=-1", "reward.timeout_s: must be >= 0 (0 = no limit), got -1.0"),
    ],
)
def test_declared_ranges_name_the_full_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert str(info.value) == message


def test_optional_keys_with_a_range_take_null() -> None:
    cfg = load_config(
        None,
        [
            "trainer.max_ckpt_to_keep=null",
            "actor_rollout_ref.actor.clip_ratio_low=null",
            "ray.num_cpus=null",
            "data.val_batch_size=null",
        ],
    )
    assert cfg.trainer.max_ckpt_to_keep is None and cfg.ray.num_cpus is None


@pytest.mark.parametrize(
    ("key", "module", "name"),
    [
        ("actor_rollout_ref.rollout.name", "conveyor.rollout.base", "ROLLOUT_ENGINES"),
        ("actor_rollout_ref.actor.router_replay.mode", "conveyor.models.router_control", "REPLAY_CHOICES"),
        ("actor_rollout_ref.actor.router.bias_update", "conveyor.models.router_control", "BIAS_UPDATES"),
        ("algorithm.kl_ctrl.type", "conveyor.algos.kl", "KL_CONTROLLERS"),
        ("actor_rollout_ref.actor.optim.lr_scheduler", "conveyor.workers.training.optim", "LR_SCHEDULERS"),
        ("critic.optim.lr_scheduler", "conveyor.workers.training.optim", "LR_SCHEDULERS"),
        ("actor_rollout_ref.model.tiny.arch", "conveyor.models.tiny", "TINY_ARCHS"),
        ("actor_rollout_ref.actor.strategy", "conveyor.workers.training.strategy", "STRATEGIES"),
    ],
)
def test_choice_lists_are_the_implementing_registries(key: str, module: str, name: str) -> None:
    import importlib

    registry = list(getattr(importlib.import_module(module), name))
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"{key}=no_such_choice"])
    assert str(info.value).startswith(f"{key}: unknown 'no_such_choice'") and str(info.value).endswith(
        f"valid: {registry}"
    )


def _python(code: str) -> str:
    """Run `code` in a fresh interpreter on this checkout; its stdout."""
    import os
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_importing_the_config_imports_no_implementation() -> None:
    out = _python(
        "import sys, conveyor.config; print(sorted(m for m in sys.modules "
        "if m.startswith('conveyor.') and not m.startswith('conveyor.config')))"
    )
    assert out.strip() == "[]", out


@pytest.mark.parametrize(
    "first", ["conveyor.workers.training.optim", "conveyor.workers.training.strategy", "conveyor.trainer.run_dir"]
)
def test_the_implementation_imports_the_config_without_a_cycle(first: str) -> None:
    _python(f"import {first}; import conveyor.config; conveyor.config.load_config()")


def _described_keys(text: str) -> list[str]:
    """The dotted key of every line of `conveyor config --describe` output, from its indentation."""
    stack: list[str] = []
    keys = []
    for line in text.splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.strip().split(":", 1)[0]
        stack[depth:] = [name]
        keys.append(".".join(stack))
    return keys


def test_describe_lists_exactly_the_schema_keys() -> None:
    from conveyor.config import field_paths

    assert _described_keys(config_to_yaml(Config(), with_help=True)) == field_paths(Config)
    assert len(field_paths(Config)) == len(set(field_paths(Config))) > 150


# The list run_dir kept by hand before the keys carried it as metadata.
OLD_NEUTRAL_KEYS = (
    "trainer.total_training_steps",
    "trainer.project_name",
    "trainer.experiment_name",
    "trainer.logger",
    "trainer.default_local_dir",
    "trainer.test_freq",
    "trainer.val_before_train",
    "trainer.save_freq",
    "trainer.max_ckpt_to_keep",
    "trainer.resume_mode",
    "trainer.resume_from_path",
    "trainer.save_on_interrupt",
    "trainer.resume_accept_config_changes",
    "trainer.dump_freq",
    "trainer.dump_num",
    "trainer.device",
    "trainer.nnodes",
    "trainer.n_gpus_per_node",
    "trainer.num_cpu_workers",
    "trainer.progress_bar",
    "trainer.prometheus.",
    "transfer_queue.",
    "ray.",
    "actor_rollout_ref.actor.strategy",
    "actor_rollout_ref.ref.strategy",
    "critic.strategy",
    "actor_rollout_ref.actor.fsdp_config.param_offload",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
    "actor_rollout_ref.ref.fsdp_config.param_offload",
    "critic.fsdp_config.param_offload",
    "critic.fsdp_config.optimizer_offload",
    "actor_rollout_ref.model.enable_gradient_checkpointing",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "critic.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.model.forward_impl",
    "actor_rollout_ref.rollout.moe_load_balance_metrics_interval",
    "actor_rollout_ref.rollout.moe_near_tie_eps",
    "data.val_files",
    "data.val_batch_size",
)


def test_resume_neutral_keys_are_the_old_list() -> None:
    from conveyor.config import resume_neutral_keys
    from conveyor.trainer.run_dir import NEUTRAL_KEYS

    assert NEUTRAL_KEYS == resume_neutral_keys(Config)
    # optimizer_offload is declared once on the FSDP section, which the reference shares; the reference has
    # no optimizer, so the key changes nothing there. defer_grad_sync (newer than the old list) moves only
    # when gradients are reduced, not what they are, so a resume may change it like the offload keys.
    # hf_whole_gather_max_gb picks how the rollout reaches the weights (gathered once or a layer at a time),
    # like forward_impl: the same numbers up to summation order.
    # The token budgets (use_dynamic_bsz and its limits) regroup rows into micro-batches, like the micro-batch
    # sizes: the losses' normalisers are the mini-batch's, so only the summation order moves.
    budgets = {
        "actor_rollout_ref.actor.use_dynamic_bsz",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
        "critic.use_dynamic_bsz",
        "critic.ppo_max_token_len_per_gpu",
        "critic.forward_max_token_len_per_gpu",
    }
    # Where the engines run (placement, replicas, the asynchronous rollout's process) and the weight sync's bucket
    # size move what the sync carries and where the rollout runs, not the weights a step starts from (the
    # checkpoint's, synced first) nor any number (tests/trainer/test_async_process.py).
    placement = {
        "actor_rollout_ref.rollout.placement",
        "actor_rollout_ref.rollout.replicas",
        "actor_rollout_ref.rollout.update_weights_bucket_megabytes",
        "trainer.v1.separate_async.rollout_process",
        # Where the teachers' ranks run moves where they score, not their log-probs.
        "distillation.placement",
        "distillation.num_workers",
    }
    # The reward model's batching, strategy and placement move how and where it scores, not its scores (its
    # FSDP section's training keys change nothing: it has no optimizer and no gradients).
    reward_model = {
        f"reward_model.{k}"
        for k in (
            "micro_batch_size_per_gpu",
            "use_dynamic_bsz",
            "forward_max_token_len_per_gpu",
            "strategy",
            "placement",
            "num_workers",
            "fsdp_config.param_offload",
            "fsdp_config.optimizer_offload",
            "fsdp_config.defer_grad_sync",
            "judge.micro_batch_size",
        )
    }
    # Whether and how often a dead or hung rollout replica is replaced: the replacement generates the same samples
    # (tests/reliability/test_replica_faults.py). The whole section is neutral: its prefix.
    faults = {"actor_rollout_ref.rollout.fault_tolerance."}
    # Rollout bundles are written beside the run, and a replay trains on the recorded samples: a replay resumes
    # from the recorded run's checkpoint (tests/trainer/test_rollout_replay.py).
    dumps = {"trainer.dump_rollouts.", "trainer.replay_rollouts_from"}
    later = (
        {
            "actor_rollout_ref.ref.fsdp_config.optimizer_offload",
            "actor_rollout_ref.rollout.hf_whole_gather_max_gb",
            "actor_rollout_ref.model.use_remove_padding",
            "actor_rollout_ref.rollout.enforce_eager",
            # The fused LM head computes the same log-probs and gradients as the logits path (float rounding).
            "actor_rollout_ref.model.use_fused_kernels",
        }
        | budgets
        | placement
        | reward_model
        | faults
        | dumps
        | {
            f"{role}.fsdp_config.defer_grad_sync"
            for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
        }
        # Sequence parallelism takes the step it would take without (tests/workers/test_sequence_parallel.py).
        | {
            f"{role}.ulysses_sequence_parallel_size"
            for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
        }
    )
    assert set(NEUTRAL_KEYS) == set(OLD_NEUTRAL_KEYS) | later
    assert len(NEUTRAL_KEYS) == len(set(NEUTRAL_KEYS))


def test_low_precision_master_dtype_is_refused_with_what_to_set() -> None:
    """bf16 master weights would make AdamW train in bf16: refused, naming the mixed-precision keys and the opt-in."""
    with pytest.raises(ConfigError) as info:
        load_config(None, ["actor_rollout_ref.model.dtype=bfloat16"])
    msg = str(info.value)
    assert "actor_rollout_ref.model.dtype" in msg
    assert "actor_rollout_ref.model.dtype=float32" in msg and "fsdp_config.param_dtype=bfloat16" in msg
    assert "allow_low_precision_master_weights=true" in msg
    cfg = load_config(
        None,
        ["actor_rollout_ref.model.dtype=bfloat16", "actor_rollout_ref.model.allow_low_precision_master_weights=true"],
    )
    assert cfg.actor_rollout_ref.model.dtype == "bfloat16"


def test_rollout_dtype_defaults_to_the_models_and_takes_dtype_names() -> None:
    assert load_config(None, []).actor_rollout_ref.rollout.dtype is None
    assert load_config(None, ["actor_rollout_ref.rollout.dtype=bfloat16"]).actor_rollout_ref.rollout.dtype == "bfloat16"
    with pytest.raises(ConfigError, match="actor_rollout_ref.rollout.dtype"):
        load_config(None, ["actor_rollout_ref.rollout.dtype=float64"])


def test_mixed_precision_dtype_defaults_per_device() -> None:
    """Unset: bf16 compute and fp32 reduction on a GPU under fsdp2; the model's dtype on a CPU and under dp/none."""
    from conveyor.workers.training.strategy import mixed_precision

    assert mixed_precision("fsdp2", None, None, "cuda") == ("bfloat16", "float32")
    assert mixed_precision("fsdp2", "float32", None, "cuda") == ("float32", "float32")
    assert mixed_precision("fsdp2", None, None, "cpu") == (None, None)
    assert mixed_precision("fsdp2", "bfloat16", "float32", "cpu") == ("bfloat16", "float32")
    assert mixed_precision("dp", None, None, "cuda") == (None, None)


def test_a_key_newer_than_the_checkpoint_differs_only_when_set_away_from_its_default():
    """A checkpoint written before a key existed resumes when the key keeps its default (the old behaviour)."""
    import copy

    from conveyor.config import config_to_dict
    from conveyor.trainer.run_dir import config_differences

    now = config_to_dict(load_config(None, []))
    saved = copy.deepcopy(now)
    del saved["actor_rollout_ref"]["rollout"]["exact"]
    assert config_differences(saved, now) == []
    changed = config_to_dict(load_config(None, ["actor_rollout_ref.rollout.exact=true"]))
    assert config_differences(saved, changed) == [("actor_rollout_ref.rollout.exact", "(absent)", True)]
    # A key the checkpoint has and this run lacks (one removed since) is still a difference.
    saved["actor_rollout_ref"]["rollout"]["retired_key"] = 1
    assert ("actor_rollout_ref.rollout.retired_key", 1, "(absent)") in config_differences(saved, now)
