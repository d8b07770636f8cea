"""The agent gateway's cost: the same tool-using sessions through the built-in loop and through the gateway.

The rollout is the multi-turn arithmetic tool loop over a tiny Qwen3-MoE (an untrained one, under a call format that
makes it call the calculator often): once with the built-in loop (`AgentLoop`, in-process), once with agents on the
real `openai` client talking to the gateway (`GatewayLoop`) that mirror the built-in loop's turns
(examples/agents/arithmetic_agent.py). The two produce the same tokens (tests/agent/test_gateway.py checks it
bitwise), so the difference in wall time is the gateway's: HTTP, JSON, rendering, the batcher's wait for the round,
and the agents themselves. Printed for 1, 8 and 64 concurrent sessions: the rollout time of each (median of
`--rounds`), their ratio and the range of the rounds' own ratios, the gateway's overhead per call, the CPU each call
costs the server's thread and the agents' threads (their openai client and tools; with `--agent command` they are
other processes, not counted), sessions/s and tokens/s.

    OMP_NUM_THREADS=1 python benchmarks/gateway.py                       # callable agents (threads, real HTTP)
    OMP_NUM_THREADS=1 python benchmarks/gateway.py --agent command       # a process per session

A `command` agent pays its interpreter's start (about 1 s of CPU for Python with the openai package) once per
session, which no server can hide; the callable measures the gateway itself.

`--learn` instead trains the arithmetic tool task both ways (examples/agent_arithmetic_tool.yaml, the built-in
loop, and examples/agent_gateway.yaml, the same agent through the gateway), for each `--seeds` trainer seed, one
run at a time from one shared warm start, and prints held-out accuracy at steps 0 and 60 and the wall time:

    OMP_NUM_THREADS=1 python benchmarks/gateway.py --learn --seeds 0 1 2 --out runs/gateway_learn
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "agents"))

from conveyor.models.tiny import build_tiny_model  # noqa: E402
from conveyor.models.tokenizer import build_char_tokenizer  # noqa: E402
from conveyor.rollout.agent_loop import AgentLoop, AgentLoopSettings  # noqa: E402
from conveyor.rollout.base import SamplingParams  # noqa: E402
from conveyor.rollout.gateway import GatewayLoop, GatewaySettings  # noqa: E402
from conveyor.rollout.gateway.trajectory import session_task  # noqa: E402
from conveyor.rollout.hf import HFEngine  # noqa: E402
from conveyor.tools import get_format, load_tools  # noqa: E402
from conveyor.user_code import import_user_code  # noqa: E402

FORMAT = "test_digit_calls"
TOOLS = str(ROOT / "examples" / "tools" / "calculator.yaml")
PLUGIN = str(ROOT / "tests" / "agent" / "digit_format.py")


def _agent(base_url: str, api_key: str, task: dict) -> None:
    import arithmetic_agent

    # The example's in-process entry point with the benchmark's call format (one HTTP client for all sessions).
    if not arithmetic_agent._CLIENT:
        import openai

        arithmetic_agent._CLIENT.append(openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600))
    client = arithmetic_agent._CLIENT[0].with_options(base_url=base_url, api_key=api_key)
    arithmetic_agent.session(client, task, tools_yaml=TOOLS, call_format=FORMAT)


def _thread_cpu(name: str) -> float:
    """CPU seconds so far of this process's live threads named `name` (Linux; 0 where /proc has no such file)."""
    total = 0.0
    for thread in threading.enumerate():
        if thread.name != name:
            continue
        try:
            with open(f"/proc/self/task/{thread.native_id}/schedstat") as f:
                total += int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            pass
    return total


