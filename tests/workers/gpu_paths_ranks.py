"""Two gloo ranks run the fsdp2 paths a GPU run takes differently, for `test_gpu_paths.py`.

    python gpu_paths_ranks.py MODEL_PATH OUT_DIR

Every rank loads the same model from MODEL_PATH and, with one `FSDP2` strategy per job:

- `offload`: the model sharded with FSDP2's CPU offload (the parameters, gradients and their shards in host
  memory, as `param_offload=true` keeps them on a GPU run), one backward, the strategy's `clip_grad_norm` and the
  weight sync's `iter_weights`; the same again without offload. Rank 0 writes both to `offload.pt`.
- `root`: the number of FSDP2 all-gathers of two training micro-batches (forward and backward), on a fresh model,
  after a `sharded_no_grad` pass and after a `full_params` block. Rank 0 writes them to `root.json`.
- `lora`: LoRA adapters (attention and experts, B drawn at random so that they change the weights) sharded with
  their layers; rank 0 writes the merged stream (`merged_weights`) to `lora.pt`.

The process group is created with the CPU half of the backend a CUDA role gets (`process_group_backend`), so the
offload's collectives on CPU tensors go through exactly what serves them there.
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

WORLD = 2
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "experts"]
LORA_SEED = 3


def load_model(model_path: str) -> torch.nn.Module:
    """The test's model in float32, the same on every rank."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)


def add_lora(model: torch.nn.Module):
    """Adapters as `apply_lora` makes them, with every B drawn at random (PEFT starts B at zero: no change)."""
    from conveyor.models.lora import apply_lora

    peft_model = apply_lora(model, rank=4, alpha=8, target_modules=LORA_TARGETS, seed=LORA_SEED)
    gen = torch.Generator().manual_seed(LORA_SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return peft_model


def batch(rank: int) -> torch.Tensor:
    """This rank's rows of token ids."""
    return torch.randint(3, 30, (2, 7), generator=torch.Generator().manual_seed(10 + rank))


def _strategy():
    from conveyor.workers.training.strategy import TrainingStrategy

    return TrainingStrategy("fsdp2", world_size=WORLD, device=torch.device("cpu"))


def _offload(model_path: str, rank: int, offload: bool) -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy

    from conveyor.weights import iter_weights

    model = load_model(model_path)
    strategy = _strategy()
    # A CPU run switches offloading off (the state is in host memory already); here it is the path under test.
    strategy.param_offload = offload
    strategy.wrap(model)
    policy = model._get_fsdp_state()._fsdp_param_group.offload_policy
    out: dict = {"offloaded": isinstance(policy, CPUOffloadPolicy)}
    ids = batch(rank)
    model(input_ids=ids, labels=ids).loss.backward()
    params = list(model.parameters())
    out["grad_devices"] = sorted({str(p.grad.to_local().device) for p in params if p.grad is not None})
    out["norm"] = strategy.clip_grad_norm(params, 0.05)
    out["grads"] = {name: p.grad.full_tensor().clone() for name, p in model.named_parameters() if p.grad is not None}
    out["weights"] = {name: t.clone() for name, t in iter_weights(model)}
    return out


def _count_all_gathers() -> list[int]:
    """A counter of FSDP2's all-gathers (one per unit gathered), from now on in this process."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    count = [0]
    gather = _fsdp_param_group.foreach_all_gather

    def counted(*args, **kwargs):
        count[0] += 1
        return gather(*args, **kwargs)

    _fsdp_param_group.foreach_all_gather = counted
    return count


def _root(model_path: str, rank: int) -> dict:
    count = _count_all_gathers()
    out: dict = {}
    for before in ("fresh", "sharded_no_grad", "full_params"):
        model = load_model(model_path)
        strategy = _strategy()
        strategy.wrap(model)
        ids = batch(rank)
        if before != "fresh":
            with torch.no_grad(), getattr(strategy, before)():
                model(input_ids=ids)
        count[0] = 0
        for _ in range(2):  # two micro-batches of one update
            model(input_ids=ids, labels=ids).loss.backward()
        out[before] = count[0]
    from conveyor.workers.training.strategy import decoder_layers

    out["layers"] = len(decoder_layers(load_model(model_path)))
    return out


def _lora(model_path: str) -> dict:
    from conveyor.weights import merged_weights

    model = load_model(model_path)
    add_lora(model)
    _strategy().wrap(model)
    return {name: t.clone() for name, t in merged_weights(model)}


def _rank_main(rank: int, model_path: str, out_dir: str, port: int) -> None:
    from conveyor.workers.training.strategy import process_group_backend

    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    cpu_half = [part for part in process_group_backend("cuda").split(",") if part.startswith("cpu:")]
    tdist.init_process_group(",".join(cpu_half), rank=rank, world_size=WORLD, timeout=timedelta(minutes=5))
    out = Path(out_dir)
    results = {"offload": _offload(model_path, rank, True), "plain": _offload(model_path, rank, False)}
    root = _root(model_path, rank)
    lora = _lora(model_path)
    if rank == 0:
        torch.save(results, out / "offload.pt")
        (out / "root.json").write_text(json.dumps(root))
        torch.save(lora, out / "lora.pt")
    tdist.barrier()
    tdist.destroy_process_group()


def main() -> None:
    """Spawn the two ranks and wait for them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(sys.argv[1], sys.argv[2], port), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
