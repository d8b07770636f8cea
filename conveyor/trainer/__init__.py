"""The training loop (`ppo.py`), its set-up, the supervised warm start and checkpoints."""
