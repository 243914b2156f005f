"""Weight-transfer time against the bytes moved, beside a raw copy of the same bytes.

  .venv/bin/python benchmarks/transfer.py [--quick]

* in one process: ``local_transfer`` (``jax.device_put`` from the learner mesh onto the rollout mesh's
  shardings, as the main job does after every update) versus ``np.copyto`` of a buffer of the same size;
* between processes (``jax.experimental.transfer`` over 127.0.0.1), pulled here into a 2-device
  rollout layout (tensor=2 where the model's shapes divide, else replicated), three ways in one run:
  - shard to shard, what the main job does: a learner of 2 processes (fsdp=2, jax.distributed), each
    offering only its own blocks, pulled in parallel and reassembled here;
  - staged, the older path: one learner process gathers the whole tree onto one device and offers
    it; this side pulls it onto one device and places it;
  - the same bytes over one plain TCP socket on 127.0.0.1.

Model sizes are Qwen2-style shapes with random weights (float32). Each figure is the median of
``--repeats`` transfers after one warm-up. Writes benchmarks/results/transfer.{json,md,png}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from asyncrl_jax import cli  # noqa: E402  pylint: disable=wrong-import-position

cli.ensure_cpu_devices(4)

import jax  # noqa: E402  pylint: disable=wrong-import-position
import numpy as np  # noqa: E402

from asyncrl_jax import models  # noqa: E402

from asyncrl_jax.infra import sharding
from asyncrl_jax.models.config import ModelConfig  # noqa: E402
from asyncrl_jax.weights import local_transfer, shards, tree_bytes  # noqa: E402
from asyncrl_jax.weights.remote import Source, WeightReceiver  # noqa: E402
from benchmarks.common import machine, pyplot, write_result  # noqa: E402

SIZES = {  # name -> (hidden, layers, intermediate, vocab)
    "0.5M (default demo)": (128, 2, 512, 17),
    "13M": (384, 6, 1536, 4096),
    "60M": (768, 8, 3072, 8192),
}

_STAGED = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
sys.path.insert(0, {root!r})
import jax
from asyncrl_jax import models
from asyncrl_jax.models.config import ModelConfig
from asyncrl_jax.weights.remote import WeightSender
cfg = ModelConfig(**{cfg!r})
params = models.init_params(cfg, jax.random.key(0))
sender = WeightSender("127.0.0.1:0")
sender.offer_staged(params, *range(1, {n} + 1))
print("ADDR", sender.address, flush=True)
sys.stdin.read()  # until the parent closes stdin
"""

_SHARDED = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
sys.path.insert(0, {root!r})
from asyncrl_jax.infra import distributed
distributed.initialize("127.0.0.1:{port}", 2, {pid})
import jax
from asyncrl_jax import models
from asyncrl_jax.infra import sharding
from asyncrl_jax.models.config import ModelConfig
from asyncrl_jax.weights import shards
from asyncrl_jax.weights.remote import WeightSender
cfg = ModelConfig(**{cfg!r})
mesh = sharding.make_mesh(jax.devices(), dict(data=1, fsdp=2, tensor=1))
params = models.init_params(cfg, jax.random.key(0), mesh=mesh)
leaves = jax.tree.leaves(params)
planned = shards.plan(leaves, [x.sharding for x in leaves])
sender = WeightSender("127.0.0.1:0")
sender.offer(params, planned, *range(1, {n} + 1))
print("ADDR", sender.address, shards.blocks_to_json(shards.blocks_by_process(planned)[{pid}]), flush=True)
sys.stdin.read()
jax.distributed.shutdown()
"""


def _children(scripts: list[str]) -> tuple[list, list[list[str]]]:
  """Starts the sender processes; returns them and each one's ``ADDR ...`` line (split)."""
  procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True) for code in scripts]
  lines = []
  for p in procs:
    line = p.stdout.readline().split(maxsplit=2)
    if not line or line[0] != "ADDR":
      for q in procs:
        q.kill()
      raise RuntimeError("a sender process did not start")
    lines.append(line[1:])
  return procs, lines


