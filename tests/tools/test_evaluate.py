"""``python -m asyncrl_jax eval`` on an export: the accuracy a hand count gives, and bad data files named."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl_jax import models

from asyncrl_jax.tokenization import load_tokenizer
from asyncrl_jax.tools import evaluate as eval_cli
from asyncrl_jax.tools.export import write_orbax

CFG = models.ModelConfig(vocab_size=17, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, max_seq_len=128)
NEW_TOKENS = 7


def _always_sevens(config):
  """Weights whose every next token is '7', whatever the prompt: every embedding is the same vector,
  attention and MLP add nothing to the residual stream, and only '7''s output row reads it."""
  params = jax.device_get(models.init_params(config, jax.random.key(0)))
  seven = load_tokenizer("").encode("7")[0]
  params["embed"] = np.ones_like(params["embed"])
  for name, layer in params.items():
    if name.startswith("layer_"):
      layer["attn"]["o"] = np.zeros_like(layer["attn"]["o"])
      layer["mlp"]["down"] = np.zeros_like(layer["mlp"]["down"])
  head = np.zeros_like(params["lm_head"])
  head[:, seven] = 10.0
  params["lm_head"] = head
  return params


def test_eval_gives_the_hand_counted_accuracy(tmp_path):
  params = _always_sevens(CFG)
  tokens = np.asarray(load_tokenizer("").encode_prompt("1+2"))[None]
  logits = np.asarray(models.logits(CFG, params, jnp.asarray(tokens)))
  assert (logits[0].argmax(-1) == load_tokenizer("").encode("7")[0]).all()  # the construction holds
  write_orbax(CFG, params, str(tmp_path / "export"))
  # every completion is "7777777": 2 of the 5 answers are that number, so greedy and pass@1 are 2/5
  answers = ["7777777", "12", "7777777", "7", "77777770"]
  data = tmp_path / "problems.jsonl"
  data.write_text("".join(json.dumps({"problem": f"{i}+{i}", "answer": a}) + "\n" for i, a in enumerate(answers)))
  result = eval_cli.evaluate_export(str(tmp_path / "export"), eval_cli.read_problems(str(data)), samples=3,
                                    max_prompt_len=16, max_new_tokens=NEW_TOKENS, reward="math")
  assert result["problems"] == 5 and result["samples"] == 3
  assert result["greedy_accuracy"] == pytest.approx(0.4)
  assert result["pass_at_1"] == pytest.approx(0.4)


def test_problem_files_in_both_layouts_and_bad_ones_named(tmp_path):
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  pq.write_table(pa.table({"problem": ["1+1", "2+2"], "answer": ["2", "4"]}), str(tmp_path / "p.parquet"))
  assert eval_cli.read_problems(str(tmp_path / "p.parquet")) == [
      {"question": "1+1", "answer": "2"}, {"question": "2+2", "answer": "4"}]
  (tmp_path / "q.jsonl").write_text('{"question": "3+3", "answer": 6}\n\n{"question": "1", "answer": "1"}\n')
  assert eval_cli.read_problems(str(tmp_path / "q.jsonl"), limit=1) == [{"question": "3+3", "answer": "6"}]
  (tmp_path / "bad.jsonl").write_text('{"problem": "1+1"}\n')
  with pytest.raises(ValueError, match=r"record 1 needs 'problem' \(or 'question'\) and 'answer'"):
    eval_cli.read_problems(str(tmp_path / "bad.jsonl"))
  (tmp_path / "broken.jsonl").write_text('{"problem": \n')
  with pytest.raises(ValueError, match="broken.jsonl:1: not JSON"):
    eval_cli.read_problems(str(tmp_path / "broken.jsonl"))
  with pytest.raises(ValueError, match="expected a .jsonl or .parquet"):
    (tmp_path / "x.csv").write_text("a,b\n")
    eval_cli.read_problems(str(tmp_path / "x.csv"))
