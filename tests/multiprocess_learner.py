"""One process of a 2-process learner (run by ``test_multiprocess.py``, not collected by pytest).

  python -m tests.multiprocess_learner PROCESS_ID NUM_PROCESSES PORT OUT_NPZ [CHECKPOINTS]
  python -m tests.multiprocess_learner PROCESS_ID NUM_PROCESSES PORT OUT_NPZ --value CHECKPOINTS

Each process has one CPU device; the learner mesh puts ``fsdp`` across the processes. The global
batch is the same in every process; each puts only its own rows on device. Process 0 writes the
parameters after one policy version (gathered from both) and what each process held.

With CHECKPOINTS (a directory holding a 1-process checkpoint of version 1): the processes then
restore it into the same learner, write the restored parameters, train version 1 on the second
batch, write those (to OUT_NPZ with ``-resume`` before ``.npz``), and save version 2 from both
processes into the same directory.

With ``--value``: a learner of single-rollout advantages (``rl.advantage="value"``, its critic sharded
like the policy) trains two versions (the first the value model's only), then runs a held-out
evaluation through the learner group's op (process 0 leading); process 0 writes both versions'
metrics, the policy's and value model's parameters and the evaluation's results, and both processes
save version 2 into CHECKPOINTS.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
os.environ["JAX_PLATFORMS"] = "cpu"

from asyncrl_jax.infra import distributed  # noqa: E402  pylint: disable=wrong-import-position


def resume(learner, directory: str, out: str, pid: int) -> None:
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.train.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel
  from tests import test_multiprocess as t  # pylint: disable=import-outside-toplevel
  ckpt = Checkpointer(directory, async_save=False)
  state, meta = ckpt.restore(1, state_like=learner.checkpoint_state())
  learner.load_checkpoint_state(state)
  learner.version = int(meta["version"])
  restored = jax.tree.leaves(multihost_utils.process_allgather(learner.params, tiled=True))
  learner.train(t.sequences(seed=6), version=1)
  trained = jax.tree.leaves(multihost_utils.process_allgather(learner.params, tiled=True))
  ckpt.save(2, state=learner.checkpoint_state(), meta={"version": 2})
  ckpt.close()
  if pid == 0:
    np.savez(out, **{f"restored_{i}": x for i, x in enumerate(restored)},
             **{f"trained_{i}": x for i, x in enumerate(trained)})


def value_mode(pid: int, n: int, out: str, checkpoints: str) -> None:
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.infra import sharding  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.train.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.learner.group import LearnerGroup  # pylint: disable=import-outside-toplevel
  from tests import test_multiprocess as t  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_default_matmul_precision", "highest")
  mesh = sharding.make_mesh(jax.devices(), {"data": 1, "fsdp": n, "tensor": 1})
  learner = t.value_learner(mesh)
  metrics = [learner.train(t.rewarded(seed=v), version=v) for v in range(2)]
  policy = jax.tree.leaves(multihost_utils.process_allgather(learner.params, tiled=True))
  value = jax.tree.leaves(multihost_utils.process_allgather(learner.critic.params, tiled=True))
  # the held-out evaluation as the main job runs it: process 0 leads, process 1 follows the op
  group = LearnerGroup(learner, None)
  if pid == 0:
    evaluation = t.value_evaluation(mesh)
    group.share_token_lists(evaluation.evaluator.prompt_ids)
    (accuracy, greedy), figures = group.evaluate(lambda: evaluation.run(learner))
    group.stop()
  else:
    evaluation = t.value_evaluation(mesh, prompt_ids=group.share_token_lists(None))
    group.on_evaluate = lambda: evaluation.run(learner)
    group.follow()
  follower = multihost_utils.process_allgather(
      np.float32(np.mean([r for _, _, r in evaluation.evaluator.last_samples])))
  ckpt = Checkpointer(checkpoints, async_save=False)
  ckpt.save(2, state=learner.checkpoint_state(), meta={"version": 2})
  ckpt.close()
  if pid == 0:
    samples = evaluation.evaluator.last_samples
    np.savez(out, **{f"policy_{i}": x for i, x in enumerate(policy)},
             **{f"value_{i}": x for i, x in enumerate(value)},
             **{f"v{v}_{k}": np.float64(m[k]) for v, m in enumerate(metrics) for k in t.VALUE_METRICS
                if k in m},
             eval_scores=np.asarray([r for _, _, r in samples]),
             eval_completions=t._padded([c for _, c, _ in samples]),  # pylint: disable=protected-access
             eval_accuracy=accuracy, eval_greedy=greedy, follower_eval_accuracy=np.asarray(follower)[1],
             **figures)


def main(pid: int, n: int, port: int, out: str, *args: str) -> None:
  distributed.initialize(f"127.0.0.1:{port}", n, pid)
  if args and args[0] == "--value":
    value_mode(pid, n, out, args[1])
    import jax  # pylint: disable=import-outside-toplevel
    jax.distributed.shutdown()
    return
  checkpoints = args[0] if args else ""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.infra import sharding  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.learner.learner import Learner  # pylint: disable=import-outside-toplevel
  from tests import test_multiprocess as t  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_default_matmul_precision", "highest")
  mesh = sharding.make_mesh(jax.devices(), {"data": 1, "fsdp": n, "tensor": 1})
  config = t.config()
  learner = Learner(t.CFG, t.params(), mesh, config, versions=config.steps)
  leaves = jax.tree.leaves(learner.params)
  whole_here = [x.is_fully_addressable for x in leaves]  # all on this process's devices
  split = [x.ndim > 1 and all(s.data.shape != x.shape for s in x.addressable_shards) for x in leaves]
  # weight matrices (biases follow the head axes, which fsdp does not split)
  matrices = [x.ndim > 1 and not jax.tree_util.keystr(k).endswith("_bias']")
              for k, x in jax.tree_util.tree_flatten_with_path(learner.params)[0]]
  placed, _ = learner.updater.place(t.sequences())
  rows = [[s.data.shape[0] for s in b.tokens.addressable_shards] for b in placed]
  metrics = learner.train(t.sequences(), version=0)
  flat = jax.tree.leaves(multihost_utils.process_allgather(learner.params, tiled=True))
  held = multihost_utils.process_allgather(np.asarray([sum(r) for r in rows]))
  if pid == 0:
    np.savez(out, *flat, held_rows=held, global_rows=np.asarray([b.tokens.shape[0] for b in placed]),
             whole_here=np.asarray(whole_here), split=np.asarray(split),
             matrices=np.asarray(matrices), loss=metrics["loss"])
  if checkpoints:  # the same learner (its compiled steps too) restores and trains on
    resume(learner, checkpoints, out.replace(".npz", "-resume.npz"), pid)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])
