"""Experiment configs load, validate, and reject bad values with a message naming the field."""

import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from asyncrl_jax import config as config_lib
from asyncrl_jax.models import ModelConfig
from asyncrl_jax.rl.objective import LossSettings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))


def _load(path):
  spec = importlib.util.spec_from_file_location("cfg", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def test_there_are_configs():
  names = {os.path.basename(p) for p in CONFIG_FILES}
  assert {"default.py", "qwen2_5_1_5b.py"} <= names


def _set(cfg, field, value):
  """``cfg[a][b][c] = value`` for ``field="a.b.c"`` (any depth, top-level fields included)."""
  *sections, name = field.split(".")
  node = cfg
  for section in sections:
    node = node[section]
  node[name] = value


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_every_config_validates(path):
  cfg = _load(path)
  before = cfg.to_dict()
  assert config_lib.validate(cfg) is cfg  # entry points write `config = validate(config)`
  assert cfg.to_dict() == before  # validation never rewrites a value


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_shipped_configs_set_the_behaviour_weight_guards_the_readme_states(path):
  """Decoupled PPO without a guard fell below naive PPO at eta 8 (docs/decisions/0004): every shipped config must
  carry the cap, floor and truncation the README documents, and a config that changes them must say so
  there."""
  with open(os.path.join(ROOT, "README.md")) as f:
    readme = f.read()
  stated = {}
  for field in ("behav_weight_cap", "behav_weight_floor", "behav_weight_clip"):
    found = re.search(rf"`rl\.{field}`\s+\(default ([0-9.]+|inf)\)", readme)
    assert found, f"README.md must state the default of rl.{field}"
    stated[field] = float(found.group(1))
  cfg = config_lib.validate(_load(path))
  assert {k: cfg.rl[k] for k in stated} == stated
  assert cfg.rl.behav_weight_clip == 1.0  # the truncation is what the probe supports (docs/decisions/0004)


def test_guards_parse_from_the_command_line_and_inf_turns_them_off():
  out = _run_cli("--config.rl.behav_weight_cap=5", "--config.rl.behav_weight_clip=inf")
  assert out.returncode == 0, out.stderr[-2000:]
  assert "rl.behav_weight_cap: 5.0" in out.stdout and "rl.behav_weight_clip: inf" in out.stdout
  from asyncrl_jax.rl.objective import LossSettings  # pylint: disable=import-outside-toplevel
  shipped = LossSettings.from_config(_load(os.path.join(ROOT, "configs", "default.py")))
  assert (shipped.behav_weight_cap, shipped.behav_weight_floor, shipped.behav_weight_clip) == (None, None, 1.0)
  cfg = _load(os.path.join(ROOT, "configs", "default.py"))
  cfg.rl.behav_weight_clip = float("inf")
  cfg.rl.behav_weight_cap = 5.0
  off = LossSettings.from_config(config_lib.validate(cfg))
  assert (off.behav_weight_cap, off.behav_weight_clip) == (5.0, None)


def test_gspo_is_selectable_from_the_command_line_with_the_papers_clip():
  out = _run_cli("--config.rl.loss=gspo", "--config.rl.gspo_eps_high=5e-4")
  assert out.returncode == 0, out.stderr[-2000:]
  assert "rl.loss: gspo" in out.stdout and "rl.gspo_eps_high: 0.0005" in out.stdout
  from asyncrl_jax.rl.objective import LossSettings  # pylint: disable=import-outside-toplevel
  cfg = _load(os.path.join(ROOT, "configs", "default.py"))
  cfg.rl.loss = "gspo"
  s = LossSettings.from_config(config_lib.validate(cfg))
  assert (s.loss, s.gspo_eps_low, s.gspo_eps_high, s.behav_weight_clip) == ("gspo", 3e-4, 4e-4, 1.0)
  assert s.needs_prox  # the sequence ratio is taken against the prox policy


def test_real_model_config_has_qwen2_5_1_5b_shape():
  model = config_lib.model_config(_load(os.path.join(ROOT, "configs", "qwen2_5_1_5b.py")))
  assert isinstance(model, ModelConfig)
  assert 1.4e9 < model.num_params < 1.65e9  # Qwen2.5-1.5B has 1.54B parameters (tied embeddings)


@pytest.mark.parametrize("field,value,pattern", [
    ("rl.loss", "grpo", r"rl.loss='grpo' is not allowed: must be one of \('ppo', 'ppo_recompute', 'decoupled_ppo', 'dis', 'gspo'\)"),
    ("rl.max_staleness", -1, r"rl.max_staleness=-1 is not allowed"),
    ("rl.eps_clip", 1.5, r"rl.eps_clip=1.5 is not allowed"),
    ("rl.eps_low", 1.0, r"rl.eps_low=1.0 is not allowed"),
    ("rl.eps_high", 0.0, r"rl.eps_high=0.0 is not allowed"),
    ("rl.gspo_eps_low", 1.0, r"rl.gspo_eps_low=1.0 is not allowed: a number in \(0, 1\)"),
    ("rl.gspo_eps_low", 0.0, r"rl.gspo_eps_low=0.0 is not allowed"),
    ("rl.gspo_eps_high", -1e-4, r"rl.gspo_eps_high=-0.0001 is not allowed: a number > 0"),
    ("rl.advantage", "critic", r"rl.advantage='critic' is not allowed: must be one of \('group', 'value'\)"),
    ("rl.value_updates", 0, r"rl.value_updates=0 is not allowed: an integer >= 1"),
    ("rl.value_learning_rate", 0.0, r"rl.value_learning_rate=0.0 is not allowed: a number > 0"),
    ("rl.value_clip", -1.0, r"rl.value_clip=-1.0 is not allowed: a number > 0"),
    ("rl.value_pretrain_versions", -1, r"rl.value_pretrain_versions=-1 is not allowed"),
    ("rl.behav_weight_cap", 1.0, r"rl.behav_weight_cap=1.0 is not allowed: a number > 1 \(inf: no cap\)"),
    ("rl.behav_weight_cap", float("nan"), r"rl.behav_weight_cap=nan is not allowed"),
    ("rl.behav_weight_floor", 1.0, r"rl.behav_weight_floor=1.0 is not allowed: a number in \[0, 1\)"),
    ("rl.behav_weight_clip", 0.0, r"rl.behav_weight_clip=0.0 is not allowed: a number > 0 \(inf: no truncation\)"),
    ("rl.group_size", 5,
     r"learner.batch_size=\d+ is not allowed: must be a multiple of rl.group_size \(5\)"),
    ("model.num_kv_heads", 3, r"model.num_heads=4 must be a multiple of model.num_kv_heads=3"),
    ("model.dtype", "float8", r"model.dtype='float8'"),
    ("rollout.top_p", 0.0, r"rollout.top_p=0.0 is not allowed"),
    ("mesh.rollout_fraction", 1.0, r"mesh.rollout_fraction=1.0 is not allowed"),
    ("data.max_completion_len", 500, r"data.max_completion_len=500 is not allowed: .* model.max_seq_len"),
    ("learner.token_budget", 10, r"learner.token_budget=10 is not allowed"),
    ("seed", -1, r"seed=-1 is not allowed: an integer >= 0"),
    ("steps", True, r"steps=True is not allowed: an integer >= 0"),  # a bool is not a count
    ("model.param_dtype", "int8", r"model.param_dtype='int8'.* must be one of"),
    ("data.task", "csv", r"data.task='csv' is not allowed: must be one of \('arithmetic', 'tool_arithmetic', 'jsonl', 'tfds', 'code_jsonl', 'code_functions'\)"),
    ("data.task", "jsonl", r"data.path='' is not allowed: required .* when data.task='jsonl'"),
    ("data.max_prompt_len", 0, r"data.max_prompt_len=0 is not allowed: an integer >= 1"),
    ("data.eval_samples", -1, r"data.eval_samples=-1 is not allowed"),
    ("data.final_eval_samples", -2, r"data.final_eval_samples=-2 is not allowed"),
    ("rl.kl_coef", -0.1, r"rl.kl_coef=-0.1 .*>= 0"),
    ("rl.kl_estimator", "k4", r"rl.kl_estimator='k4' .*one of k1, k2, k3"),
    ("data.final_eval_problems", 501, r"data.final_eval_problems=501 .*at most data.num_test \(500\)"),
    ("data.max_terms", 1, r"data.max_terms=1 is not allowed: an integer >= data.min_terms \(2\)"),
    ("data.max_digits", 0, r"data.max_digits=0 is not allowed: an integer in \[1, 9\]"),
    ("data.task", "tool_arithmetic", r"env.name='' is not allowed: must name an environment for data.task"),
    ("env.options", "not json", r"env.options='not json': not JSON"),
    ("env.options", "[1, 2]", r"env.options='\[1, 2\]' is not allowed: must be a JSON object"),
    ("env.max_turns", 0, r"env.max_turns=0 is not allowed: an integer >= 1"),
    ("env.step_timeout", 0.0, r"env.step_timeout=0.0 is not allowed: a number of seconds > 0"),
    ("rollout.num_slots", 0, r"rollout.num_slots=0 is not allowed: an integer >= 1"),
    ("rollout.temperature", -0.5, r"rollout.temperature=-0.5 is not allowed"),
    ("rollout.top_k", -1, r"rollout.top_k=-1 is not allowed"),
    ("rollout.logprob_source", "both", r"rollout.logprob_source='both' is not allowed: must be one of"),
    ("rollout.on_weight_update", "drop", r"rollout.on_weight_update='drop' is not allowed: must be one of"),
    ("rollout.port", 65536, r"rollout.port=65536 is not allowed: a port in \[0, 65535\]"),
    ("learner.learning_rate", 0.0, r"learner.learning_rate=0.0 is not allowed: a number > 0"),
    ("learner.b2", 1.0, r"learner.b2=1.0 is not allowed: a number in \[0, 1\)"),
    ("learner.ppo_minibatches", 10**6,
     r"learner.ppo_minibatches=1000000 is not allowed: must be <= learner.batch_size \(\d+\)"),
    ("learner.warm_start_lr", float("inf"), r"learner.warm_start_lr=inf is not allowed"),
    ("rl.group_size", 1, r"rl.group_size=1 is not allowed: must be >= 2 when rl.advantage='group'"),
    # 0 must fail its own check, not reach `batch_size % group_size`
    ("rl.group_size", 0, r"rl.group_size=0 is not allowed: an integer >= 1"),
    ("rl.aggregation", "sum", r"rl.aggregation='sum' is not allowed: must be one of"),
    ("rl.gamma", 1.5, r"rl.gamma=1.5 is not allowed: a number in \[0, 1\]"),
    ("mesh.learner.data", 0, r"mesh.learner.data=0 is not allowed: a positive integer, or -1"),
    ("mesh.rollout.fsdp", -1, r"mesh.rollout=\{.*\} is not allowed: at most one axis may be -1"),
    ("checkpoint.every_steps", 0, r"checkpoint.every_steps=0 is not allowed: an integer >= 1"),
    ("checkpoint.max_to_keep", 0, r"checkpoint.max_to_keep=0 is not allowed: an integer >= 1"),
    # (found by the fuzz test: a size past int64 became a float shape deep in jax)
    ("model.intermediate_size", 10 ** 19, r"model.intermediate_size=10000000000000000000: must be a "
                                          r"positive integer below 2\*\*31"),
    ("log.trajectories", -1, r"log.trajectories=-1 is not allowed: an integer >= 0"),
])
def test_bad_values_name_the_field(field, value, pattern):
  cfg = _load(os.path.join(ROOT, "configs", "default.py"))
  _set(cfg, field, value)
  with pytest.raises(config_lib.ConfigError, match=pattern):
    config_lib.validate(cfg)


@pytest.mark.parametrize("field,value,pattern", [
    # value advantages need no group, but a batch is still whole groups
    ("rl.group_size", 5, r"learner.batch_size=\d+ is not allowed: must be a multiple of rl.group_size \(5\)"),
    ("rl.value_pretrain_versions", 200, r"rl.value_pretrain_versions=200 is not allowed: must be < steps \(200\)"),
])
def test_bad_value_mode_settings_name_the_field(field, value, pattern):
  cfg = _load(os.path.join(ROOT, "configs", "default.py"))
  cfg.rl.advantage = "value"
  _set(cfg, field, value)
  with pytest.raises(config_lib.ConfigError, match=pattern):
    config_lib.validate(cfg)


@pytest.mark.parametrize("changes", [
    {"rollout.top_p": 1.0, "rollout.temperature": 0.0, "rollout.top_k": 0, "rollout.port": 65535},
    {"learner.batch_size": 64, "learner.ppo_minibatches": 64, "rl.group_size": 64},  # both bounds inclusive
    {"rl.advantage": "value", "rl.group_size": 1, "rl.loss": "dis", "rl.value_pretrain_versions": 199,
     "rl.value_freeze_attention": True},
    {"data.max_terms": 2, "data.eval_samples": 0, "learner.b1": 0.0, "rl.gamma": 0.0, "rl.gae_lambda": 1.0},
    {"model.max_seq_len": 256, "data.max_prompt_len": 64, "data.max_completion_len": 192,
     "learner.token_budget": 256},
    {"data.task": "jsonl", "data.path": "/data/math.jsonl"},
    {"mesh.learner.fsdp": 1, "mesh.learner.tensor": -1, "mesh.rollout.data": 2},
    # with an HF checkpoint, max_seq_len and the token budget come from elsewhere: no length checks
    {"model.hf_path": "gs://bucket/ckpt", "data.max_completion_len": 100000, "learner.token_budget": 16},
])
def test_values_at_the_allowed_boundaries_pass(changes):
  cfg = _load(os.path.join(ROOT, "configs", "default.py"))
  for field, value in changes.items():
    _set(cfg, field, value)
  config_lib.validate(cfg)


def test_an_hf_checkpoint_config_still_checks_the_dtypes():
  cfg = _load(os.path.join(ROOT, "configs", "default.py"))
  cfg.model.hf_path = "gs://bucket/ckpt"  # the architecture is not checked inline, the dtypes still are
  cfg.model.dtype = "float8"
  with pytest.raises(config_lib.ConfigError, match=r"^model.dtype='float8' is not allowed: must be one of"):
    config_lib.validate(cfg)


@pytest.mark.parametrize("changes,pattern", [
    # too long for the model and for the token budget: the length the user set is named
    ({"data.max_completion_len": 5000, "learner.token_budget": 4096},
     r"^data.max_completion_len=5000 is not allowed: .* model.max_seq_len"),
    # fails its own range and the group multiple: the range is what is wrong
    ({"learner.batch_size": -3}, r"^learner.batch_size=-3 is not allowed: an integer >= 1"),
    # sections are reported in the order of base_config
    ({"rl.loss": "grpo", "learner.b1": 1.0}, r"^learner.b1=1.0 is not allowed"),
    ({"mesh.rollout_fraction": 0.0, "data.num_train": 0}, r"^data.num_train=0 is not allowed"),
])
def test_the_first_offending_field_is_reported(changes, pattern):
  with pytest.raises(config_lib.ConfigError, match=pattern):
    config_lib.validate(_default_with(changes))


def _default_with(changes: dict):
  cfg = _load(os.path.join(ROOT, "configs", "default.py"))
  for field, value in changes.items():
    _set(cfg, field, value)
  return cfg


@pytest.mark.parametrize("changes,pattern", [
    ({"rollout.logprob_source": "model", "rollout.temperature": 0.7},
     r"^rollout.logprob_source='model' is not allowed: at rollout.temperature=0.7"),
    ({"rollout.top_k": 5, "learner.vocab_chunk": 8},
     r"^learner.vocab_chunk=8 is not allowed: with rollout.top_k=5, rollout.top_p=1.0 .* whole vocabulary"),
])
def test_log_probs_the_learner_cannot_match_are_refused(changes, pattern):
  cfg = _default_with(changes)
  with pytest.raises(config_lib.ConfigError, match=pattern):
    config_lib.validate(cfg)
  # the same settings pass where the learner can match them
  _set(cfg, "rollout.logprob_source", "sampling")
  _set(cfg, "learner.vocab_chunk", 0)
  config_lib.validate(cfg)


def test_the_loss_uses_the_distribution_the_behaviour_log_probs_were_recorded_in():
  cfg = _load(os.path.join(ROOT, "configs", "default.py"))
  _set(cfg, "rollout.temperature", 0.6)
  _set(cfg, "rollout.top_p", 0.9)
  _set(cfg, "rollout.top_k", 5)
  s = LossSettings.from_config(cfg)
  assert (s.temperature, s.top_k, s.top_p) == (0.6, 5, 0.9)
  _set(cfg, "rollout.temperature", 1.0)
  _set(cfg, "rollout.logprob_source", "model")  # the raw model: no truncation either
  s = LossSettings.from_config(cfg)
  assert (s.temperature, s.top_k, s.top_p) == (1.0, 0, 1.0)
  _set(cfg, "rollout.temperature", 0.0)  # greedy records the raw model
  _set(cfg, "rollout.logprob_source", "sampling")
  s = LossSettings.from_config(cfg)
  assert (s.temperature, s.top_k, s.top_p) == (1.0, 0, 1.0)


def test_colocate_refuses_remote_decode_servers():
  cfg = _load(os.path.join(ROOT, "configs", "default.py"))
  cfg.mesh.colocate = True
  config_lib.validate(cfg)
  cfg.rollout.servers = 2
  with pytest.raises(config_lib.ConfigError, match=r"mesh.colocate=True .* rollout.servers > 0"):
    config_lib.validate(cfg)


def test_unknown_field_is_rejected():
  cfg = _load(os.path.join(ROOT, "configs", "default.py"))
  cfg.rl.unlock()
  cfg.rl.max_stalenes = 3
  with pytest.raises(config_lib.ConfigError, match=r"unknown config field\(s\) \['rl.max_stalenes'\]"):
    config_lib.validate(cfg)


def _run_cli(*overrides):
  cmd = [sys.executable, "-m", "asyncrl_jax.tools.info", f"--config={ROOT}/configs/default.py", *overrides]
  return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_cli_override_and_bad_value_exit_nonzero():
  ok = _run_cli("--config.rl.max_staleness=4", "--config.rl.loss=dis")
  assert ok.returncode == 0, ok.stderr
  assert "rl.max_staleness: 4" in ok.stdout and "rl.loss: dis" in ok.stdout
  bad = _run_cli("--config.rl.loss=reinforce")
  assert bad.returncode != 0
  assert "rl.loss='reinforce'" in bad.stderr
  typo = _run_cli("--config.rl.max_stalenes=4")
  assert typo.returncode != 0 and "max_stalenes" in typo.stderr


def _leaf_fields(config, prefix=""):
  out = []
  for k, v in config.items():
    if hasattr(v, "items"):
      out += _leaf_fields(v, f"{prefix}{k}.")
    else:
      out.append(f"{prefix}{k}")
  return out


_FUZZ_VALUES = [
    "abc", "", "-1", "0", "1", "3", "1.5", "-0.5", "1e309", "-1e309", "nan", "inf", "-inf", "True",
    "False", "None", "[]", "{}", "[1, 2]", "(1,)", "0x10", "'quoted'", "9999999999999999999", "1 2"]


def _fuzz_strategy():
  from hypothesis import strategies as st  # pylint: disable=import-outside-toplevel
  fields = _leaf_fields(config_lib.base_config())
  values = st.one_of(st.sampled_from(_FUZZ_VALUES), st.integers(-10 ** 6, 10 ** 6).map(str),
                     st.floats(allow_nan=True, allow_infinity=True).map(repr),
                     st.text(alphabet="ab01.,-_=[]{}' e", max_size=8))
  return st.sampled_from(fields), values


def test_fuzzed_command_line_values_give_one_line_errors_or_configs_that_build():
  """Any field, any value, parsed the way every entry point parses it (ml_collections first, then
  ``validate``): either a one-line ``config error`` naming the field with exit status 2, never a
  traceback, or a config whose model and optimizer state build under ``jax.eval_shape``."""
  import contextlib  # pylint: disable=import-outside-toplevel
  import io  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  from absl import flags  # pylint: disable=import-outside-toplevel
  from hypothesis import HealthCheck, given, settings  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  from asyncrl_jax import cli, models  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.learner.updater import make_optimizer  # pylint: disable=import-outside-toplevel
  field_st, value_st = _fuzz_strategy()
  outcomes = {"refused": 0, "accepted": 0}

  @settings(max_examples=int(os.environ.get("ASYNCRL_FUZZ_EXAMPLES", "120")), deadline=None,
            derandomize=not os.environ.get("ASYNCRL_FUZZ_EXAMPLES"),
            suppress_health_check=[HealthCheck.too_slow])
  @given(field=field_st, value=value_st)
  def check(field, value):
    argv = ["prog", f"--config={ROOT}/configs/default.py", f"--config.{field}={value}"]
    fv = flags.FlagValues()  # (overrides are found in sys_argv, as they are in sys.argv in a process)
    config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True, sys_argv=argv)
    err = io.StringIO()
    try:
      with contextlib.redirect_stderr(err):
        cli.parse_flags(argv, fv)
        config = cli.validated(fv.config)
    except SystemExit as e:
      lines = err.getvalue().strip().splitlines()
      assert e.code == 2 and len(lines) == 1 and lines[0].startswith("config error: "), (argv, lines)
      assert field in lines[0] or field.split(".")[0] in lines[0], (argv, lines)
      outcomes["refused"] += 1
      return
    model = models.config_of(config)
    params = models.abstract_params(model)
    optimizer = make_optimizer(learning_rate=config.learner.learning_rate, total_steps=config.steps,
                               grad_clip=config.learner.grad_clip)
    jax.eval_shape(optimizer.init, params)
    outcomes["accepted"] += 1

  check()  # pylint: disable=no-value-for-parameter
  assert outcomes["refused"] > 20 and outcomes["accepted"] > 5, outcomes