def _pulls(pull, repeats: int) -> float:
  """Median seconds of ``pull(uuid)`` over uuids 2..repeats+1 (uuid 1 warms up)."""
  times = [pull(uuid).seconds for uuid in range(1, repeats + 2)]
  return float(np.median(times[1:]))


def _cross_process(cfg: ModelConfig, like, repeats: int) -> tuple[float, float]:
  """(shard-to-shard seconds, staged seconds) per pull into ``like``."""
  n = repeats + 1
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  procs, lines = _children([_SHARDED.format(root=ROOT, cfg=dataclasses.asdict(cfg), n=n, port=port, pid=i)
                            for i in range(2)])
  receiver = WeightReceiver("127.0.0.1:0")
  try:
    sharded = _pulls(lambda u: receiver.pull(
        [Source(a, u, tuple(shards.blocks_from_json(b))) for a, b in lines], like)[1], repeats)
  finally:
    for p in procs:  # (every stdin first: shutting jax.distributed down waits for both processes)
      p.stdin.close()
    for p in procs:
      p.wait(timeout=60)
  procs, lines = _children([_STAGED.format(root=ROOT, cfg=dataclasses.asdict(cfg), n=n)])
  try:
    staged = _pulls(lambda u: receiver.pull_staged(lines[0][0], u, like)[1], repeats)
  finally:
    procs[0].stdin.close()
    procs[0].wait(timeout=60)
  return sharded, staged


def _config(hidden, layers, inter, vocab) -> ModelConfig:
  return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                     num_heads=max(hidden // 64, 2), num_kv_heads=max(hidden // 128, 1), max_seq_len=256)


def _rollout_layouts(cfg: ModelConfig, params, devices) -> list[tuple]:
  """Pull specs on 2 local devices: the learner's own layout (fsdp=2: every block lands where it
  stays), tensor=2 where the shapes divide, and replicated (data=2: every block is needed twice)."""
  out = []
  for shape, label in ((dict(data=1, fsdp=2, tensor=1), "fsdp=2 (learner's)"),
                       (dict(data=1, fsdp=1, tensor=2), "tensor=2"), (dict(data=2, fsdp=1, tensor=1), "data=2")):
    try:
      target = models.param_shardings(cfg, sharding.make_mesh(devices, shape))
    except sharding.MeshError:
      continue
    out.append((jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params,
                             target), label))
  return out


