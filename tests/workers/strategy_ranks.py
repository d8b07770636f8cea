"""Run one or more roles' endpoints on N ranks (one process each, gloo) for the strategy tests.

    python strategy_ranks.py SPEC.json

SPEC holds `world`, `model_path` and `runs`, a list run one after another by
the same ranks (starting ranks costs far more than any run here: every rank
imports torch, transformers and conveyor). Each run holds: `role` (actor,
critic, or ref for the `stats` job), `overrides` (config overrides), `batch` (a torch file of the batch's
fields, loaded with weights_only), `jobs` (what to run, in order) and `out` (a
folder). For every run each rank builds its own memory data plane holding the
same batch and a fresh worker, takes its share of the keys with the worker
groups' own `split_for_ranks`, and runs the jobs:

- `update`: one update over the whole batch; rank 0 writes the gathered
  parameters to `out/params.pt` and every rank its metrics to `out/metrics_<rank>.json`.
- `log_prob`: compute_log_prob; each rank's `old_log_probs` go to `out/log_probs_<rank>.pt`.
- `ref_log_prob` (LoRA with a KL term): compute_ref_log_prob; each rank's `ref_log_prob` go to
  `out/ref_log_probs_<rank>.pt`.
- `stats`: compute_log_prob with entropy at temperature 0.7 (the actor; with the routing when the plan
  records it), the reference's compute_log_prob, or compute_values (the critic); each rank writes its keys,
  its sequence-parallel size and the outputs to `out/stats_<rank>.pt`.
- `no_grad_both`: the no-grad forward of the role's endpoint (compute_log_prob with entropy, or
  compute_values), over the shards layer by layer, and the same forward on the whole model gathered
  (`full_params`); each rank writes both to `out/both_<rank>.pt`.
- `generate`: greedy generate_sequences (6 tokens, routing captured) on the rank's share of the prompts;
  each rank writes the rollout's fields to `out/gen_<rank>.pt`.
- `router`: compute_routing_agreement (router health included), then one update with `moe_metrics` on; each
  rank writes the two calls' extra_info to `out/router_<rank>.json` and `out/router_update_<rank>.json`.
- `grads`: one update whose gradients (gathered, before the step) rank 0 writes to `out/grads.pt`;
  `grads_update` also writes what `update` does (parameters, metrics).

- `logits`: the training model's logits (no grad, over the shards) on the rank's rows of `batch`'s prompts;
  each rank writes them to `out/logits_<rank>.pt`.
- `iter_weights`: the weights as the vllm weight sync streams them (`iter_weights`, whole tensors);
  rank 0 writes them to `out/streamed.pt`.
- `delta_sync`: three weight syncs as the shipper runs one in process (the actor's `weight_stream`, cast to bf16
  by `cast_weights`, through a `DeltaEncoder` from the run's `rollout.delta_sync` settings and a `DeltaDecoder`):
  sync 0 before any update, syncs 1 and 2 each after one update. Every rank walks the streams (the gathers are
  collective); rank 0 alone encodes and decodes, and writes, per sync, the decoded tensors, the bf16 cast of a
  second stream taken right after (the trainer's weights), the encoder's stats and the decoder's mismatches to
  `out/delta.pt`.
- `layout`: after an update, each rank writes the local shape, mesh dimension names and placements of every
  parameter and of its AdamW moment to `out/layout_<rank>.pt`.

A run may name its own `model_path` (a dense model beside the default MoE one).
- `save:DIR` / `load:DIR`: a sharded checkpoint written or read by all ranks
  (`load` reads the schedule state from `out/extra.pt`, else from `DIR.extra.pt`, which `save` writes; after it, rank 0
  writes
  the parameters to `out/loaded.pt`).
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


def _capture_grads(worker) -> dict:
    """The worker's gradients just before its next optimizer step, gathered whole (every rank must call the step)."""
    grads: dict = {}
    step = worker.trained.step

    def capturing(grad_clip: float):
        for name, p in worker.model.named_parameters():
            if p.grad is not None:
                g = p.grad
                grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
        return step(grad_clip)

    worker.trained.step = capturing
    return grads


