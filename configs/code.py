"""Built-in CPU experiment for code RL: programs for functions shown by examples, rewarded by running
them on hidden tests in the sandbox.

Run (one CPU machine, 4 virtual devices: 3 decode, 1 learner):

  python -m asyncrl_jax.train --config=configs/code.py --workdir=/tmp/asyncrl_code

Task (``data.code_functions``): the prompt shows ``f(1), f(2), f(3)`` of a hidden ``f(x) = a*x + b``;
the completion works out ``a`` and ``b`` and writes a Python program in a fenced block that reads
``x`` and prints ``f(x)``; the reward runs that program on 4 hidden inputs in the sandbox
(``rl.rewards.code_reward``: 1 only when every test passes; the same program in a group is run
once). Model: the default config's 2-layer d=128 decoder over the built-in code vocabulary (30
tokens: digits, operators, and four pieces of Python as one token each), warm-started on worked
solutions. RL recipe: the main job's (decoupled PPO at lr 1e-4, sequence-mean aggregation) with its
KL term towards the warm start (``rl.kl_coef=0.3``, k3): without it one probe lost 10 points of
pass@1 in 25 versions, with it one rose 0.506 -> 0.537 over 50 versions, greedy 0.970 -> 0.936
(one seed each: benchmarks/results/code_rl_probe.md). Needs the sandbox (bubblewrap, bundled by requirements.txt): the run refuses to start
without it.
"""

from asyncrl_jax.config import base_config


def get_config():
  c = base_config()
  c.steps = 150
  c.model.update(vocab_size=30, hidden_size=128, intermediate_size=512, num_layers=2, num_heads=4,
                 num_kv_heads=2, max_seq_len=128)
  c.data.update(task="code_functions", tokenizer_path="builtin:code", max_prompt_len=24,
                max_completion_len=48, final_eval_problems=500)
  c.rollout.update(num_slots=96, temperature=1.0)
  c.learner.update(batch_size=128, token_budget=4096, learning_rate=1e-4, warmup_steps=20,
                   grad_clip=1.0, ppo_minibatches=1, eval_every=25, warm_start_steps=150,
                   warm_start_batch=128, warm_start_lr=1e-3)
  # 8 reward threads: each program runs in its own sandbox start, mostly waiting on processes, so
  # threads beyond the cores add throughput (benchmarks/code_reward.py measures it)
  c.rl.update(loss="decoupled_ppo", max_staleness=2, eps_clip=0.2, advantage="group", group_size=8,
              aggregation="sequence_mean", kl_coef=0.3, kl_estimator="k3", reward_threads=8)
  c.checkpoint.update(every_steps=25)
  return c
