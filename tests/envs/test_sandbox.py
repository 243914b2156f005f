"""Hostile code against the Python tool's sandbox (``envs.sandbox``): every attempt below fails inside
the sandbox, as this process's user and, when the tests run as root, as an unprivileged user (a helper
process running as uid 65534 with the system's Python). The attempts that the sandbox alone stops
are also run without it (``python_tool._run_unsandboxed``), where they succeed: the negative control
that shows each probe can see what it looks for.

Network probes target only a listener these tests start on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

from asyncrl_jax.envs import python_tool, sandbox

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMITS = sandbox.Limits(seconds=30.0, cpu_seconds=2, memory_bytes=256 << 20, output_bytes=1 << 16,
                        open_files=32, processes=8, disk_bytes=1 << 20)
SECRET = "asyncrl-test-secret-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def host(tmp_path_factory):
  """What the host holds that the code must not reach: a secret in a process's environment (a
  stand-in for a decode server holding its token), a world-readable file and a world-writable directory outside the sandbox, and a listener on
  127.0.0.1 that records whether anyone connected."""
  ok, why = sandbox.available()
  assert ok, f"the sandbox must run on this machine (it does on CI's): {why}"
  server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                            env={"ASYNCRL_AUTH_TOKEN": SECRET})
  shared = tempfile.mkdtemp(prefix="asyncrl-sandbox-host-")
  os.chmod(shared, 0o777)
  secret_file = os.path.join(shared, "secret.txt")
  with open(secret_file, "w") as f:
    f.write(SECRET)
  os.chmod(secret_file, 0o644)
  listener = socket.socket()
  listener.bind(("127.0.0.1", 0))
  listener.listen(8)
  connected = []

  def accept():
    while True:
      try:
        conn, _ = listener.accept()
      except OSError:
        return
      connected.append(1)
      conn.close()

  threading.Thread(target=accept, daemon=True).start()
  yield {"pid": server.pid, "dir": shared, "file": secret_file, "port": listener.getsockname()[1],
         "connected": connected}
  listener.close()
  server.kill()
  server.wait()
  subprocess.run(["rm", "-rf", shared], check=False)


def _probes(h, marker):
  """name -> the hostile code; each prints what it obtained."""
  return {
      "proc_environ": f"""
import os
found = []
for p in os.listdir('/proc'):
    try:
        if {SECRET!r} in open(f'/proc/{{p}}/environ', errors='replace').read():
            found.append(p)
    except OSError:
        pass
try:
    found.append(open('/proc/{h['pid']}/environ').read())
except OSError as e:
    print('denied', type(e).__name__)
print('FOUND' if any({SECRET!r} in f or f.isdigit() for f in found) else 'none')
""",
      "host_file": f"""
try:
    print(open({h['file']!r}).read())
except OSError as e:
    print('denied', type(e).__name__)
""",
      "write_outside": f"""
import os
for path in [{os.path.join(h['dir'], 'written.txt')!r}, '/written.txt', '/usr/lib/written.txt', '/proc/written']:
    try:
        with open(path, 'w') as f:
            f.write('x')
        print('WROTE', path)
    except OSError as e:
        print('denied', path, type(e).__name__)
""",
      "connect": f"""
import socket
s = socket.socket()
s.settimeout(5)
try:
    s.connect(('127.0.0.1', {h['port']}))
    print('CONNECTED')
except OSError as e:
    print('denied', type(e).__name__)
""",
      "processes": """
import os, time
n = 0
try:
    while n < 200:
        if os.fork() == 0:
            time.sleep(3)
            os._exit(0)
        n += 1
except OSError as e:
    print('refused', type(e).__name__)
print('started', n)
""",
      "outlive": f"""
import os, subprocess, sys
sleeper = [sys.executable, '-c', 'import time; time.sleep(60)  # {marker}']
subprocess.Popen(sleeper, start_new_session=True)   # its own session
subprocess.Popen(sleeper)                           # the caller's session
if os.fork() == 0:                                  # a daemon: fork, setsid, fork
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, sleeper)
    os._exit(0)
print('left behind')
""",
      "memory": """
try:
    x = bytearray(512 << 20)
    print('ALLOCATED')
except MemoryError:
    print('denied MemoryError')
""",
      "cpu": """
while True:
    pass
""",
      "nested_namespaces": """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for name, flags in (("user", 0x10000000), ("user+net", 0x50000000), ("net", 0x40000000), ("mount", 0x20000)):
    pid = os.fork()
    if pid == 0:  # (in a child: a namespace it did enter would not change this probe's own)
        os._exit(0 if libc.unshare(flags) == 0 else 100 + ctypes.get_errno())
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    print(name, 'UNSHARED' if code == 0 else f'refused {code - 100}')
""",
      "kernel_surface": """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
