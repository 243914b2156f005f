"""``python -m asyncrl_jax.train``: the main job (``asyncrl_jax.train.job``)."""

from asyncrl_jax.train.job import main

if __name__ == "__main__":
  main()
