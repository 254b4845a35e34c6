"""The package's layering, read from the source with `ast` (nothing is imported).

Two rules:

  Honest names: no module of flax_mha/ or experiments/ imports an underscore name of another
  module (`from m import _x`), reaches one through an imported name (`m._x`), or imports a
  module whose name starts with an underscore from outside that module's own package folder.
  What several modules use is public internal API under a name that says what it is. The
  same holds for JAX's private API, but for the reaches that have no public spelling, each
  listed in JAX_PRIVATE.

  Direction: what the docstring of `flax_mha/__init__.py` states, read from it. Its rooms
  (sets of top-level modules, or folders) are ordered bottom first; every import of a module,
  at load or inside a function, reaches its own room or one before it, and the graph of
  imports between modules has no circle. Every module is in a room, and the top level holds
  at most 12 modules. The rooms up to cache/ load no flax, `flax_mha.nn.shared` none at all,
  and nothing in flax_mha/ imports experiments/.
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


def rooms(package_doc: str) -> list[tuple[str, ...]]:
  """The rooms of flax_mha/__init__.py's docstring, bottom first: each a folder ('kernels/') or
  top-level modules ('attention', 'remat'); a line of two spaces then the room, the rest of
  the line (after two spaces) or the lines indented further its description."""
  block = package_doc.split("reads this list):", 1)[1].split("\n\n", 2)[1]
  out = []
  for line in block.splitlines():
    if line.startswith("  ") and not line.startswith("   "):
      out.append(tuple(name.strip() for name in line.strip().split("  ")[0].split(",")))
  return out


ROOMS = rooms(ast.get_docstring(ast.parse((ROOT / "flax_mha" / "__init__.py").read_text())))


def room(module: str, room_list=ROOMS) -> float:
  """The index of `module`'s room (the root package flax_mha itself, which re-exports the API,
  above every room of the package and below experiments/); a KeyError for a module of no
  room."""
  parts = module.split(".")
  for i, names in enumerate(room_list):
    for name in names:
      if name.endswith("/"):
        folder = ["experiments"] if name == "experiments/" else ["flax_mha", name[:-1]]
        if parts[:len(folder)] == folder:
          return i
      elif parts == ["flax_mha", name]:
        return i
  if module == "flax_mha":
    return len(room_list) - 1.5
  raise KeyError(f"{module} is in no room of flax_mha/__init__.py's list")


def resolve(name: str, modules=MODULES) -> str:
  """The first-party module an imported dotted name reaches (`flax_mha.cache.KVCache` ->
  `flax_mha.cache`), or '' for a third-party one."""
  while name and name not in modules:
    name = name.rpartition(".")[0]
  return name


def graph(sources: dict[str, str], modules=MODULES) -> dict[str, set[str]]:
  """module -> the first-party modules it imports (at load or inside a function): the module a
  dotted name reaches, a package where the name is one of its own (`from flax_mha.cache import
  KVCache` is an arrow to the package, which loads every module it re-exports from)."""
  edges = {}
  for module, source in sources.items():
    targets = {resolve(name, modules) for _, name, _ in _imports(ast.parse(source))}
    edges[module] = {t for t in targets if t and t != module}
  return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
  """Every strongly connected set of more than one module (Tarjan), each a circle of imports."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(edges.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return found


def upward(edges: dict[str, set[str]], room_list=ROOMS) -> list[str]:
  """Every arrow from a module to one of a later room (or to the root package from inside it)."""
  bad = []
  for module, targets in sorted(edges.items()):
    for target in sorted(targets):
      inside = module.startswith("flax_mha.") and target == "flax_mha"
      if inside or room(target, room_list) > room(module, room_list):
        bad.append(f"{module} imports {target}, a room up")
  return bad


NO_FLAX_ROOMS = 6  # the rooms up to cache/ load no flax (the docstring)
NO_FLAX_AT_ALL = ("flax_mha.nn.shared",)  # flax_mha/nn/__init__.py: "which imports no flax"


def direction_violations(module: str, path: pathlib.Path, source: str) -> list[str]:
  """What `module` breaks of the flax rules the docstring states: the rooms up to cache/ load
  no flax, `nn.shared` none at all, and nothing in flax_mha/ imports experiments/."""
  tree = ast.parse(source, str(path))
  bad = []
  for node, name, at_load in _imports(tree):
    where = f"{path.relative_to(ROOT)}:{node.lineno}"
    top = name.split(".")[0]
    if top == "flax" and ((at_load and room(module) < NO_FLAX_ROOMS) or module in NO_FLAX_AT_ALL):
      bad.append(f"{where}: {module} imports {name}{' at load' if at_load else ''}")
    if top == "experiments" and module.startswith("flax_mha"):
      bad.append(f"{where}: {module} imports {name} (experiments/ sits beside the package)")
  return bad


