"""The collectives of one compiled program, read from its optimized HLO (`parse`), and their time
on the target's interconnect (`seconds`).

What each collective moves is counted with the ring algorithm's bytes per device, for a group
of n devices and S the per-device buffer it works on (the gathered result of an all-gather, the
input of a reduce-scatter, the array all-reduced or exchanged):

  all-gather, reduce-scatter, all-to-all   (n - 1) / n * S
  ragged all-to-all                        (n - 1) / n * S, S the smaller of its input and
                                           output buffers (what it moves with balanced routing)
  all-reduce                               2 (n - 1) / n * S   (a reduce-scatter, then an all-gather)
  collective-permute                       S                   (each device sends its buffer once)

A collective inside a loop counts once per iteration where the loop's trip count is known (XLA's
`known_trip_count`, or, where the compiler does not annotate it, a condition `i < N` of a
constant N: the layer scan, the microbatch loop); inside a loop whose trip
count it does not know (a sampler's decode loop, which stops early) it is reported per
iteration of that loop. Async pairs count once (the `-start`, or the collective inside an
`async-start`'s computation); both branches of a conditional count (an upper bound).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np

from launch.plan import targets

# The collective opcodes counted (and their async `-start` forms); `-done` halves are skipped.
KINDS = ('all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all', 'ragged-all-to-all',
         'collective-permute')

# dtype -> bytes per element, as optimized HLO text spells array types.
HLO_BYTES = {'pred': 1, 's4': 0.5, 'u4': 0.5, 's8': 1, 'u8': 1, 'f8e4m3fn': 1, 'f8e5m2': 1,
             'f8e4m3': 1, 'f8e5m2fnuz': 1, 'f8e4m3fnuz': 1, 's16': 2, 'u16': 2, 'f16': 2,
             'bf16': 2, 's32': 4, 'u32': 4, 'f32': 4, 's64': 8, 'u64': 8, 'f64': 8, 'c64': 8,
             'c128': 16}
_ARRAY = re.compile(r'\b([a-z]\w*)\[([\d,]*)\]')
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*')
_CALLEE = re.compile(r'\b(body|calls|to_apply|true_computation|false_computation|'
                     r'branch_computations)=\{?([%\w.\-, ]+)\}?')


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of a program.

  Attributes:
    kind: one of KINDS.
    name: its instruction name in the optimized HLO.
    buffer_bytes: S, the per-device buffer the ring formula applies to (module docstring).
    groups: the participating devices' logical ids per group (for a collective-permute, its
      (source, target) pairs).
    count: how many times one call of the program runs it (known trip counts multiplied).
    loop: '' or the while loop of unknown trip count it sits in: then `count` is per
      iteration of that loop.
  """
  kind: str
  name: str
  buffer_bytes: float
  groups: tuple[tuple[int, ...], ...]
  count: int = 1
  loop: str = ''

  @property
  def group_size(self) -> int:
    return 2 if self.kind == 'collective-permute' else max(len(g) for g in self.groups)

  @property
  def moved_bytes(self) -> float:
    """Bytes each device sends per run (the ring algorithm's count, module docstring)."""
    n = self.group_size
    if self.kind == 'collective-permute':
      return float(self.buffer_bytes)
    if n <= 1:
      return 0.0
    return (2.0 if self.kind == 'all-reduce' else 1.0) * (n - 1) / n * self.buffer_bytes


def _array_bytes(type_text: str) -> float:
  """Bytes of an HLO type: an array 'bf16[8,128]{1,0}' or a tuple of them."""
  total = 0.0
  for dt, dims in _ARRAY.findall(type_text):
    if dt in HLO_BYTES:
      total += int(np.prod([int(d) for d in dims.split(',') if d])) * HLO_BYTES[dt]
  return total


def _split_type(rest: str) -> tuple[str, str]:
  """(the result type, the text after it) of an instruction's right-hand side."""
  if rest.startswith('('):
    depth = 0
    for i, ch in enumerate(rest):
      depth += ch == '('
      depth -= ch == ')'
      if depth == 0:
        return rest[:i + 1], rest[i + 1:].lstrip()
  head, _, tail = rest.partition(' ')
  return head, tail


