"""Tiny random Hugging Face checkpoints and tokenizers written by the tests themselves (no hub access)."""

import json
import os

import numpy as np
import tokenizers
import torch
import transformers
from tokenizers import decoders, normalizers, pre_tokenizers, trainers
from tokenizers import models as tok_models


def make_hf_model(path, *, arch="qwen2", tie=False, vocab=97, hidden=64, inter=96, layers=2, heads=8,
                  kv_heads=2, rope_theta=5000.0, dtype=torch.float32, seed=0):
  """Saves a randomly initialised model with non-trivial norms and biases; returns the torch model."""
  torch.manual_seed(seed)
  common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                tie_word_embeddings=tie, rope_theta=rope_theta, rms_norm_eps=1e-6)
  if arch == "qwen2":
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
  else:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.3 * torch.randn_like(p))
      elif "bias" in name:
        p.normal_(0.0, 0.3)
      else:
        p.normal_(0.0, 0.15)
  model = model.to(dtype).eval()
  model.save_pretrained(str(path))
  return model


def torch_logits(model, tokens):
  with torch.no_grad():
    out = model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits
  return out.float().numpy()


# Qwen2.5's chat layout (im_start / im_end turns, a default system turn), shortened system prompt.
QWEN_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + "
    "'<|im_end|>\n' }}{%- else %}{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{%- endif %}{%- for message in messages %}{%- if message['role'] != 'system' %}{{- '<|im_start|>' + "
    "message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Qwen2's pre-tokenizer split, as transformers' Qwen2Tokenizer rebuilds it whatever tokenizer.json says:
# every digit alone, words with their leading space
QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
              r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


def make_bpe_tokenizer(path, corpus, *, vocab_size=384):
  """Writes a byte-level BPE ``tokenizer.json`` laid out as Qwen2's (NFC, Qwen2's split, byte-level;
  its special tokens are ids 0-2) trained on ``corpus``, and a ``tokenizer_config.json`` with
  ``QWEN_CHAT_TEMPLATE``; returns the ``tokenizers.Tokenizer`` (at most ``vocab_size`` tokens: fewer
  when the corpus has fewer merges to learn)."""
  tok = tokenizers.Tokenizer(tok_models.BPE())
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(QWEN_SPLIT), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(QWEN_SPECIAL_TOKENS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator(corpus, trainer=trainer)
  os.makedirs(path, exist_ok=True)
  tok.save(os.path.join(str(path), "tokenizer.json"))
  with open(os.path.join(str(path), "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>",
               "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": QWEN_CHAT_TEMPLATE}, f)
  return tok


def steer_next_tokens(model, path, offsets, *, strength=64.0):
  """Adds ``offsets`` (token id -> logit) to the next-token logits at every position, give or take the
  random network's own logits, and saves ``model`` to ``path`` again; returns it.

  Hidden unit 0 becomes a constant channel: every embedding holds ``strength`` there, no block reads it
  (its norm weights are 0) or writes it (row 0 of ``o_proj`` and ``down_proj`` is 0), and the other
  norm weights are scaled by ``strength / sqrt(hidden)`` to undo the share of the RMS it takes. After
  the final norm it is ~sqrt(hidden) everywhere, and ``lm_head`` column 0 turns it into ``offsets``.
  The other embedding units are tripled and ``lm_head``'s other columns halved, so the network's own
  logits (a few units, varying with the tokens) stay below the offsets but still pick among them.
  """
  hidden = model.config.hidden_size
  gain = strength / hidden ** 0.5
  with torch.no_grad():
    embed = model.model.embed_tokens.weight
    embed[:, 1:] *= 3.0
    embed[:, 0] = strength
    norms = [model.model.norm]
    for layer in model.model.layers:
      norms += [layer.input_layernorm, layer.post_attention_layernorm]
      layer.self_attn.o_proj.weight[0, :] = 0.0
      layer.mlp.down_proj.weight[0, :] = 0.0
    for norm in norms:
      norm.weight[1:] *= gain
      norm.weight[0] = 0.0
    model.model.norm.weight[0] = 1.0  # the final norm passes the constant on to lm_head
    head = model.lm_head.weight
    head[:, 1:] *= 0.5
    head[:, 0] = 0.0
    for token, offset in offsets.items():
      head[token, 0] = offset / hidden ** 0.5
  model.save_pretrained(str(path))
  return model
