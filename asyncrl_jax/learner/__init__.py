"""The learner: the jitted update, the critic, the multi-process group, and the publishing of weights."""
