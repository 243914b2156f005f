"""GKE manifests for one experiment, from the same env file as the Cloud TPU scripts.

  python -m asyncrl_jax.tools.gke --env launch/tpu/examples/qwen2_5_1_5b_v5p.env --out manifests/
  kubectl apply -f manifests/

Writes two JobSets (``jobset.x-k8s.io/v1alpha2``; the JobSet controller must be installed in the
cluster):

* ``NAME-learner``: ``LEARNER_SLICES`` replicated jobs of one TPU slice each, one pod per TPU VM host.
  Pod ``i`` of slice ``s`` is learner process ``s * HOSTS + i`` (``ASYNCRL_PROCESS_ID``, computed from
  the JobSet job index and the Job completion index), and every pod names pod 0 of slice 0 as the
  ``jax.distributed`` coordinator through the JobSet's headless service. With several slices the
  ``MEGASCALE_*`` variables make it a multislice job.
* ``NAME-rollout``: ``ROLLOUT_SERVERS`` single-host decode servers, each registering with the learner
  at the coordinator's address on ``REGISTRY_PORT`` and listening on its pod IP.

The container image (``IMAGE``) holds this repository with its requirements and the TPU jax build
installed at ``/app``; ``WORKDIR`` must be writable from every learner pod.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys

import yaml

REQUIRED = ("PROJECT", "ZONE", "NAME", "LEARNER_ACCELERATOR", "ROLLOUT_ACCELERATOR", "WORKDIR")
DEFAULTS = {"LEARNER_SLICES": "1", "ROLLOUT_SERVERS": "1", "PROVISIONING": "spot", "RUNTIME_VERSION": "",
            "CONFIG": "configs/default.py", "OVERRIDES": "", "REPO_URL": "", "COMMIT": "main",
            "JAX_TPU": "jax[tpu]==0.10.2", "PYTHON": "python3.11", "COORDINATOR_PORT": "8476",
            "REGISTRY_PORT": "8477", "ROLLOUT_PORT": "8478", "REMOTE_DIR": "asyncrl_jax", "IMAGE": "",
            **{k: "" for k in REQUIRED}}

# GKE node labels per TPU generation, and the slice topologies by chip count
_GKE_ACCELERATOR = {"v6e": "tpu-v6e-slice", "v5litepod": "tpu-v5-lite-podslice", "v5p": "tpu-v5p-slice",
                    "v4": "tpu-v4-podslice"}
_TOPOLOGY_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_TOPOLOGY_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
                512: "8x8x8"}


class EnvError(ValueError):
  """A bad env file: the message names the line or field."""


def read_env(path: str) -> dict:
  """KEY=VALUE lines (``#`` comments, optional quotes) with the defaults filled in; unknown and
  missing required fields are errors."""
  if not os.path.isfile(path):
    raise EnvError(f"env file {path!r} not found")
  out = dict(DEFAULTS)
  with open(path) as f:
    for n, raw in enumerate(f, start=1):
      line = raw.split("#", 1)[0].strip()
      if not line:
        continue
      m = re.fullmatch(r"([A-Z_][A-Z0-9_]*)=(.*)", line)
      if not m:
        raise EnvError(f"{path}:{n}: not a KEY=VALUE line: {line!r}")
      key, value = m.groups()
      if key not in DEFAULTS:
        raise EnvError(f"{path}:{n}: unknown field {key!r} (allowed: {' '.join(sorted(DEFAULTS))})")
      if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        value = value[1:-1]
      out[key] = value
  missing = [k for k in REQUIRED + ("IMAGE",) if not out[k]]
  if missing:
    raise EnvError(f"{path}: required fields missing: {' '.join(missing)}")
  for key in ("LEARNER_SLICES", "ROLLOUT_SERVERS", "COORDINATOR_PORT", "REGISTRY_PORT", "ROLLOUT_PORT"):
    if not out[key].isdigit() or int(out[key]) < 1:
      raise EnvError(f"{path}: {key}={out[key]!r} must be a positive integer")
  return out


def slice_shape(accelerator: str) -> dict:
  """Chips, hosts, chips per host, GKE accelerator label and topology of one slice."""
  kind, _, size = accelerator.rpartition("-")
  if kind not in _GKE_ACCELERATOR or not size.isdigit():
    raise EnvError(f"unknown accelerator type {accelerator!r} (v6e-N, v5litepod-N, v5p-N, v4-N)")
  n = int(size)
  chips = n // 2 if kind in ("v5p", "v4") else n
  topology = (_TOPOLOGY_3D if kind in ("v5p", "v4") else _TOPOLOGY_2D).get(chips)
  if topology is None:
    raise EnvError(f"{accelerator}: no slice topology for {chips} chips")
  per_host = min(chips, 8 if kind in ("v6e", "v5litepod") and chips <= 8 else 4)
  return {"chips": chips, "hosts": chips // per_host, "chips_per_host": per_host,
          "gke_accelerator": _GKE_ACCELERATOR[kind], "topology": topology}


def _pod_spec(shape: dict, container: dict, provisioning: str) -> dict:
  selector = {"cloud.google.com/gke-tpu-accelerator": shape["gke_accelerator"],
              "cloud.google.com/gke-tpu-topology": shape["topology"]}
  if provisioning == "spot":
    selector["cloud.google.com/gke-spot"] = "true"
  container["resources"] = {"limits": {"google.com/tpu": shape["chips_per_host"]}}
  return {"nodeSelector": selector, "restartPolicy": "Never", "containers": [container]}


def _jobset(name: str, replicas: int, hosts: int, pod: dict) -> dict:
  return {
      "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
      "metadata": {"name": name, "annotations": {
          "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}},
      "spec": {"network": {"enableDNSHostnames": True},
               "failurePolicy": {"maxRestarts": 0},
               "replicatedJobs": [{"name": "slice", "replicas": replicas, "template": {"spec": {
                   "parallelism": hosts, "completions": hosts, "backoffLimit": 0,
                   "completionMode": "Indexed", "template": {"spec": pod}}}}]}}


def _env_var(name: str, value=None, field: str = "") -> dict:
  if field:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field}}}
  return {"name": name, "value": str(value)}


def render(env: dict) -> list[dict]:
  """The learner and decode-server JobSets for ``env`` (``read_env``)."""
  learner, rollout = slice_shape(env["LEARNER_ACCELERATOR"]), slice_shape(env["ROLLOUT_ACCELERATOR"])
  if rollout["hosts"] != 1:
    raise EnvError(f"ROLLOUT_ACCELERATOR={env['ROLLOUT_ACCELERATOR']} spans several hosts; each decode "
                   "server is one host: set ROLLOUT_SERVERS instead")
  slices, hosts = int(env["LEARNER_SLICES"]), learner["hosts"]
  name = env["NAME"]
  coordinator = f"{name}-learner-slice-0-0.{name}-learner"
  overrides = shlex.split(env["OVERRIDES"])
  job_index = "metadata.annotations['jobset.sigs.k8s.io/job-index']"
  learner_env = [
      _env_var("JOB_INDEX", field=job_index),
      _env_var("JOB_COMPLETION_INDEX", field="metadata.annotations['batch.kubernetes.io/job-completion-index']"),
      _env_var("POD_IP", field="status.podIP"),
      _env_var("ASYNCRL_COORDINATOR", f"{coordinator}:{env['COORDINATOR_PORT']}"),
      _env_var("ASYNCRL_NUM_PROCESSES", slices * hosts)]
  if slices > 1:
    learner_env += [_env_var("MEGASCALE_COORDINATOR_ADDRESS", coordinator),
                    _env_var("MEGASCALE_NUM_SLICES", slices), _env_var("MEGASCALE_SLICE_ID", field=job_index)]
  train = ["python", "-m", "asyncrl_jax.train", f"--config={env['CONFIG']}", f"--workdir={env['WORKDIR']}",
           f"--config.rollout.servers={env['ROLLOUT_SERVERS']}", "--config.rollout.host=$(POD_IP)",
           f"--config.rollout.registry_port={env['REGISTRY_PORT']}", *overrides]
  learner_container = {
      "name": "learner", "image": env["IMAGE"], "workingDir": "/app", "env": learner_env,
      # ($$ is Kubernetes' escape for $: the shell computes the process id)
      "command": ["bash", "-c", f"export ASYNCRL_PROCESS_ID=$$((JOB_INDEX * {hosts} + JOB_COMPLETION_INDEX)) "
                  f"&& exec {' '.join(shlex.quote(w) for w in train)}"],
      "ports": [{"containerPort": int(env["COORDINATOR_PORT"])}, {"containerPort": int(env["REGISTRY_PORT"])}]}
  decode = ["python", "-m", "asyncrl_jax.rollout.main", f"--config={env['CONFIG']}",
            "--server_id=decode-$(JOB_INDEX)", "--config.rollout.host=$(POD_IP)",
            f"--config.rollout.port={env['ROLLOUT_PORT']}",
            f"--config.rollout.learner_address={coordinator}:{env['REGISTRY_PORT']}", *overrides]
  decode_container = {
      "name": "decode", "image": env["IMAGE"], "workingDir": "/app", "command": decode,
      "env": [_env_var("JOB_INDEX", field=job_index), _env_var("POD_IP", field="status.podIP")],
      "ports": [{"containerPort": int(env["ROLLOUT_PORT"])}]}
  return [_jobset(f"{name}-learner", slices, hosts, _pod_spec(learner, learner_container, env["PROVISIONING"])),
          _jobset(f"{name}-rollout", int(env["ROLLOUT_SERVERS"]), 1,
                  _pod_spec(rollout, decode_container, env["PROVISIONING"]))]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--env", required=True, help="experiment env file (launch/tpu/examples/*.env)")
  p.add_argument("--out", required=True, help="directory for learner.yaml and rollout.yaml")
  args = p.parse_args(argv)
  try:
    manifests = render(read_env(args.env))
  except EnvError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  os.makedirs(args.out, exist_ok=True)
  for role, manifest in zip(("learner", "rollout"), manifests):
    path = os.path.join(args.out, f"{role}.yaml")
    with open(path, "w") as f:
      yaml.safe_dump(manifest, f, sort_keys=False)
    print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
