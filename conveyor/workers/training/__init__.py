"""The training machinery of a role's ranks: strategies on device meshes (none, dp, fsdp2, fsdp2 + EP), loading
onto shards, the optimizer, micro-batching and token balance, and the memory accounting of a layout.

Nothing here knows which role it trains or where its ranks run: `conveyor.workers.ranks` uses it, and
`conveyor.workers.placement` places those ranks.
"""
