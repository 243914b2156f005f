"""The experiment config: the schema (``config_schema``: ``base_config()`` and the allowed values) and
its validation.

Every ``configs/<experiment>.py`` starts from ``base_config()`` and changes only what differs, so the
experiments cannot drift apart. ``validate(config)`` runs at start-up of every entry point; a value that
is not allowed raises ``ConfigError`` with the field's dotted name and what is allowed, and the entry
point exits non-zero with that message.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Iterable

import ml_collections

from asyncrl_jax.config_schema import (ADVANTAGES, AGGREGATIONS, DTYPES, KL_ESTIMATORS, LOGPROB_SOURCES,  # noqa: F401
                                       LOSSES, STALENESS_MODES, TASKS, ConfigError, base_config)
from asyncrl_jax.data.workloads import LengthWorkload
from asyncrl_jax.infra import sharding
from asyncrl_jax.tokenization import BUILTIN as BUILTIN_TOKENIZERS
from asyncrl_jax.tokenization import TokenizerError, template_kwargs
from asyncrl_jax.models.config import MOE_EXCHANGES, MOE_MATMULS, ModelConfig, ModelConfigError
from asyncrl_jax.models.forward import ATTENTION_KINDS, DECODE_KINDS, REMAT_POLICIES
from asyncrl_jax.models.quant import WEIGHT_DTYPES


def config_module(path: str, beside: str = ""):
  """The experiment-config module at ``path`` (relative to the file ``beside``, e.g. a config's own
  ``__file__``), loaded by path: configs are files, not a package, so one can build on another."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  if beside:
    path = os.path.join(os.path.dirname(os.path.abspath(beside)), path)
  spec = importlib.util.spec_from_file_location(os.path.basename(path).rsplit(".", 1)[0], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _check(cond: bool, field: str, value: Any, allowed: str) -> None:
  if not cond:
    raise ConfigError(f"{field}={value!r} is not allowed: {allowed}")


def _one_of(config, field: str, choices: Iterable[str]) -> None:
  value = _get(config, field)
  choices = tuple(choices)
  _check(value in choices, field, value, f"must be one of {choices}")


def _get(config, field: str):
  node = config
  for part in field.split("."):
    node = node[part]
  return node


def _number(config, field: str, ok: Callable[[float], bool], allowed: str, integer: bool = False,
            allow_inf: bool = False):
  value = _get(config, field)
  is_num = isinstance(value, int) if integer else isinstance(value, (int, float))
  finite = is_num and (math.isfinite(value) or (allow_inf and value == math.inf))
  _check(is_num and not isinstance(value, bool) and finite and ok(value), field, value, allowed)


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Checks every field; returns the config or raises ConfigError naming the offending field.

  Sections are checked in the order of ``base_config``; a check across two sections runs with the
  later one, once the fields it combines have passed their own checks. The first offending field in
  that order is the one reported.
  """
  _check_same_fields(config, base_config(), "")
  _validate_run(config)
  _validate_model(config)
  _validate_data(config)
  _validate_rollout(config)
  _validate_learner(config)
  _validate_rl(config)
  _validate_mesh(config)
  _validate_checkpoint(config)
  _validate_monitor(config)
  _number(config, "log.trajectories", lambda v: v >= 0, "an integer >= 0", integer=True)
  _validate_env(config)
  return config


def _validate_env(config) -> None:
  """The environment's options are a JSON object and its limits positive (whether ``env.name`` is
  registered is checked where environments are built: ``train.job``, the decode servers)."""
  env = config.env
  _check(isinstance(env.name, str), "env.name", env.name, "must be a string")
  try:
    options = json.loads(env.options)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"env.options={env.options!r}: not JSON ({e})") from None
  _check(isinstance(options, dict), "env.options", env.options, "must be a JSON object")
  _number(config, "env.max_turns", lambda v: v >= 1, "an integer >= 1", integer=True)
  _number(config, "env.workers", lambda v: v >= 0, "an integer >= 0 (0: one per decode slot)",
          integer=True)
  _number(config, "env.step_timeout", lambda v: v > 0, "a number of seconds > 0")
  if config.data.task == "tool_arithmetic":
    _check(bool(env.name), "env.name", env.name, "must name an environment for "
           "data.task='tool_arithmetic' ('tools': the built-in calculator)")
    _check(config.data.tokenizer_path == "builtin:tools", "data.tokenizer_path",
           config.data.tokenizer_path, "must be 'builtin:tools' for data.task='tool_arithmetic'")
  if config.data.task == "code_functions":
    _check(config.data.tokenizer_path in ("builtin:code", "builtin:code_tools"), "data.tokenizer_path",
           config.data.tokenizer_path, "must be 'builtin:code' (or 'builtin:code_tools' for the coding "
           "agent) for data.task='code_functions'")


def _validate_run(config) -> None:
  _number(config, "seed", lambda v: v >= 0, "an integer >= 0", integer=True)
  _number(config, "steps", lambda v: v >= 0, "an integer >= 0", integer=True)


def _local_dir_holding(config, field: str, name: str) -> None:
  """A set, local directory ``field`` must hold ``name`` (a bucket path is checked when it is read)."""
  value = _get(config, field)
  _check(isinstance(value, str), field, value, "must be a path (or empty)")
  if value and not value.startswith("gs://"):
    _check(os.path.isfile(os.path.join(value, name)), field, value,
           f"must be a directory holding {name}")


def _validate_model(config) -> None:
  """An inline architecture must build a ModelConfig; with ``hf_path`` the checkpoint decides."""
  _local_dir_holding(config, "model.hf_path", "config.json")
  if config.data.tokenizer_path not in BUILTIN_TOKENIZERS:
    _local_dir_holding(config, "data.tokenizer_path", "tokenizer.json")
  try:
    kwargs = template_kwargs(config)
  except TokenizerError as e:
    raise ConfigError(str(e)) from None
  if kwargs and config.data.tokenizer_path in BUILTIN_TOKENIZERS:
    raise ConfigError(f"data.chat_template_kwargs={config.data.chat_template_kwargs!r}: the built-in "
                      f"tokenizer {config.data.tokenizer_path or 'builtin'!r} has no chat template")
  if not config.model.hf_path:
    try:
      model_config(config)
    except ModelConfigError as e:
      raise ConfigError(str(e)) from None
  _one_of(config, "model.dtype", DTYPES)
  _one_of(config, "model.param_dtype", DTYPES)
  moe = config.model.moe
  _check(isinstance(moe.aux_loss_coef, (int, float)) and moe.aux_loss_coef >= 0, "model.moe.aux_loss_coef",
         moe.aux_loss_coef, ">= 0")
  _one_of(config, "model.moe.matmul", MOE_MATMULS)
  _one_of(config, "model.moe.exchange", MOE_EXCHANGES)
  _check(isinstance(moe.capacity_factor, (int, float)) and (moe.capacity_factor == 0 or moe.capacity_factor >= 1),
         "model.moe.capacity_factor", moe.capacity_factor, "0 (dropless) or >= 1")
  _check(isinstance(config.rollout.record_routes, bool), "rollout.record_routes",
         config.rollout.record_routes, "True or False")
  _check(isinstance(config.rl.replay_routes, bool), "rl.replay_routes", config.rl.replay_routes,
         "True or False")
  if config.rollout.record_routes and not config.model.hf_path:
    _check(moe.num_experts > 0, "rollout.record_routes", True,
           "False for a dense model (routes exist only with model.moe.num_experts > 0)")
  if not config.model.hf_path and config.learner.scan_layers:
    m = model_config(config)
    _check(len(m.moe_layers) in (0, m.num_layers), "learner.scan_layers", True,
           f"False for a model that mixes dense and mixture-of-experts layers (MoE layers {list(m.moe_layers)} "
           f"of {m.num_layers}: model.moe.decoder_sparse_step, model.moe.mlp_only_layers)")


def _validate_data(config) -> None:
  """Task and data location, sizes, and (inline model only) prompt + completion within max_seq_len."""
  _one_of(config, "data.task", TASKS)
  if config.data.task not in ("arithmetic", "tool_arithmetic", "code_functions"):
    _check(bool(config.data.path), "data.path", config.data.path,
           f"required (a file or directory) when data.task={config.data.task!r}")
  for f in ("data.max_prompt_len", "data.max_completion_len", "data.num_train",
            "data.num_test", "data.eval_problems"):
    _number(config, f, lambda v: v >= 1, "an integer >= 1", integer=True)
  _number(config, "data.seed", lambda v: v >= 0, "an integer >= 0", integer=True)
  _number(config, "data.eval_samples", lambda v: v >= 0, "an integer >= 0 (0: greedy only)", integer=True)
  for f in ("data.final_eval_problems", "data.final_eval_samples"):
    _number(config, f, lambda v: v >= 0, "an integer >= 0 (0: as data.eval_problems / eval_samples)",
            integer=True)
  _check(isinstance(config.data.initial_eval_final, bool), "data.initial_eval_final",
         config.data.initial_eval_final, "True or False")
  if config.data.task in ("arithmetic", "tool_arithmetic", "code_functions"):
    _number(config, "data.final_eval_problems", lambda v: v <= config.data.num_test,
            f"at most data.num_test ({config.data.num_test}): the held-out split has no more", integer=True)
  _number(config, "data.min_terms", lambda v: v >= 2, "an integer >= 2", integer=True)
  _number(config, "data.max_terms", lambda v: v >= config.data.min_terms,
          f"an integer >= data.min_terms ({config.data.min_terms})", integer=True)
  _number(config, "data.max_digits", lambda v: 1 <= v <= 9, "an integer in [1, 9]", integer=True)
  _number(config, "data.demo_max_terms", lambda v: v == 0 or v >= 2,
          "an integer >= 2, or 0 (demonstrations from the task's own train split)", integer=True)
  if config.data.demo_max_terms:
    _check(config.data.task in ("arithmetic", "tool_arithmetic"), "data.demo_max_terms",
           config.data.demo_max_terms,
           f"applies to the built-in task only (data.task={config.data.task!r})")
  if not config.model.hf_path:
    total = config.data.max_prompt_len + config.data.max_completion_len
    _check(total <= config.model.max_seq_len, "data.max_completion_len", config.data.max_completion_len,
           f"data.max_prompt_len + data.max_completion_len = {total} must be <= model.max_seq_len "
           f"({config.model.max_seq_len})")


def _validate_rollout(config) -> None:
  _number(config, "rollout.num_slots", lambda v: v >= 1, "an integer >= 1", integer=True)
  _number(config, "rollout.attention_chunk", lambda v: v >= 0, "an integer >= 0 (0: no chunking)",
          integer=True)
  _number(config, "rollout.prefill_tokens", lambda v: v >= 0, "an integer >= 0 (0: no cap)",
          integer=True)
  _number(config, "rollout.temperature", lambda v: v >= 0, "a number >= 0 (0 = greedy)")
  _number(config, "rollout.top_p", lambda v: 0 < v <= 1, "a number in (0, 1]")
  _number(config, "rollout.top_k", lambda v: v >= 0, "an integer >= 0 (0 = off)", integer=True)
  _number(config, "rollout.min_new_tokens", lambda v: 0 <= v <= config.data.max_completion_len,
          f"an integer in [0, data.max_completion_len={config.data.max_completion_len}]", integer=True)
  _check(isinstance(config.rollout.length_workload, str), "rollout.length_workload",
         config.rollout.length_workload, "must be a string (\"\" = off)")
  try:
    workload = LengthWorkload.parse(config.rollout.length_workload)
  except ValueError as e:
    raise ConfigError(f"rollout.length_workload: {e}") from None
  _check(workload is None or workload.cap <= config.data.max_completion_len, "rollout.length_workload",
         config.rollout.length_workload,
         f"caps lengths above data.max_completion_len={config.data.max_completion_len}")
  _check(workload is None or not config.rollout.min_new_tokens, "rollout.min_new_tokens",
         config.rollout.min_new_tokens, "must be 0 with rollout.length_workload (which sets each "
         "request's minimum)")
  _one_of(config, "rollout.logprob_source", LOGPROB_SOURCES)
  r = config.rollout
  _check(r.logprob_source != "model" or r.temperature in (0, 1), "rollout.logprob_source",
         r.logprob_source, f"at rollout.temperature={r.temperature} the 'model' log-probs (temperature 1) "
         "are not those of the distribution sampled from, so no importance weight is exact; use "
         "'sampling' (or temperature 1)")
  truncated = r.temperature > 0 and r.logprob_source == "sampling" and (r.top_k or r.top_p < 1)
  _check(not (truncated and config.learner.vocab_chunk), "learner.vocab_chunk",
         config.learner.vocab_chunk, f"with rollout.top_k={r.top_k}, rollout.top_p={r.top_p} the "
         "learner's log-probs are those of the truncated distribution, which needs the whole "
         "vocabulary at once: set learner.vocab_chunk=0 (or rollout.top_k=0, rollout.top_p=1)")
  _one_of(config, "rollout.on_weight_update", ("recompute", "keep_cache", "drain"))
  _check(isinstance(config.rollout.warm_up, bool), "rollout.warm_up", config.rollout.warm_up,
         "must be True or False")
  for port in ("rollout.port", "rollout.registry_port"):
    _number(config, port, lambda v: 0 <= v <= 65535, "a port in [0, 65535] (0 = any free)", integer=True)
  _number(config, "rollout.servers", lambda v: v >= 0, "an integer >= 0 (0 = decode in this process)",
          integer=True)
  for timeout in ("rollout.register_timeout", "rollout.push_timeout", "rollout.server_deadline",
                  "rollout.register_interval", "rollout.drain_timeout"):
    _number(config, timeout, lambda v: v > 0, "a number of seconds > 0")
  _check(isinstance(config.rollout.auth_token_file, str), "rollout.auth_token_file",
         config.rollout.auth_token_file, "must be a path (or empty)")
  for retries in ("rollout.push_retries", "rollout.max_retries"):
    _number(config, retries, lambda v: v >= 0, "an integer >= 0", integer=True)
  address = config.rollout.learner_address
  _check(not address or (address.rpartition(":")[0] and address.rpartition(":")[2].isdigit()),
         "rollout.learner_address", address, "must be HOST:PORT (or empty)")


def _validate_learner(config) -> None:
  """Optimizer and batch settings; (inline model only) one micro-batch must hold the longest sequence."""
  _number(config, "learner.batch_size", lambda v: v >= 1, "an integer >= 1", integer=True)
  _number(config, "learner.token_budget", lambda v: v >= 1, "an integer >= 1", integer=True)
  _number(config, "learner.learning_rate", lambda v: v > 0, "a number > 0")
  _number(config, "learner.warmup_steps", lambda v: v >= 0, "an integer >= 0", integer=True)
  _number(config, "learner.weight_decay", lambda v: v >= 0, "a number >= 0")
  _number(config, "learner.grad_clip", lambda v: v > 0, "a number > 0")
  _number(config, "learner.b1", lambda v: 0 <= v < 1, "a number in [0, 1)")
  _number(config, "learner.b2", lambda v: 0 <= v < 1, "a number in [0, 1)")
  _number(config, "learner.ppo_minibatches", lambda v: v >= 1, "an integer >= 1", integer=True)
  _check(config.learner.ppo_minibatches <= config.learner.batch_size, "learner.ppo_minibatches",
         config.learner.ppo_minibatches, f"must be <= learner.batch_size ({config.learner.batch_size})")
  _number(config, "learner.eval_every", lambda v: v >= 0, "an integer >= 0 (0: never)", integer=True)
  _number(config, "learner.warm_start_steps", lambda v: v >= 0, "an integer >= 0", integer=True)
  _number(config, "learner.warm_start_batch", lambda v: v >= 1, "an integer >= 1", integer=True)
  _number(config, "learner.warm_start_lr", lambda v: v > 0, "a number > 0")
  _check(config.learner.warm_start_train in ("all", "adapters"), "learner.warm_start_train",
         config.learner.warm_start_train, "'all' or 'adapters'")
  _check(config.learner.warm_start_train != "adapters" or config.model.lora.rank > 0,
         "learner.warm_start_train", config.learner.warm_start_train,
         "'adapters' needs LoRA adapters (model.lora.rank > 0)")
  _check(config.learner.remat in REMAT_POLICIES, "learner.remat", config.learner.remat,
         f"one of {REMAT_POLICIES}")
  _check(config.learner.attention in ATTENTION_KINDS, "learner.attention", config.learner.attention,
         f"one of {ATTENTION_KINDS}")
  _check(config.rollout.decode_attention in DECODE_KINDS, "rollout.decode_attention",
         config.rollout.decode_attention, f"one of {DECODE_KINDS}")
  _check(config.rollout.weight_dtype in WEIGHT_DTYPES, "rollout.weight_dtype", config.rollout.weight_dtype,
         f"one of {WEIGHT_DTYPES} ('': the serving dtypes)")
  _check(isinstance(config.learner.scan_layers, bool), "learner.scan_layers",
         config.learner.scan_layers, "True or False")
  _check(isinstance(config.learner.warm_up, bool), "learner.warm_up", config.learner.warm_up,
         "True or False")
  _check(isinstance(config.learner.stop_on_alarm, bool), "learner.stop_on_alarm",
         config.learner.stop_on_alarm, "True or False")
  _number(config, "learner.vocab_chunk", lambda v: v >= 0, "an integer >= 0 (0: no chunking)",
          integer=True)
  _number(config, "learner.profile_start", lambda v: v >= -1, "a policy version >= 0, or -1 (no trace)",
          integer=True)
  _number(config, "learner.profile_versions", lambda v: v >= 1, "an integer >= 1", integer=True)
  _number(config, "learner.attention_chunk", lambda v: v >= 0, "an integer >= 0 (0: no chunking)",
          integer=True)
  if not config.model.hf_path:
    longest = config.data.max_prompt_len + config.data.max_completion_len
    _check(config.learner.token_budget >= longest, "learner.token_budget", config.learner.token_budget,
           f"must be >= the longest sequence (data.max_prompt_len + data.max_completion_len = {longest})")


def _validate_rl(config) -> None:
  """Objective, clipping and behaviour-weight guards, advantages; group advantages need whole groups."""
  _one_of(config, "rl.loss", LOSSES)
  _number(config, "rl.max_staleness", lambda v: v >= 0, "an integer >= 0 (eta; 0 = synchronous)",
          integer=True)
  _one_of(config, "rl.staleness_mode", STALENESS_MODES)
  _check(isinstance(config.rl.dis_sign_aware, bool), "rl.dis_sign_aware", config.rl.dis_sign_aware,
         "True or False")
  _validate_correction(config)
  for flag in ("filter_uniform_groups", "overlong_filter"):
    _check(isinstance(config.rl[flag], bool), f"rl.{flag}", config.rl[flag], "True or False")
  _check(not (config.rl.filter_uniform_groups and config.rl.advantage != "group"),
         "rl.filter_uniform_groups", True, "needs rl.advantage='group' (a group of rewards to compare)")
  _number(config, "rl.overlong_penalty_len", lambda v: 0 <= v < config.data.max_completion_len,
          f"an integer in [0, data.max_completion_len={config.data.max_completion_len}) (0: none)",
          integer=True)
  _number(config, "rl.eps_clip", lambda v: 0 < v < 1, "a number in (0, 1)")
  _number(config, "rl.kl_coef", lambda v: 0 <= v < float("inf"), "a finite number >= 0 (0: no KL term)")
  _check(config.rl.kl_estimator in KL_ESTIMATORS, "rl.kl_estimator", config.rl.kl_estimator,
         f"one of {', '.join(KL_ESTIMATORS)}")
  _number(config, "rl.eps_low", lambda v: 0 < v < 1, "a number in (0, 1): the DIS interval starts at "
          "1 - eps_low > 0")
  _number(config, "rl.eps_high", lambda v: v > 0, "a number > 0")
  _number(config, "rl.gspo_eps_low", lambda v: 0 < v < 1, "a number in (0, 1): GSPO's clip starts at "
          "1 - gspo_eps_low > 0")
  _number(config, "rl.gspo_eps_high", lambda v: v > 0, "a number > 0")
  _number(config, "rl.behav_weight_cap", lambda v: v > 1, "a number > 1 (inf: no cap)", allow_inf=True)
  _number(config, "rl.behav_weight_floor", lambda v: 0 <= v < 1, "a number in [0, 1) (0: no floor)")
  _number(config, "rl.behav_weight_clip", lambda v: v > 0, "a number > 0 (inf: no truncation)",
          allow_inf=True)
  _one_of(config, "rl.advantage", ADVANTAGES)
  _one_of(config, "rl.aggregation", AGGREGATIONS)
  _number(config, "rl.group_size", lambda v: v >= 1, "an integer >= 1", integer=True)
  _number(config, "rl.reward_threads", lambda v: 1 <= v <= 256, "an integer in 1..256", integer=True)
  if config.rl.advantage == "group":
    _check(config.rl.group_size >= 2, "rl.group_size", config.rl.group_size,
           "must be >= 2 when rl.advantage='group' (a group of one has no baseline; "
           "rl.advantage='value' needs none)")
  _check(config.learner.batch_size % config.rl.group_size == 0, "learner.batch_size",
         config.learner.batch_size, f"must be a multiple of rl.group_size ({config.rl.group_size})")
  _number(config, "rl.gamma", lambda v: 0 <= v <= 1, "a number in [0, 1]")
  _number(config, "rl.gae_lambda", lambda v: 0 <= v <= 1, "a number in [0, 1]")
  _number(config, "rl.value_learning_rate", lambda v: v > 0, "a number > 0")
  _number(config, "rl.value_updates", lambda v: v >= 1, "an integer >= 1", integer=True)
  _number(config, "rl.value_clip", lambda v: v > 0, "a number > 0")
  _number(config, "rl.value_pretrain_versions", lambda v: v >= 0, "an integer >= 0", integer=True)
  if config.rl.advantage == "value":
    _check(config.rl.value_pretrain_versions < config.steps, "rl.value_pretrain_versions",
           config.rl.value_pretrain_versions,
           f"must be < steps ({config.steps}): those versions train the value model only")


def _validate_correction(config) -> None:
  c = config.rl.correction
  _one_of(config, "rl.correction.ratio", ("current", "prox"))
  _number(config, "rl.correction.tis_cap", lambda v: v > 0, "a number > 0 (inf: off)", allow_inf=True)
  _number(config, "rl.correction.dual_clip", lambda v: v > 1, "a number > 1 (inf: off)", allow_inf=True)
  _check(not (math.isfinite(c.tis_cap) and config.rl.loss != "ppo_recompute"), "rl.correction.tis_cap",
         c.tis_cap, f"corrects rl.loss='ppo_recompute' only (rl.loss={config.rl.loss!r} has its importance "
         "ratio already; decoupled PPO truncates it with rl.behav_weight_clip)")
  _check(not (math.isfinite(c.dual_clip) and config.rl.loss == "dis"), "rl.correction.dual_clip",
         c.dual_clip, "bounds PPO's clipped objective; rl.loss='dis' has none (inf: off)")
  for name in ("icepop", "seq_mask"):
    _number(config, f"rl.correction.{name}_low", lambda v: 0 <= v < 1, "a number in [0, 1) (0: off)")
    _number(config, f"rl.correction.{name}_high", lambda v: v > 1, "a number > 1 (inf: off)",
            allow_inf=True)


def _validate_mesh(config) -> None:
  """The device split, colocation (not with remote decode servers), and each role's mesh axes."""
  _number(config, "mesh.rollout_fraction", lambda v: 0 < v < 1, "a number strictly between 0 and 1")
  _check(isinstance(config.mesh.colocate, bool), "mesh.colocate", config.mesh.colocate, "must be True or False")
  _check(not (config.mesh.colocate and config.rollout.servers), "mesh.colocate", True,
         "cannot be combined with rollout.servers > 0 (decode servers in other processes have their own "
         "devices)")
  for role in ("learner", "rollout"):
    unknown = sorted(set(config.mesh[role].keys()) - set(sharding.MESH_AXES))
    _check(not unknown, f"mesh.{role}", dict(config.mesh[role]), f"unknown axes {unknown}; the axes are "
           f"{sharding.MESH_AXES}")
    for axis in sharding.MESH_AXES:
      if axis not in config.mesh[role]:
        continue  # (an axis left out has size 1)
      f = f"mesh.{role}.{axis}"
      _number(config, f, lambda v: v >= 1 or v == -1, "a positive integer, or -1 for 'the rest'",
              integer=True)
    n_auto = sum(config.mesh[role].get(a, 1) == -1 for a in sharding.MESH_AXES)
    _check(n_auto <= 1, f"mesh.{role}", dict(config.mesh[role]), "at most one axis may be -1")


