"""The one experiment-config schema: every field with its default and, in a comment beside it, its
meaning (``docs/configuration.md`` is generated from these comments by ``tools/config_doc.py``), and
the allowed values of the fields that take one of a few. ``asyncrl_jax.config`` validates.

Sections:
  model       architecture (or ``hf_path``: take it from a Hugging Face checkpoint directory)
  data        task, prompt / completion lengths, dataset location
  rollout     decode-server slots and sampling settings
  learner     batch, optimizer, token budget for dynamic micro-batching
  rl          objective (``loss``), clipping, staleness bound ``max_staleness`` (eta), advantages
  mesh        device split between rollout and learner, and each role's mesh shape
  checkpoint  Orbax checkpointing cadence
  monitor     the health monitor's thresholds (signatures of collapse, ``rl.health``)
  log         what the run writes beyond its metrics (trajectories for debugging)
  env         multi-turn episodes: the environment each rollout runs in (none: one completion)
"""

from __future__ import annotations

import ml_collections

AGGREGATIONS = ("token_mean", "sequence_mean")
LOSSES = ("ppo", "ppo_recompute", "decoupled_ppo", "dis", "gspo")
KL_ESTIMATORS = ("k1", "k2", "k3")  # rl.kl_estimator (rl.losses.reference_kl)
STALENESS_MODES = ("bounded", "pinned")
ADVANTAGES = ("group", "value")
DTYPES = ("float32", "bfloat16", "float16")
TASKS = ("arithmetic", "tool_arithmetic", "jsonl", "tfds", "code_jsonl", "code_functions")
LOGPROB_SOURCES = ("sampling", "model")


class ConfigError(ValueError):
  """A configuration value is not allowed. The message names the field."""


def _model_section() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      hf_path="",  # when set, architecture and weights come from this HF directory
      # the decoder (the built-in default: 2 layers, d=128, Qwen2-style); head_dim 0 = hidden_size /
      # num_heads; qk_norm: Qwen3's RMSNorm on each query and key head before RoPE
      vocab_size=17, hidden_size=128, intermediate_size=512, num_layers=2, num_heads=4,
      num_kv_heads=2, head_dim=0, rope_theta=10000.0, rms_norm_eps=1e-6, qkv_bias=True, qk_norm=False,
      # RoPE frequency scaling as the hub writes it (models.rope): rope_type "default" (none),
      # "llama3" (factor, original_max_position_embeddings, low_freq_factor, high_freq_factor) or
      # "yarn" (factor, original_max_position_embeddings, beta_fast, beta_slow, and an attention
      # factor on cos / sin: attention_factor, else from factor, mscale, mscale_all_dim)
      rope_scaling=ml_collections.ConfigDict(dict(
          rope_type="default", factor=1.0, original_max_position_embeddings=0, low_freq_factor=1.0,
          high_freq_factor=4.0, beta_fast=32.0, beta_slow=1.0, attention_factor=0.0, mscale=0.0,
          mscale_all_dim=0.0, truncate=True)),
      # mixture of experts (models.moe; Qwen3-MoE): num_experts > 0 makes the MLP of every
      # decoder_sparse_step-th layer, except mlp_only_layers (comma-separated indices), top_k of
      # num_experts experts of width intermediate_size, dropless; norm_topk_prob renormalises the
      # k routing weights. matmul: "ragged" (grouped by expert with jax.lax.ragged_dot), "dense"
      # (every expert on every token: the reference) or "megablox" (grouped by the megablox TPU
      # kernel; elsewhere interpreted, for tests). exchange: with a mesh expert axis, how tokens
      # reach their experts' shard: "padded" (all_to_all of a worst-case buffer; runs on CPU) or
      # "ragged" (ragged_all_to_all: routed rows only; TPU/GPU). capacity_factor: 0 (dropless) or
      # c >= 1: with a mesh expert axis each shard sends at most c x its even share of routing slots
      # to each expert shard and drops the rest (logged as moe_dropped_frac). With hf_path only
      # matmul, exchange, capacity_factor and aux_loss_coef apply. aux_loss_coef: the router's load-balancing loss (E sum_e f_e P_e, averaged over the
      # MoE layers) added to the learner's loss times this (0: logged, not trained)
      moe=ml_collections.ConfigDict(dict(
          num_experts=0, top_k=0, intermediate_size=0, norm_topk_prob=True, decoder_sparse_step=1,
          mlp_only_layers="", matmul="ragged", exchange="padded", capacity_factor=0.0,
          aux_loss_coef=0.0)),
      # dtype: activations and matmuls (decode servers also hold the weights in it, norm scales
      # excepted); param_dtype: the learner's stored weights and optimizer state
      tie_embeddings=False, max_seq_len=256, dtype="float32", param_dtype="float32",
      # LoRA: rank > 0 adds adapters (scale alpha / rank) to the targets, comma-separated of
      # q,k,v,o,gate,up,down,router (a mixture of experts: the attention projections and optionally
      # the router; experts carry none); the learner then trains only the adapters (the base stays
      # frozen)
      lora=ml_collections.ConfigDict(dict(rank=0, alpha=16.0, targets="q,k,v,o,gate,up,down")),
  ))


