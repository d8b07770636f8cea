"""What one rank of a role runs: the actor, reference, critic, reward and rollout workers, their forward,
generation, settings, call parameters and per-phase memory figures.

A worker here takes its settings and a data plane and is called through its endpoints; it never decides where
it runs (`conveyor.workers.placement`) and never reads the root config.
"""
