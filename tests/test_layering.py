"""The package's layering, read from the source with `ast` (nothing is imported).

Two rules:

  Honest names: no module of flax_mha/ or experiments/ imports an underscore name of another
  module (`from m import _x`), reaches one through an imported name (`m._x`), or imports a
  module whose name starts with an underscore from outside that module's own package folder.
  What several modules use is public internal API under a name that says what it is. The
  same holds for JAX's private API, but for the reaches that have no public spelling, each
  listed in JAX_PRIVATE.

  Direction: what the docstring of `flax_mha/__init__.py` states. The top-level modules
  (the pure API) and flax_mha/kernels/ load no flax and import nothing from flax_mha.nn,
  flax_mha.models or experiments; flax_mha/nn/ imports nothing from flax_mha.models or
  experiments, and `flax_mha.nn.shared` imports no flax at all; flax_mha/models/ imports nothing
  from experiments. experiments/ may import anything.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIRST_PARTY = ("flax_mha", "experiments")


def _modules():
  """{dotted module name: path} for every .py file under flax_mha/ and experiments/."""
  out = {}
  for top in FIRST_PARTY:
    for path in sorted((ROOT / top).rglob("*.py")):
      parts = path.relative_to(ROOT).with_suffix("").parts
      out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


MODULES = _modules()


# The reaches into JAX's private API that have no public spelling, each named here so that a new
# one is a decision: a custom `jax.config` state (flax_mha.platforms, flax_mha.cache) and the
# base class of splash's mask functions (flax_mha.kernels.splash).
JAX_PRIVATE = frozenset({
    "jax._src.config",
    "splash_lib.splash_attention_mask._ComputableMask",
})


def _private(name: str) -> bool:
  return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _package(module: str, path: pathlib.Path) -> str:
  """The package folder a module lives in (a package's own __init__ lives in itself)."""
  return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _imports(tree: ast.AST, at_load: bool = True):
  """(node, imported dotted name, runs at load?) for every import, with `from m import x` giving
  `m.x` (a submodule or a name of m: both are reaches into m). An import inside a function runs
  when the function is called, not when the module loads."""
  for node in ast.iter_child_nodes(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield node, alias.name, at_load
    elif isinstance(node, ast.ImportFrom):
      assert node.level == 0, "relative imports: the rules below read absolute names"
      for alias in node.names:
        yield node, f"{node.module}.{alias.name}", at_load
    else:
      inner = at_load and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
      yield from _imports(node, inner)


def honest_names_violations(module: str, path: pathlib.Path, source: str) -> list[str]:
  """What `module` (at `path`, text `source`) breaks of the honest-names rule."""
  tree = ast.parse(source, str(path))
  where = lambda node: f"{path.relative_to(ROOT)}:{node.lineno}"
  bad, bound = [], set()
  for node, name, _ in _imports(tree):
    parts = name.split(".")
    if name not in MODULES and isinstance(node, ast.ImportFrom) and _private(parts[-1]):
      bad.append(f"{where(node)}: imports the underscore name {name}")
      parts = parts[:-1]  # the module it comes from is checked below
    for i, part in enumerate(parts):  # a private module: only from its own package folder
      owner = ".".join(parts[:i])
      if _private(part) and owner != _package(module, path) and name not in JAX_PRIVATE:
        bad.append(f"{where(node)}: imports {name}, private to {owner}")
        break
    for alias in node.names:
      bound.add((alias.asname or alias.name).split(".")[0])
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and _private(node.attr):
      root = node.value
      while isinstance(root, ast.Attribute):
        root = root.value
      reach = ast.unparse(node)
      if isinstance(root, ast.Name) and root.id in bound and reach not in JAX_PRIVATE:
        bad.append(f"{where(node)}: reaches {reach} of an imported module")
  return bad


def _layer(module: str) -> str:
  """api (the top-level modules), kernels, nn, models, experiments, or the third-party root."""
  parts = module.split(".")
  if parts[0] == "flax_mha":
    return parts[1] if len(parts) > 1 and parts[1] in ("kernels", "nn", "models") else "api"
  return parts[0]


# layer -> (layers it never imports, layers it never imports at module level)
FORBIDDEN = {
    "api": ({"nn", "models", "experiments"}, {"flax"}),
    "kernels": ({"nn", "models", "experiments"}, {"flax"}),
    "nn": ({"models", "experiments"}, set()),
    "models": ({"experiments"}, set()),
    "experiments": (set(), set()),
}
NO_FLAX_AT_ALL = ("flax_mha.nn.shared",)  # flax_mha/nn/__init__.py: "which imports no flax"


def direction_violations(module: str, path: pathlib.Path, source: str) -> list[str]:
  """What `module` breaks of the import direction that flax_mha/__init__.py states."""
  tree = ast.parse(source, str(path))
  never, not_at_load = FORBIDDEN[_layer(module)]
  if module in NO_FLAX_AT_ALL:
    never = never | {"flax"}
  bad = []
  for node, name, at_load in _imports(tree):
    target = _layer(name)
    if target in never or (at_load and target in not_at_load):
      bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {_layer(module)} module {module} "
                 f"imports {name}{' at load' if target in not_at_load else ''}")
  return bad


def _path(module: str) -> pathlib.Path:
  return MODULES.get(module, ROOT / (module.replace(".", "/") + ".py"))


@pytest.mark.parametrize("check", [honest_names_violations, direction_violations],
                         ids=["honest_names", "direction"])
def test_package_follows_the_rule(check):
  assert len(MODULES) > 50, "the walk found too few modules: is ROOT right?"
  bad = [line for module, path in MODULES.items()
         for line in check(module, path, path.read_text())]
  assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module, source, check", [
    ("flax_mha.kernels.xla", "from flax_mha.mods import _pytree\n", honest_names_violations),
    ("flax_mha.kernels.xla", "from flax_mha import mods\nmods._pytree\n",
     honest_names_violations),
    ("flax_mha.kernels.xla", "import flax_mha.mods\nflax_mha.mods._pytree\n",
     honest_names_violations),
    ("experiments.bench.ring", "from flax_mha.kernels import _layouts\n",
     honest_names_violations),
    ("flax_mha.attention", "from flax_mha.kernels._layouts import order\n",
     honest_names_violations),
    ("flax_mha.attention", "from jax._src import core\n", honest_names_violations),
    ("flax_mha.attention", "import jax\njax._src.core\n", honest_names_violations),
    ("flax_mha.attention", "from flax_mha.nn import linen\n", direction_violations),
    ("flax_mha.kernels.xla", "from flax_mha.models import lm\n", direction_violations),
    ("flax_mha.kernels.xla", "import flax.linen as nn\n", direction_violations),
    ("flax_mha.nn.linen", "def f():\n  from flax_mha.models import lm\n", direction_violations),
    ("flax_mha.nn.shared", "def f():\n  import flax\n", direction_violations),
    ("flax_mha.models.lm", "import experiments.train\n", direction_violations),
])
def test_a_violation_is_caught(module, source, check):
  """Each rule fails on a file that breaks it (the checks above are not vacuous)."""
  path = _path(module)
  assert check(module, path, source)


@pytest.mark.parametrize("module, source, check", [
    # a private module, imported from its own package folder
    ("flax_mha.kernels.seqmods", "from flax_mha.kernels._layouts import order\n",
     honest_names_violations),
    ("flax_mha.kernels", "import flax_mha.kernels._layouts\n", honest_names_violations),
    ("flax_mha.remat", "def f():\n  import flax.linen\n", direction_violations),
    ("experiments.train", "from flax_mha.models import lm\nimport flax\n", direction_violations),
    ("flax_mha.mods", "x = object()\nx._hidden\n", honest_names_violations),
])
def test_what_is_allowed_passes(module, source, check):
  path = _path(module)
  assert not check(module, path, source)
