"""What one batch of the asynchronous rollout costs the trainer's process when its replica is in a process of its own.

With `trainer.v1.separate_async.rollout_process=own` the replica (and the
reward worker in its process) reads and writes the trainer's embedded store
through the served data plane (`conveyor/data_plane/served.py`). Every
request is answered by a thread of the trainer's process, under the
interpreter lock the trainer's update needs too, so its cost is the figure
that matters for the asynchronous speed-up (docs/async.md).

This replays the four requests of one default-run batch (`--prompts` x `--n`
samples, `--prompt-len` prompt and `--response-len` response tokens, routed
experts of `--layers` x `--top-k`) and prints, per request, the milliseconds
the server spends on it in this process (decode the request, run it on the
store, encode the answer: what the serving thread holds the lock for), the
median of `--reps` repetitions, and the same reads as the server did them
before list columns were sent as lists (through a TensorDict). Then the round
trip of each request from a client in this process over the socket.

This script writes no files and installs nothing.

    python benchmarks/served_plane.py
    python benchmarks/served_plane.py --prompts 64 --response-len 1024 --reps 51
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from conveyor.data_plane import make_data_plane
from conveyor.data_plane.base import plain_columns
from conveyor.data_plane.served import DataPlaneServer, _dumps


def median_ms(fn: Callable[[], Any], reps: int) -> float:
    """Median milliseconds of `fn()` over `reps` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def batch(args: argparse.Namespace) -> tuple[list[str], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A batch's keys, its prompt fields (what the trainer puts), the rollout's fields and the reward's."""
    b, p, r = args.prompts * args.n, args.prompt_len, args.response_len
    keys = [f"batch-1/p{i // args.n}/s{i % args.n}" for i in range(b)]
    prompts = {
        "prompts": torch.randint(0, 100, (b, p)),
        "prompt_mask": torch.ones(b, p, dtype=torch.bool),
        "uid": [k.rsplit("/", 1)[0] for k in keys],
        "data_source": ["arith"] * b,
        "ground_truth": [str(i % 97) for i in range(b)],
        "raw_prompt": ["What is 12 + 34?"] * b,
    }
    rollout = {
        "responses": torch.randint(0, 100, (b, r)),
        "response_mask": torch.ones(b, r, dtype=torch.long),
        "rollout_log_probs": torch.randn(b, r),
        "routed_experts": torch.randint(0, 8, (b, p + r, args.layers, args.top_k), dtype=torch.int16),
        "policy_version": torch.zeros(b, dtype=torch.long),
        "token_policy_version": torch.zeros(b, r, dtype=torch.long),
    }
    reward = {"rm_scores": torch.zeros(b, r), "acc": torch.zeros(b)}
    return keys, prompts, rollout, reward


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Run the benchmark; returns the medians in ms by name."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=12)
    p.add_argument("--response-len", type=int, default=6)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--reps", type=int, default=101)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    keys, prompts, rollout, reward = batch(args)
    plane = make_data_plane("memory")
    plane.kv_batch_put(keys, "batch-1", prompts, [{"seq_len": args.prompt_len} for _ in keys])
    plane.kv_batch_put(keys, "batch-1", {**rollout, **reward})
    reads = {
        "read prompts": ["prompts", "prompt_mask"],
        "read reward inputs": ["responses", "response_mask", "data_source", "ground_truth"],
    }
    writes = {"write rollout fields": rollout, "write rewards": reward}

    server = DataPlaneServer(plane)

    # The requests as the client sends them, encoded once: only what the serving thread does is timed.
    read_requests = {name: _dumps(("get", (keys, "batch-1", fields))) for name, fields in reads.items()}
    write_requests = {name: _dumps(("put", (keys, "batch-1", fields, None))) for name, fields in writes.items()}

    def serve_read(name: str, plain: bool) -> bytes:
        if plain:  # what the serving thread does
            return server.answer(read_requests[name])
        # As it did before: the read's TensorDict form built, then taken apart again.
        args = pickle.loads(read_requests[name])[1]
        return _dumps(("ok", (len(keys), plain_columns(plane.kv_batch_get(*args)))))

    for request in (*read_requests.values(), *write_requests.values()):
        status, value = pickle.loads(server.answer(request))
        assert status == "ok", value  # time answers, not errors
    out: dict[str, float] = {}
    print(f"one batch: {len(keys)} samples, {args.prompt_len} + {args.response_len} tokens; median of {args.reps}")
    print("server side (ms the serving thread spends, under the interpreter lock):")
    for name in reads:
        out[f"server {name}"] = median_ms(lambda: serve_read(name, True), args.reps)
        out[f"server {name} (via TensorDict)"] = median_ms(lambda: serve_read(name, False), args.reps)
        print(
            f"  {name:22s} {out[f'server {name}']:7.3f}   (through a TensorDict: "
            f"{out[f'server {name} (via TensorDict)']:7.3f})"
        )
    for name, request in write_requests.items():
        out[f"server {name}"] = median_ms(lambda: server.answer(request), args.reps)
        print(f"  {name:22s} {out[f'server {name}']:7.3f}")
    total = sum(out[f"server {n}"] for n in (*reads, *writes))
    out["server batch"] = total
    print(f"  {'a batch (four requests)':22s} {total:7.3f}")
    try:
        client = server.client()
        print("round trip from a client over the socket (ms):")
        for name, fields in reads.items():
            out[f"round trip {name}"] = median_ms(lambda: client.kv_batch_get(keys, "batch-1", fields), args.reps)
            print(f"  {name:22s} {out[f'round trip {name}']:7.3f}")
        for name, fields in writes.items():
            out[f"round trip {name}"] = median_ms(lambda: client.kv_batch_put(keys, "batch-1", fields), args.reps)
            print(f"  {name:22s} {out[f'round trip {name}']:7.3f}")
    finally:
        server.close()
        plane.close()
    return out


if __name__ == "__main__":
    main()