for name, args in (("keyctl", (250, 0, -3, 0, 0, 0)), ("personality", (135, 0xffffffff)),
                   ("userfaultfd", (323, 0)), ("bpf", (321, 0, 0, 0)), ("perf_event_open", (298, 0, 0, -1, -1, 0)),
                   ("io_uring_setup", (425, 1, 0)), ("ptrace", (101, 0, 0, 0, 0)), ("clone_newuser", (56, 0x10000011, 0, 0, 0, 0))):
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:  # (in a child: a call that works changes nothing of this probe's)
        r = libc.syscall(*args)
        if name == "clone_newuser" and r == 0:
            libc.syscall(231, 0)  # exit_group: the new process leaves at once
        os._exit(0 if r >= 0 else 100 + ctypes.get_errno())
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    print(name, 'ALLOWED' if code == 0 else f'refused {code - 100}')
""",
      "write_special": """
for path in ['/dev/shm/x', '/dev/x', '/run/x', '/var/tmp/x']:
    try:
        with open(path, 'w') as f:
            f.write('x')
        print('WROTE', path)
    except OSError as e:
        print('denied', path, type(e).__name__)
with open('/dev/null', 'w') as f:  # (devices still work)
    f.write('x')
""",
      "disk": """
n = 0
try:
    for i in range(100):
        with open(f'/tmp/f{i}', 'wb') as f:
            f.write(b'x' * 60000)
        n += 60000
except OSError as e:
    print('denied', type(e).__name__)
