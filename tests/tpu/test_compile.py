"""``info --compile``: the main job's programs compiled by the TPU compiler (libtpu) for small
topologies on this CPU machine, through the same code path as the shipped configs' compile."""

import json
import os
import subprocess
import sys

import pytest

from asyncrl_jax import config as config_lib, models
from asyncrl_jax.tpu import chips, compile as tpu_compile, projection

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tiny(**learner):
  c = config_lib.base_config()
  c.model.update(vocab_size=512, hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4,
                 num_kv_heads=2, max_seq_len=256)
  c.data.update(max_prompt_len=32, max_completion_len=96)
  c.rollout.update(num_slots=16)
  c.learner.update(token_budget=1024, batch_size=64, ppo_minibatches=2, **learner)
  c.rl.update(loss="decoupled_ppo", group_size=8)
  c.mesh.learner.update(data=1, fsdp=-1, tensor=1)
  c.mesh.rollout.update(data=-1, fsdp=1, tensor=1)
  return config_lib.validate(c)


def test_topology_names_follow_the_listed_slice_shapes():
  assert chips.parse("v5p-32")[1] == 16 and chips.parse("v6e-16")[1] == 16
  assert chips.parse("v5litepod-8")[0].kind == "v5e"
  assert [chips.topology_name("v5p", n) for n in (4, 8, 16, 32, 64)] == [
      "v5p:2x2x1", "v5p:2x2x2", "v5p:2x2x4", "v5p:2x4x4", "v5p:4x4x4"]
  assert [chips.topology_name("v6e", n) for n in (4, 8, 16, 64)] == [
      "v6e:2x2", "v6e:2x4", "v6e:4x4", "v6e:8x8"]
  assert chips.host_chips("v5p-8") == 4 and chips.host_chips("v6e-8") == 8
  with pytest.raises(ValueError, match="v5p-7"):
    chips.parse("v5p-7")
  with pytest.raises(ValueError, match="v7x"):
    chips.parse("v7x-8")


@pytest.fixture(scope="module", params=[("v5p-8", "v5p-8"), ("v6e-8", "v6e-8")])
def report(request):
  config = _tiny(scan_layers=True, remat="full")
  learner, rollout = request.param
  return config, tpu_compile.compile_config(config, learner, rollout, progress=lambda _: None)


@pytest.mark.slow(99)
def test_every_program_of_both_roles_is_compiled(report):
  config, r = report
  names = [p["name"] for p in r["roles"]["learner"]["programs"]]
  # decoupled PPO with 2 minibatches: the later update's gradient step takes prox log-probs
  assert names == ["grad_step[first]", "grad_step[later]", "prox_pass", "accumulate", "apply"]
  decode = [p["name"] for p in r["roles"]["rollout"]["programs"]]
  assert decode[0] == "decode_chunk[16 steps]"
  assert "prefill_insert[16x32]" in decode and "refill[16x128]" in decode
  for role in r["roles"].values():
    assert role["fits"]
    for p in role["programs"]:
      assert p["compiled_bytes"] > 0 and p["roofline_seconds"] > 0
      assert p["estimate_bytes"] is not None
  assert r["libtpu"] and json.loads(json.dumps(r)) == r
  del config


@pytest.mark.slow(15)
def test_flops_are_the_model_flops_with_loops_counted(report):
  """The gradient step's FLOPs per chip against 6 x parameters x tokens plus attention (plus the
  forward pass again, rematerialised); the decode chunk's against 16 steps of 2 x parameters per
  slot. XLA alone counts a loop body once: with the layers in a scan and 16 decode steps in a loop,
  its own figure is far below (the negative control)."""
  config, r = report
  m = models.config_of(config)
  learner = r["roles"]["learner"]
  grad = learner["programs"][0]
  tokens = config.learner.token_budget / learner["chips"]
  width = learner["row_len"]
  model = projection.model_flops_per_token(m, width) * tokens  # (one sequence per row here)
  assert 1.0 <= grad["flops"] / model <= 2.0  # + remat's second forward pass, full attention blocks
  assert grad["xla_flops"] < 0.7 * grad["flops"]
  rollout = r["roles"]["rollout"]
  chunk = rollout["programs"][0]
  slots = config.rollout.num_slots / rollout["chips"]
  per_step = 2 * (m.num_params - (0 if m.tie_embeddings else m.vocab_size * m.hidden_size)) * slots
  assert 0.8 <= chunk["flops"] / (16 * per_step) <= 2.5  # + attention over the whole cache
  assert chunk["xla_flops"] < 0.2 * chunk["flops"]


