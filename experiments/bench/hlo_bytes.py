"""Bytes one device receives in a compiled (optimised, SPMD-partitioned) XLA program, read from
its HLO text: each collective's result size, as much of it as comes from other devices of its
group, times the trips of the loops it sits in (`known_trip_count` of the `while` ops)."""

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