def _data_section() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      # built-in tasks: "arithmetic" (chain-of-thought sums of digits), "tool_arithmetic" (sums of
      # multi-digit numbers, solved with a calculator: env.name="tools", tokenizer "builtin:tools"),
      # "code_functions" (a program for a function shown by examples, scored on hidden tests in the
      # sandbox: tokenizer "builtin:code");
      # "jsonl" / "tfds" read prepared math data; "code_jsonl" imports code problems (LiveCodeBench /
      # DeepCoder rows, data/code_problems.py) scored by running their tests in the sandbox
      task="arithmetic",
      path="",  # file or TFDS data_dir for non-built-in tasks
      # directory with tokenizer.json (+ tokenizer_config.json); "" = the built-in arithmetic
      # tokenizer, "builtin:tools" = the built-in one with tool markers [ ] { }
      tokenizer_path="",
      # a JSON object the tokenizer's chat template gets beside the messages, e.g.
      # '{"enable_thinking": false}' for Qwen3's non-thinking mode (its template's default is
      # thinking on); "" none. A Hugging Face tokenizer's only (the built-in ones have no template)
      chat_template_kwargs="",
      max_prompt_len=48, max_completion_len=160,  # tokens; longer prompts are skipped and counted
      min_terms=2, max_terms=16,  # built-in task: number of summed digits (lognormal, truncated)
      # built-in task: > 0 draws the supervised warm start's demonstrations from chains of 2 to this
      # many terms, apart from the RL prompts (min_terms..max_terms): no demonstration of the long
      # chains RL must solve. 0: the warm start reads the task's own train split
      demo_max_terms=0,
      max_digits=4,  # tool_arithmetic: each number has 1 to this many digits
      num_train=20000, num_test=500,  # built-in task: problems per split
      seed=0,  # built-in task: generator seed of the problems (the run's seed drives everything else)
      eval_problems=256,  # held-out problems per evaluation
      eval_samples=4,  # sampled completions per held-out problem (pass@1); 0 = greedy accuracy only
      # the evaluation of the last version (the summary's final_eval_*): problems and samples per
      # problem; 0 = as every evaluation (eval_problems, eval_samples). E.g. 500 x 16 for a pass@1
      # with a standard error near half a point
      final_eval_problems=0, final_eval_samples=0,
      # when the last version's evaluation reads more than every other's, a fresh run evaluates its
      # starting weights that way too (summary: initial_final_eval_*), so before and after RL are
      # compared on the same problems: one more evaluation of that size at the start
      initial_eval_final=True,
  ))