@pytest.mark.slow(15)
def test_the_decode_chunk_runs_no_collectives_and_the_learner_gathers_its_shards(report):
  """Data-parallel decode servers hold whole weights: a decode step that all-gathers them is a bug.
  The FSDP learner all-gathers parameters (inside the layer loop) and reduces gradients."""
  _, r = report
  assert r["roles"]["rollout"]["programs"][0]["collectives"] == {}
  grad = r["roles"]["learner"]["programs"][0]["collectives"]
  assert grad["all-gather"]["count"] >= 2  # at least once per layer
  assert "all-reduce" in grad or "reduce-scatter" in grad


@pytest.mark.slow(15)
def test_the_projection_has_rates_and_the_planner_ratio(report):
  _, r = report
  p = r["projection"]
  for key in ("learner_tokens_per_s", "learner_mfu", "decode_tokens_per_s", "async_over_sync"):
    assert p[key] > 0, key
  assert p["learner_mfu"] < 1


def _info(*args, env=None):
  return subprocess.run([sys.executable, "-m", "asyncrl_jax", "info", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=900,
                        env=dict(os.environ, **(env or {})))


@pytest.mark.slow(15)
def test_a_token_budget_that_cannot_fit_is_refused_naming_the_learner():
  """Four full-length rows per chip with attention unchunked (their [heads, 16384, 16384] scores)
  do not fit a 32 GiB v6e chip: exit 1, the learner and its program named. (One row per chip fits,
  at 13 GiB: the refusal is the budget's.)"""
  out = _info("--config=configs/default.py", "--accelerator=v6e-8", "--compile", "--roles=learner",
              "--config.model.max_seq_len=16384", "--config.data.max_completion_len=16000",
              f"--config.learner.token_budget={8 * 4 * 16384}")
  assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
  assert "the learner does not fit" in out.stderr and "grad_step" in out.stderr
  assert "the rollout does not fit" not in out.stderr and "decode_chunk" not in out.stdout


def test_without_libtpu_it_says_how_to_install_it_and_exits_2(tmp_path):
  blocker = tmp_path / "sitecustomize.py"
  blocker.write_text("import sys\nsys.modules['libtpu'] = None\n")
  out = _info("--config=configs/default.py", "--accelerator=v5p-8", "--compile",
              env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
  assert out.returncode == 2
  assert "launch/setup.sh --tpu-compile" in out.stderr


def test_with_libtpu_installed_jax_still_runs_on_the_cpu():
  """libtpu on the machine must not change what the main job and the tests run on."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  out = subprocess.run([sys.executable, "-c", "import jax; print(jax.devices()[0].platform, "
                        "jax.device_count())"], capture_output=True, text=True, timeout=300,
                       env=dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=8"))
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split() == ["cpu", "8"]


def test_entry_points_do_not_try_the_tpu_backend_on_a_machine_without_one():
  """libtpu installed, no TPU here: an entry point's start (``cli.ensure_cpu_devices``) runs on the
  CPU without libtpu's errors about its missing hardware; without it, JAX tries the TPU first
  (the negative control: libtpu's complaint is there)."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_PLATFORMS", "TPU_"))}
  code = "import jax; print(jax.devices()[0].platform)"
  runs = {}
  for name, prefix in (("entry", "from asyncrl_jax import cli; cli.ensure_cpu_devices(2); "), ("bare", "")):
    runs[name] = subprocess.run([sys.executable, "-c", prefix + code], capture_output=True, text=True,
                                timeout=300, env=env, cwd=ROOT)
    assert runs[name].returncode == 0 and runs[name].stdout.split() == ["cpu"], runs[name].stderr[-2000:]
  assert "TPU" not in runs["entry"].stderr, runs["entry"].stderr[-2000:]
  assert "TPU" in runs["bare"].stderr


@pytest.mark.slow(15)
def test_compiling_leaves_no_tpu_settings_for_processes_started_later(report):
  """libtpu is quieted with TPU_* variables only while it describes a topology: left set, they make a
  main job started from this process (a test, a benchmark) take itself for a TPU VM."""
  del report  # (compiled in this process)
  assert not {"TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE"} & set(os.environ)


@pytest.mark.slow(50)
def test_the_benchmark_table_reads_a_report(report):
  """``benchmarks/tpu_compile.py``'s section: one row per program, the verdicts and the projection."""
  from benchmarks import tpu_compile as bench  # pylint: disable=import-outside-toplevel
  _, r = report
  record = dict(r, config="tiny.py", accelerators={"learner": "v5p-8", "rollout": "v5p-8"},
                commit="abc1234", date="2026-12-03 00:00 UTC", seconds=1, machine={"cpu_count": 2})
  text = "\n".join(bench.section(record))
  rows = [l for l in text.splitlines() if l.startswith("| learner |") or l.startswith("| rollout |")]
  assert len(rows) == len(r["roles"]["learner"]["programs"]) + len(r["roles"]["rollout"]["programs"])
  assert "abc1234" in text and "libtpu" in text and "Projection: learner" in text
  assert text.count("fits one") == 2


@pytest.mark.slow(20)
def test_the_paged_decode_step_compiles_and_reads_only_the_live_share_of_its_cache():
  """``rollout.decode_attention="ragged"``: the decode chunk compiles for a v5p chip with the ragged
  paged attention kernel (head_dim 128, as the kernel needs), once per layer and step; the walker
  marks the kernel's work and cache reads as scaling with the live share, and the projection's
  step at a quarter of the cache reads about a quarter of its cache bytes. The masked decode over
  the whole cache (the control) has no such share."""
  def config(decode):
    c = config_lib.base_config()
    c.model.update(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=2,
                   num_kv_heads=1, head_dim=128, max_seq_len=512, dtype="bfloat16")
    c.data.update(max_prompt_len=32, max_completion_len=480)
    c.rollout.update(num_slots=16, decode_attention=decode)
    c.mesh.rollout.update(data=-1, fsdp=1, tensor=1)
    return config_lib.validate(c)

  import jax  # pylint: disable=import-outside-toplevel
  chunks = {}
  for decode in ("xla", "ragged"):
    c = config(decode)
    # (the tests' process-wide "highest" precision would ask Mosaic for float32 products of bf16)
    with jax.default_matmul_precision("default"):
      r = tpu_compile.compile_config(c, "v5p-8", "v5p-8", roles=("rollout",), progress=lambda _: None)
    chunks[decode] = r["roles"]["rollout"]["programs"][0]
  paged = chunks["ragged"]["kernels"]
  assert paged["calls"] == {"ragged_paged_attention": 2 * 16}
  cache = (16 // 4) * 512 * 2 * 128 * 2  # one layer's cache per chip: 4 slots x 512 x 2K x H, bf16
  assert paged["paged_bytes"] == pytest.approx(2 * 16 * cache)
  chip = chips.CHIPS["v5p"]
  full = projection.roofline_at(chunks["ragged"], chip, 1.0, "live_cache")
  quarter = projection.roofline_at(chunks["ragged"], chip, 0.25, "live_cache")
  assert quarter < full and full == pytest.approx(chunks["ragged"]["roofline_seconds"])
  assert chunks["xla"]["kernels"]["paged_bytes"] == 0
