"""Evidence for the MoE router controls (docs/moe.md, "Controls") on the default run's tiny Qwen3-MoE, on a CPU.

Part `balance`: loss-free balancing against a skewed router. The base model (`--base`) gets each MoE
layer's router row of one expert refitted (the other rows and every other weight untouched) until that expert
is in the top-k of nearly every token of the task's text: about 4x its fair share of the assignments
(max_vio 3.0 with top-2 of 8 experts). Two runs of the default config start from that model, one with
`actor_rollout_ref.actor.router.bias_update_rate` (`--rate`; its `bias_update` rule `--update`, its
`bias_dead_band` `--dead-band`) and one without, per seed (`trainer.seed`). Printed per seed:
`rollout/moe/max_vio/max` over the first load-balance interval (steps 1-10 in the default run) and over the
last, the held-out accuracy at the last step, the mean of `actor/moe/flip_rate/avg` (how much of the
routing moved across each update), and whether the bias run cut max_vio by at least half (against the run
without it) with its accuracy within `--acc-tolerance` of the run without it. `--no-skew` runs the same two
arms from the base model itself: what balancing costs where there is no skew to undo. `--aux-loss-coef`
balances by the load-balancing loss at that weight instead of the bias, for comparison.

The base: `--base default` is the default run's warm-started model. Its own routing is already far from
balanced (max_vio about 2: the warm start has no balancing term, so a few experts took most tokens and the
rest were barely trained), so any balancing sends tokens to experts that never learned the task, skew or no
skew. `--base balanced` (the default) is the same tiny model warm-started the same way (same init seed,
steps, learning rate and stopping accuracy) with the routers' load-balancing loss added at
`--warmstart-aux-coef` over `--warmstart-aux-tokens`, as MoE pre-training keeps every expert trained: what a
skew then breaks, balancing can restore. The defaults (30, `answer`) balance the tokens `rollout/moe/max_vio`
counts, the answers: the loss over every token (`all`, at 1, 3 or 10) leaves the answer digits' routing
unbalanced (max_vio 0.8-2.3 per layer), so every expert learns the prompts but only a few the answers, and
balancing the answers then costs accuracy whatever the control. The base's load per expert is printed over
the task's whole problems and over their answer tokens.

Held-out accuracy is measured on `--val` problems (default 1000, `data.synthetic.num_val`; the default run
has 128): two policies that disagree on a third of 128 problems differ by about 0.05 from the sample alone,
more than the 0.03 the comparison allows.

Part `replay`: `router_replay.mode=auto` (which the plan resolves on the default run; its line is printed)
against a fixed `R3`, per seed: held-out accuracy at the last step and the median step time
(`timing_s/step`), the two arms alternating so that a noisy neighbour slows both.

Runs are in this process, one after another, each in its own temporary run directory; the model cache is
conveyor's (`CONVEYOR_CACHE`, else ~/.cache/conveyor), so the warm-started model is built once. Nothing is
written elsewhere. The load average before and after is printed: on a shared machine step times move with it,
the ratios less.

    python benchmarks/router_control.py                                  # both parts, seeds 0 1 2, 100 steps
    python benchmarks/router_control.py --part balance --seeds 0 --steps 100 --rate 0.02
    python benchmarks/router_control.py --part balance --update proportional
    python benchmarks/router_control.py --part balance --warmstart-aux-tokens all --warmstart-aux-coef 1 --dead-band 0.5
    python benchmarks/router_control.py --part balance --seeds 0 --no-skew  # balancing the base's own routing
    python benchmarks/router_control.py --part balance --base default      # skew the default warm start
    python benchmarks/router_control.py --part replay --seeds 0 1 --steps 200
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RUN = ROOT / "examples" / "tiny_cpu.yaml"


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _config(overrides: Sequence[str], run_dir: Path) -> Any:
    from conveyor.config import load_config

    return load_config(
        str(DEFAULT_RUN),
        [
            *overrides,
            f"trainer.default_local_dir={run_dir}",
            "trainer.logger=[jsonl]",
            "trainer.progress_bar=false",
            "trainer.save_freq=0",
        ],
    )


def _task_texts(n: int, seed: int) -> list[str]:
    """`n` problems of the default task written out with their answers ("23+45=68"): what the router routes."""
    from conveyor.tasks.synthetic import evaluate, make_arithmetic_records

    out = []
    for record in make_arithmetic_records(n, seed=seed):
        text = record["prompt"][-1]["content"]
        a, b = text.rstrip("=").split("+")
        out.append(f"{text}{evaluate(int(a), '+', int(b))}")
    return out


def _router_inputs(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Each MoE layer's router input rows over the real tokens of `ids`."""
    from conveyor.models.moe_routing import moe_layers

    seen: list[torch.Tensor] = []
    hooks = [layer.router.register_forward_pre_hook(lambda m, a: seen.append(a[0])) for layer in moe_layers(model)]
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    finally:
        for hook in hooks:
            hook.remove()
    keep = mask.reshape(-1).bool()
    return [h.reshape(-1, h.shape[-1])[keep] for h in seen]


