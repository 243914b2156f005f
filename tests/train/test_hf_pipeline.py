"""The real-model path end to end at tiny size, as configs/qwen2_5_1_5b.py takes it: a Qwen2 checkpoint
written by transformers, a byte-level BPE tokenizer.json with a chat template, a JSONL math file and
math-verify rewards -> the main job -> Hugging Face and Orbax exports -> JetStream serving of the export.

One main-job run is shared by every check (built once per session, across pytest-xdist workers too).
The checkpoint is steered (``hf_fixtures.steer_next_tokens``) to write mostly spaces, 1s and 2s, and
every answer is 1 or 2, so math-verify (which reads the last number) scores some completions of a group
1 and others 0: the advantages, and so the policy gradient, are not zero, and the run changes the weights.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import types

import filelock
import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
import transformers

from asyncrl_jax import config as config_lib, models
from asyncrl_jax.data import builder as builder_lib, pipeline
from asyncrl_jax.models.generate import greedy_generate
from asyncrl_jax.rl.rewards import _math_verify, arithmetic_reward
from asyncrl_jax.rollout.jetstream_compat import jetstream_pb2, jetstream_pb2_grpc
from asyncrl_jax.tokenization import HFTokenizer
from tests.fixtures.hf_models import make_bpe_tokenizer, make_hf_model, steer_next_tokens, torch_logits

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VERSIONS, BATCH, GROUP = 3, 8, 4
MAX_PROMPT, MAX_COMPLETION = 32, 16
# every answer is 1 or 2: "What is 5-4?" -> "1"
PROBLEMS = [{"question": f"What is {a + d}-{a}?", "answer": str(d)} for a in range(3, 15) for d in (1, 2)]
# configs/qwen2_5_1_5b.py with its sizes cut down, a learning rate that moves the weights in 3 steps, and
# eta 2 (not 8) so that few rollouts are decoded past the last version
OVERRIDES = {
    "steps": VERSIONS, "data.task": "jsonl", "data.max_prompt_len": MAX_PROMPT,
    "data.max_completion_len": MAX_COMPLETION, "rollout.num_slots": 12, "learner.batch_size": BATCH,
    "learner.token_budget": 256, "learner.learning_rate": 1e-3, "learner.warmup_steps": 0,
    "learner.eval_every": 0, "rl.group_size": GROUP, "rl.max_staleness": 2, "mesh.rollout.tensor": 1,
    "checkpoint.every_steps": 1, "checkpoint.max_to_keep": VERSIONS,
    # the real config computes in bfloat16; float32 here so that logits compare with transformers' at 1e-4
    "model.dtype": "float32",
    "learner.ppo_minibatches": 1,  # the config's 4 optimizer updates per version only cost time here
}


def _env():
  # each subprocess chooses its own virtual CPU device count (train: 4, serve: 1)
  return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def _python(*args, timeout):
  out = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=ROOT,
                       timeout=timeout, env=_env())
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return out


def _once(tmp_path_factory, name: str, build) -> pathlib.Path:
  """``build(path)`` once per test session, also when pytest-xdist spreads this module's tests over
  workers: they share the session's directory, the first builds under a lock, the others reuse it."""
  base = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    base = base.parent  # pytest-N/, above each worker's popen-gwK/
  path = base / f"hf_pipeline_{name}"
  with filelock.FileLock(f"{path}.lock"):
    if not (path / "DONE").exists():
      shutil.rmtree(path, ignore_errors=True)
      path.mkdir()
      build(path)
      (path / "DONE").touch()
  return path


