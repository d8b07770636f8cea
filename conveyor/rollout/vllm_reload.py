"""Loading new weights into a live vLLM engine in place: the vllm rollout engine's weight sync.

`VLLMEngine.update_weights` hands the trainer's tensors to every vLLM worker
through `collective_rpc`, which calls the worker's in-place `reload_weights`:
no restart, no checkpoint on disk, and in-process no copy beyond the one
into the engine's parameters. vLLM 0.32's CPU MoE kernel keeps its experts
in a prepacked layout made once at load; a weight update refreshes only the
raw tensors, so the sync repacks them (without it, an MoE model's outputs
after a sync are wrong while a dense model's are right). Each tensor is cast
to the engine's dtype first, and after the reload the prefix cache is reset:
its full blocks hold KV computed by the old weights, which vLLM would reuse
for every prompt sharing them. Workers in other processes (vLLM's mp or ray
executor: tensor parallelism outside a trainer's world) get the weights
pickled instead, in buckets of whole layers (`layer_buckets`).

It deliberately does not name, cast or gather the trainer's tensors (conveyor.weights and the engine do),
nor reset the prefix cache or wake a sleeping engine (VLLMEngine.update_weights does): it only moves a stream
of (name, tensor) into vLLM's workers.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = ["executor_in_process", "layer_buckets", "reload_vllm"]


def _repack_cpu_experts(model: torch.nn.Module) -> int:
    """Redo the CPU MoE kernel's prepacking after an in-place weight reload; returns how many layers it touched."""
    n = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        # Only the CPU kernel keeps a layout of its own; GPU kernels read the reloaded tensors directly.
        if experts is not None and type(experts).__name__.startswith("CPU") and hasattr(module, "w13_weight"):
            experts.process_weights_after_loading(module)
            n += 1
    return n


def _reload_stream(worker: Any, weights: Iterable[tuple[str, Tensor]]) -> int:
    """Runs in a vLLM worker (collective_rpc): one in-place reload over the lazy stream, then the CPU repack."""
    worker.reload_weights(weights_iterator=iter(weights))
    return _repack_cpu_experts(worker.model_runner.model)


class _DropUntouched(logging.Filter):
    """Drops the layerwise reload's warning for a layer a call did not carry (a bucketed sync's other layers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in record.getMessage()


def _reload_bucket(worker: Any, bucket: list[tuple[str, Tensor]]) -> int:
    """Runs in a vLLM worker process (collective_rpc): one in-place reload of a bucket of whole layers, then repacks."""
    # Every call leaves the layers of the other buckets as they are, which vLLM reports as a failed load.
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _DropUntouched) for f in log.filters):
        log.addFilter(_DropUntouched())
    return _reload_stream(worker, bucket)


# Executors that run the worker in this process: collective_rpc hands it the arguments as they are. Every other
# one (mp, ray) pickles them to worker processes, and a generator does not pickle.
_IN_PROCESS_EXECUTORS = ("uni", "external_launcher")


def executor_in_process(llm: Any) -> bool:
    """Whether `llm`'s workers run in this process (vLLM's uni or external_launcher executor)."""
    return llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend in _IN_PROCESS_EXECUTORS


_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def layer_buckets(named: Iterable[tuple[str, Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """`named` as picklable lists of whole decoder layers on the CPU: at most `bucket_bytes` each, or one layer.

    A layer never straddles two lists: vLLM's layerwise reload rebuilds a layer that got part of its tensors in a
    call from uninitialised memory, and leaves a layer a call did not carry as it was. Tensors outside the decoder
    layers (embeddings, final norm, head) are a group each. A group whose tensors do not come together is refused.
    """
    bucket: list[tuple[str, Tensor]] = []
    group: list[tuple[str, Tensor]] = []
    size = group_size = 0
    current, done = None, set()

    def close() -> Iterator[list[tuple[str, Tensor]]]:
        nonlocal bucket, size
        if bucket and size + group_size > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.extend(group)
        size += group_size

    for name, tensor in named:
        m = _LAYER.match(name)
        key = m.group(1) if m else name.rsplit(".", 1)[0]
        if key != current:
            if key in done:
                raise ValueError(f"layer_buckets: the tensors of {key} do not come together ({name})")
            yield from close()
            done.add(current)
            group, group_size, current = [], 0, key
        tensor = tensor.detach().to("cpu").contiguous()
        group.append((name, tensor))
        group_size += tensor.numel() * tensor.element_size()
    yield from close()
    if bucket:
        yield bucket


def reload_vllm(
    llm: Any, named: Iterable[tuple[str, Tensor]], *, bucket_bytes: int = 512 << 20, in_process: bool | None = None
) -> None:
    """Load `named` into a vLLM engine (`vllm.LLM`) in place: one reload call over the lazy stream in process.

    One call, not one per bucket: vLLM's layerwise reload rebuilds a layer that got part of its tensors in a
    call from uninitialised memory. The in-process executor passes the iterator itself to its worker, so the
    stream is drawn (gathered, received) while vLLM loads it, layer by layer. Workers in other processes
    (`in_process` False; None: asked of the engine) take the tensors pickled instead: one call per bucket of
    whole layers (`layer_buckets`), on the CPU, at most `bucket_bytes` each beyond one layer.
    """
    if in_process is None:
        in_process = executor_in_process(llm)
    if in_process:
        llm.collective_rpc(_reload_stream, args=(named,))
        return
    for bucket in layer_buckets(named, bucket_bytes):
        llm.collective_rpc(_reload_bucket, args=(bucket,))
