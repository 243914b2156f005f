"""Tiny random Hugging Face checkpoints written by the tests themselves (no hub access)."""

import numpy as np
import torch
import transformers


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