def _write_inputs(root: pathlib.Path) -> None:
  corpus = (["system\nYou are a helpful assistant.\nuser\nassistant\n"] * 8 +
            [f"{p['question']} The answer is {p['answer']}." for p in PROBLEMS])
  raw = make_bpe_tokenizer(root / "tokenizer", corpus)
  tokenizer = HFTokenizer(str(root / "tokenizer"))
  assert max(len(tokenizer.encode_prompt(p["question"])) for p in PROBLEMS) <= MAX_PROMPT
  # Qwen2's split makes every digit a token; completions of " ", "1" and "2" often end in a lone 1 or 2
  space, one, two = (raw.token_to_id(t) for t in ("\u0120", "1", "2"))  # byte-level " " is U+0120
  model = make_hf_model(root / "model", vocab=tokenizer.vocab_size)
  model = steer_next_tokens(model, root / "model", {space: 11.5, one: 10.0, two: 10.0, tokenizer.eos_id: 8.5})
  # the steering holds on real prompts: most of the next-token mass on those three, a little on EOS
  prompt = np.array([tokenizer.encode_prompt(PROBLEMS[0]["question"])])
  probs = torch.softmax(torch.tensor(torch_logits(model, prompt)[0]), -1).numpy()
  assert probs[:, [space, one, two]].sum(-1).mean() > 0.6 and probs[:, tokenizer.eos_id].mean() < 0.3
  (root / "math_train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
  """The three inputs of a real run: tokenizer directory, Qwen2 checkpoint, JSONL math file."""
  root = _once(tmp_path_factory, "inputs", _write_inputs)
  return types.SimpleNamespace(
      tokenizer_dir=str(root / "tokenizer"), tokenizer=HFTokenizer(str(root / "tokenizer")),
      model_dir=str(root / "model"), data=str(root / "math_train.jsonl"),
      torch_model=transformers.AutoModelForCausalLM.from_pretrained(str(root / "model")).eval())


@pytest.fixture(scope="module")
def run(inputs, tmp_path_factory):
  """The main job on ``inputs`` with configs/qwen2_5_1_5b.py; its workdir and what it wrote."""
  flags = {**OVERRIDES, "model.hf_path": inputs.model_dir, "data.tokenizer_path": inputs.tokenizer_dir,
           "data.path": inputs.data}
  workdir = _once(tmp_path_factory, "run", lambda w: _python(
      "asyncrl_jax.train", f"--config={ROOT}/configs/qwen2_5_1_5b.py", f"--workdir={w}",
      *(f"--config.{k}={v}" for k, v in flags.items()), timeout=600))
  read = lambda name: [json.loads(l) for l in (workdir / name).read_text().splitlines() if l.strip()]
  return types.SimpleNamespace(
      workdir=workdir, metrics=read("metrics.jsonl"), prompts=read("trained_prompts.jsonl"),
      summary=json.loads((workdir / "summary.json").read_text()),
      config=json.loads((workdir / "config.json").read_text()))


@pytest.fixture(scope="module")
def final(run):
  """(model config, params) of the run's last checkpoint, read with plain Orbax (not the export code)."""
  state = ocp.StandardCheckpointer().restore(str(run.workdir / "checkpoints" / str(VERSIONS) / "state"))
  model_config = models.config_of(ml_collections.ConfigDict(run.config))  # the checkpoint's architecture
  return model_config, jax.tree.map(np.asarray, state["params"])


def _export(workdir, out: pathlib.Path) -> None:
  for fmt in ("hf", "orbax"):
    said = _python("asyncrl_jax", "export", f"--workdir={workdir}", f"--format={fmt}",
                   f"--out={out / fmt}", timeout=300)
    assert f"exported policy version {VERSIONS} " in said.stdout, said.stdout


@pytest.fixture(scope="module")
def exports(run, tmp_path_factory):
  """``python -m asyncrl_jax export`` of the run in both formats."""
  out = _once(tmp_path_factory, "exports", lambda o: _export(run.workdir, o))
  return types.SimpleNamespace(hf=out / "hf", orbax=out / "orbax")


@pytest.mark.slow(30)
def test_the_main_job_trains_on_the_jsonl_problems_with_math_verify_rewards(run, inputs):
  assert run.config["model"]["hf_path"] == inputs.model_dir and run.config["data"]["task"] == "jsonl"
  assert run.summary["steps"] == VERSIONS and run.summary["trained_tokens"] > 0
  assert [m["version"] for m in run.metrics] == list(range(1, VERSIONS + 1))
  for m in run.metrics:
    assert 0.0 <= m["reward"] <= 1.0
    assert m["reward"] * BATCH == pytest.approx(round(m["reward"] * BATCH))  # 0/1 per trajectory
    assert m["accuracy"] == pytest.approx(m["reward"]) and m["failed_rollouts"] == 0
  # The completions ("12  2 1", ...) hold no '#': the built-in task's exact-answer reward scores them all
  # 0, so a reward above 0 came from math-verify, and one below 1 means some completions missed.
  assert arithmetic_reward("12  2", "2") == 0.0 and _math_verify("12  2", "2") == 1.0
  mixed = [m for m in run.metrics if 0.0 < m["reward"] < 1.0]
  assert mixed, [m["reward"] for m in run.metrics]
  assert all(m["grad_norm"] > 0 for m in mixed)  # rewards differ within groups: a policy gradient
  steps = sorted(int(p) for p in os.listdir(run.workdir / "checkpoints") if p.isdigit())
  assert steps == list(range(1, VERSIONS + 1))
  # every trained prompt is a problem of the JSONL file, each trained once
  digests = {pipeline.Prompt(0, p["question"], p["answer"], "").digest for p in PROBLEMS}
  assert [r["version"] for r in run.prompts] == list(range(VERSIONS))
  trained = [d for r in run.prompts for d in r["digests"]]
  assert len(trained) == len(set(trained)) == VERSIONS * BATCH // GROUP and set(trained) <= digests
  assert all(len(r["completion_lengths"]) == BATCH for r in run.prompts)
  assert all(0 < n <= MAX_COMPLETION for r in run.prompts for n in r["completion_lengths"])


@pytest.mark.slow(30)
def test_hf_export_loads_in_transformers_with_the_runs_logits(exports, final, inputs):
  model_config, params = final
  assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(
      os.listdir(exports.hf))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(exports.hf)).eval()
  assert type(reloaded).__name__ == "Qwen2ForCausalLM"
  prompt = inputs.tokenizer.encode_prompt(PROBLEMS[1]["question"])
  rng = np.random.default_rng(0)
  tokens = np.stack([prompt, rng.integers(0, model_config.vocab_size, size=len(prompt))]).astype(np.int32)
  ours = np.asarray(models.logits(model_config, params, tokens))
  theirs = torch_logits(reloaded, tokens)
  np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
  # the run trained: the exported model is not the initial one, by far more than the tolerance above
  assert np.abs(torch_logits(inputs.torch_model, tokens) - theirs).max() > 1e-2
  # the exported tokenizer, in transformers, renders the same chat prompt the run trained on
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(exports.hf))
  want = hf_tokenizer.apply_chat_template([{"role": "user", "content": PROBLEMS[1]["question"]}],
                                          add_generation_prompt=True, tokenize=True)
  want = want["input_ids"] if hasattr(want, "keys") else want
  assert list(want) == prompt


