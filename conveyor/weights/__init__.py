"""Weight shipping: everything that moves the trainer's weights into rollout engines, in one package.

A weight sync is a pipeline of lazy iterators over `(name, tensor)`; nothing holds the whole model at once:

    iter_weights(model)                     one full tensor at a time (an FSDP2 DTensor is gathered
                                            when it is reached: `full_tensor` is a collective, so every
                                            rank iterates in the same order); LoRA:
                                            merged_weights(model), adapters merged in         stream.py
    -> cast_weights(..., dtype)             each at the dtype the engine holds (bf16 from fp32 masters)
    -> engine_names(..., layout=...)        fused 3-D MoE experts (transformers 5) as the engine loads
                                            them: fused, or per expert in the checkpoint's names (views)
                                                                                              naming.py
    -> buckets(..., bucket_bytes)           lists of at most `bucket_bytes`; `pack`/`unpack` one flat
                                            buffer and its table                              buckets.py
    -> a transport, one module each:
         stream_to(load)                    in this process                                   local.py
         send_buckets / iter_received       over a torch.distributed group                    collective.py
         WeightChannel                      a standalone group from the actor's rank 0 to
                                            separate replicas                                 channel.py
         SharedSlots / map_shared           a file in /dev/shm that replicas on this machine map
                                                                                              shared.py
         put_packed / get_packed            one packed buffer through Ray's object store      object_store.py
    -> kept for later (asynchronous runs): WeightInbox, StagedWeights                         staged.py

Delta sync wraps the stream on both ends: `DeltaEncoder.encode` after the cast (only the elements that changed
since the last sync, as indices or a bitmap, or the tensor whole where that is smaller), `DeltaDecoder.decode`
before the engine's load (whole tensors again, checked against the sender's checksum)             delta.py

`WeightShipper` (shipper.py) is what a rollout group delegates its weights to: it picks the transport from
where the actor and the replicas run, orders the exchanges, and says what the replicas load before they
generate. The workers' weight endpoints are thin calls into the modules above.

Import weight code from here (`from conveyor.weights import ...`), not from the modules.

What it deliberately does not do: decide when the trainer syncs (the sample source does), wake or sleep an
engine (the engine adapters do), or load tensors into an engine (the engine's `update_weights`).
"""

from conveyor.weights.buckets import Staging, SyncStats, Table, buckets, layout, pack, unpack
from conveyor.weights.channel import THREAD_PREFIX, WeightChannel, free_address, send_over
from conveyor.weights.collective import apart_bytes_for, iter_received, receive_buckets, send_buckets
from conveyor.weights.delta import DeltaDecoder, DeltaEncoder, DeltaSettings, DeltaStats, checksum
from conveyor.weights.local import copy_into, into_model, stream_to
from conveyor.weights.naming import EXPERT_NAMES, ExpertNames, Layout, engine_names, expert_names_for, split_experts
from conveyor.weights.object_store import get_packed, put_packed
from conveyor.weights.shared import SharedSlots, map_shared
from conveyor.weights.shipper import Endpoints, WeightShipper
from conveyor.weights.staged import LOAD_SHARED, LOAD_STAGED, StagedWeights, WeightInbox, staged_copy
from conveyor.weights.stream import cast_weights, iter_weights, merged_weights

__all__ = [
    "ExpertNames",
    "Layout",
    "Staging",
    "SyncStats",
    "EXPERT_NAMES",
    "expert_names_for",
    "iter_weights",
    "cast_weights",
    "engine_names",
    "split_experts",
    "buckets",
    "stream_to",
    "send_buckets",
    "receive_buckets",
    "iter_received",
    "copy_into",
    "into_model",
    "apart_bytes_for",
    "pack",
    "unpack",
    "layout",
    "Table",
    "SharedSlots",
    "map_shared",
    "WeightChannel",
    "free_address",
    "THREAD_PREFIX",
    "merged_weights",
    "put_packed",
    "get_packed",
    "StagedWeights",
    "staged_copy",
    "WeightInbox",
    "LOAD_STAGED",
    "LOAD_SHARED",
    "Endpoints",
    "WeightShipper",
    "send_over",
    "DeltaSettings",
    "DeltaStats",
    "DeltaEncoder",
    "DeltaDecoder",
    "checksum",
]
