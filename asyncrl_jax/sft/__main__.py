"""``python -m asyncrl_jax.sft``: the supervised warm start (``asyncrl_jax.sft.supervised``)."""

from asyncrl_jax.sft.main import main

if __name__ == "__main__":
  main()