def _both_no_grad(worker, role: str, plane, share) -> dict:
    """The role's no-grad forward over the shards (through its endpoint) and on the gathered model, on one share."""
    from conveyor.workers.ranks.calls import LogProbCall
    from conveyor.workers.ranks.forward import micro_batches

    fields = ["prompts", "prompt_mask", "responses", "response_mask"]
    if role == "critic":
        worker.compute_values(share)
        sharded = {"values": plane.kv_batch_get(share.keys, share.partition_id, ["values"])["values"]}
        td = plane.kv_batch_get(share.keys, share.partition_id, fields)
        with torch.no_grad(), worker.trained.strategy.full_params():
            full = {"values": torch.cat([worker._values(td[sl]) for sl in micro_batches(len(td), 3)])}
        return {"sharded": sharded, "full": full}
    replay = worker.settings.forward_replays_routing
    worker.compute_log_prob(
        share.with_extra_info(**LogProbCall(temperature=0.7, calculate_entropy=True).to_extra_info())
    )
    got = plane.kv_batch_get(share.keys, share.partition_id, ["old_log_probs", "entropy"])
    sharded = {"log_probs": got["old_log_probs"], "entropy": got["entropy"]}
    td = plane.kv_batch_get(share.keys, share.partition_id, fields + (["routed_experts"] if replay else []))
    lps, ents = [], []
    with torch.no_grad(), worker.trained.strategy.full_params():  # no collective inside: each rank on its own
        for sl in micro_batches(len(td), 3):
            mb = td[sl]
            routed = mb["routed_experts"].long() if replay else None
            lp, ent, _ = worker.forward.log_probs(mb, 0.7, True, routed)
            lps.append(lp)
            ents.append(ent)
    mask = td["response_mask"].bool()
    return {
        "sharded": sharded,
        "full": {"log_probs": torch.cat(lps) * mask, "entropy": torch.cat(ents) * mask},
        "replayed": bool(replay),
    }


def _layout(worker) -> dict:
    """name -> (local shape, mesh dimension names, placements) of each parameter and of its first AdamW moment."""
    out: dict = {}
    state = worker.trained.optimizer.state
    for name, p in worker.model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        moment = state.get(p, {}).get("exp_avg")
        moment_local = moment.to_local() if hasattr(moment, "to_local") else moment
        out[name] = {
            "shape": tuple(local.shape),
            "dims": tuple(p.device_mesh.mesh_dim_names) if hasattr(p, "device_mesh") else (),
            "placements": [str(pl) for pl in getattr(p, "placements", ())],
            "moment_shape": tuple(moment_local.shape) if moment_local is not None else None,
        }
    return out


def _delta_sync(worker, rank: int, update) -> list[dict]:
    """Sync 0, then `update()` and a sync, twice: per sync (rank 0; empty elsewhere) the decoded weights, the trainer's
    bf16 weights, the encoder's stats and the decoder's mismatches."""
    from conveyor.weights import DeltaDecoder, DeltaEncoder, DeltaSettings, cast_weights

    delta = worker.settings.rollout.delta_sync
    encoder = DeltaEncoder(DeltaSettings(enable=delta.enable, full_every=delta.full_every)) if rank == 0 else None
    decoder = DeltaDecoder("cpu") if rank == 0 else None
    syncs: list[dict] = []
    for sync in range(3):
        if sync:
            update()
        stream = cast_weights(worker.weight_stream(), torch.bfloat16)
        if encoder is None or decoder is None:  # not the sender: its part in the gathers only
            for _ in stream:
                pass
        else:
            # The decoder yields views of its own copies, which the next sync updates in place: cloned here.
            decoded = {name: t.clone() for name, t in decoder.decode(encoder.encode(stream))}
        trainer = {name: t.clone() for name, t in cast_weights(worker.weight_stream(), torch.bfloat16)}
        if encoder is not None and decoder is not None:
            stats = encoder.last
            encoder.report_mismatch(decoder.mismatches)  # as the shipper does after each sync
            syncs.append(
                {
                    "decoded": decoded,
                    "trainer": trainer,
                    "changed_frac": stats.changed_frac,
                    "full": stats.full,
                    "forced": stats.forced,
                    "bytes": stats.bytes,
                    "full_bytes": stats.full_bytes,
                    "mismatches": decoder.mismatches,
                }
            )
    return syncs