def _operands(call: str) -> list[str]:
  """The operand names of 'opcode(%a, %b), attrs' (types before a name are dropped)."""
  depth, end = 0, len(call)
  for i, ch in enumerate(call):
    depth += ch in '({['
    depth -= ch in ')}]'
    if depth == 0 and ch == ')':
      end = i
      break
  inner = call[call.index('(') + 1:end]
  return re.findall(r'%([\w.\-]+)', inner) or [t.strip().split()[-1] for t in inner.split(',')
                                                if t.strip()]


def replica_groups(attrs: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
  """The groups of `replica_groups=` in an instruction's attributes: the explicit form
  {{0,1},{2,3}}, the iota form [G,S]<=[dims] (optionally T(perm)), the TPU compiler's mesh
  form mesh['a'=2,'b'=4] {'b'} (the devices numbered in the mesh's order, a group along the
  named axes), or {} (every device)."""
  m = re.search(r'replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?', attrs)
  if m:
    shape = [int(d) for d in m.group(1).split(',')]
    dims = [int(d) for d in m.group(2).split(',')]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(3):
      ids = ids.transpose([int(p) for p in m.group(3).split(',')])
    return tuple(tuple(int(i) for i in row) for row in ids.reshape(shape))
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
  if m:            # the TPU compiler's form: mesh['a'=2,'b'=4] {'b'}: groups along 'b'
    axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
    chosen = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(2))]
    rest = [i for i in range(len(names)) if i not in chosen]
    ids = np.arange(int(np.prod(sizes))).reshape(sizes).transpose(rest + chosen)
    width = int(np.prod([sizes[i] for i in chosen]))
    return tuple(tuple(int(i) for i in row) for row in ids.reshape(-1, width))
  m = re.search(r'replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}', attrs)
  if m and m.group(1).strip():
    return tuple(tuple(int(i) for i in g.split(',') if i.strip())
                 for g in re.findall(r'\{([\d,\s]*)\}', m.group(1)))
  return (tuple(range(num_devices)),)


def _pairs(attrs: str) -> tuple[tuple[int, ...], ...]:
  m = re.search(r'source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}', attrs)
  return tuple(tuple(int(i) for i in p.split(',')) for p in re.findall(r'\{(\d+,\d+)\}',
                                                                         m.group(1))) if m else ()


def _trip_count(attrs: str) -> int | None:
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', attrs)
  return int(m.group(1)) if m else None


@dataclasses.dataclass
class _Computation:
  types: dict          # instruction name -> result type text
  found: list          # (kind, name, buffer bytes, groups)
  calls: list          # (callee, trip count or None where unknown, loop name, condition)
  consts: dict = dataclasses.field(default_factory=dict)   # integer scalar constants
  bound: tuple = ()    # a ROOT compare(a, b) direction=LT: (a, b)

  def trip_count(self) -> int | None:
    """As a loop condition `i < N` of a constant N (a scan's, counting from 0 by 1): N."""
    if len(self.bound) == 2 and self.bound[1] in self.consts and (
        self.bound[0] not in self.consts):
      return self.consts[self.bound[1]]
    return None


def _computations(hlo_text: str) -> tuple[dict[str, _Computation], str, int]:
  """Every computation of a module by name, the entry's name and the module's device count."""
  m = re.search(r'num_partitions=(\d+)', hlo_text)
  parts = int(m.group(1)) if m else 1
  m = re.search(r'replica_count=(\d+)', hlo_text)
  n = parts * (int(m.group(1)) if m else 1)
  comps, entry, current = {}, '', None
  for line in hlo_text.splitlines():
    if line and not line[0].isspace():
      head = line.split()
      is_entry = head[0] == 'ENTRY'
      if line.rstrip().endswith('{') and ('->' in line or is_entry):
        name = (head[1] if is_entry else head[0]).lstrip('%')
        current = comps.setdefault(name, _Computation({}, [], []))
        entry = name if is_entry else entry
      else:
        current = None
      continue
    m = _INSTRUCTION.match(line) if current is not None else None
    if m is None:
      continue
    rtype, call = _split_type(line[m.end():])
    current.types[m.group(1)] = rtype
    _scalars(current, m.group(1), rtype, call, line.lstrip().startswith('ROOT'))
    _instruction(current, m.group(1), call, n)
  return comps, entry, n


