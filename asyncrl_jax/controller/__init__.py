"""The controller: admits prompts under the staleness bound, scores and batches trajectories, decides when weights are published."""
