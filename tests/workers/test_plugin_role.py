"""A scoring role from a plugin file: registered in the role table, run on the actor's ranks and on its own.

The plugin (written here into tmp_path, named by `trainer.plugins`) registers one `Role`: a worker that adds
`bonus` x each response's length to its reward, a handle whose `score` calls it, and a decision read from the
environment (the test sets it). Nothing else names the role: the plan, the worker specs, the groups and the reward
stage all reach it through the table.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from conveyor.config import load_config
from conveyor.metrics.trackers import read_metrics_jsonl
from conveyor.trainer.run import run_training
from conveyor.workers.placement.group import LocalWorkerGroup
from conveyor.workers.placement.role_table import ROLES

pytestmark = pytest.mark.process  # it trains

PLUGIN = textwrap.dedent(
    '''
    """A toy scoring role: `bonus` x the response's length, added to its reward on the last response token."""

    import os

    import torch

    from conveyor.metrics.reduce import weighted
    from conveyor.workers.placement.role_table import Role, RoleHandle, register_role
    from conveyor.workers.ranks.perf import result_handle


    class LengthScorer:
        """One rank of the toy role."""

        def __init__(self, *, rank, world_size, data_plane, bonus):
            self.rank, self.data_plane, self.bonus = rank, data_plane, bonus

        def compute_length_score(self, meta):
            """Writes `length_score` (B,) and adds it to `rm_scores` (B, R) on each response's last token."""
            fields = ["response_mask", "rm_scores"]
            td = self.data_plane.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=fields)
            lengths = td["response_mask"].sum(-1).long()
            score = self.bonus * lengths.float()
            rm_scores = td["rm_scores"].float().clone()
            rm_scores[torch.arange(len(score)), (lengths - 1).clamp(min=0)] += score
            self.data_plane.kv_batch_put(
                keys=meta.keys,
                partition_id=meta.partition_id,
                fields={"rm_scores": rm_scores, "length_score": score},
            )
            metrics = weighted("reward/length_score", float(score.sum()), float(len(score)))
            return result_handle(meta, ["rm_scores", "length_score"], metrics)


    class LengthScoreGroup(RoleHandle):
        """The toy role's handle."""

        def score(self, meta):
            """Stage 3: the length score, summed into rm_scores."""
            return self.ranks.call(LengthScorer.compute_length_score, meta)


    def decide(cfg, decision):
        """On the actor's ranks or on its own, as the test asks; not at all when it does not."""
        placement = os.environ.get("CONVEYOR_TEST_LENGTH_SCORE")
        if placement is not None:
            decision.why.append(f"length score: {placement}")
        return placement


    register_role(
        Role(
            "length_score",
            LengthScorer,
            lambda cfg, plan, where: {"data_plane": where.data_plane, "bonus": 100.0},
            LengthScoreGroup,
            decide,
            scores=True,
        )
    )
    '''
)


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory):
    """The plugin file; its role leaves the table after the module's tests (it was registered in this process)."""
    path = tmp_path_factory.mktemp("plugin") / "length_score_role.py"
    path.write_text(PLUGIN)
    yield path
    ROLES.pop("length_score", None)


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_a_plugin_role_scores_on_the_actors_ranks_and_apart(plugin, placement, tiny_run, monkeypatch) -> None:
    import conveyor.trainer.run as run

    built = []

    def recording(*args, **kwargs):
        built.append(build(*args, **kwargs))
        return built[-1]

    build = run.build_worker_groups
    monkeypatch.setattr(run, "build_worker_groups", recording)
    monkeypatch.setenv("CONVEYOR_TEST_LENGTH_SCORE", placement)
    cfg = load_config(None, tiny_run + [f"trainer.plugins=[{plugin}]"])
    run_training(cfg)

    run_dir = Path(cfg.trainer.default_local_dir)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["roles"]["length_score"] == placement and f"length score: {placement}" in plan["decisions"]
    (groups,) = built
    ranks, actor = groups.length_score.ranks, groups.actor.ranks
    assert isinstance(ranks, LocalWorkerGroup) and groups.scorers() == [groups.length_score]
    # Colocated: its worker is built in the actor's host, beside the actor's; apart: a host of its own.
    assert (ranks.host is actor.host) == (placement == "colocated")
    assert ranks.host.roles == (["actor", "length_score"] if placement == "colocated" else ["length_score"])

    rows = [r for r in read_metrics_jsonl(run_dir / "metrics.jsonl") if r["step"] > 0]
    assert len(rows) == 2
    for row in rows:
        # The score reached the reward: 100 x the mean response length, beside a rule reward within [-1, 1].
        assert row["reward/length_score"] == pytest.approx(100.0 * row["response_length/mean"])
        assert abs(row["reward/mean"] - row["reward/length_score"]) <= 1.0


def test_the_table_refuses_a_taken_name_a_handle_of_another_kind_and_a_role_where_it_cannot_run() -> None:
    import dataclasses

    from conveyor.trainer.plan import build_run_plan
    from conveyor.workers.placement.roles import register_role, worker_specs

    actor = ROLES["actor"]
    assert register_role(actor) is actor  # the same record again (a module imported twice): a no-op
    with pytest.raises(ValueError, match="role 'actor' is already registered"):
        register_role(dataclasses.replace(actor, scores=True))
    with pytest.raises(ValueError, match="RoleHandle subclass"):
        dataclasses.replace(actor, name="other", handle=object)
    plan = build_run_plan(load_config(None, []), "cpu")
    for roles, message in (
        ({**plan.roles, "nope": "colocated"}, "role: unknown 'nope'"),
        ({**plan.roles, "judge": "colocated"}, "role 'judge' runs on ranks of its own"),
        ({**plan.roles, "critic": "elsewhere"}, "unknown placement 'elsewhere'"),
    ):
        with pytest.raises(ValueError, match=message):
            worker_specs(load_config(None, []), dataclasses.replace(plan, roles=roles), "unused", None, None, "cpu")