def _scalars(comp: _Computation, name: str, rtype: str, call: str, root: bool) -> None:
  """Records an integer scalar constant, or a root `compare(...), direction=LT` (what a loop
  condition of a known trip count looks like where the compiler does not annotate it)."""
  m = re.match(r'constant\((-?\d+)\)', call)
  if m and re.match(r'[su](8|16|32|64)\[\]', rtype):
    comp.consts[name] = int(m.group(1))
  elif root and call.startswith('compare(') and 'direction=LT' in call:
    comp.bound = tuple(_operands(call))


def _instruction(comp: _Computation, name: str, call: str, n: int) -> None:
  """Records one instruction: a collective it is, or the computations it calls."""
  opcode = call.split('(', 1)[0].strip()
  base = opcode[:-len('-start')] if opcode.endswith('-start') else opcode
  attrs = call[call.find(')'):] if ')' in call else ''
  if base in KINDS:
    operands = [comp.types.get(o, '') for o in _operands(call)]
    if base == 'collective-permute':
      groups, size = _pairs(attrs), _array_bytes(operands[0]) if operands else 0.0
    else:
      groups = replica_groups(attrs, n)
      if base == 'ragged-all-to-all':
        # (input, output, offsets and sizes): the rows sent depend on the routing; with it
        # balanced, a device sends the smaller of its input and output buffers' rows.
        operands = [min(operands[:2], key=_array_bytes)] if len(operands) >= 2 else operands[:1]
      size = sum(_array_bytes(t) for t in operands)
      if base == 'all-gather':
        size *= max(len(g) for g in groups)
    comp.found.append((base, name, size, groups))
    return
  if opcode in ('async-done', 'async-update'):   # the pair's `async-start` counted it
    return
  if opcode == 'while':
    body = re.search(r'\bbody=%?([\w.\-]+)', call)
    cond = re.search(r'\bcondition=%?([\w.\-]+)', call)
    if body:
      comp.calls.append((body.group(1), _trip_count(call), name, cond.group(1) if cond else ''))
    return
  for key, names in _CALLEE.findall(call):
    if key == 'body':
      continue
    for callee in re.findall(r'%?([\w.\-]+)', names):
      comp.calls.append((callee, 1, '', ''))


def parse(hlo_text: str) -> tuple[Collective, ...]:
  """The collectives of an optimized HLO module (`compiled.as_text()`), each with how often one
  call of the program runs it (see the module docstring)."""
  comps, entry, n = _computations(hlo_text)
  counts: dict[tuple[str, str, str], int] = {}

  def visit(name: str, times: int, loop: str, depth: int) -> None:
    comp = comps.get(name)
    if comp is None or depth > 64:
      return
    for kind, inst, size, groups in comp.found:
      key = (name, inst, loop)
      counts[key] = counts.get(key, 0) + times
    for callee, mult, where, cond in comp.calls:
      if mult is None and cond in comps:     # the TPU compiler annotates none: `i < N`
        mult = comps[cond].trip_count()
      if mult is None:          # unknown trip count: per iteration of that (outermost) loop
        visit(callee, 1 if not loop else times, loop or f'{name}/{where}', depth + 1)
      else:
        visit(callee, times * mult, loop, depth + 1)

  visit(entry, 1, '', 0)
  out = []
  for (comp_name, inst, loop), times in counts.items():
    kind, _, size, groups = next(f for f in comps[comp_name].found if f[1] == inst)
    out.append(Collective(kind, inst, size, groups, times, loop))
  return tuple(out)


def moved_bytes(found: Sequence[Collective], per_iteration: bool = False) -> float:
  """Bytes each device sends in one call of the program (`per_iteration`: in one iteration of
  its heaviest loop of unknown trip count instead)."""
  if not per_iteration:
    return sum(c.count * c.moved_bytes for c in found if not c.loop)
  loops: dict[str, float] = {}
  for c in found:
    if c.loop:
      loops[c.loop] = loops.get(c.loop, 0.0) + c.count * c.moved_bytes
  return max(loops.values(), default=0.0)


def by_kind(found: Sequence[Collective]) -> dict[str, float]:
  """Bytes each device sends per call by kind (loops of unknown trip count: one iteration)."""
  out: dict[str, float] = {}
  for c in found:
    out[c.kind] = out.get(c.kind, 0.0) + c.count * c.moved_bytes
  return out


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a program's logical device ids sit: per id its domain (a TPU slice, a GPU host:
  the fast interconnect's reach) and its chip coordinates in the torus (None where unknown)."""
  domains: tuple[int, ...]
  coords: tuple[tuple[int, ...] | None, ...]


