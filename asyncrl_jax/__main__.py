"""``python -m asyncrl_jax <command> [flags]`` (also installed as ``asyncrl-jax``).

Commands:
  train    the main job: asynchronous RL (``python -m asyncrl_jax.train`` is the same)
  sft      supervised warm start, exported in Hugging Face format
  decode   a decode server as its own process (``python -m asyncrl_jax.rollout.main``)
  export   the policy a run trained, as a Hugging Face or params-only Orbax checkpoint
  eval     an exported policy on a JSONL/Parquet math set: greedy accuracy and pass@1
  serve    JetStream serving of an exported checkpoint
  info     print the validated config and model size (and, for TPU slices, the memory per chip)
  gke      Kubernetes manifests for a GKE TPU node pool from a launch env file
"""

import sys

COMMANDS = {"train": "asyncrl_jax.train.job", "sft": "asyncrl_jax.sft.main", "decode": "asyncrl_jax.rollout.main",
            "serve": "asyncrl_jax.tools.serve", "info": "asyncrl_jax.tools.info",
            "export": "asyncrl_jax.tools.export", "eval": "asyncrl_jax.tools.evaluate",
            "gke": "asyncrl_jax.tools.gke"}


def main() -> None:
  if len(sys.argv) >= 2 and sys.argv[1] in ("-h", "--help", "help"):
    print(__doc__.strip())
    return
  if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
    print(__doc__.strip(), file=sys.stderr)
    sys.exit(2)
  command = sys.argv.pop(1)
  module = __import__(COMMANDS[command], fromlist=["main"])
  module.main()


if __name__ == "__main__":
  main()
