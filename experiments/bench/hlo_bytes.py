"""Bytes in a compiled XLA program, read from its HLO text, loops counted by their trips
(`known_trip_count` of the `while` ops):
- `collective_bytes`: what one device receives in an (optimised, SPMD-partitioned) program,
  each collective's result size, as much of it as comes from other devices of its group;
- `hlo_counts`: XLA:CPU's instructions by kind (products, transposes, copies, slices, ...) and
  the bytes each kind writes per call (experiments.bench.modules' `--part hlo`)."""

from __future__ import annotations

import re

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
# collective -> the share of its result (size r) that crosses devices, for groups of n: an
# all-gather or all-to-all keeps its own 1/n, a permute receives all of it, a reduce-scatter
# receives n - 1 partial results of its size, a (ring) all-reduce 2(n - 1)/n.
_RECEIVED = {"all-gather": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
             "collective-permute": lambda n: 1.0, "reduce-scatter": lambda n: n - 1.0,
             "all-reduce": lambda n: 2 * (n - 1) / n}
_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{$")
_OP = re.compile(r"= (.*?) (" + "|".join(_RECEIVED) + r")(?:-start)?\(")
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)="
                    r"%([\w.\-]+)|branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# replica_groups={{0,1},{2,3}} (listed) or replica_groups=[2,4]<=[8] (iota: 2 groups of 4).
_GROUPS = re.compile(r"replica_groups=(?:\{\{([^}]*)\}|\[\d+,(\d+)\]<=)")


def _size(types: str) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(types):
    count = 1
    for d in filter(None, dims.split(",")):
      count *= int(d)
    total += count * _BYTES[dtype]
  return total


def _group_size(line: str, n: int) -> int:
  """The devices in each replica group of the collective on `line` (n where none are listed);
  a group of one (XLA leaves such all-reduces in) receives nothing."""
  groups = _GROUPS.search(line)
  if groups is None:
    return n
  listed, iota = groups.groups()
  return len(listed.split(",")) if listed is not None else int(iota)


def collective_bytes(hlo: str, n: int) -> float:
  """Bytes a device receives over all collectives of `hlo` (a compiled program's `as_text()`)
  among n devices (or the replica groups a collective names), loops unrolled by their known
  trip counts (1 where unknown)."""
  comp, own, calls = None, {}, {}  # computation -> its bytes; caller -> [(callee, trips)]
  for line in hlo.splitlines():
    header = _HEADER.match(line)
    if header:
      comp = header.group(1)
      own[comp], calls[comp] = 0.0, []
      continue
    if comp is None:
      continue
    op = _OP.search(line)
    if op and not op.group(2).endswith("-done"):
      own[comp] += _size(op.group(1)) * _RECEIVED[op.group(2)](_group_size(line, n))
    trips = _TRIPS.search(line)
    for single, branches in _CALLS.findall(line):
      for callee in ([single] if single else re.findall(r"%([\w.\-]+)", branches)):
        is_body = f"body=%{callee}" in line
        calls[comp].append((callee, int(trips.group(1)) if trips and is_body else 1))
  entry = next(m.group(1) for m in map(_HEADER.match, hlo.splitlines())
               if m and m.string.startswith("ENTRY"))

  def total(name: str) -> float:
    return own.get(name, 0.0) + sum(trips * total(callee) for callee, trips in calls.get(name, ()))

  return total(entry)


def _computations(text: str) -> dict[str, list[str]]:
  """name -> instruction lines of each computation in compiled HLO text ('ENTRY' the entry)."""
  comps, name = {}, None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      name = "ENTRY" if line.startswith("ENTRY") else header.group(1)
      comps[name] = []
    elif name and " = " in line:
      comps[name].append(line)
  return comps


_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][\w\-]*)\((.*)$")
BOOKKEEPING = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}  # no data moved


def _bytes(shape: str) -> int:
  """Bytes of an array shape 'f32[8,512]{1,0}' (0 for tuples and tokens)."""
  return _size(shape) if re.fullmatch(r"\w+\[[\d,]*\](\{.*\})?", shape) else 0


def _callee(line: str, key: str = "calls") -> str:
  """The computation an instruction's `key=%name` names (a fusion's calls, a loop's body)."""
  return re.search(key + r"=%([\w.\-]+)", line).group(1)