def placement(mesh, kind: str, slices: int = 1) -> Placement:
  """The placement of `mesh`'s devices in the order a program's logical ids number them
  (`mesh.devices.flat`): a TPU topology's devices carry their slice and coordinates; GPUs are
  in hosts of `targets.GPUS_PER_HOST`; simulated CPU devices standing in for a TPU are
  `slices` consecutive blocks with no coordinates."""
  devices = list(mesh.devices.flat)
  n = len(devices)
  if kind == 'tpu':
    return Placement(tuple(int(getattr(d, 'slice_index', 0) or 0) for d in devices),
                     tuple(tuple(d.coords) if getattr(d, 'coords', None) is not None else None
                           for d in devices))
  if kind == 'gpu':
    return Placement(tuple(i // targets.GPUS_PER_HOST for i in range(n)), (None,) * n)
  return Placement(tuple(i * slices // n for i in range(n)), (None,) * n)


def _axes_spanned(members: Sequence[int], where: Placement) -> int:
  """How many torus axes a group's chips differ along (1 where coordinates are unknown)."""
  coords = [where.coords[i] for i in members if i < len(where.coords)]
  if not coords or any(c is None for c in coords):
    return 1
  return max(1, sum(len({c[a] for c in coords}) > 1 for a in range(len(coords[0]))))


def group_seconds(c: Collective, members: Sequence[int], net: targets.Interconnect,
                  where: Placement) -> float:
  """Seconds one run of `c` takes for the group `members` (`targets.Interconnect` says how)."""
  gb = 1e9
  if c.kind == 'collective-permute':
    a, b = members
    cross = where.domains[a] != where.domains[b]
    return c.buffer_bytes / ((net.network_gbps if cross else net.link_gbps) * gb)
  if len({where.domains[i] for i in members}) > 1:
    return c.moved_bytes / (net.network_gbps * gb)
  if net.switched:
    return c.moved_bytes / (net.link_gbps * gb)
  axes = _axes_spanned(members, where)
  if c.kind in ('all-to-all', 'ragged-all-to-all'):
    # On a bidirectional ring each of the 2n directed links carries S n / 8 (the mean distance
    # of a peer is n / 4): all-to-all is bisection-bound, not (n - 1) / n * S over two links.
    return c.buffer_bytes * c.group_size / 8 / (axes * net.link_gbps * gb)
  return c.moved_bytes / (2 * axes * net.link_gbps * gb)


def seconds(found: Sequence[Collective], net: targets.Interconnect | None, where: Placement,
            per_iteration: bool = False) -> float:
  """Seconds the collectives of one program call take on `net`, one after another, each group
  running in parallel with the others and the slowest group setting the time (0 without an
  interconnect). `per_iteration`: those of one iteration of its heaviest loop of unknown trip
  count instead of those outside such loops."""
  if net is None:
    return 0.0
  if not per_iteration:
    return sum(c.count * max(group_seconds(c, g, net, where) for g in c.groups)
               for c in found if not c.loop and c.groups)
  loops: dict[str, float] = {}
  for c in found:
    if c.loop and c.groups:
      loops[c.loop] = loops.get(c.loop, 0.0) + c.count * max(
          group_seconds(c, g, net, where) for g in c.groups)
  return max(loops.values(), default=0.0)


def priced(programs: Sequence, mesh, hw, kind: str | None = None) -> tuple:
  """`programs` (results.ProgramReport) with their collectives' seconds on the interconnect of
  `hw` (config.hardware; `targets.interconnect`) for `mesh`'s devices (`kind`: the devices'
  platform, default the mesh's)."""
  net = targets.interconnect(hw)
  kind = kind or mesh.devices.flat[0].platform
  kind = {'cuda': 'gpu', 'rocm': 'gpu'}.get(kind, kind)
  if kind == 'cpu' and hw.platform == 'gpu':     # CPU stand-ins for GPUs: hosts of 8 all the same
    kind = 'gpu'
  where = placement(mesh, kind, hw.slices)
  return tuple(dataclasses.replace(p, collective_s=seconds(p.collectives, net, where),
                                   collective_step_s=seconds(p.collectives, net, where, True))
               for p in programs)