def measure(
    sessions: int,
    rounds: int,
    agent: str,
    max_new_tokens: int = 24,
    seed: int = 0,
    hidden: int = 0,
    layers: int = 0,
    batch_wait_s: float = 60.0,
) -> dict:
    """Median rollout seconds of the built-in loop and of the gateway over `rounds`, for `sessions` sessions."""
    import_user_code(PLUGIN, key="--plugin")
    tok = build_char_tokenizer()
    size = {"hidden_size": hidden, "num_layers": layers} if hidden else {}
    model = build_tiny_model("qwen3_moe", tok, seed=seed, **size).eval()
    engine = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    texts = [f"{(i * 37) % 100}*{(i * 53) % 100}=" for i in range(sessions)]
    enc = tok(texts, padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    params = SamplingParams(max_new_tokens=max_new_tokens, capture_routing=True)
    builtin = AgentLoop(
        engine,
        tok,
        load_tools(TOOLS),
        get_format(FORMAT),
        AgentLoopSettings(max_assistant_turns=3, max_user_turns=2, max_tool_response_length=16),
    )
    if agent == "command":
        settings = GatewaySettings(
            command=f"{sys.executable} {ROOT / 'examples/agents/arithmetic_agent.py'} --format {FORMAT} "
            f"--plugin {PLUGIN}",
            batch_wait_s=batch_wait_s,
        )
    else:
        settings = GatewaySettings(callable=_agent, batch_wait_s=batch_wait_s)
    gateway = GatewayLoop(engine, tok, get_format(FORMAT), settings)
    tasks = [session_task([{"role": "user", "content": t}], "t", "0", {}, t) for t in texts]
    ref_s, gw_s, engine_s, calls, tokens = [], [], [], 0, 0
    # Where the gateway's CPU goes, per round: the trainer's thread (the engine and the batcher), the server's thread,
    # and the rest of the process (the agents' threads: their openai client and tools).
    cpu: dict[str, list[float]] = {"main": [], "server": [], "agents": []}
    try:
        for r in range(rounds):
            t0 = time.perf_counter()
            ref = builtin.run(ids, mask, params, generator=torch.Generator().manual_seed(r))
            ref_s.append(time.perf_counter() - t0)
            main0, server0, all0 = time.thread_time(), _thread_cpu("agent-gateway"), time.process_time()
            t0 = time.perf_counter()
            out = gateway.run(ids, mask, params, generator=torch.Generator().manual_seed(r), tasks=tasks)
            gw_s.append(time.perf_counter() - t0)
            main, server = time.thread_time() - main0, _thread_cpu("agent-gateway") - server0
            cpu["main"].append(main)
            cpu["server"].append(server)
            cpu["agents"].append(max(0.0, time.process_time() - all0 - main - server))
            calls = int(out.metrics["rollout/agent/calls_per_session@sum"])
            engine_s.append(out.metrics["rollout/agent/engine_time_s"])
            tokens = int(out["response_mask"].sum())
            if batch_wait_s >= 60:  # the round rule in force: the same batches as the built-in loop, the same tokens
                assert tokens == int(ref["response_mask"].sum()), "the gateway sampled other tokens than the loop"
    finally:
        gateway.close()
    a, b = statistics.median(ref_s), statistics.median(gw_s)
    return {
        "sessions": sessions,
        "builtin_s": a,
        "gateway_s": b,
        "engine_s": statistics.median(engine_s),
        "ratio": b / a,
        # The spread: each round's ratio (its built-in run and its gateway run are neighbours in time, so a busy
        # machine slows both alike).
        "ratio_min": min(g / r for g, r in zip(gw_s, ref_s)),
        "ratio_max": max(g / r for g, r in zip(gw_s, ref_s)),
        "calls": calls,
        "overhead_ms_per_call": 1000 * (b - a) / max(calls, 1),
        # CPU per call off the engine: the server's thread, and the agents' (with its openai client) in this process.
        "server_cpu_ms_per_call": 1000 * statistics.median(cpu["server"]) / max(calls, 1),
        "agents_cpu_ms_per_call": 1000 * statistics.median(cpu["agents"]) / max(calls, 1),
        "main_cpu_s": statistics.median(cpu["main"]),
        "sessions_per_s": sessions / b,
        "tokens_per_s": tokens / b,
    }


def learn(seeds: list[int], out: Path) -> list[dict]:
    """Train both examples for each trainer seed; held-out accuracy at the first and last validation, and seconds."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), CONVEYOR_CACHE=str(out / "cache"))
    rows = []
    for seed in seeds:
        for name in ("agent_arithmetic_tool", "agent_gateway"):
            run = out / f"{name}-{seed}"
            cmd = [
                sys.executable,
                "-m",
                "conveyor.cli",
                "train",
                "--config",
                str(ROOT / "examples" / f"{name}.yaml"),
                f"trainer.seed={seed}",
                f"trainer.default_local_dir={run}",
                "trainer.progress_bar=false",
                "trainer.logger=[jsonl]",
            ]
            t0 = time.perf_counter()
            subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
            seconds = time.perf_counter() - t0
            vals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
            acc = [(r["step"], r["val/accuracy"]) for r in vals if "val/accuracy" in r]
            rows.append({"loop": name, "seed": seed, "start": acc[0][1], "end": acc[-1][1], "seconds": seconds})
            print(
                f"{name:>22} seed {seed}: held-out {acc[0][1]:.3f} -> {acc[-1][1]:.3f} in {seconds:.0f} s", flush=True
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print the table for each session count."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--agent", choices=["callable", "command"], default="callable")
    ap.add_argument("--max-new-tokens", type=int, default=24, help="each session's response budget")
    ap.add_argument("--hidden", type=int, default=0, help="the model's hidden size (0: the tiny default)")
    ap.add_argument("--layers", type=int, default=0, help="its layers (with --hidden)")
    ap.add_argument(
        "--batch-wait-s",
        type=float,
        default=60.0,
        help="agent.batch_wait_s (60: every batch waits for the whole round, as the built-in loop's; smaller: the "
        "engine starts on the requests that are there, other batches, other tokens)",
    )
    ap.add_argument("--learn", action="store_true", help="train the tool task through both loops instead")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "gateway_learn")
    args = ap.parse_args(argv)
    if args.learn:
        rows = learn(args.seeds, args.out)
        for seed in args.seeds:
            a, b = (
                next(r["end"] for r in rows if r["seed"] == seed and r["loop"] == n)
                for n in ("agent_arithmetic_tool", "agent_gateway")
            )
            print(f"seed {seed}: built-in {a:.3f}, gateway {b:.3f}, difference {b - a:+.3f}")
        return 0
    torch.set_num_threads(1)
    size = f"hidden {args.hidden}, {args.layers} layers" if args.hidden else "the tiny size"
    print(
        f"agent: {args.agent}; median of {args.rounds} rounds; Qwen3-MoE at {size}, {args.max_new_tokens}-token "
        "budget, 3 turns at most"
    )
    print(
        f"{'sessions':>8} {'built-in s':>10} {'gateway s':>10} {'engine s':>9} {'ratio':>6} {'rounds':>11} "
        f"{'calls':>6} {'ms/call':>8} {'server ms':>9} {'agents ms':>9} {'sessions/s':>10} {'tokens/s':>9}"
    )
    for n in args.sessions:
        r = measure(
            n,
            args.rounds,
            args.agent,
            args.max_new_tokens,
            hidden=args.hidden,
            layers=args.layers,
            batch_wait_s=args.batch_wait_s,
        )
        print(
            f"{n:>8} {r['builtin_s']:>10.3f} {r['gateway_s']:>10.3f} {r['engine_s']:>9.3f} {r['ratio']:>6.2f} "
            f"{r['ratio_min']:>5.2f}-{r['ratio_max']:<5.2f} "
            f"{r['calls']:>6} {r['overhead_ms_per_call']:>8.2f} {r['server_cpu_ms_per_call']:>9.2f} "
            f"{r['agents_cpu_ms_per_call']:>9.2f} {r['sessions_per_s']:>10.1f} {r['tokens_per_s']:>9.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