@pytest.mark.slow(30)
def test_orbax_export_restores_with_orbax_alone_to_the_runs_final_params(exports, final, inputs):
  model_config, params = final
  restored = ocp.StandardCheckpointer().restore(str(exports.orbax / "params"))  # no target, no project code
  want, got = (jax.tree_util.tree_flatten_with_path(t)[0] for t in (params, restored))
  assert [k for k, _ in got] == [k for k, _ in want]
  for (path, w), (_, g) in zip(want, got):
    np.testing.assert_array_equal(np.asarray(g), w, err_msg=jax.tree_util.keystr(path))
  described = json.loads((exports.orbax / "model_config.json").read_text())
  assert described["vocab_size"] == inputs.tokenizer.vocab_size == model_config.vocab_size
  # and the parameters are not the checkpoint the run started from
  _, initial = models.load_hf(inputs.model_dir)
  diffs = [float(np.abs(np.asarray(a) - b).max())
           for a, b in zip(jax.tree.leaves(initial), jax.tree.leaves(params))]
  assert min(diffs) > 0 and max(diffs) > 1e-3, diffs


def _decode_text(stub, text: str, max_tokens: int):
  request = jetstream_pb2.DecodeRequest(text_content=jetstream_pb2.DecodeRequest.TextContent(text=text),
                                        max_tokens=max_tokens)
  tokens, pieces = [], []
  for response in stub.Decode(request, timeout=120):
    for sample in response.stream_content.samples:
      tokens.extend(sample.token_ids)
      pieces.append(sample.text)
  return tokens, "".join(pieces)


@pytest.mark.slow(30)
@pytest.mark.parametrize("fmt", ["hf", "orbax"])
def test_serve_on_each_export_gives_our_greedy_tokens(exports, final, inputs, fmt):
  import grpc  # pylint: disable=import-outside-toplevel
  import portpicker  # pylint: disable=import-outside-toplevel
  model_config, params = final
  port = portpicker.pick_unused_port()
  # the HF export holds the tokenizer (serve finds its tokenizer.json); the Orbax one is params only
  tokenizer = [] if fmt == "hf" else [f"--tokenizer={inputs.tokenizer_dir}"]
  server = subprocess.Popen([sys.executable, "-m", "asyncrl_jax", "serve",
                             f"--checkpoint={getattr(exports, fmt)}", *tokenizer,
                             f"--port={port}", "--slots=2", "--max_prefill_length=32",
                             "--max_target_length=64"],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
      grpc.channel_ready_future(channel).result(timeout=180)
    except grpc.FutureTimeoutError:
      server.kill()
      pytest.fail("serve did not come up: " + server.communicate()[0][-3000:])
    question, n = PROBLEMS[2]["question"], 12
    got, text = _decode_text(jetstream_pb2_grpc.OrchestratorStub(channel), question, max_tokens=n)
    channel.close()
  finally:
    server.terminate()
    server.wait(timeout=30)
  # the reference: our fused greedy loop on the run's final params (it never reads the export)
  prompt = inputs.tokenizer.encode_prompt(question)  # the chat template, as the run's prompts
  padded = np.array([prompt + [inputs.tokenizer.pad_id] * (MAX_PROMPT - len(prompt))], np.int32)
  tokens, lengths = greedy_generate(model_config, params, padded, np.array([len(prompt)], np.int32),
                                    max_new_tokens=n + 1, eos_id=inputs.tokenizer.eos_id)
  want = [int(t) for t in np.asarray(tokens)[0, :int(lengths[0])] if t != inputs.tokenizer.eos_id]
  assert len(want) > 3, want  # a real sequence, not an immediate EOS
  assert got == want[:n]
  assert text == inputs.tokenizer.decode(want[:n])


@pytest.mark.slow(30)
def test_jsonl_math_files_in_the_problem_layout_import(tmp_path):
  data = tmp_path / "math_train.jsonl"
  data.write_text("".join(json.dumps({"problem": p["question"], "answer": p["answer"]}) + "\n"
                          for p in PROBLEMS))
  config = config_lib.base_config()
  config.data.update(task="jsonl", path=str(data))
  builder = builder_lib.from_config(config, str(tmp_path))
  got = sorted(r["question"] for r in pipeline.read_split(builder, "train"))
  assert got == sorted(p["question"] for p in PROBLEMS)
