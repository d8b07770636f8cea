"""The training loop and what surrounds it.

`run.py` is the composition root (it builds everything from the config and the
run plan, trains and tears down); `plan.py` makes the run's decisions once;
`ppo.py` is the stage pipeline of one step; `stages.py` holds the stages
that make a step's samples (prompts, generation, rewards), which the
sources and validation are handed; `sources.py` is where a step's
samples come from (synchronous, asynchronous with bounded staleness, dynamic
sampling); `state.py`, `signals.py` and `validation.py` hold the checkpoint
contents, the stop signals and held-out evaluation; `timing.py` times a step's
stages; `setup.py` prepares the model checkpoint, the prompts and the data
plane.
"""