def _rollout_section() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      num_slots=32,  # per decode server (one per rollout host, or per decode-server process)
      temperature=1.0, top_p=1.0, top_k=0,
      logprob_source="sampling",  # behaviour log-probs of the transformed (sampling) distribution
      # no stop token before this many completion tokens (a sampling setting: the learner applies the
      # same ban to its log-probs)
      min_new_tokens=0,
      # a synthetic length workload for throughput measurements, e.g.
      # "lognormal:median=32,sigma=1.15,cap=640": each request generates exactly a drawn number of
      # tokens (its minimum and maximum length); "" = off (asyncrl_jax.data.workloads)
      length_workload="",
      host="127.0.0.1", port=0,  # where servers listen (the learner's registry and senders too)
      # decode-server processes the learner waits for; they register with learner process 0 at
      # rollout.learner_address (the learner listens on rollout.host:rollout.registry_port; 0 = any
      # free port, written to WORKDIR/registry_address). 0 servers = decode in the learner's process
      servers=0, registry_port=0, learner_address="",
      register_timeout=600.0,  # seconds the learner waits for rollout.servers to register
      # a decode server repeats its registration this often, so that a learner restarted from its
      # checkpoint (same registry address: set rollout.registry_port) re-attaches to it
      register_interval=5.0,
      # on SIGTERM a decode server takes no new work and gives its queue back, lets its sequences in
      # flight finish for at most this many seconds, delivers them, and exits 0
      drain_timeout=15.0,
      push_timeout=300.0,  # seconds a decode server may take to pull a version of the weights
      # a decode server that has not answered a health check for this many seconds (killed, stalled)
      # is dropped: its requests go to the others, and no weight push waits for it
      server_deadline=30.0,
      push_retries=2,  # a failed pull is retried (new uuid, newest version) this often, then dropped
      # a rollout that comes back failed or malformed is resubmitted under its id this often, then
      # trained as a failed rollout (reward 0, counted)
      max_retries=2,
      # a shared secret every gRPC call must carry (a file; or ASYNCRL_AUTH_TOKEN): required when
      # rollout.host is not a loopback address. No TLS: keep the traffic on the private network
      auth_token_file="",
      # on new weights: "recompute" re-prefills every in-flight sequence under them (exact); "keep_cache"
      # continues on the KV cache the older weights wrote (no re-prefill; the recorded log-probs are
      # still those of the distribution each token was drawn from); "drain" lets the sequences in
      # flight finish under the old weights and starts none until they have (non-interruptible)
      on_weight_update="recompute",
      # compile every batched-prefill shape (new prompts, re-prefills) in the background at start, so
      # decoding rarely waits for a compilation
      warm_up=True,
      # prefill attention this many queries at a time (0: all at once; a re-prefill of every slot at
      # the longest length then holds [slots, heads, length, length] scores)
      attention_chunk=0,
      # tokens (rows x width) per batched-prefill call at most, single rows excepted (0: no cap)
      prefill_tokens=0,
      # how a decode step attends to the KV cache: "xla" reads every position (masked); "ragged" is
      # the Pallas paged kernel, reading each slot's positions only up to its own (on a TPU, with
      # model.head_dim a multiple of 128; elsewhere an XLA stand-in, exact and no faster: tests)
      decode_attention="xla",
      # the decode servers' weights: "" the serving dtypes (the model's compute dtype, norms as
      # stored); "int8" quantizes each projection kernel per output channel (bfloat16 scales) when
      # weights arrive and dequantizes as a step reads them; the recorded behaviour log-probs are the
      # int8 model's (models.quant)
      weight_dtype="",
      # a mixture-of-experts policy: record, per token and MoE layer, the experts the server chose;
      # they travel with the trajectory (int16) and the learner computes the proximal and current
      # policies with those experts (routing replay, R3; the gate weights still from its own router)
      record_routes=False,
  ))


def _learner_section() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      batch_size=32,  # trajectories per policy update (B in the staleness bound)
      token_budget=4096,  # tokens per micro-batch (dynamic micro-batching)
      # AdamW (cosine decay to 10% over the run's optimizer updates, after warmup_steps); gradients
      # clipped to this global norm
      learning_rate=3e-4, warmup_steps=0, weight_decay=0.0, grad_clip=1.0, b1=0.9, b2=0.999,
      ppo_minibatches=1,  # optimizer updates per global batch (prox is fixed for all of them)
      eval_every=10,  # policy versions between held-out evaluations (0: never, not even before RL)
      warm_start_steps=0,  # supervised steps on worked solutions before RL (0: none)
      warm_start_batch=128, warm_start_lr=1e-3,  # the warm start's batch (sequences) and peak rate
      # what the warm start trains: "all" (every weight, LoRA adapters included) or "adapters" (LoRA
      # supervised fine-tuning: the base stays frozen, as in LoRA RL; needs model.lora.rank > 0)
      warm_start_train="all",
      # memory and speed, not maths. remat: what each block keeps for the backward pass ("none",
      # "full": only its input, "minimal": the weight products' outputs, "dots_saveable": every
      # product's, "minimal_offloaded": "minimal" held in host memory; True / False = "full" /
      # "none"); log-softmax over the vocabulary in chunks of this many columns (0: all at once,
      # through [tokens, V] float32 logits); attention: "xla" (the reference: attention_chunk queries
      # at a time, 0: all at once, through [rows, heads, width, width] scores) or "splash" (the
      # Pallas TPU kernel: scores stay on chip, blocks above the diagonal skipped; off a TPU it runs
      # interpreted, for tests only); one loop over the layers (lax.scan of their stacked
      # parameters) instead of one copy of the block per layer: a program the size of one layer,
      # compiled in a fraction of the time, and one the TPU compiler cannot reorder into holding
      # every layer's activations at once
      remat="none", vocab_chunk=0, attention="xla", attention_chunk=0, scan_layers=False,
      # compile every micro-batch shape (one per row-length bucket up to the longest sequence) at
      # start, applying nothing, so that no version stalls on a compilation mid-run
      warm_up=True,
      # stop (with a checkpoint, exit 1, naming the signal) at the first alarm of the health monitor
      stop_on_alarm=False,
      # a jax profiler trace of the whole process (decode, learner, host) over profile_versions
      # policy versions from profile_start, in WORKDIR/profile (-1: none)
      profile_start=-1, profile_versions=3,
  ))


