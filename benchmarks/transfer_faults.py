"""What a dead or stalled peer does to ``jax.experimental.transfer`` (jax 0.10.2, CPU, 127.0.0.1).

  python -m benchmarks.transfer_faults [--mb 256] [--out benchmarks/results/transfer_faults.md]

Each case runs a sender process (offers one float32 array of ``--mb`` MB under a uuid, the way a
learner process offers its blocks) and a receiver process (pulls it, the way a decode server does),
kills or stops one of them at a point, and then checks the survivor: is it alive, does its call
return or raise or hang (bounded by a deadline), and can it still serve a fresh peer?

Cases:
* ``receiver_killed_before_pull``: the sender offered; the receiver dies without pulling.
* ``receiver_killed_mid_pull``: the receiver dies while the bytes are moving.
* ``sender_killed_mid_pull``: the sender dies while the receiver pulls.
* ``receiver_stopped_mid_pull``: SIGSTOP on the receiver mid-pull (a stalled decode server).
* ``sender_killed_then_new_sender``: the receiver, after its sender died mid-pull, pulls from a fresh
  sender.

The findings shape ``rollout.backends.RemoteRollout``: see the table this writes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROLE_ENV = "ASYNCRL_TRANSFER_FAULT_ROLE"


def _write(path: str, text: str) -> None:
  with open(path + ".tmp", "w") as f:
    f.write(text)
  os.replace(path + ".tmp", path)


def _wait_file(path: str, timeout: float) -> bool:
  deadline = time.time() + timeout
  while not os.path.exists(path):
    if time.time() > deadline:
      return False
    time.sleep(0.05)
  return True


def _child(role: str, out: str, mb: int) -> None:
  """The sender or receiver process; reports events as files under ``out``."""
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.weights.remote import _start_server  # pylint: disable=import-outside-toplevel
  server = _start_server("127.0.0.1:0")
  n = mb * 2 ** 20 // 4
  if role.startswith("sender"):
    x = jax.device_put(np.arange(n, dtype=np.float32))
    for uuid in (1, 2, 3):
      server.await_pull(uuid, [x])
    _write(f"{out}/{role}.addr", server.address())
    while True:  # serve until killed; a command file asks for a fresh offer
      time.sleep(0.1)
  elif role == "receiver_idle":  # connects, never pulls
    with open(f"{out}/sender.addr") as f:
      server.connect(f.read())
    while True:
      time.sleep(0.1)
  else:  # receiver: pull from the sender named in the file, report timing
    first_uuid = int(role[len("receiver"):] or 1)
    for attempt, sender in enumerate(["sender", "sender2"]):
      if not _wait_file(f"{out}/{sender}.addr", 120):
        return
      if attempt and not os.path.exists(f"{out}/try_second"):
        return
      with open(f"{out}/{sender}.addr") as f:
        address = f.read()
      spec = [jax.ShapeDtypeStruct((n,), np.float32,
                                   sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))]
      _write(f"{out}/pull-{attempt}.start", str(time.time()))
      try:
        conn = server.connect(address)
        y = jax.block_until_ready(conn.pull(first_uuid + attempt, spec))
        ok = bool(np.asarray(y[0][-1]) == n - 1)
        _write(f"{out}/pull-{attempt}.end", json.dumps({"ok": ok, "t": time.time()}))
      except Exception as e:  # pylint: disable=broad-except
        _write(f"{out}/pull-{attempt}.end", json.dumps({"error": repr(e)[:300], "t": time.time()}))


def _spawn(role: str, out: str, mb: int) -> subprocess.Popen:
  env = dict(os.environ, **{ROLE_ENV: role, "JAX_PLATFORMS": "cpu"})
  return subprocess.Popen([sys.executable, "-m", "benchmarks.transfer_faults", "--child", role,
                           "--out", out, "--mb", str(mb)], env=env,
                          stdout=subprocess.DEVNULL, stderr=open(f"{out}/{role}.log", "w"))


def _alive(p: subprocess.Popen) -> bool:
  return p.poll() is None


def _result(out: str, attempt: int, deadline: float) -> str:
  path = f"{out}/pull-{attempt}.end"
  if not _wait_file(path, deadline):
    return f"no return within {deadline:.0f}s (hangs)"
  with open(path) as f:
    r = json.load(f)
  return "returned, data correct" if r.get("ok") else f"raised {r.get('error', 'wrong data')}"


def run_case(case: str, mb: int, deadline: float) -> dict:
  out = tempfile.mkdtemp(prefix=f"tf-{case}-")
  sender = _spawn("sender", out, mb)
  receiver = None
  row = {"case": case}
  try:
    if not _wait_file(f"{out}/sender.addr", 120):
      return dict(row, survivor="sender failed to start")
    if case == "receiver_killed_before_pull":
      receiver = _spawn("receiver_idle", out, mb)
      time.sleep(1.0)
      receiver.kill()
      time.sleep(1.0)
      fresh = _spawn("receiver", out, mb)
      row["survivor"] = f"sender alive: {_alive(sender)}"
      row["fresh peer"] = _result(out, 0, deadline)
      fresh.kill()
      return row
    receiver = _spawn("receiver", out, mb)
    _wait_file(f"{out}/pull-0.start", 120)
    time.sleep(0.05)  # the pull is under way
    if os.path.exists(f"{out}/pull-0.end"):
      row["note"] = "pull finished before the fault: use a larger --mb"
    if case == "receiver_killed_mid_pull":
      receiver.kill()
      time.sleep(1.0)
      row["survivor"] = f"sender alive: {_alive(sender)}"
      os.remove(f"{out}/pull-0.start")
      if os.path.exists(f"{out}/pull-0.end"):
        os.remove(f"{out}/pull-0.end")
      fresh = _spawn("receiver2", out, mb)  # a fresh peer pulls another uuid of the same sender
      row["fresh peer"] = _result(out, 0, deadline)
      fresh.kill()
      if os.path.exists(f"{out}/pull-0.end"):
        os.remove(f"{out}/pull-0.end")
      retry = _spawn("receiver", out, mb)  # and the killed pull's uuid again
      row["retry same uuid"] = _result(out, 0, deadline)
      retry.kill()
    elif case == "receiver_stopped_mid_pull":
      receiver.send_signal(signal.SIGSTOP)
      time.sleep(deadline)
      row["survivor"] = f"sender alive: {_alive(sender)}"
      receiver.send_signal(signal.SIGCONT)
      row["after SIGCONT"] = _result(out, 0, deadline)
    elif case in ("sender_killed_mid_pull", "sender_killed_then_new_sender"):
      sender.kill()
      row["receiver's pull"] = _result(out, 0, deadline)
      row["survivor"] = f"receiver alive: {_alive(receiver)}"
      if case == "sender_killed_then_new_sender":
        _write(f"{out}/try_second", "1")
        sender2 = _spawn("sender2", out, mb)
        row["fresh peer"] = _result(out, 1, deadline)
        row["survivor"] = f"receiver alive: {_alive(receiver)}"
        sender2.kill()
    return row
  finally:
    for p in (sender, receiver):
      if p is not None and _alive(p):
        p.send_signal(signal.SIGCONT)
        p.kill()


CASES = ("receiver_killed_before_pull", "receiver_killed_mid_pull", "sender_killed_mid_pull",
         "receiver_stopped_mid_pull", "sender_killed_then_new_sender")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--mb", type=int, default=256)
  ap.add_argument("--deadline", type=float, default=20.0)
  ap.add_argument("--out", default="benchmarks/results/transfer_faults.md")
  ap.add_argument("--child", default="")
  ap.add_argument("--cases", default=",".join(CASES))
  args = ap.parse_args()
  if args.child:
    _child(args.child, args.out, args.mb)
    return
  rows = []
  for case in args.cases.split(","):
    t = time.time()
    row = run_case(case, args.mb, args.deadline)
    row["seconds"] = f"{time.time() - t:.1f}"
    print(json.dumps(row), flush=True)
    rows.append(row)
  import jax  # pylint: disable=import-outside-toplevel
  cols = ["case", "survivor", "receiver's pull", "fresh peer", "retry same uuid", "after SIGCONT", "note"]
  lines = [f"# jax.experimental.transfer under peer faults\n",
           f"jax {jax.__version__}, CPU, 127.0.0.1, one {args.mb} MB float32 array, deadline "
           f"{args.deadline:.0f} s per wait. `python -m benchmarks.transfer_faults`.\n",
           "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    f.write("\n".join(lines) + "\n")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
