"""RL building blocks: the rollout sampler, losses, advantages, trajectory batches."""
