"""The main job: asynchronous RL of the policy, from prompts to checkpoints."""