def skew_router(
    source: str, target: Path, *, expert: int = 0, share: float = 0.99, lead: float = 0.0, seed: int = 0
) -> tuple[list[float], list[float]]:
    """Copy the checkpoint `source` to `target` with each router's row of `expert` refitted into nearly every
    token's top-k; per layer, the expert's share of tokens and its median logit lead over the k-th other.

    Layer by layer (a layer's inputs depend on the routing before it): Adam on that one row only, pushing the
    expert's logit above the k-th largest of the others' on the task's text, until it is in the top-k of `share`
    of the tokens and its median lead is at least `lead` (0: the share alone decides).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conveyor.models.moe_routing import moe_layers

    shutil.copytree(source, target, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    batch = tokenizer(_task_texts(256, seed), return_tensors="pt", padding=True)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    shares, gaps = [], []
    for index, layer in enumerate(moe_layers(model)):
        h = _router_inputs(model, ids, mask)[index]
        weight = layer.router.weight
        row = weight.detach()[expert].clone().requires_grad_(True)
        others = torch.cat([weight.detach()[:expert], weight.detach()[expert + 1 :]])
        k = int(layer.router.top_k)
        kth = torch.topk(h @ others.T, k, dim=-1).values[:, k - 1]
        opt = torch.optim.Adam([row], lr=0.01)
        margin = lead + 0.5
        for _ in range(2000):
            ahead = h @ row - kth
            # Stop once the expert is in the top-k of `share` of the tokens (by a median `lead`): no larger a skew.
            if float((ahead > 0).float().mean()) >= share and float(ahead.median()) >= lead:
                break
            loss = torch.relu(margin - ahead).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            weight[expert] = row.detach()
        chosen = layer.router(h)[2]
        shares.append(float((chosen == expert).any(dim=-1).float().mean()))
        gaps.append(float((h @ row.detach() - kth).median()))
    model.save_pretrained(target, safe_serialization=True)
    return shares, gaps


def task_load(path: str) -> dict[str, torch.Tensor]:
    """Each MoE layer's top-k assignments per expert, (L, E), of the checkpoint `path` over the task's text:
    `all` its tokens and `answer` the answers' only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conveyor.models.router_control import RouterTap

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    texts = _task_texts(256, 0)
    batch = AutoTokenizer.from_pretrained(path)(texts, return_tensors="pt", padding=True)
    mask = batch["attention_mask"]
    answer = torch.zeros_like(mask)
    for i, text in enumerate(texts):  # one token per character: the answer is the real row's last characters
        real = mask[i].nonzero().flatten()
        answer[i, real[len(real) - (len(text) - text.index("=") - 1) :]] = 1
    out = {}
    for name, rows in (("all", mask), ("answer", answer)):
        tap = RouterTap(model, keep_logits=False, count=True)
        with torch.no_grad(), tap.active(rows):
            model(input_ids=batch["input_ids"], attention_mask=mask)
        out[name] = tap.pop_load()
    return out


