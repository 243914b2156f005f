"""What the policy objective does with stale data: per-version weights, gradient shares, alignment.

  .venv/bin/python benchmarks/objective_diagnosis.py record --workdir=DIR --loss=decoupled_ppo \
      [--ws=WARM_START_DIR] [--override=--config.x=y ...]
  .venv/bin/python benchmarks/objective_diagnosis.py analyze --workdir=DIR

``record`` runs the main job (configs/default.py in the probe regime of ``staleness_ablation.py
--regime=probe``: lr 3e-4, 2 optimizer updates per batch, eta 8, 80 versions) and stores, for every
policy version ``v``, the global batch the learner trained on (tokens, mask, behaviour log-probs,
advantages, per-token versions) and the parameters it held before the update (``DIR/diag``).

``analyze`` reads them back and measures, per version:

* the behaviour weight ``w = exp(prox - behav)`` over policy tokens: quantiles, the share above 5 and
  below 0.2, and KL(behaviour || prox);
* which tokens the gradient comes from, in parameter space, at the version's first optimizer update
  (where decoupled PPO's ``u = 1``, so its gradient is ``-(1/N) sum_t w_t A_t grad logp_t``, and naive
  PPO's is the same sum without the tokens its clip around the behaviour policy removes): the norms
  and cosines of the gradients of token subsets (``w > 5``; the tokens decoupled PPO keeps and naive
  PPO clips) against the whole;
* the same split by completion length (sequence-mean aggregation gives each trajectory equal weight);
* alignment: every recorded behaviour log-prob recomputed under the parameters of the version its
  token carries (full forward of the packed batch), so packing, per-token versions and interrupted,
  resumed generations are checked against the model itself;
* the loss's gradient with respect to ``logp`` at these stale inputs against a numpy reference of
  the formula (with ``logp`` one version newer than prox, so clipping is exercised).

Writes ``DIR/diagnosis.json`` and prints a table (one row per 10 versions).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from asyncrl_jax import cli  # noqa: E402  pylint: disable=wrong-import-position

cli.ensure_cpu_devices(4)

import jax  # noqa: E402  pylint: disable=wrong-import-position
import jax.numpy as jnp  # noqa: E402  pylint: disable=wrong-import-position

CONFIG = os.path.join(ROOT, "configs", "default.py")
PROBE = ["--config.learner.learning_rate=3e-4", "--config.learner.ppo_minibatches=2",
         "--config.rl.max_staleness=8", "--config.steps=80", "--config.learner.eval_every=20"]
FIELDS = ("tokens", "mask", "behav_logp", "advantages", "versions")


def _flat(params) -> dict[str, np.ndarray]:
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}


def _unflat(like, arrays) -> dict:
  paths, treedef = jax.tree_util.tree_flatten_with_path(like)
  return jax.tree_util.tree_unflatten(treedef, [arrays[jax.tree_util.keystr(k)] for k, _ in paths])


def record(args) -> None:
  from asyncrl_jax.learner import learner as learner_lib  # pylint: disable=import-outside-toplevel
  out = os.path.join(args.workdir, "diag")
  os.makedirs(out, exist_ok=True)
  original = learner_lib.Learner.train

  def recording_train(self, sequences, *, version):
    v = self.version
    np.savez(os.path.join(out, f"params_{v:04d}.npz"), **_flat(jax.device_get(self.params)))
    lengths = np.array([len(s.tokens) for s in sequences])
    np.savez(os.path.join(out, f"batch_{v:04d}.npz"), lengths=lengths,
             **{f: np.concatenate([getattr(s, f) for s in sequences]) for f in FIELDS})
    return original(self, sequences, version=version)

  learner_lib.Learner.train = recording_train
  argv = ["train", f"--config={CONFIG}", f"--workdir={args.workdir}", f"--config.rl.loss={args.loss}",
          f"--config.seed={args.seed}", *PROBE]
  if args.ws:
    argv.append(f"--config.model.hf_path={args.ws}")
  argv += list(args.override)
  sys.argv = argv  # config_flags registers the --config.x overrides from sys.argv at import
  from asyncrl_jax.train import job as train  # pylint: disable=import-outside-toplevel
  train.main(argv)


def _sequences(batch):
  from asyncrl_jax.rl import batching  # pylint: disable=import-outside-toplevel
  ends = np.cumsum(batch["lengths"])
  starts = ends - batch["lengths"]
  return [batching.SequenceData(*[batch[f][s:e] for f in FIELDS]) for s, e in zip(starts, ends)]


def analyze(args) -> None:
  from asyncrl_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  from asyncrl_jax import models  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.rl import batching, losses  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.rl.logprobs import token_logprobs  # pylint: disable=import-outside-toplevel
  diag = os.path.join(args.workdir, "diag")
  with open(os.path.join(args.workdir, "config.json")) as f:
    saved = json.load(f)
  config = config_lib.base_config()
  config.model.update({k: v for k, v in saved["model"].items() if k in config.model})
  config.model.hf_path = ""
  model_config = config_lib.model_config(config)
  eps = saved["rl"]["eps_clip"]
  versions = sorted(int(p[-8:-4]) for p in glob.glob(os.path.join(diag, "batch_*.npz")))
  recorded = set(versions)
  if args.versions:
    lo, hi = (int(x) for x in args.versions.split(":"))
    versions = [v for v in versions if lo <= v <= hi]
  param_cache: dict[int, dict] = {}
  like = None

  def params_at(v):
    nonlocal like
    if v not in param_cache:
      arrays = dict(np.load(os.path.join(diag, f"params_{v:04d}.npz")))
      if like is None:
        like = models.api.abstract_params(model_config)
      param_cache[v] = jax.tree.map(jnp.asarray, _unflat(like, arrays))
      if len(param_cache) > 12:
        param_cache.pop(min(param_cache))
    return param_cache[v]

  logp_fn = jax.jit(lambda p, b: token_logprobs(model_config, p, b.tokens, b.positions, b.segment_ids))

  def grad_of(params, b, coef):
    """Gradient of -sum_t coef_t logp_t (coef held constant): the loss gradient at u = 1."""
    return jax.grad(lambda p: -jnp.sum(coef * logp_fn(p, b)))(params)

  grad_fn = jax.jit(grad_of)
  rows = []
  for v in versions:
    batch = dict(np.load(os.path.join(diag, f"batch_{v:04d}.npz")))
    seqs = _sequences(batch)
    if saved["rl"]["aggregation"] == "sequence_mean":
      seqs = batching.weight_sequences_equally(seqs)
    mbs = batching.pack_sequences(seqs, saved["learner"]["token_budget"])
    median_len = float(np.median([s.mask.sum() for s in seqs]))
    prox_p = params_at(v)
    next_p = params_at(v + 1) if v + 1 in recorded else None
    n_tok = batching.total_policy_tokens(mbs)
    stats = dict(w=[], adv=[], seq_len=[], align=[], interrupted_align=[], ref_err=[])
    grads = {}
    for b in mbs:
      b = batching.TokenBatch(*[jnp.asarray(x) for x in b])
      m = np.asarray(b.mask) > 0
      prox = np.asarray(logp_fn(prox_p, b))
      behav, adv, lw = np.asarray(b.behav_logp), np.asarray(b.advantages), np.asarray(b.loss_weight)
      w = np.exp(np.minimum(np.where(m, prox - behav, 0.0), losses.MAX_LOG_RATIO))
      stats["w"].append(w[m])
      stats["adv"].append(adv[m])
      seg = np.asarray(b.segment_ids)
      # completion length of each token's sequence (for the length split)
      lens = np.zeros_like(adv)
      for r in range(seg.shape[0]):
        for s in np.unique(seg[r][seg[r] > 0]):
          sel = seg[r] == s
          lens[r, sel] = m[r, sel].sum()
      stats["seq_len"].append(lens[m])
      # alignment: behaviour log-prob vs the log-prob under the version each token carries
      vers = np.asarray(b.versions)
      err = np.full(adv.shape, np.nan)
      for u in np.unique(vers[m]):
        if os.path.exists(os.path.join(diag, f"params_{int(u):04d}.npz")):
          sel = m & (vers == u)
          err[sel] = np.abs(np.asarray(logp_fn(params_at(int(u)), b)) - behav)[sel]
      stats["align"].append(err[m & ~np.isnan(err)])
      # the same over sequences that span several versions (interrupted and resumed generations)
      for r in range(seg.shape[0]):
        for s in np.unique(seg[r][seg[r] > 0]):
          sel = (seg[r] == s) & m[r]
          if len(np.unique(vers[r][sel])) > 1:
            e = err[r][sel]
            stats["interrupted_align"].append(e[~np.isnan(e)])
      # subsets of the first update's gradient
      base = w * adv * lw / n_tok
      base_tm = w * adv / n_tok  # the same batch under token-mean aggregation (no loss weights)
      keep_naive = ~(((adv > 0) & (w > 1 + eps)) | ((adv < 0) & (w < 1 - eps)))
      subsets = {
          "decoupled": m,
          "naive": m & keep_naive,
          "w_gt5": m & (w > 5),
          "extra_over_naive": m & ~keep_naive,
          "extra_pos_adv": m & ~keep_naive & (adv > 0),
          "long_half": m & (lens > median_len),
          "w_lt02": m & (w < 0.2),
          "w_lt02_neg_adv": m & (w < 0.2) & (adv < 0),
          "w_in_02_5": m & (w >= 0.2) & (w <= 5),
          "w_gt5_neg_adv": m & (w > 5) & (adv < 0),
          "w_gt1_neg_adv": m & (w > 1) & (adv < 0),
      }
      coefs = {name: np.where(sel, base, 0.0) for name, sel in subsets.items()}
      coefs.update(token_mean=np.where(m, base_tm, 0.0), token_mean_w_gt5=np.where(m & (w > 5), base_tm, 0.0))
      for name, coef in coefs.items():
        g = grad_fn(prox_p, b, jnp.asarray(coef, jnp.float32))
        grads[name] = g if name not in grads else jax.tree.map(jnp.add, grads[name], g)
      # gradient wrt logp against the formula, at logp one version on (clipping active)
      if next_p is not None:
        logp = jnp.asarray(logp_fn(next_p, b))
        g_lp = np.asarray(jax.grad(lambda lp: losses.decoupled_ppo_loss(
            lp, jnp.asarray(prox), b.behav_logp, b.advantages, b.mask, eps_clip=eps,
            normalizer=n_tok, loss_weight=b.loss_weight)[0])(logp))
        u_r = np.exp(np.where(m, np.asarray(logp) - prox, 0.0))
        active = ~(((adv > 0) & (u_r > 1 + eps)) | ((adv < 0) & (u_r < 1 - eps)))
        ref = np.where(m & active, -w * u_r * adv * lw / n_tok, 0.0)
        scale = np.abs(ref).max() + 1e-30
        stats["ref_err"].append(np.array([np.abs(g_lp - ref).max() / scale]))
    w_all, adv_all = np.concatenate(stats["w"]), np.concatenate(stats["adv"])
    vec = {k: jnp.concatenate([x.ravel() for x in jax.tree.leaves(g)]) for k, g in grads.items()}
    norm = {k: float(jnp.linalg.norm(x)) for k, x in vec.items()}
    cos = lambda a, c: float(jnp.dot(vec[a], vec[c]) / (norm[a] * norm[c] + 1e-30))
    align = np.concatenate(stats["align"]) if stats["align"] else np.zeros(1)
    log_w = np.log(w_all)
    row = dict(
        version=v, policy_tokens=int(n_tok),
        w_q50=float(np.quantile(w_all, 0.5)), w_q99=float(np.quantile(w_all, 0.99)),
        w_max=float(w_all.max()), frac_w_gt5=float((w_all > 5).mean()),
        frac_w_lt02=float((w_all < 0.2).mean()),
        # k3 estimate of KL(behav || prox) from the behaviour policy's samples: E[(w - 1) - log w]
        kl_behav_prox=float(np.mean(np.expm1(log_w) - log_w)),
        # tokens naive PPO's clip removes at the first update and decoupled PPO keeps
        frac_extra_over_naive=float((((adv_all > 0) & (w_all > 1 + eps)) |
                                     ((adv_all < 0) & (w_all < 1 - eps))).mean()),
        grad_norm_decoupled=norm["decoupled"], grad_norm_naive=norm["naive"],
        cos_naive_decoupled=cos("naive", "decoupled"),
        share_w_gt5=norm["w_gt5"] / max(norm["decoupled"], 1e-30), cos_w_gt5=cos("w_gt5", "decoupled"),
        share_extra=norm["extra_over_naive"] / max(norm["decoupled"], 1e-30),
        share_extra_pos=norm["extra_pos_adv"] / max(norm["decoupled"], 1e-30),
        share_long_half=norm["long_half"] / max(norm["decoupled"], 1e-30),
        share_w_gt5_token_mean=norm["token_mean_w_gt5"] / max(norm["token_mean"], 1e-30),
        share_w_lt02=norm["w_lt02"] / max(norm["decoupled"], 1e-30),
        share_w_gt5_neg_adv=norm["w_gt5_neg_adv"] / max(norm["decoupled"], 1e-30),
        frac_w_gt5_neg_adv=float(((w_all > 5) & (adv_all < 0)).mean()),
        cos_w_gt1_neg_adv_naive=cos("w_gt1_neg_adv", "naive"),
        share_w_lt02_neg_adv=norm["w_lt02_neg_adv"] / max(norm["decoupled"], 1e-30),
        cos_kept_02_5=cos("w_in_02_5", "decoupled"), cos_kept_02_5_naive=cos("w_in_02_5", "naive"),
        frac_w_lt02_neg_adv=float(((w_all < 0.2) & (adv_all < 0)).mean()),
        align_max=float(align.max()), align_tokens=int(align.size),
        interrupted_tokens=int(sum(x.size for x in stats["interrupted_align"])),
        interrupted_align_max=float(max((x.max() for x in stats["interrupted_align"] if x.size),
                                        default=0.0)),
        grad_ref_rel_err=float(max(x.max() for x in stats["ref_err"])) if stats["ref_err"] else None)
    rows.append(row)
    print(json.dumps(row), flush=True)
  with open(os.path.join(args.workdir, "diagnosis.json"), "w") as f:
    json.dump(dict(config=saved["rl"], rows=rows), f, indent=2)
  keys = ["version", "w_q99", "w_max", "frac_w_gt5", "kl_behav_prox", "grad_norm_decoupled",
          "cos_naive_decoupled", "share_w_gt5", "share_w_gt5_token_mean", "share_extra_pos", "align_max",
          "interrupted_align_max"]
  print(" ".join(f"{k:>12}" for k in keys))
  for r in rows[::10]:
    print(" ".join(f"{r[k]:>12.4g}" if isinstance(r[k], float) else f"{r[k]:>12}" for k in keys))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  sub = p.add_subparsers(dest="mode", required=True)
  r = sub.add_parser("record")
  r.add_argument("--workdir", required=True)
  r.add_argument("--loss", default="decoupled_ppo", choices=("ppo", "decoupled_ppo", "dis"))
  r.add_argument("--seed", type=int, default=0)
  r.add_argument("--ws", default="", help="warm-start directory (model.hf_path); default: warm start in the run")
  r.add_argument("--override", action="append", default=[])
  a = sub.add_parser("analyze")
  a.add_argument("--workdir", required=True)
  a.add_argument("--versions", default="", help="FIRST:LAST (inclusive); default every recorded version")
  args = p.parse_args(argv)
  record(args) if args.mode == "record" else analyze(args)
  return 0


if __name__ == "__main__":
  sys.exit(main())
