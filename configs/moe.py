"""Built-in CPU experiment on a mixture-of-experts policy: the built-in arithmetic task (as
configs/default.py) on a tiny Qwen3-MoE-shaped decoder, with routing replay.

Run (one CPU machine, 4 virtual devices: 3 decode, 1 learner):

  python -m asyncrl_jax train --config=configs/moe.py --workdir=/tmp/asyncrl_moe

Model: 2-layer, d=128 Qwen3-MoE-shaped decoder (q/k RMSNorm, no q/k/v bias, head_dim 32): each
layer's MLP is 8 experts of width 128, top 2 per token with the two weights renormalised
(Qwen3-MoE's norm_topk_prob), dropless. On the CPU the experts run as the dense reference
(model.moe.matmul="dense": every expert on every token, weighted 0 off the chosen two), because XLA's
CPU lowering of jax.lax.ragged_dot is slower here than the 4x larger dense product
(benchmarks/results/moe_layer.md); the pod configs run "ragged". The decode
servers record each token's experts (int16, 2 layers x 2 per token) and the learner replays them
(rollout.record_routes, rl.replay_routes); the router's load-balancing loss is added at Qwen3-MoE's
coefficient 0.001. metrics.jsonl carries moe_aux_loss, moe_load_max, moe_load/<e> and
moe_route_mismatch (the share of token-layer pairs the learner would have routed elsewhere).
Measured (seed 0, benchmarks/results/moe_main_job.md): held-out pass@1 (4 samples, T=1, all 500
problems) 0.35 after the warm start -> 0.45 after 200 RL versions, greedy 0.61 -> 0.66; routing
mismatch about 1.4% of token-layer pairs per version. That run took 65 minutes on 2 cores shared with
other work the whole time (a TPU compile, tests); alone it takes less (the first 20 versions and the
warm start took 11 minutes beside the tests).
Overrides: --config.rl.replay_routes=False (record only: the mismatch is measured, not replayed),
--config.rl.loss=gspo, --config.model.moe.matmul=ragged (grouped by expert), ...
"""

from asyncrl_jax.config import base_config


def get_config():
  c = base_config()
  c.steps = 200
  c.model.update(vocab_size=17, hidden_size=128, intermediate_size=512, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=32, qkv_bias=False, qk_norm=True, max_seq_len=256)
  c.model.moe.update(num_experts=8, top_k=2, intermediate_size=128, norm_topk_prob=True,
                     matmul="dense", aux_loss_coef=0.001)
  c.data.update(task="arithmetic", max_prompt_len=48, max_completion_len=96, final_eval_problems=500)
  c.rollout.update(num_slots=96, temperature=1.0, record_routes=True)
  c.learner.update(batch_size=256, token_budget=4096, learning_rate=1e-4, warmup_steps=20,
                   grad_clip=1.0, ppo_minibatches=1, eval_every=20, warm_start_steps=150,
                   warm_start_batch=128, warm_start_lr=1e-3)
  c.rl.update(loss="decoupled_ppo", max_staleness=2, eps_clip=0.2, advantage="group", group_size=8,
              aggregation="sequence_mean", kl_coef=0.3, kl_estimator="k3", replay_routes=True)
  c.checkpoint.update(every_steps=20)
  return c