def _median_time(fn, repeats: int) -> float:
  fn()
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def _socket_copy_seconds(nbytes: int, repeats: int) -> float:
  """Seconds to push ``nbytes`` through a TCP socket on 127.0.0.1 (receiver reads into a buffer)."""
  payload = np.ones(nbytes, np.uint8)
  srv = socket.socket()
  srv.bind(("127.0.0.1", 0))
  srv.listen(1)
  port = srv.getsockname()[1]

  def receive():
    conn, _ = srv.accept()
    buf = bytearray(1 << 20)
    with conn:
      for _ in range(repeats + 1):
        left = nbytes
        while left:
          left -= conn.recv_into(buf, min(left, len(buf)))
        conn.sendall(b"k")

  th = threading.Thread(target=receive, daemon=True)
  th.start()
  cli_sock = socket.create_connection(("127.0.0.1", port))
  view = memoryview(payload)
  times = []
  for i in range(repeats + 1):
    t = time.perf_counter()
    cli_sock.sendall(view)
    cli_sock.recv(1)
    if i:
      times.append(time.perf_counter() - t)
  cli_sock.close()
  th.join()
  srv.close()
  return float(np.median(times))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="the two smaller models, 3 repeats")
  p.add_argument("--repeats", type=int, default=None)
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  repeats = args.repeats or (3 if args.quick else 7)
  sizes = dict(list(SIZES.items())[:2]) if args.quick else SIZES
  devices = jax.devices()
  rollout_devices, learner_devices = sharding.split_devices(devices, 0.75)
  learner_mesh = sharding.make_mesh(learner_devices, dict(data=1, fsdp=-1, tensor=1))
  rollout_mesh = sharding.make_mesh(rollout_devices, dict(data=-1, fsdp=1, tensor=1))
  rows, out = [], {}
  for name, shape in sizes.items():
    cfg = _config(*shape)
    params = models.init_params(cfg, jax.random.key(0), mesh=learner_mesh)
    nbytes = tree_bytes(params)
    target = models.param_shardings(cfg, rollout_mesh)
    local = _median_time(lambda: local_transfer(params, target), repeats)
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    raw = _median_time(lambda: np.copyto(dst, src), repeats)
    sock = _socket_copy_seconds(nbytes, repeats)
    out[name] = dict(bytes=nbytes, params=models.count_params(params), local_seconds=local,
                     raw_copy_seconds=raw, socket_seconds=sock, layouts={})
    for like, layout in _rollout_layouts(cfg, params, devices[:2]):
      sharded, staged = _cross_process(cfg, like, repeats)
      out[name]["layouts"][layout] = dict(sharded_seconds=sharded, staged_seconds=staged)
      rows.append([name, f"{nbytes / 1e6:.1f}", f"{local * 1e3:.2f}", f"{raw * 1e3:.2f}",
                   f"{local / raw:.1f}x", layout, f"{nbytes / sharded / 1e9:.2f}",
                   f"{nbytes / staged / 1e9:.2f}", f"{nbytes / sock / 1e9:.2f}", f"{staged / sharded:.2f}x",
                   f"{sharded / sock:.1f}x"])
    print(f"[transfer] {name}: {out[name]}", flush=True)
  result = dict(machine=machine(), config=dict(repeats=repeats, sizes={k: SIZES[k] for k in sizes},
                                               rollout_devices=len(rollout_devices),
                                               learner_devices=len(learner_devices)),
                results=out)
  header = ["model", "MB", "in-process (ms)", "np.copyto (ms)", "ratio", "rollout layout",
            "shard-to-shard GB/s", "staged GB/s", "TCP socket GB/s", "shard-to-shard / staged speed",
            "shard-to-shard time / socket"]
  notes = ("In-process: learner mesh (1 device) -> rollout mesh (3 devices, the engine's shardings: "
           "replicated here, so 3 copies are written). Cross-process, into a 2-device rollout layout "
           "here: shard to shard from a learner of 2 processes (fsdp=2; each offers only its blocks, "
           "pulled in parallel and reassembled on this side), against the older staged path (one "
           "learner process gathers the whole tree onto one device; pulled onto one device here, "
           "then placed), against one plain TCP copy of the same bytes. GB/s = model bytes / median "
           "seconds per version. Virtual CPU devices share host memory and 2 cores, so these are "
           "memory-bandwidth and CPU figures, not interconnect ones.")
  md = write_result("transfer", result, header, rows, notes, **({"out_dir": args.out} if args.out else {}))
  _plot(out, os.path.join(os.path.dirname(md), "transfer.png"))
  print(json.dumps({k: {kk: v[kk] for kk in ("bytes", "local_seconds", "layouts")} for k, v in out.items()}))
  return 0


def _plot(out, path):
  plt = pyplot()
  mb = [v["bytes"] / 1e6 for v in out.values()]
  fig, ax = plt.subplots(figsize=(6, 4))
  for key, label in (("local_seconds", "in-process device_put"), ("raw_copy_seconds", "np.copyto"),
                     ("socket_seconds", "TCP socket")):
    ax.plot(mb, [v[key] * 1e3 for v in out.values()], "o-", label=label)
  for layout in sorted({l for v in out.values() for l in v["layouts"]}):
    have = [(m, v["layouts"][layout]) for m, v in zip(mb, out.values()) if layout in v["layouts"]]
    ax.plot([m for m, _ in have], [r["sharded_seconds"] * 1e3 for _, r in have], "s-",
            label=f"shard to shard -> {layout}")
    ax.plot([m for m, _ in have], [r["staged_seconds"] * 1e3 for _, r in have], "x--",
            label=f"staged -> {layout}")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("MB moved")
  ax.set_ylabel("ms per version")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  sys.exit(main())
