"""Weight-transfer time against the bytes moved, beside a raw copy of the same bytes.

  .venv/bin/python benchmarks/transfer.py [--quick]

* in one process: ``local_transfer`` (``jax.device_put`` from the learner mesh onto the rollout mesh's
  shardings, as the main job does after every update) versus ``np.copyto`` of a buffer of the same size;
* between processes: a learner-side ``WeightSender`` in a child process, pulled by ``WeightReceiver``
  here (``jax.experimental.transfer`` over 127.0.0.1, staged through one device, then placed into the
  rollout sharding) versus the same bytes sent over a plain TCP socket on 127.0.0.1.

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

from asyncrl_jax import models, sharding  # noqa: E402
from asyncrl_jax.models.config import ModelConfig  # noqa: E402
from asyncrl_jax.transfer import WeightReceiver, local_transfer, tree_bytes  # noqa: E402
from benchmarks.common import machine, pyplot, write_result  # noqa: E402

SIZES = {  # name -> (hidden, layers, intermediate, vocab)
    "0.5M (default demo)": (128, 2, 512, 17),
    "13M": (384, 6, 1536, 4096),
    "60M": (768, 8, 3072, 8192),
}

_SENDER = r"""
import os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
sys.path.insert(0, {root!r})
import jax
from asyncrl_jax import models
from asyncrl_jax.models.config import ModelConfig
from asyncrl_jax.transfer import WeightSender
cfg = ModelConfig(**{cfg!r})
params = models.init_params(cfg, jax.random.key(0))
sender = WeightSender("127.0.0.1:0")
for uuid in range(1, {n} + 1):
  sender.offer(params, uuid)
print(sender.address, flush=True)
sys.stdin.read()  # until the parent closes stdin
"""


def _config(hidden, layers, inter, vocab) -> ModelConfig:
  return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                     num_heads=max(hidden // 64, 2), num_kv_heads=max(hidden // 128, 1), max_seq_len=256)


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
    # cross-process: a child offers repeats + 1 versions; we pull them into the rollout sharding
    child = subprocess.Popen(
        [sys.executable, "-c", _SENDER.format(root=ROOT, cfg=dataclasses.asdict(cfg), n=repeats + 1)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    address = child.stdout.readline().strip()
    if not address:
      child.kill()
      raise RuntimeError("the sender process did not start")
    receiver = WeightReceiver("127.0.0.1:0")
    like = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, target)
    times = []
    for uuid in range(1, repeats + 2):
      _, stats = receiver.pull(address, uuid, like)
      if uuid > 1:
        times.append(stats.seconds)
    child.stdin.close()
    child.wait(timeout=60)
    remote = float(np.median(times))
    sock = _socket_copy_seconds(nbytes, repeats)
    out[name] = dict(bytes=nbytes, params=models.count_params(params), local_seconds=local,
                     raw_copy_seconds=raw, remote_seconds=remote, socket_seconds=sock)
    rows.append([name, f"{nbytes / 1e6:.1f}", f"{local * 1e3:.2f}", f"{raw * 1e3:.2f}",
                 f"{local / raw:.1f}x", f"{remote * 1e3:.1f}", f"{sock * 1e3:.1f}", f"{remote / sock:.1f}x",
                 f"{nbytes / remote / 1e9:.2f}"])
    print(f"[transfer] {name}: {out[name]}", flush=True)
  result = dict(machine=machine(), config=dict(repeats=repeats, sizes={k: SIZES[k] for k in sizes},
                                               rollout_devices=len(rollout_devices),
                                               learner_devices=len(learner_devices)),
                results=out)
  header = ["model", "MB", "in-process (ms)", "np.copyto (ms)", "ratio", "cross-process (ms)",
            "TCP socket (ms)", "ratio", "cross-process GB/s"]
  notes = ("In-process: learner mesh (1 device) -> rollout mesh (3 devices, the engine's shardings: "
           "replicated here, so 3 copies are written). Cross-process: `jax.experimental.transfer` pull "
           "of a single-device staging copy, then placement into the rollout sharding (the staging is "
           "needed on jax 0.10.2, see NOTES.md), against one plain TCP copy of the same bytes. Virtual "
           "CPU devices share host memory, so these are memory-bandwidth figures, not interconnect ones.")
  md = write_result("transfer", result, header, rows, notes, **({"out_dir": args.out} if args.out else {}))
  _plot(out, os.path.join(os.path.dirname(md), "transfer.png"))
  print(json.dumps({k: {kk: v[kk] for kk in ("bytes", "local_seconds", "remote_seconds")} for k, v in out.items()}))
  return 0


def _plot(out, path):
  plt = pyplot()
  mb = [v["bytes"] / 1e6 for v in out.values()]
  fig, ax = plt.subplots(figsize=(6, 4))
  for key, label in (("local_seconds", "in-process device_put"), ("raw_copy_seconds", "np.copyto"),
                     ("remote_seconds", "cross-process transfer"), ("socket_seconds", "TCP socket")):
    ax.plot(mb, [v[key] * 1e3 for v in out.values()], "o-", label=label)
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("MB moved")
  ax.set_ylabel("ms")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  sys.exit(main())