def hlo_counts(text: str) -> dict[str, list[float]]:
  """kind -> [instructions in the program, MiB they write per call] in XLA:CPU's compiled HLO,
  loop bodies counted once for the instructions and times their known trip count for the
  bytes (a dynamic-update-slice writes its update in place: its update's bytes). Kinds:
  'products' (YNNPACK's custom fusions, and dots: the projections, and the attention tiles
  with their softmax), 'transpose' (a fusion holding a transpose, whatever else it fuses: a
  bias add, the query's scale), 'copy' (one holding a copy and no transpose), 'slice' (dynamic
  slices and updates: a loop's reads and writes of its operands), 'other' (the rest: bias adds,
  fills, reductions), 'while' (loops). A transpose may be one of layout only, its bytes in the
  order they came in (XLA picks the layouts): read the program to tell."""
  comps = {name: [m.groups() for m in map(_INSTRUCTION.match, lines) if m]
           for name, lines in _computations(text).items()}
  shapes = {name: {inst[0]: inst[1] for inst in insts} for name, insts in comps.items()}
  counts = {kind: [0, 0.0] for kind in ("products", "transpose", "copy", "slice", "other", "while")}

  def written(comp, inst) -> int:
    """Bytes `inst` of computation `comp` writes: its update's where it (or its fusion) is a
    dynamic-update-slice, else its result's."""
    name, shape, opcode, rest = inst
    if opcode == "fusion":
      called = _callee(rest)
      root = next((i for i in comps[called] if i[2] == "dynamic-update-slice"), None)
      return written(called, root) if root else _bytes(shape)
    if opcode == "dynamic-update-slice":
      return _bytes(shapes[comp][re.findall(r"%([\w.\-]+)", rest)[1]])
    return _bytes(shape)

  def kind_of(opcode, line):
    if opcode == "fusion":
      if "__ynn_fusion" in line:
        return "products"
      opcodes = {inst[2] for inst in comps[_callee(line)]}
    else:
      opcodes = {opcode}
    for kind, marks in (("transpose", {"transpose"}), ("copy", {"copy"}),
                        ("slice", {"dynamic-slice", "dynamic-update-slice"})):
      if opcodes & marks:
        return kind
    return "other"

  def walk(name, trips):
    for inst in comps[name]:
      _, shape, opcode, line = inst
      if opcode == "while":
        trip = _TRIPS.search(line)
        counts["while"][0] += 1
        walk(_callee(line, "body"), trips * int(trip.group(1) if trip else 1))
      elif opcode == "call":
        walk(_callee(line, "to_apply"), trips)
      elif opcode == "conditional":  # every branch: an upper bound
        branches = re.search(r"branch_computations=\{([^}]*)\}", line).group(1)
        for called in re.findall(r"%([\w.\-]+)", branches):
          walk(called, trips)
      elif opcode not in BOOKKEEPING and not (opcode == "copy" and _bytes(shape) <= 8):
        kind = "products" if opcode == "dot" else kind_of(opcode, line)  # (a copy <= 8 B: a
        # loop counter)
        counts[kind][0] += 1
        counts[kind][1] += trips * written(name, inst) / 2**20
  walk("ENTRY", 1)
  return counts



def _fused_opcodes(comps, opcode: str, line: str) -> set[str]:
  """The opcodes an instruction runs: a fusion's called ones, else its own."""
  return {inst[2] for inst in comps[_callee(line)]} if opcode == "fusion" else {opcode}


def _dims(shape: str) -> tuple[int, ...]:
  """The dims of an array shape 'f32[8,512]{1,0}' (() for a scalar or a tuple)."""
  match = re.match(r"\w+\[([\d,]*)\]", shape)
  return tuple(int(d) for d in match.group(1).split(",") if d) if match else ()


def converts(text: str, shapes=()) -> dict[str, int]:
  """A compiled program's dtype conversions (instructions holding a `convert`, fused or not)
  and products, inside its loops (the bodies of `while`, and the branches of what they call)
  and outside: 'loop_converts', 'loop_shaped_converts' (of them, those whose result has the
  dims of one of `shapes`: a weight's or a cache's conversion rather than an activation's),
  'loop_ynn' (YNNPACK's fusions), 'loop_dots' (dots XLA:CPU runs itself), and 'converts',
  'shaped_converts' outside any loop. Each instruction once, whatever the loop's trips."""
  shapes = {tuple(s) for s in shapes}
  comps = {name: [m.groups() for m in map(_INSTRUCTION.match, lines) if m]
           for name, lines in _computations(text).items()}
  counts = dict.fromkeys(("loop_converts", "loop_shaped_converts", "loop_ynn", "loop_dots",
                          "converts", "shaped_converts"), 0)

  def walk(name: str, in_loop: bool):
    where = "loop_" if in_loop else ""
    for _, shape, opcode, line in comps[name]:
      if opcode == "while":
        walk(_callee(line, "body"), True)
      elif opcode in ("call", "conditional"):
        called = ([_callee(line, "to_apply")] if opcode == "call" else re.findall(
            r"%([\w.\-]+)", re.search(r"branch_computations=\{([^}]*)\}", line).group(1)))
        for callee in called:
          walk(callee, in_loop)
      elif "__ynn_fusion" in line:
        counts["loop_ynn"] += in_loop
      elif opcode not in BOOKKEEPING:
        ops = _fused_opcodes(comps, opcode, line)
        counts["loop_dots"] += in_loop and "dot" in ops
        if "convert" in ops:
          counts[where + "converts"] += 1
          counts[where + "shaped_converts"] += _dims(shape) in shapes
  walk("ENTRY", False)
  return counts
