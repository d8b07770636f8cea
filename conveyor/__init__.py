"""conveyor: RL post-training of LLMs over a key-value data plane, Mixture-of-Experts first."""

__version__ = "0.1.0"
