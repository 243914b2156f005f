"""The processes of the shard-to-shard transfer test (run by ``test_multiprocess.py``).

  python -m tests.multiprocess_transfer learner PROCESS_ID PORT DIR   # 2 of these: fsdp=2 over them
  python -m tests.multiprocess_transfer server DIR                    # 2 local devices, tensor=2

Learner processes (1 CPU device each) offer their blocks and write their addresses, what they offered
and (process 0) the plan and the whole parameters gathered; the decode server pulls from both,
assembles onto its own layout and writes what it received. The learners wait for its ``done`` file.
"""

import json
import os
import sys
import time

ROLE = sys.argv[1]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={1 if ROLE == 'learner' else 2}"
os.environ["JAX_PLATFORMS"] = "cpu"

from asyncrl_jax.infra import distributed  # noqa: E402  pylint: disable=wrong-import-position

UUID = 7


def _wait_for(path: str, timeout: float = 200.0) -> None:
  deadline = time.time() + timeout
  while not os.path.exists(path):
    if time.time() > deadline:
      raise TimeoutError(f"{path} did not appear within {timeout:.0f}s")
    time.sleep(0.1)


def _write(path: str, text: str) -> None:
  with open(path + ".tmp", "w") as f:
    f.write(text)
  os.replace(path + ".tmp", path)


def learner(pid: int, port: int, out: str) -> None:
  distributed.initialize(f"127.0.0.1:{port}", 2, pid)
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  from asyncrl_jax import models  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.infra import sharding
  from asyncrl_jax.weights import shards  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.weights.remote import WeightSender  # pylint: disable=import-outside-toplevel
  from tests import test_multiprocess as t  # pylint: disable=import-outside-toplevel
  mesh = sharding.make_mesh(jax.devices(), {"data": 1, "fsdp": 2, "tensor": 1})
  params = jax.device_put(t.params(), models.param_shardings(t.CFG, mesh))
  leaves = jax.tree.leaves(params)
  planned = shards.plan(leaves, [x.sharding for x in leaves])
  sender = WeightSender("127.0.0.1:0")
  nbytes, shapes = sender.offer(params, planned, UUID)
  _write(f"{out}/offered-{pid}.json", json.dumps({"bytes": nbytes, "shapes": shapes}))
  whole = jax.tree.leaves(multihost_utils.process_allgather(params, tiled=True))
  if pid == 0:
    np.savez(f"{out}/learner.npz", *whole)
    manifest = {p: shards.blocks_to_json(b) for p, b in shards.blocks_by_process(planned).items()}
    _write(f"{out}/manifest.json", json.dumps(manifest))
  _write(f"{out}/addr-{pid}", sender.address)
  _wait_for(f"{out}/done")
  jax.distributed.shutdown()


def server(out: str) -> None:
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from asyncrl_jax import models  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.infra import sharding
  from asyncrl_jax.weights import shards  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.weights.remote import Source, WeightReceiver  # pylint: disable=import-outside-toplevel
  from tests import test_multiprocess as t  # pylint: disable=import-outside-toplevel
  mesh = sharding.make_mesh(jax.local_devices(), {"data": 1, "fsdp": 1, "tensor": 2})
  like = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), t.params(),
                      models.param_shardings(t.CFG, mesh))
  for pid in range(2):
    _wait_for(f"{out}/addr-{pid}")
  _wait_for(f"{out}/manifest.json")
  with open(f"{out}/manifest.json") as f:
    manifest = json.load(f)
  sources = []
  for pid in range(2):
    with open(f"{out}/addr-{pid}") as f:
      sources.append(Source(f.read(), UUID, tuple(shards.blocks_from_json(manifest[str(pid)]))))
  params, stats = WeightReceiver("127.0.0.1:0").pull(sources, like)
  leaves = jax.tree.leaves(params)
  np.savez(f"{out}/server.npz", *[np.asarray(x) for x in leaves])
  layout = [[x.sharding == s.sharding for x, s in zip(leaves, jax.tree.leaves(like))],
            [[list(sh.data.shape) for sh in x.addressable_shards] for x in leaves]]
  _write(f"{out}/pulled.json", json.dumps({"bytes": stats.bytes, "shapes": stats.buffers,
                                          "per_source": [len(s.blocks) for s in sources],
                                          "layout_ok": layout[0], "local_shards": layout[1]}))
  _write(f"{out}/done", "1")


if __name__ == "__main__":
  if ROLE == "learner":
    learner(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
  else:
    server(sys.argv[2])
