"""docs/configuration.md's field reference is what ``tools/config_doc.py`` generates from the schema
today, and it names every field of ``base_config()``."""

import os

from asyncrl_jax import config_schema
from asyncrl_jax.tools import config_doc


def _flat(section, prefix=""):
  for key, value in section.items():
    if hasattr(value, "items"):
      yield from _flat(value, f"{prefix}{key}.")
    else:
      yield prefix + key


def test_the_document_holds_the_current_reference():
  with open(config_doc.DOC) as f:
    text = f.read()
  reference = config_doc.render()
  assert reference in text, ("docs/configuration.md is out of date: run "
                             "python -m asyncrl_jax.tools.config_doc --write")
  assert config_doc.updated(text, reference) == text  # (rewriting changes nothing)


def test_every_field_is_in_the_reference_with_its_meaning_where_the_schema_gives_one():
  reference = config_doc.render()
  fields = list(_flat(config_schema.base_config()))
  assert len(fields) > 100
  missing = [f for f in fields if f"`{f}`" not in reference]
  assert not missing
  assert "| `rl.max_staleness`" not in reference  # (it shares a line with rl.loss and its comment)
  assert "`rl.loss`, `rl.max_staleness`" in reference
  assert "| `learner.batch_size` | `32` | trajectories per policy update (B in the staleness bound) |" in reference


def test_a_changed_schema_makes_the_document_out_of_date():
  """Negative control: a field added to the schema's source is not in today's document."""
  with open(config_schema.__file__) as f:
    source = f.read()
  line = next(l for l in source.splitlines() if l.strip().startswith("batch_size=32,"))
  changed = source.replace(line, line + "\n      new_field=7,  # a field added")
  assert changed != source
  reference = config_doc.render(changed)
  assert "`learner.new_field` | `7` | a field added |" in reference
  with open(config_doc.DOC) as f:
    assert reference not in f.read()
