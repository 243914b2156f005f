"""The GKE renderer: JobSet kinds, replica counts, TPU resources and the coordinator / registry wiring,
from the same env file as the Cloud TPU scripts."""

import os
import re
import subprocess

import pytest
import yaml

from asyncrl_jax.tools import gke

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "launch", "tpu", "examples", "qwen2_5_1_5b_v5p.env")


def _env(tmp_path, **changes):
  text = open(EXAMPLE).read() + "IMAGE=us-docker.pkg.dev/p/r/asyncrl:1\n"
  text += "".join(f"{k}={v}\n" for k, v in changes.items())
  path = tmp_path / "run.env"
  path.write_text(text)
  return gke.read_env(str(path))


def _vars(container) -> dict:
  return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def _process_id(container, job_index: int, completion_index: int) -> int:
  """What the learner pod's shell computes for ASYNCRL_PROCESS_ID."""
  script = container["command"][2].split(" && ")[0].replace("$$", "$")
  out = subprocess.run(["bash", "-c", f"{script}; echo $ASYNCRL_PROCESS_ID"], capture_output=True, text=True,
                       env={"JOB_INDEX": str(job_index), "JOB_COMPLETION_INDEX": str(completion_index)})
  return int(out.stdout)


@pytest.mark.parametrize("accelerator,slices,hosts,chips", [("v5p-32", 1, 4, 4), ("v6e-16", 2, 4, 4),
                                                             ("v6e-8", 1, 1, 8)])
def test_learner_jobset_wires_every_host_to_the_coordinator(tmp_path, accelerator, slices, hosts, chips):
  learner, rollout = gke.render(_env(tmp_path, LEARNER_ACCELERATOR=accelerator, LEARNER_SLICES=slices))
  assert learner["kind"] == rollout["kind"] == "JobSet"
  assert learner["apiVersion"].startswith("jobset.x-k8s.io/")
  (job,) = learner["spec"]["replicatedJobs"]
  assert job["replicas"] == slices
  spec = job["template"]["spec"]
  assert spec["parallelism"] == spec["completions"] == hosts and spec["completionMode"] == "Indexed"
  pod = spec["template"]["spec"]
  (container,) = pod["containers"]
  assert container["resources"]["limits"]["google.com/tpu"] == chips
  assert pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"].startswith(f"tpu-{accelerator[:3]}")
  env = _vars(container)
  assert env["ASYNCRL_COORDINATOR"] == "asyncrl-qwen15b-learner-slice-0-0.asyncrl-qwen15b-learner:8476"
  assert env["ASYNCRL_NUM_PROCESSES"] == str(slices * hosts)
  ids = [_process_id(container, s, i) for s in range(slices) for i in range(hosts)]
  assert ids == list(range(slices * hosts))  # pod i of slice s: process s * hosts + i
  assert ("MEGASCALE_NUM_SLICES" in env) == (slices > 1)
  assert "--config.rollout.servers=8" in container["command"][2]  # ROLLOUT_SERVERS in the example env


def test_decode_servers_register_with_the_learner(tmp_path):
  _, rollout = gke.render(_env(tmp_path, ROLLOUT_SERVERS=5, REGISTRY_PORT=9100))
  (job,) = rollout["spec"]["replicatedJobs"]
  assert job["replicas"] == 5 and job["template"]["spec"]["parallelism"] == 1
  (container,) = job["template"]["spec"]["template"]["spec"]["containers"]
  assert ("--config.rollout.learner_address=asyncrl-qwen15b-learner-slice-0-0.asyncrl-qwen15b-learner:9100"
          in container["command"])
  assert "--config.rollout.host=$(POD_IP)" in container["command"]
  assert _vars(container)["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
  assert container["resources"]["limits"]["google.com/tpu"] == 4  # one v5p-8 host


def test_multi_host_decode_servers_and_bad_fields_are_refused(tmp_path):
  with pytest.raises(gke.EnvError, match="spans several hosts"):
    gke.render(_env(tmp_path, ROLLOUT_ACCELERATOR="v5p-16"))
  bad = tmp_path / "bad.env"
  bad.write_text("NAME=x\nCOLOR=blue\n")
  with pytest.raises(gke.EnvError, match="unknown field 'COLOR'"):
    gke.read_env(str(bad))
  bad.write_text("NAME=x\n")
  with pytest.raises(gke.EnvError, match="required fields missing: PROJECT ZONE"):
    gke.read_env(str(bad))
  with pytest.raises(gke.EnvError, match="no slice topology for 12 chips"):
    gke.slice_shape("v6e-12")


def test_the_renderer_and_the_tpu_scripts_accept_the_same_fields():
  lib = open(os.path.join(ROOT, "launch", "tpu", "lib.sh")).read()
  block = lib[lib.index("declare -A ASYNCRL_DEFAULTS=("):lib.index("\n)\n")]
  assert set(re.findall(r"\[([A-Z_]+)\]=", block)) == set(gke.DEFAULTS)


def test_cli_writes_manifests_that_parse_back(tmp_path):
  env_path = tmp_path / "run.env"
  env_path.write_text(open(EXAMPLE).read() + "IMAGE=img:1\n")
  assert gke.main(["--env", str(env_path), "--out", str(tmp_path / "m")]) == 0
  learner = yaml.safe_load((tmp_path / "m" / "learner.yaml").read_text())
  rollout = yaml.safe_load((tmp_path / "m" / "rollout.yaml").read_text())
  assert learner == gke.render(gke.read_env(str(env_path)))[0]
  assert rollout["metadata"]["name"] == "asyncrl-qwen15b-rollout"