def balanced_warmstart(cfg: Any, source: str, target: Path, coef: float, tokens: str = "all") -> int:
    """Write to `target` the tiny model of `cfg` warm-started as the default one is, plus `coef` x the routers'
    load-balancing loss; how many warm-start steps it took."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from conveyor.trainer.setup import load_prompt_records
    from conveyor.trainer.warmstart import supervised_warmstart

    tiny = cfg.actor_rollout_ref.model.tiny
    shutil.copytree(source, target, dirs_exist_ok=True)  # the tokenizer and config; the weights are rewritten
    train, _ = load_prompt_records(cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source))
        losses = supervised_warmstart(
            model,
            AutoTokenizer.from_pretrained(source),
            train,
            steps=tiny.warmstart_steps,
            lr=tiny.warmstart_lr,
            seed=tiny.seed,
            until_accuracy=tiny.warmstart_until_accuracy,
            aux_loss_coef=coef,
            aux_loss_tokens=tokens,
        )
    model.eval().save_pretrained(target, safe_serialization=True)
    return len(losses)


def _base(steps: int, val: int, extra: Sequence[str]) -> list[str]:
    """The overrides every run of a part shares: `steps` steps, held-out accuracy on `val` problems at the end."""
    return [
        f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={steps}",
        f"data.synthetic.num_val={val}",
        *extra,
    ]


def run(overrides: Sequence[str]) -> dict[int, dict[str, float]]:
    """One training run of the default config with `overrides`; its metrics rows by step."""
    from conveyor.metrics.trackers import read_metrics_jsonl
    from conveyor.trainer.run import run_training

    with tempfile.TemporaryDirectory(prefix="router-control-") as tmp:
        run_training(_config(overrides, Path(tmp)))
        return {int(r["step"]): r for r in read_metrics_jsonl(Path(tmp) / "metrics.jsonl")}


def _last(rows: dict[int, dict[str, float]], key: str) -> float:
    return next(rows[s][key] for s in sorted(rows, reverse=True) if key in rows[s])


def _first(rows: dict[int, dict[str, float]], key: str) -> float:
    return next(rows[s][key] for s in sorted(rows) if key in rows[s] and s > 0)


def _mean(rows: dict[int, dict[str, float]], key: str) -> float:
    values = [r[key] for s, r in rows.items() if s > 0 and key in r]
    return statistics.fmean(values) if values else float("nan")


def balance(
    seeds: Sequence[int],
    steps: int,
    rate: float,
    tolerance: float,
    extra: Sequence[str],
    start: str = "balanced",
    aux_coef: float = 30.0,
    update: str = "sign",
    dead_band: float = 0.3,
    skew: bool = True,
    aux_loss_coef: float = 0.0,
    skew_lead: float = 0.0,
    aux_tokens: str = "answer",
    val: int = 1000,
) -> list[dict[str, Any]]:
    """Part `balance`: loss-free balancing from a skewed router, against the same run without it, per seed."""
    from conveyor.trainer.setup import prepare_default_model

    base = _base(steps, val, extra)
    cfg = _config(base, Path(tempfile.gettempdir()))
    source = prepare_default_model(cfg)
    results = []
    with tempfile.TemporaryDirectory(prefix="skewed-router-") as tmp:
        skewed = Path(tmp) / "skewed"
        if start == "balanced":
            balanced = Path(tmp) / "balanced"
            ws_steps = balanced_warmstart(cfg, source, balanced, aux_coef, aux_tokens)
            print(
                f"balanced warm start: {ws_steps} steps with load-balancing loss x {aux_coef} over {aux_tokens} tokens"
            )
            source = str(balanced)
        for tokens, load in task_load(source).items():
            mean = load.mean(dim=1)
            for i, (row, vio) in enumerate(zip(load.tolist(), ((load.max(dim=1).values - mean) / mean).tolist())):
                print(
                    f"base model ({start}) layer {i}, {tokens} tokens: assignments per expert "
                    f"{[int(x) for x in row]}, max_vio {vio:.2f}"
                )
        if skew:
            shares, gaps = skew_router(source, skewed, lead=skew_lead)
            print(
                f"skewed router: expert 0 in the top-k of {', '.join(f'{s:.3f}' for s in shares)} of tokens per "
                f"layer, its logit ahead of the k-th other's by a median {', '.join(f'{g:.2f}' for g in gaps)}"
            )
        else:
            print("no skew: both arms start from the base model")
        model = [f"actor_rollout_ref.model.path={skewed if skew else source}"]
        key = "actor_rollout_ref.actor.router"
        bias = [f"{key}.bias_update_rate={rate}", f"{key}.bias_update={update}", f"{key}.bias_dead_band={dead_band}"]
        if aux_loss_coef > 0:  # the balancing arm balances by the load-balancing loss instead
            bias = [f"{key}.aux_loss_coef={aux_loss_coef}"]
        print(f"balancing arm ('bias' below): {' '.join(bias)}")
        for seed in seeds:
            arms = {}
            for name, more in (("off", []), ("bias", bias)):
                rows = run(base + model + [f"trainer.seed={seed}", *more])
                arms[name] = {
                    "vio_first": _first(rows, "rollout/moe/max_vio/max"),
                    "vio_last": _last(rows, "rollout/moe/max_vio/max"),
                    "acc": _last(rows, "val/accuracy"),
                    "acc0": rows[0]["val/accuracy"] if "val/accuracy" in rows.get(0, {}) else float("nan"),
                    "flip": _mean(rows, "actor/moe/flip_rate/avg"),
                }
            off, on = arms["off"], arms["bias"]
            cut = on["vio_last"] <= 0.5 * off["vio_last"] and on["vio_last"] <= 0.5 * off["vio_first"]
            ok = cut and abs(on["acc"] - off["acc"]) <= tolerance
            results.append({"seed": seed, "off": off, "bias": on, "cut_half": cut, "pass": ok})
            print(
                f"seed {seed}: max_vio first interval off {off['vio_first']:.3f} bias {on['vio_first']:.3f}; "
                f"last interval off {off['vio_last']:.3f} bias {on['vio_last']:.3f} "
                f"({on['vio_last'] / max(off['vio_last'], 1e-9):.2f}x); held-out accuracy step 0 {off['acc0']:.3f}, "
                f"step {steps} off {off['acc']:.3f} bias {on['acc']:.3f} (diff {on['acc'] - off['acc']:+.3f}); "
                f"mean actor/moe/flip_rate/avg off {off['flip']:.4f} bias {on['flip']:.4f}; "
                f"{'PASS' if ok else 'FAIL'}"
            )
    return results


def replay(seeds: Sequence[int], steps: int, extra: Sequence[str], val: int = 1000) -> list[dict[str, Any]]:
    """Part `replay`: router_replay.mode=auto against R3 on the default run, per seed."""
    from conveyor.trainer.plan import build_run_plan

    base = _base(steps, val, extra)
    plan = build_run_plan(
        _config(base + ["actor_rollout_ref.actor.router_replay.mode=auto"], Path("/nonexistent")), "cpu"
    )
    print(next(d for d in plan.decisions if d.startswith("router_replay.mode=auto")))
    results = []
    for seed in seeds:
        arms = {}
        for mode in ("auto", "R3"):
            t0 = time.perf_counter()
            rows = run(base + [f"actor_rollout_ref.actor.router_replay.mode={mode}", f"trainer.seed={seed}"])
            step_times = [r["timing_s/step"] for s, r in rows.items() if s > 1 and "timing_s/step" in r]
            # The thread's CPU seconds per step: what a busy machine disturbs far less than wall time.
            cpu_times = [r["timing_cpu_s/step"] for s, r in rows.items() if s > 1 and "timing_cpu_s/step" in r]
            arms[mode] = {
                "acc": _last(rows, "val/accuracy"),
                "step_s": statistics.median(step_times),
                "cpu_step_s": statistics.median(cpu_times) if cpu_times else float("nan"),
                "wall_s": time.perf_counter() - t0,
            }
        a, r3 = arms["auto"], arms["R3"]
        results.append(
            {
                "seed": seed,
                "auto": a,
                "R3": r3,
                "step_ratio": r3["step_s"] / a["step_s"],
                "cpu_ratio": r3["cpu_step_s"] / a["cpu_step_s"],
            }
        )
        print(
            f"seed {seed}: held-out accuracy step {steps} auto ({plan.replay_mode}) {a['acc']:.3f}, "
            f"R3 {r3['acc']:.3f}; "
            f"median step auto {a['step_s'] * 1e3:.1f} ms, R3 {r3['step_s'] * 1e3:.1f} ms "
            f"(R3 / auto {r3['step_s'] / a['step_s']:.2f}x); CPU per step auto {a['cpu_step_s'] * 1e3:.1f} ms, "
            f"R3 {r3['cpu_step_s'] * 1e3:.1f} ms ({r3['cpu_step_s'] / a['cpu_step_s']:.2f}x)"
        )
    if results:
        cpu = [r["cpu_ratio"] for r in results]
        print(
            f"R3 / auto CPU time per step: median {statistics.median(cpu):.2f}x "
            f"(min {min(cpu):.2f}, max {max(cpu):.2f})"
        )
        ratios = [r["step_ratio"] for r in results]
        print(
            f"R3 / auto step time: median {statistics.median(ratios):.2f}x "
            f"(min {min(ratios):.2f}, max {max(ratios):.2f})"
        )
    return results


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the parts asked for; print one line per seed and a summary; return the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("balance", "replay", "both"), default="both")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="trainer.seed of each run pair")
    parser.add_argument("--steps", type=int, default=100, help="training steps of every run")
    parser.add_argument("--rate", type=float, default=0.05, help="router.bias_update_rate of the balancing runs")
    parser.add_argument(
        "--update", default="sign", help="router.bias_update of the balancing runs (sign or proportional)"
    )
    parser.add_argument("--dead-band", type=float, default=0.3, help="router.bias_dead_band of the balancing runs")
    parser.add_argument(
        "--no-skew", dest="skew", action="store_false", help="start both arms from the base model, unskewed"
    )
    parser.add_argument(
        "--skew-lead",
        type=float,
        default=0.0,
        help="refit the skewed row until the expert's median logit lead over the k-th other is at least this",
    )
    parser.add_argument(
        "--aux-loss-coef",
        type=float,
        default=0.0,
        help="balance by router.aux_loss_coef at this weight instead of the bias (a control; 0 = the bias)",
    )
    parser.add_argument(
        "--base", choices=("balanced", "default"), default="balanced", help="the model the skew is applied to"
    )
    parser.add_argument(
        "--warmstart-aux-coef", type=float, default=30.0, help="load-balancing loss of the balanced warm start"
    )
    parser.add_argument(
        "--warmstart-aux-tokens",
        choices=("all", "answer"),
        default="answer",
        help="the tokens the balanced warm start's load-balancing loss counts",
    )
    parser.add_argument("--val", type=int, default=1000, help="held-out problems (data.synthetic.num_val)")
    parser.add_argument("--acc-tolerance", type=float, default=0.03, help="allowed held-out accuracy difference")
    parser.add_argument("--set", nargs="*", default=[], help="more config overrides for every run (tests: smaller)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (a first and a last load-balance interval)")
    from conveyor.models.router_control import BIAS_UPDATES

    if args.update not in BIAS_UPDATES:
        parser.error(f"--update must be one of {', '.join(BIAS_UPDATES)} (router.bias_update), got {args.update!r}")
    print(f"load average before: {_load()} ({os.cpu_count()} CPUs); seeds {args.seeds}, {args.steps} steps")
    out: dict[str, Any] = {}
    if args.part in ("balance", "both"):
        out["balance"] = balance(
            args.seeds,
            args.steps,
            args.rate,
            args.acc_tolerance,
            args.set,
            args.base,
            args.warmstart_aux_coef,
            args.update,
            args.dead_band,
            args.skew,
            args.aux_loss_coef,
            args.skew_lead,
            args.warmstart_aux_tokens,
            args.val,
        )
        passed = sum(r["pass"] for r in out["balance"])
        print(f"loss-free balancing: {passed}/{len(out['balance'])} seeds cut max_vio by half within accuracy")
    if args.part in ("replay", "both"):
        out["replay"] = replay(args.seeds, args.steps, args.set, args.val)
    print(f"load average after: {_load()}")
    return out


if __name__ == "__main__":
    main()
