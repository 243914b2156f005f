"""The house's rules, checked on the source: roles are folders, the top level stays small, imports run
one way (each module imports from its own layer or below; the controller, the learner and the rollout
never import one another; ``weights`` imports neither), and no modules import each other in a loop,
function-local imports included. ``docs/architecture.md`` states the same rule."""

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "asyncrl_jax")

# bottom to top; a module may import from its own layer or any layer below
LAYERS = [
    {"infra"},
    {"models", "tokenization", "data", "weights"},
    {"config", "config_schema", "cli"},
    {"rl", "envs"},
    {"controller", "learner", "rollout"},
    {"train", "sft"},
    {"tools", "tpu", "sim", "__main__"},
]
SIBLINGS_APART = {"controller", "learner", "rollout"}  # never import one another


def _modules() -> dict[str, str]:
  """Dotted module name -> file path, for every module of the package."""
  out = {}
  for folder, _, files in os.walk(ROOT):
    for f in files:
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(folder, f), os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
        out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(folder, f)
  return out


def _imports(path: str, modules) -> set[str]:
  """The package's modules that the file imports, anywhere in it (function-local imports too)."""
  out = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      # ``from pkg import submodule`` depends on the submodule; ``from pkg import name``, on pkg
      names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
               for a in node.names]
    else:
      continue
    for name in names:
      while name and name not in modules:
        name = name.rpartition(".")[0]
      if name and name != "asyncrl_jax":
        out.add(name)
  return out


@pytest.fixture(scope="module")
def graph():
  modules = _modules()
  return {m: _imports(p, modules) - {m} for m, p in modules.items()}


def _part(module: str) -> str:
  return module.split(".")[1] if module.count(".") else ""


def _layer(module: str) -> int:
  for i, parts in enumerate(LAYERS):
    if _part(module) in parts:
      return i
  raise AssertionError(f"{module}: its folder {_part(module)!r} has no layer in tests/test_layout.py")


def test_the_top_level_holds_at_most_six_modules():
  top = sorted(f for f in os.listdir(ROOT) if f.endswith(".py") and f != "__init__.py")
  assert len(top) <= 6, top


def test_imports_run_one_way(graph):
  wrong = []
  for module, imported in sorted(graph.items()):
    if module == "asyncrl_jax":
      continue
    for other in sorted(imported):
      a, b = _part(module), _part(other)
      if _layer(other) > _layer(module) or (a != b and {a, b} <= SIBLINGS_APART):
        wrong.append(f"{module} -> {other}")
  assert not wrong, "imports against the dependency rule:\n" + "\n".join(wrong)


def _cycles(graph) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_no_modules_import_each_other_in_a_loop(graph):
  assert _cycles(graph) == []


def _packages(graph) -> dict[str, set]:
  """The import graph between the package's folders (a folder's modules importing another's)."""
  out = {}
  for module, imported in graph.items():
    out.setdefault(_part(module), set()).update(_part(o) for o in imported)
  return {p: deps - {p} for p, deps in out.items()}


def test_no_packages_import_each_other_in_a_loop(graph):
  """Within a layer imports may go either way between modules, but two folders that import each
  other (even through different modules) are one concept split in two."""
  assert _cycles(_packages(graph)) == []


def test_the_checks_see_a_loop_and_a_wrong_way_import():
  """Negative control: a made-up graph with a loop and an upward import is caught."""
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
  # two folders importing each other through different modules: no module loop, a package loop
  modules = {"asyncrl_jax.tools.info": {"asyncrl_jax.tpu.compile"}, "asyncrl_jax.tpu.compile": set(),
             "asyncrl_jax.tpu.other": {"asyncrl_jax.tools.memory"}, "asyncrl_jax.tools.memory": set()}
  assert _cycles(modules) == [] and _cycles(_packages(modules)) == [["tools", "tpu"]]
  assert _layer("asyncrl_jax.rollout.engine") > _layer("asyncrl_jax.rl.losses")
  assert _layer("asyncrl_jax.infra.paths") < _layer("asyncrl_jax.models.api")
