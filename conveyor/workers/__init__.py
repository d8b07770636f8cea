"""Workers: the roles of a run (actor/rollout, reference, critic, reward) and the groups that place their ranks."""