def _correction_section() -> ml_collections.ConfigDict:
  """Off-policy corrections on top of any rl.loss (``rl.losses.Corrections``); all off by default."""
  return ml_collections.ConfigDict(dict(
      # the importance ratio the corrections read: "current" pi_theta / pi_behav, "prox" pi_prox / pi_behav
      ratio="current",
      tis_cap=float("inf"),  # truncated IS: each token's loss times min(ratio, cap) (inf: off)
      icepop_low=0.0, icepop_high=float("inf"),  # IcePop: tokens with a ratio outside [low, high] weigh 0
      # sequences whose geometric-mean ratio is outside [low, high] weigh 0 (0, inf: off)
      seq_mask_low=0.0, seq_mask_high=float("inf"),
      dual_clip=float("inf"),  # PPO's dual clip c > 1 for negative advantages (inf: off)
  ))


def _rl_section() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      # ppo: PPO on the behaviour ratio; ppo_recompute: PPO with the old log-probs recomputed under the
      # weights before the update (ignores the behaviour policy: the seeds' naive baseline);
      # decoupled_ppo: AReaL; dis: SAO's masked importance sampling; gspo: Qwen's sequence-level ratio
      # and clip, trust region around the prox policy and each sequence weighted by its geometric-mean
      # pi_prox / pi_behav (under the behav_weight guards), so plain GSPO at eta 0
      loss="decoupled_ppo", max_staleness=2, eps_clip=0.2, eps_low=0.3, eps_high=5.0,
      # bounded: tokens are at most max_staleness versions old (AReaL's bound; how old they are depends
      # on the roles' speeds); pinned: every token trained at version v was sampled by version
      # exactly max(0, v - max_staleness) (for ablations: no interrupted generations, weights reach
      # the decode servers only between batches)
      staleness_mode="bounded",
      # DIS masks only the tokens whose drift agrees with their advantage (rl.losses.dis_loss)
      dis_sign_aware=False,
      # GSPO's clip of the sequence ratio, (1 - gspo_eps_low, 1 + gspo_eps_high): the paper's 3e-4, 4e-4
      gspo_eps_low=3e-4, gspo_eps_high=4e-4,
      # with rollout.record_routes: the learner's forward passes (prox, current, reference) use the
      # decode servers' recorded experts (routing replay); False records them only to measure the
      # routing mismatch (metrics.jsonl: moe_route_mismatch)
      replay_routes=True,
      # data shaping (DAPO; controller): drop groups whose rewards are all equal and fill the batch
      # from the next groups; give completions cut by the length budget loss weight 0; a soft
      # penalty on the reward over the last overlong_penalty_len tokens of the budget (0: none)
      filter_uniform_groups=False, overlong_filter=False, overlong_penalty_len=0,
      # threads scoring finished rollouts (rl.rewards.RewardWorker): a code reward's sandbox runs
      # are processes a thread waits on, so more threads than cores still add throughput
      reward_threads=2,
      correction=_correction_section(),
      # decoupled PPO's behaviour weight w = pi_prox / pi_behav (GSPO's: its geometric mean over the
      # sequence): tokens (GSPO: sequences) above the cap or below the floor are dropped (inf / 0:
      # none); kept ones weigh min(w, clip) (inf: no truncation). Truncation at 1, no cap: in the eta 8
      # probe the cap alone (AReaL's 5) removed the stale tokens that correct the policy's current
      # mistakes and an unbounded w let a few tokens steer the update (docs/decisions/0004).
      behav_weight_cap=float("inf"), behav_weight_floor=0.0, behav_weight_clip=1.0,
      # a penalty of kl_coef times the policy's KL divergence from a reference per policy token, the
      # reference being the policy
      # the run's RL started from (after any warm start), estimated on the sampled tokens by
      # kl_estimator: k1 (log ratio), k2 (half its square) or k3 (GRPO's r - 1 - log r); 0 = none.
      # It costs one more forward pass per micro-batch and, without LoRA, a copy of the weights
      kl_coef=0.0, kl_estimator="k3",
      # group: GRPO's group-mean baseline over group_size samples per prompt (divided by the group's
      # std with scale_by_std); value: a learned baseline with GAE(gamma, gae_lambda)
      advantage="group", group_size=8, scale_by_std=False, gamma=1.0, gae_lambda=1.0,
      # advantage="value" (SAO's single rollout): the learner's value model (the policy's trunk and a
      # scalar head), its optimizer steps per version on the clipped value loss, the versions at the
      # start that train it alone (the policy is published unchanged), and whether its attention
      # parameters stay frozen
      value_learning_rate=3e-4, value_updates=2, value_clip=0.2, value_pretrain_versions=10,
      value_freeze_attention=False,
      # token_mean: every policy token of the batch weighs the same (long completions weigh more);
      # sequence_mean: every trajectory weighs the same (its tokens share 1 / its length)
      aggregation="token_mean",
  ))