def _validate_checkpoint(config) -> None:
  _number(config, "checkpoint.every_steps", lambda v: v >= 1, "an integer >= 1", integer=True)
  _number(config, "checkpoint.max_to_keep", lambda v: v >= 1, "an integer >= 1", integer=True)


def _validate_monitor(config) -> None:
  _number(config, "monitor.window", lambda v: v >= 1, "an integer >= 1", integer=True)
  for f in ("reward_drop", "eval_drop", "truncated_max", "masked_max"):
    _number(config, f"monitor.{f}", lambda v: v >= 0, "a number >= 0 (0 or inf: off)", allow_inf=True)
  _number(config, "monitor.entropy_floor", lambda v: 0 <= v < 1, "a number in [0, 1) (0: off)")
  _number(config, "monitor.entropy_ceiling", lambda v: v == 0 or v > 1, "a number > 1 (0 or inf: off)",
          allow_inf=True)
  _number(config, "monitor.ratio_p99_max", lambda v: v == 0 or v > 1, "a number > 1 (0 or inf: off)",
          allow_inf=True)


def _check_same_fields(config, expected, prefix: str) -> None:
  got, want = set(config.keys()), set(expected.keys())
  unknown = sorted(got - want)
  if unknown:
    raise ConfigError(f"unknown config field(s) {[prefix + k for k in unknown]}; "
                      f"fields of {prefix.rstrip('.') or 'the config'}: {sorted(want)}")
  missing = sorted(want - got)
  if missing:
    raise ConfigError(f"missing config field(s) {[prefix + k for k in missing]}")
  for key in want:
    if isinstance(expected[key], ml_collections.ConfigDict):
      if not isinstance(config[key], ml_collections.ConfigDict):
        raise ConfigError(f"{prefix + key} must be a section, got {config[key]!r}")
      _check_same_fields(config[key], expected[key], f"{prefix}{key}.")


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
  """The ModelConfig of an experiment whose architecture is given inline (no ``hf_path``)."""
  return ModelConfig.from_mapping(config.model.to_dict())