print('wrote', n)
""",
  }


def _check(name, r: dict, h, marker):
  """Asserts that probe ``name`` failed inside the sandbox (``r``: its RunResult as a dict)."""
  out = r["stdout"]
  where = f"{name}: stdout={out!r} stderr={r['stderr'][-300:]!r}"
  assert r["sandboxed"], where
  if name == "proc_environ":
    assert "none" in out and "denied" in out and SECRET not in out, where
  elif name == "host_file":
    assert "denied" in out and SECRET not in out, where
  elif name == "write_outside":
    assert "WROTE" not in out and out.count("denied") == 4, where
    assert not os.path.exists(os.path.join(h["dir"], "written.txt")), where
  elif name == "connect":
    assert "CONNECTED" not in out and "denied" in out, where
  elif name == "processes":
    assert "refused" in out and f"started {LIMITS.processes}" in out, where
  elif name == "outlive":
    assert "left behind" in out, where
    assert not _alive(marker), f"{where}: a process it started is still running"
  elif name == "memory":
    assert "denied MemoryError" in out and "ALLOCATED" not in out, where
  elif name == "cpu":  # killed by SIGXCPU, well before the wall clock
    assert not r["timed_out"] and r["exit_code"] not in (0, None), where
  elif name == "nested_namespaces":
    assert "UNSHARED" not in out and out.count("refused") == 4, where
  elif name == "kernel_surface":
    assert "ALLOWED" not in out and out.count("refused 1") == 8, where
  elif name == "write_special":
    assert "WROTE" not in out and out.count("denied") == 4 and r["exit_code"] == 0, where
  elif name == "disk":
    written = int(out.split("wrote ")[1])
    assert "denied" in out and written <= LIMITS.disk_bytes, where
  else:
    raise AssertionError(name)


def _alive(marker) -> bool:
  time.sleep(0.5)  # a process being killed leaves /proc within this
  for p in os.listdir("/proc"):
    try:
      with open(f"/proc/{p}/cmdline", "rb") as f:
        if marker.encode() in f.read():
          return True
    except OSError:
      continue
  return False


def test_hostile_code_fails_inside_the_sandbox_as_this_user(host):
  marker = "asyncrl-marker-" + uuid.uuid4().hex
  for name, code in _probes(host, marker).items():
    _check(name, dataclasses.asdict(sandbox.run(code, LIMITS)), host, marker)
  assert not host["connected"]


_HELPER = """
import dataclasses, importlib.util, json, sys
spec = importlib.util.spec_from_file_location("sandbox", sys.argv[1])
sandbox = sys.modules["sandbox"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sandbox)
sandbox.bwrap_path = lambda: sys.argv[2]
probes, limits = json.loads(sys.stdin.read())
limits = sandbox.Limits(**limits)
print(json.dumps({n: dataclasses.asdict(sandbox.run(code, limits)) for n, code in probes.items()}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can switch to another user; the test above "
                    "already runs the probes as this unprivileged user")
def test_hostile_code_fails_inside_the_sandbox_as_an_unprivileged_user(host):
  """The server running as uid 65534 (not root): the sandbox then relies on the kernel's
  unprivileged user namespaces, and the process limit on that user's count."""
  python = "/usr/bin/python3"
  assert os.path.exists(python), "the unprivileged form needs a system Python readable by uid 65534"
  bwrap = sandbox.bwrap_path()
  assert sandbox._other_can_read(bwrap), f"{bwrap} must be runnable by uid 65534"  # pylint: disable=protected-access
  marker = "asyncrl-marker-" + uuid.uuid4().hex
  module = os.path.join(ROOT, "asyncrl_jax", "envs", "sandbox.py")
  probes = _probes(host, marker)
  r = subprocess.run([python, "-I", "-c", _HELPER, module, bwrap],
                     input=json.dumps([probes, dataclasses.asdict(LIMITS)]), capture_output=True,
                     text=True, user=65534, group=65534, extra_groups=[], cwd="/", env={}, timeout=600,
                     check=False)
  assert r.returncode == 0, r.stderr[-2000:]
  results = json.loads(r.stdout)
  assert set(results) == set(probes)
  for name in probes:
    _check(name, results[name], host, marker)
  assert not host["connected"]


def test_without_the_sandbox_the_same_probes_succeed(host):
  """Negative control: the probes can see what they look for when nothing stops them."""
  limits = dataclasses.replace(LIMITS, seconds=10.0)
  marker = "asyncrl-marker-" + uuid.uuid4().hex
  probes = _probes(host, marker)
  got = {n: python_tool._run_unsandboxed(probes[n], limits) for n in  # pylint: disable=protected-access
         ("proc_environ", "host_file", "write_outside", "connect", "outlive")}
  assert not any(r.sandboxed for r in got.values())
  assert "FOUND" in got["proc_environ"].stdout
  assert SECRET in got["host_file"].stdout
  assert f"WROTE {os.path.join(host['dir'], 'written.txt')}" in got["write_outside"].stdout
  assert "CONNECTED" in got["connect"].stdout and host["connected"]
  assert _alive(marker), "a detached process outlives an unsandboxed call"
  subprocess.run(["pkill", "-f", marker], check=False)
  os.remove(os.path.join(host["dir"], "written.txt"))
  host["connected"].clear()


def test_without_the_seccomp_filter_and_bwrap_flags_the_new_probes_succeed(host, monkeypatch):
  """Negative control for the closing of kernel surface: in the same sandbox without the seccomp
  filter, ``--disable-userns`` and a read-only ``/dev``, the probes reach what those stop."""
  probes = _probes(host, "unused")
  real = sandbox.command

  def weaker(*args, **kwargs):
    cmd = real(*args, **kwargs)
    cmd.remove("--disable-userns")
    i = cmd.index("/dev", cmd.index("--remount-ro"))
    del cmd[i - 1:i + 1]  # "--remount-ro /dev"
    return cmd

  monkeypatch.setattr(sandbox, "command", weaker)
  monkeypatch.setattr(sandbox, "seccomp_program", lambda: None)
  out = {n: sandbox.run(probes[n], LIMITS).stdout for n in ("nested_namespaces", "kernel_surface", "write_special")}
  assert "user UNSHARED" in out["nested_namespaces"] and "user+net UNSHARED" in out["nested_namespaces"], out
  assert "keyctl ALLOWED" in out["kernel_surface"] and "personality ALLOWED" in out["kernel_surface"], out
  assert "WROTE /dev/shm/x" in out["write_special"] and "WROTE /dev/x" in out["write_special"], out


def test_the_tool_refuses_to_run_where_the_sandbox_cannot(monkeypatch):
  monkeypatch.setattr(sandbox, "available", lambda python="": (False, "user namespaces refused (test)"))
  with pytest.raises(sandbox.SandboxUnavailable, match="user namespaces refused.*allow_unsandboxed"):
    python_tool.run_python("print(1)")
  r = python_tool.run_python("print(1)", allow_unsandboxed=True)
  assert r.stdout.strip() == "1" and not r.sandboxed


def test_a_run_with_the_python_tool_refuses_to_start_without_the_sandbox(monkeypatch):
  """``envs.sandbox_status``: what the main job checks before any setup, and what summary.json keeps."""
  from asyncrl_jax import envs  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.config import base_config  # pylint: disable=import-outside-toplevel
  c = base_config()
  c.env.name, c.env.options = "tools", '{"tool": "python"}'
  assert envs.sandbox_status(c)["sandboxed"]
  assert envs.episode_template(c)["options"]["allow_unsandboxed"] is False
  monkeypatch.setattr(sandbox, "available", lambda python="": (False, "no user namespaces (test)"))
  with pytest.raises(sandbox.SandboxUnavailable, match="no user namespaces.*allow_unsandboxed=True"):
    envs.sandbox_status(c)
  c.env.allow_unsandboxed = True
  assert envs.sandbox_status(c) == {"sandboxed": False, "why": "no user namespaces (test)",
                                    "interpreter": None}
  assert envs.episode_template(c)["options"]["allow_unsandboxed"] is True
  c.env.options = '{"tool": "calculator"}'
  assert envs.sandbox_status(c) is None  # no model code runs
  c.data.task = "code_jsonl"  # the code reward: refused where the sandbox cannot run, whatever the flag
  with pytest.raises(sandbox.SandboxUnavailable, match="code_jsonl.*no user namespaces"):
    envs.sandbox_status(c)
