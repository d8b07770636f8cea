"""Tokens, not rows: padded against packed forwards with token budgets, old log-probs + update, on 1 and 2 ranks.

A dense Qwen3 of about 50M float32 parameters is built from config and
saved as a checkpoint. A batch of `--seqs` sequences has prompts of 16 to 64
tokens and responses whose lengths are spread uniformly from 1 to
`--max-response` (512): forced, not generated, so that both modes see the
same lengths. Every rank builds two actors from the one checkpoint through
the trainer's `worker_specs`:

- padded: `use_remove_padding=false`, fixed micro-batches of `--micro`
  sequences; every row is as wide as the batch's longest prompt + response
  (what the rollout writes);
- packed: `use_remove_padding=true` with token budgets
  (`use_dynamic_bsz`, `ppo_max_token_len_per_gpu` =
  `log_prob_max_token_len_per_gpu` = `--budget`): each micro-batch's real
  tokens in one row, attention within each sequence.

Both run the Hugging Face forward (`forward_impl=hf`: the lean forward drops
padding too, on one rank), the same weights and the same batch, split over
the ranks by prompt + response tokens (`balanced_partition`, as the trainer
splits it). Each step times the old-log-prob endpoint and the update
endpoint; the modes alternate within one run (`--reps` times each), and the
table gives the median per mode, the speed-up padded / packed, and each
phase's peak resident memory above the process's baseline (the largest rank).

    python benchmarks/packing.py                 # ~50M model, 1 and 2 ranks (~10 min on 2 cores)
    python benchmarks/packing.py --smoke         # a tiny model, seconds (the suite runs it)

Bar: packed at least 1.5x faster (goal 2x) on 1 and on 2 ranks; exit status 1
when missed (not checked under --smoke).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

GB = 1e9
BAR, GOAL = 1.5, 2.0


def _batch(seqs: int, max_response: int, vocab: int, special: set[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts of 16..64 tokens, right-padded responses of 1..max_response, random advantages."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(16, 65, (seqs,), generator=gen)
    response_lengths = torch.randint(1, max_response + 1, (seqs,), generator=gen)
    width_p, width_r = int(prompt_lengths.max()), int(response_lengths.max())
    prompt_mask = torch.arange(width_p)[None] >= (width_p - prompt_lengths)[:, None]
    response_mask = torch.arange(width_r)[None] < response_lengths[:, None]
    prompts = torch.randint(0, vocab, (seqs, width_p), generator=gen)
    responses = torch.randint(0, vocab, (seqs, width_r), generator=gen)
    for t in special:
        prompts[prompts == t] = (t + 1) % vocab
        responses[responses == t] = (t + 1) % vocab
    prompts[~prompt_mask] = 0
    responses[~response_mask] = 0
    return {
        "prompts": prompts,
        "prompt_mask": prompt_mask,
        "responses": responses,
        "response_mask": response_mask,
        "rollout_log_probs": torch.zeros(seqs, width_r),
        "advantages": torch.randn(seqs, width_r, generator=gen) * response_mask,
    }


def _overrides(mode: str, micro: int, budget: int, world: int) -> list[str]:
    common = [
        "actor_rollout_ref.model.forward_impl=hf",
        f"trainer.num_cpu_workers={world}",
        "algorithm.rollout_correction.bypass_mode=false",
        "actor_rollout_ref.actor.use_kl_loss=false",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
    ]
    if mode == "padded":
        return common + ["actor_rollout_ref.model.use_remove_padding=false"]
    return common + [
        "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={budget}",
    ]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rank(rank: int, world: int, port: int, model_path: str, args: dict, out: str) -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    from conveyor.config import load_config
    from conveyor.data_plane import make_data_plane
    from conveyor.models.loading import load_tokenizer
    from conveyor.protocol import KVBatchMeta
    from conveyor.trainer.plan import build_run_plan
    from conveyor.workers.placement.group import ColocatedWorker
    from conveyor.workers.placement.roles import worker_specs
    from conveyor.workers.ranks.calls import LogProbCall, UpdateCall
    from conveyor.workers.training.balance import balanced_partition, sequence_lengths

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    if world > 1:
        tdist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=30))
    tokenizer = load_tokenizer(model_path)
    baseline = _rss()
    actors = {}
    for mode in ("padded", "packed"):
        cfg = load_config(None, _overrides(mode, args["micro"], args["budget"], world))
        plane = make_data_plane("memory")
        host = ColocatedWorker(rank, world)
        host.add(worker_specs(cfg, build_run_plan(cfg, "cpu"), model_path, plane, tokenizer, "cpu")["actor"])
        actors[mode] = (host, host.worker("actor"), plane)
    vocab = actors["padded"][1].model.config.vocab_size
    fields = _batch(args["seqs"], args["max_response"], vocab, {tokenizer.pad_token_id, tokenizer.eos_token_id})
    lengths = sequence_lengths(fields["prompt_mask"], fields["response_mask"]).tolist()
    share = sorted(balanced_partition(lengths, world, equal_size=True)[rank])
    mine = {k: v[share] for k, v in fields.items()}
    keys = [f"s{i}" for i in share]
    lp = LogProbCall(temperature=1.0, calculate_entropy=False).to_extra_info()
    update = UpdateCall(temperature=1.0, calculate_entropy=False).to_extra_info()
    times: dict[str, list[float]] = {"padded": [], "packed": []}
    peaks: dict[str, dict[str, float]] = {"padded": {}, "packed": {}}
    for rep in range(args["reps"]):
        for mode in ("padded", "packed") if rep % 2 == 0 else ("packed", "padded"):
            _, actor, plane = actors[mode]
            part = f"{mode}-{rep}"
            meta = plane.kv_batch_put(keys, part, mine)
            meta = KVBatchMeta(keys, part, meta.fields, [{} for _ in keys], {})
            if world > 1:
                tdist.barrier()
            t0 = time.perf_counter()
            got = dict(actor.compute_log_prob(meta.with_extra_info(**lp)).extra_info)
            got.update(actor.update_actor(meta.with_extra_info(**update)).extra_info)
            if world > 1:
                tdist.barrier()
            times[mode].append(time.perf_counter() - t0)
            for phase in ("old_log_prob", "update_actor"):
                peaks[mode][phase] = max(
                    peaks[mode].get(phase, 0.0), got[f"perf/{phase}/max_memory_gb"] * 1024**3 - baseline
                )
            plane.kv_clear(part)
    real = sum(lengths[i] for i in share)
    widest = int(fields["prompt_mask"].shape[1] + fields["response_mask"].shape[1])
    Path(out, f"rank{rank}.json").write_text(
        json.dumps({"times": times, "peaks": peaks, "real_tokens": real, "padded_tokens": len(share) * widest})
    )
    for host, _, _ in actors.values():
        host.close()
    if world > 1:
        tdist.barrier()
        tdist.destroy_process_group()


def _run_ranks(world: int, model_path: str, args: dict) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        mp.spawn(_rank, args=(world, port, model_path, args, tmp), nprocs=world)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def measure(hidden: int, layers: int, intermediate: int, args: dict, worlds: tuple[int, ...]) -> dict:
    """Build and save the dense model, then run every world size; the figures of each."""
    import transformers

    from conveyor.models.loading import save_pretrained_checkpoint
    from conveyor.models.tiny import build_tiny_model
    from conveyor.models.tokenizer import build_char_tokenizer

    transformers.utils.logging.disable_progress_bar()
    tok = build_char_tokenizer()
    heads = max(4, hidden // 64)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(
            "qwen3",
            tok,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=max(1, heads // 2),
            intermediate_size=intermediate,
            max_position_embeddings=1024,
        )
        params = sum(p.numel() for p in model.parameters())
        path = save_pretrained_checkpoint(model, tok, Path(tmp) / "model")
        del model
        runs = {w: _run_ranks(w, str(path), args) for w in worlds}
    return {"params": params, "runs": runs}


def report(res: dict, args: dict) -> dict[str, float]:
    """Print the table; the speed-up of each world size."""
    print(
        f"model: qwen3 (dense) {res['params'] / 1e6:.1f}M float32 parameters; {args['seqs']} sequences, prompts "
        f"16..64, responses 1..{args['max_response']} tokens; padded: micro-batches of {args['micro']}; packed: "
        f"budget {args['budget']} tokens; old log-probs + update per step, median of {args['reps']}"
    )
    print(
        f"{'ranks':<7}{'padded s':>10}{'packed s':>10}{'speed-up':>10}{'tokens padded/real':>20}"
        f"{'peak padded GB':>16}{'peak packed GB':>16}"
    )
    speedups = {}
    for world, ranks in res["runs"].items():
        # A step ends when its slowest rank does (the barriers make every rank's time that).
        med = {
            m: statistics.median(max(r["times"][m][i] for r in ranks) for i in range(args["reps"]))
            for m in ("padded", "packed")
        }
        speedup = med["padded"] / med["packed"]
        speedups[f"speedup_{world}"] = speedup
        tokens = sum(r["padded_tokens"] for r in ranks) / sum(r["real_tokens"] for r in ranks)
        peak = {m: max(max(r["peaks"][m].values()) for r in ranks) / GB for m in ("padded", "packed")}
        speedups[f"peak_padded_{world}"], speedups[f"peak_packed_{world}"] = peak["padded"], peak["packed"]
        print(
            f"{world:<7}{med['padded']:>10.2f}{med['packed']:>10.2f}{speedup:>9.2f}x{tokens:>20.2f}"
            f"{peak['padded']:>16.2f}{peak['packed']:>16.2f}"
        )
    return speedups


def main(argv: list[str] | None = None) -> int:
    """Run the measurement and print the table; 1 when the bar is missed (not under --smoke)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny model and batch: seconds")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--max-response", type=int, default=512)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ns = ap.parse_args(argv)
    if ns.smoke:
        ns.hidden, ns.layers, ns.intermediate, ns.seqs, ns.max_response, ns.budget, ns.reps = 64, 2, 128, 8, 48, 256, 2
    args = {"seqs": ns.seqs, "max_response": ns.max_response, "micro": ns.micro, "budget": ns.budget, "reps": ns.reps}
    res = measure(ns.hidden, ns.layers, ns.intermediate, args, tuple(ns.ranks))
    speedups = report(res, args)
    if ns.smoke:
        return 0
    worst = min(v for k, v in speedups.items() if k.startswith("speedup_"))
    print(f"bar {BAR}x, goal {GOAL}x: worst {worst:.2f}x -> {'met' if worst >= BAR else 'MISSED'}")
    return 0 if worst >= BAR else 1


if __name__ == "__main__":
    raise SystemExit(main())
