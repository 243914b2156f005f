"""Environments for multi-turn, tool-using episodes: the interface (``base``), the registry that builds
them by name, the worker pool that runs their steps off the decode loop with a timeout each
(``pool``), and the built-in tools (``calculator``, ``python_tool``) with optional latency
(``latency``) for benchmarks."""

from asyncrl_jax.envs import tools_env  # noqa: F401,E402  (registers the built-in environments)