def _run(rank: int, world: int, model_path: str, run: dict) -> None:
    """One run's jobs on this rank, with a worker of its own."""
    from conveyor.config import load_config
    from conveyor.data_plane import make_data_plane
    from conveyor.protocol import KVBatchMeta
    from conveyor.trainer.plan import build_run_plan
    from conveyor.workers.placement.group import split_for_ranks
    from conveyor.workers.ranks.actor import PolicyWorker
    from conveyor.workers.ranks.calls import GenerateCall, LogProbCall, UpdateCall
    from conveyor.workers.ranks.critic import CriticWorker
    from conveyor.workers.ranks.reference import ReferenceWorker
    from conveyor.workers.ranks.settings import actor_settings, critic_settings, reference_settings

    out = Path(run["out"])
    model_path = run.get("model_path", model_path)
    cfg = load_config(None, run["overrides"])
    fields = torch.load(run["batch"], weights_only=True)
    n = len(next(iter(fields.values())))
    keys = [f"s{i}" for i in range(n)]
    plane = make_data_plane("memory")
    meta = plane.kv_batch_put(keys, "p", fields)
    share = split_for_ranks(KVBatchMeta(keys, "p", meta.fields, [{} for _ in keys], {}), world)[rank]
    # A copy for the log-prob job, so that its old_log_probs leave the update's inputs untouched.
    plane.kv_batch_put(keys, "lp", fields)
    plane.kv_batch_put(keys, "gen", {k: fields[k] for k in ("prompts", "prompt_mask")})  # for the generate job
    lp_share = KVBatchMeta(share.keys, "lp", share.fields, share.tags, {})
    plan = build_run_plan(cfg, "cpu")
    if run["role"] == "critic":
        worker = CriticWorker(
            critic_settings(cfg, plan), model_path=model_path, data_plane=plane, rank=rank, world_size=world
        )
    elif run["role"] == "ref":
        worker = ReferenceWorker(
            reference_settings(cfg, plan), model_path=model_path, data_plane=plane, rank=rank, world_size=world
        )
    else:
        worker = PolicyWorker(
            actor_settings(cfg, plan), model_path=model_path, data_plane=plane, rank=rank, world_size=world
        )

    def update():
        """One update of the run's role on this rank's share (the jobs' update)."""
        call = share.with_extra_info(**UpdateCall(temperature=1.0, calculate_entropy=False).to_extra_info())
        return worker.update_critic(call) if run["role"] == "critic" else worker.update_actor(call)

    for job in run["jobs"]:
        if job == "update":
            result = update()
            (out / f"metrics_{rank}.json").write_text(json.dumps(result.extra_info))
            params = worker.model_state_dict()
            if rank == 0:
                torch.save(params, out / "params.pt")
        elif job == "log_prob":
            worker.compute_log_prob(
                lp_share.with_extra_info(**LogProbCall(temperature=1.0, calculate_entropy=False).to_extra_info())
            )
            got = plane.kv_batch_get(share.keys, "lp", ["old_log_probs"])["old_log_probs"]
            torch.save(got, out / f"log_probs_{rank}.pt")
        elif job == "ref_log_prob":  # LoRA: the actor's forward with its adapters disabled
            worker.compute_ref_log_prob(
                lp_share.with_extra_info(**LogProbCall(temperature=1.0, calculate_entropy=False).to_extra_info())
            )
            got = plane.kv_batch_get(share.keys, "lp", ["ref_log_prob"])["ref_log_prob"]
            torch.save(got, out / f"ref_log_probs_{rank}.pt")
        elif job == "generate":
            call = GenerateCall(
                max_new_tokens=6,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                do_sample=False,
                seed=0,
                capture_routing=True,
                pad_to_max_new_tokens=False,
            )
            worker.generate_sequences(KVBatchMeta(share.keys, "gen", [], share.tags, call.to_extra_info()))
            torch.save(
                dict(
                    plane.kv_batch_get(
                        share.keys, "gen", ["responses", "response_mask", "rollout_log_probs", "routed_experts"]
                    ).items()
                ),
                out / f"gen_{rank}.pt",
            )
            # A forward outside inference mode after it (an old-log-prob pass) must still run on the same shards.
            worker.compute_log_prob(
                lp_share.with_extra_info(**LogProbCall(temperature=1.0, calculate_entropy=False).to_extra_info())
            )
        elif job == "router":
            result = worker.compute_routing_agreement(share)
            (out / f"router_{rank}.json").write_text(json.dumps(result.extra_info))
            update = UpdateCall(temperature=1.0, calculate_entropy=False, moe_metrics=True).to_extra_info()
            result = worker.update_actor(share.with_extra_info(**update))
            (out / f"router_update_{rank}.json").write_text(json.dumps(result.extra_info))
        elif job == "stats":
            if run["role"] == "critic":
                worker.compute_values(lp_share)
                names = ["values"]
            elif run["role"] == "ref":
                worker.compute_log_prob(
                    lp_share.with_extra_info(**LogProbCall(temperature=0.7, calculate_entropy=False).to_extra_info())
                )
                names = ["ref_log_prob"]
            else:
                call = LogProbCall(
                    temperature=0.7, calculate_entropy=True, calculate_sum_pi_squared=True
                ).to_extra_info()
                result = worker.compute_log_prob(lp_share.with_extra_info(**call))
                names = [
                    n for n in ("old_log_probs", "entropy", "sum_pi_squared", "routed_experts") if n in result.fields
                ]
            got = plane.kv_batch_get(share.keys, "lp", names)
            sp = getattr(worker, "sp", None) if run["role"] == "critic" else worker.forward.sp
            saved = {"keys": list(share.keys), "sp_size": sp.size if sp is not None else 1}
            torch.save({**saved, **{n: got[n] for n in names}}, out / f"stats_{rank}.pt")
        elif job == "no_grad_both":
            torch.save(_both_no_grad(worker, run["role"], plane, lp_share), out / f"both_{rank}.pt")
        elif job in ("grads", "grads_update"):
            grads = _capture_grads(worker)
            result = update()
            if rank == 0:
                torch.save(grads, out / "grads.pt")
            if job == "grads_update":  # the update's outcome too, as `update` writes it
                (out / f"metrics_{rank}.json").write_text(json.dumps(result.extra_info))
                params = worker.model_state_dict()
                if rank == 0:
                    torch.save(params, out / "params.pt")
        elif job == "logits":
            prompts = plane.kv_batch_get(share.keys, "p", ["prompts"])["prompts"]
            with torch.no_grad(), worker.trained.strategy.sharded_no_grad():
                logits = worker.model(input_ids=prompts.long()).logits
            torch.save(logits, out / f"logits_{rank}.pt")
        elif job == "iter_weights":
            from conveyor.weights import iter_weights

            streamed = {name: t.clone() for name, t in iter_weights(worker.model, device="cpu")}
            if rank == 0:
                torch.save(streamed, out / "streamed.pt")
        elif job == "delta_sync":
            syncs = _delta_sync(worker, rank, update)
            if rank == 0:
                torch.save(syncs, out / "delta.pt")
        elif job == "layout":
            torch.save(_layout(worker), out / f"layout_{rank}.pt")
        elif job.startswith("save:"):
            extra = worker.save_checkpoint(job[5:])
            if rank == 0:
                torch.save(extra, out / "extra.pt")
                torch.save(extra, f"{job[5:]}.extra.pt")  # for a later run that loads this checkpoint
        elif job.startswith("load:"):
            extra_path = out / "extra.pt" if (out / "extra.pt").exists() else Path(f"{job[5:]}.extra.pt")
            worker.load_checkpoint(job[5:], torch.load(extra_path, weights_only=True))
            params = worker.model_state_dict()
            if rank == 0:
                torch.save(params, out / "loaded.pt")
        else:
            raise ValueError(f"unknown job {job!r}")
    tdist.barrier()  # every rank done with this run (its files written) before the next one starts


def _rank_main(rank: int, spec: dict, port: int) -> None:
    torch.set_num_threads(1)
    world = spec["world"]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    tdist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=5))
    for run in spec["runs"]:
        _run(rank, world, spec["model_path"], run)
    tdist.barrier()  # every rank past its last collective before any tears the group down
    tdist.destroy_process_group()


def main() -> None:
    """Spawn the ranks of SPEC.json and wait for them."""
    spec = json.loads(Path(sys.argv[1]).read_text())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(spec, port), nprocs=spec["world"], join=True)


if __name__ == "__main__":
    main()
