"""Scheduling simulators: what synchronous RL loses to stragglers, and what decoupling wins back."""