def _sources() -> dict[str, str]:
  return {module: path.read_text() for module, path in MODULES.items()}


def test_every_module_is_in_a_room_and_the_rooms_are_the_docstring_s():
  assert [names[0] for names in ROOMS][:3] == ["checks", "kernels/", "dispatch"], ROOMS
  assert ROOMS[-1] == ("experiments/",) and ("cache/",) in ROOMS
  assert NO_FLAX_ROOMS == ROOMS.index(("cache/",)) + 1
  for module in MODULES:
    room(module)  # a KeyError names a module of no room
  top_level = [m for m in MODULES if m.count(".") == 1 and m.startswith("flax_mha.")
               and not (ROOT / m.replace(".", "/")).is_dir()]
  assert len(top_level) <= 12, top_level


def test_the_import_graph_has_no_circle_and_no_upward_arrow():
  edges = graph(_sources())
  assert not circles(edges), circles(edges)
  assert not upward(edges), "\n".join(upward(edges))


@pytest.mark.parametrize("module, source", [
    ("flax_mha.cache.kv", "from flax_mha.cache import entry\n"),  # entry imports kv: a circle
    ("flax_mha.dispatch", "def f():\n  from flax_mha.parallel import ring\n"),  # ring: dispatch
    ("flax_mha.kernels.registry", "from flax_mha import dispatch\n"),  # dispatch: registry
    ("flax_mha.cache.steps", "from flax_mha.cache import KVCache\n"),  # the package: entry
])
def test_a_circle_is_caught(module, source):
  """A circle through an import inside a function counts (steps.explain once made one)."""
  sources = dict(_sources(), **{module: source})
  assert circles(graph(sources))


@pytest.mark.parametrize("module, source", [
    ("flax_mha.kernels.xla", "from flax_mha.parallel import seq_parallel\n"),
    ("flax_mha.kernels", "from flax_mha.parallel import seq_parallel\n"),
    ("flax_mha.dispatch", "def f():\n  from flax_mha import attention\n"),
    ("flax_mha.nn.linen", "from flax_mha.models import lm\n"),
    ("flax_mha.masks", "import flax_mha\n"),
])
def test_an_upward_arrow_is_caught(module, source):
  sources = dict(_sources(), **{module: source})
  assert upward(graph(sources))


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
    ("flax_mha.kernels.xla", "import flax.linen as nn\n", direction_violations),
    ("flax_mha.cache.kv", "import flax\n", direction_violations),
    ("flax_mha.nn.shared", "def f():\n  import flax\n", direction_violations),
    ("flax_mha.models.lm", "import experiments.train\n", direction_violations),
])
def test_a_violation_is_caught(module, source, check):
  """Each rule fails on a file that breaks it (the checks above are not vacuous)."""
  path = _path(module)
  assert check(module, path, source)


@pytest.mark.parametrize("module, source, check", [
    # a private module, imported from its own package folder
    ("flax_mha.kernels.tiling", "from flax_mha.kernels._layouts import order\n",
     honest_names_violations),
    ("flax_mha.kernels", "import flax_mha.kernels._layouts\n", honest_names_violations),
    ("flax_mha.remat", "def f():\n  import flax.linen\n", direction_violations),
    ("experiments.train", "from flax_mha.models import lm\nimport flax\n", direction_violations),
    ("flax_mha.mods", "x = object()\nx._hidden\n", honest_names_violations),
])
def test_what_is_allowed_passes(module, source, check):
  path = _path(module)
  assert not check(module, path, source)


TESTS = ROOT / "tests"


def taken_from_test_files(source: str, test_files: set[str]) -> list[str]:
  """The underscore names a test file's `source` takes from another test file: imported (`from
  test_x import _y`) or reached (`import test_x as unit; unit._y`)."""
  tree = ast.parse(source)
  bad, aliases = [], {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module in test_files:
      bad += [f"{node.module}.{a.name}" for a in node.names if _private(a.name)]
    elif isinstance(node, ast.Import):
      aliases.update({a.asname or a.name: a.name for a in node.names if a.name in test_files})
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in aliases and _private(node.attr)):
      bad.append(f"{aliases[node.value.id]}.{node.attr}")
  return bad


def test_no_test_file_takes_another_s_underscore_names():
  """What several test files share is public in the file that defines it (or in helpers.py)."""
  test_files = {p.stem for p in TESTS.rglob("test_*.py")}
  bad = {str(p.relative_to(ROOT)): taken_from_test_files(p.read_text(), test_files)
         for p in TESTS.rglob("*.py")}
  assert not {k: v for k, v in bad.items() if v}
  planted = ("from test_serving import _lm\n", "import test_cache as unit\nunit._front_end\n")
  assert all(taken_from_test_files(source, test_files) for source in planted)
