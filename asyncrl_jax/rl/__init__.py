"""RL math as pure, jittable functions: losses, advantages, the staleness rule, micro-batching."""