def _mesh_section() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      rollout_fraction=0.75,  # share of devices for decode servers (3:1 as in AReaL)
      # True: decode servers and learner share every device, taking turns (one-device machines, and the
      # colocated synchronous baseline); rollout_fraction is then unused
      colocate=False,
      # each role's mesh axes (-1: the devices left over); parameters split over fsdp x tensor (a
      # mixture of experts' experts also over expert), rows over data x fsdp x expert
      learner=ml_collections.ConfigDict(dict(data=1, fsdp=-1, expert=1, tensor=1)),
      rollout=ml_collections.ConfigDict(dict(data=-1, fsdp=1, expert=1, tensor=1)),  # per decode server
  ))


def _monitor_section() -> ml_collections.ConfigDict:
  """The health monitor's thresholds (``rl.health``): each signature of collapse alarms past its
  bound (0 or inf: off); averages over the last ``window`` versions."""
  return ml_collections.ConfigDict(dict(
      window=5,  # versions averaged
      reward_drop=0.15,  # batch reward below its best window average by this much
      eval_drop=0.10,  # held-out accuracy below its best evaluation by this much
      entropy_floor=0.2,  # mean token entropy below this fraction of its first window's
      entropy_ceiling=1.5,  # ... or above this multiple of it
      truncated_max=0.5,  # share of completions cut by the length budget above this
      ratio_p99_max=10.0,  # 99th percentile of pi_theta / pi_behav above this
      masked_max=0.5,  # share of policy tokens given weight 0 above this
  ))


def _checkpoint_section() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      # a checkpoint every this many policy versions, the newest kept, written in the background
      every_steps=20, max_to_keep=3, async_save=True,
  ))


def _log_section() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      # trajectories written per policy version to WORKDIR/trajectories.jsonl (tokens and text,
      # action mask, versions, behaviour log-probs, reward, finish reason): how to debug a reward.
      # 0 = none
      trajectories=0,
  ))


def _env_section() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      # the registered environment every rollout runs in as a multi-turn episode ("tools": the
      # built-in calculator / Python tool environment, envs.tools_env; "openai-agent": an agent
      # program written against an OpenAI-compatible client, envs.agent); "" = single-turn completions
      name="",
      # JSON object of the environment's constructor options, e.g. '{"tool": "calculator",
      # "latency": "lognormal:median=0.2,sigma=1.15"}' (tool_arithmetic adds its markers itself)
      options="{}",
      max_turns=4,  # actions per episode; the episode then ends with finish reason "turns"
      # environment steps running at once per decode server (a thread pool); 0 = one per decode
      # slot (a parked episode never waits for a worker)
      workers=0,
      step_timeout=30.0,  # seconds; a longer step ends its episode as "env_timeout"
      # the Python tool runs model code in a bubblewrap sandbox (envs.sandbox) and refuses to run
      # where the kernel refuses its namespaces; True runs it there with resource limits only (not a
      # boundary: logged at the start and in summary.json)
      allow_unsandboxed=False,
  ))


def base_config() -> ml_collections.ConfigDict:
  """Every field with its default. Experiments override; they never add fields."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # the run's seed: initial weights, prompt order, sampling
  c.steps = 100  # learner updates (policy versions) to train for
  c.model = _model_section()
  c.data = _data_section()
  c.rollout = _rollout_section()
  c.learner = _learner_section()
  c.rl = _rl_section()
  c.mesh = _mesh_section()
  c.checkpoint = _checkpoint_section()
  c.monitor = _monitor_section()
  c.log = _log_section()
  c.env = _env_section()
  return c
