"""Score the reward-model tests' batch on N gloo ranks under fsdp2 (one process each), each rank its share.

    python reward_model_ranks.py SPEC.json

SPEC holds `world`, `model_path` and `out`; rank r writes `out/scores_<r>.pt` with the rows of its share
(rank 0 four rows, rank 1 two), their scores, and its strategy.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))

from reward_batches import put_batch  # noqa: E402

from conveyor.config import load_config  # noqa: E402
from conveyor.data_plane import make_data_plane  # noqa: E402
from conveyor.models.tokenizer import build_char_tokenizer  # noqa: E402
from conveyor.workers.ranks.reward_model import RewardModelWorker, reward_model_settings  # noqa: E402


def _rank_main(rank: int, spec: dict, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    world = spec["world"]
    tdist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=5))
    cfg = load_config(
        None,
        [
            "reward_model.enable=true",
            f"reward_model.model.path={spec['model_path']}",
            "reward_model.strategy=fsdp2",
            "reward_model.micro_batch_size_per_gpu=1",
        ],
    )
    tok = build_char_tokenizer()
    dp = make_data_plane("memory")
    worker = RewardModelWorker(
        reward_model_settings(cfg), policy_tokenizer=tok, data_plane=dp, rank=rank, world_size=world
    )
    meta = put_batch(dp, tok)
    # Uneven shares: rank 0 four rows, rank 1 two, so the ranks run
    # different numbers of real forwards and rank 1 pairs its extra gathers with dropped ones.
    rows = [0, 1, 2, 3] if rank == 0 else [4, 5]
    share = meta.select(rows)
    worker.compute_rm_score(share)
    scores = dp.kv_batch_get(keys=share.keys, partition_id="p", select_fields=["rm_model_score"])["rm_model_score"]
    torch.save(
        {
            "rows": torch.tensor(rows),
            "scores": scores,
            "strategy": worker.trained.strategy.name,
            "sharded": worker.trained.strategy.sharded,
        },
        Path(spec["out"]) / f"scores_{rank}.pt",
    )
    tdist.barrier()
    tdist.destroy_process_group()


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Forked after the imports above: the ranks start in a moment instead of importing torch and conveyor again.
    mp.start_processes(_rank_main, args=(spec, port), nprocs=spec["world"], join=True, start_method="fork")


if __name__ == "__main__":
    main()
