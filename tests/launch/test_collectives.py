"""launch.plan's collectives: read from the optimized HLO of programs with known collectives on 8
simulated devices, the ring algorithm's bytes per device equal those computed by hand; the
parser's HLO forms (tuple-shaped, async pairs, both replica-group forms, loops); their seconds on
a torus, through a switch and across domains; their place in the step-time bound."""

import importlib.util
import pathlib
import types

import jax
from jax import shard_map
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from cascade import config as config_lib
from launch.plan import collectives
from launch.plan import compiler
from launch.plan import report
from launch.plan import results
from launch.plan import step_time
from launch.plan import targets

F32 = 4


@pytest.fixture(scope='module')
def mesh():
  """(a=2, b=4): the groups along 'b' are {0..3} and {4..7}, along 'a' {i, i + 4}."""
  return jax.make_mesh((2, 4), ('a', 'b'))


def _found(mesh, body, rows: int = 16, cols: int = 32):
  """The collectives of `body` under shard_map over `mesh`, on an f32[rows, cols] array split
  over ('a', 'b') (per device [rows / 2, cols / 4])."""
  fn = jax.jit(shard_map(body, mesh=mesh, in_specs=P('a', 'b'), out_specs=P('a', 'b'),
                         check_vma=False))
  x = jax.ShapeDtypeStruct((rows, cols), jnp.float32, sharding=NamedSharding(mesh, P('a', 'b')))
  return collectives.parse(fn.lower(x).compile().as_text())


def _one(found, kind):
  [c] = [c for c in found if c.kind == kind]
  return c


def test_all_gather_bytes_by_hand(mesh):
  # Each device holds f32[8, 8] (256 B) and gathers 4 of them along 'b': S = 1024 B; a ring
  # sends the 3 shards it does not hold, 768 B.
  c = _one(_found(mesh, lambda x: jax.lax.all_gather(x, 'b', tiled=True)[:8]), 'all-gather')
  assert c.buffer_bytes == 4 * 8 * 8 * F32 and c.group_size == 4
  assert c.moved_bytes == 3 * 8 * 8 * F32 == 768
  assert sorted(c.groups) == [(0, 1, 2, 3), (4, 5, 6, 7)] and c.count == 1 and not c.loop


def test_reduce_scatter_bytes_by_hand(mesh):
  # f32[32, 8] (1024 B) per device reduce-scattered over 'b' (4 devices): 3/4 of it sent.
  def body(x):
    return jax.lax.psum_scatter(jnp.concatenate([x] * 4), 'b', tiled=True)
  c = _one(_found(mesh, body), 'reduce-scatter')
  assert c.buffer_bytes == 32 * 8 * F32 and c.moved_bytes == 768


def test_all_reduce_bytes_by_hand(mesh):
  # f32[8, 8] summed over 'a' (2 devices): 2 (n - 1) / n * 256 B = 256 B.
  c = _one(_found(mesh, lambda x: jax.lax.psum(x, 'a')), 'all-reduce')
  assert c.buffer_bytes == 256 and c.moved_bytes == 256
  assert sorted(c.groups) == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_all_to_all_bytes_by_hand(mesh):
  # f32[8, 8] split 4 ways over 'b' (XLA:CPU makes it a tuple of 4 f32[2, 8]): 3/4 of 256 B.
  c = _one(_found(mesh, lambda x: jax.lax.all_to_all(x, 'b', 0, 0, tiled=True)), 'all-to-all')
  assert c.buffer_bytes == 256 and c.moved_bytes == 192


def test_a_collective_in_a_counted_loop_counts_per_iteration(mesh):
  def body(x):
    step = lambda c, _: (jax.lax.ppermute(c, 'b', [(i, (i + 1) % 4) for i in range(4)]) * 0.5,
                         None)
    return jax.lax.scan(step, x, None, length=5)[0]
  c = _one(_found(mesh, body), 'collective-permute')
  assert c.count == 5 and not c.loop and c.buffer_bytes == 256
  assert collectives.moved_bytes([c]) == 5 * 256


def test_compile_program_reports_the_collectives(mesh):
  spec = NamedSharding(mesh, P(None, 'b'))
  x = jax.ShapeDtypeStruct((8, 64), jnp.float32, sharding=spec)
  fn = jax.jit(lambda x: x.sum(axis=1))       # the sum over 'b' needs an all-reduce
  rep = compiler.compile_program('p', 'x', lambda: fn.lower(x))
  kinds = {c.kind for c in rep.collectives}
  assert kinds and kinds <= {'all-reduce', 'all-gather', 'reduce-scatter'}, rep.collectives
  assert 'collectives per device per call: ' in report.collective_text(rep)


HLO = '''HloModule m, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%rs_async (p: bf16[64,16]) -> bf16[16,16] {
  %p = bf16[64,16]{1,0} parameter(0)
  ROOT %rs = bf16[16,16]{1,0} reduce-scatter(%p), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
}

%body (t: (s32[], f32[128])) -> (s32[], f32[128]) {
  %t = (s32[], f32[128]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[128]{0} get-tuple-element(%t), index=1
  %ars = f32[128]{0} all-reduce-start(%v), channel_id=4, replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add
  %ard = f32[128]{0} all-reduce-done(%ars)
  ROOT %o = (s32[], f32[128]{0}) tuple(%i, %ard)
}

%cond (t: (s32[], f32[128])) -> pred[] {
  %t = (s32[], f32[128]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%decode (t: (s32[], f32[128])) -> (s32[], f32[128]) {
  %t = (s32[], f32[128]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[128]{0} get-tuple-element(%t), index=1
  %cp = f32[128]{0} collective-permute(%v), channel_id=5, source_target_pairs={{0,1},{1,0}}
  ROOT %o = (s32[], f32[128]{0}) tuple(%i, %cp)
}

ENTRY %main (x: bf16[16,16], y: f32[8], z: f32[128]) -> f32[128] {
  %x = bf16[16,16]{1,0} parameter(0)
  %y = f32[8]{0} parameter(1)
  %z = f32[128]{0} parameter(2)
  %ags = ((bf16[16,16]{1,0}, f32[8]{0}), (bf16[64,16]{1,0}, f32[32]{0})) all-gather-start(%x, %y), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %agd = (bf16[64,16]{1,0}, f32[32]{0}) all-gather-done(%ags)
  %g0 = bf16[64,16]{1,0} get-tuple-element(%agd), index=0
  %rss = ((bf16[64,16]{1,0}), bf16[16,16]{1,0}) async-start(%g0), calls=%rs_async
  %rsd = bf16[16,16]{1,0} async-done(%rss), calls=%rs_async
  %t0 = (s32[], f32[128]{0}) tuple(%i0, %z)
  %w = (s32[], f32[128]{0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %d = (s32[], f32[128]{0}) while(%w), condition=%cond, body=%decode
  %a2a = (f32[4]{0}, f32[4]{0}) all-to-all(%y), channel_id=6, replica_groups={}
  ROOT %r = f32[128]{0} get-tuple-element(%d), index=1
}
'''


def test_the_parser_reads_tuples_async_pairs_both_group_forms_and_loops():
  found = {c.name: c for c in collectives.parse(HLO)}
  assert set(found) == {'ags', 'rs', 'ars', 'cp', 'a2a'}      # no -done, no async-done twice
  ag = found['ags']         # a tuple all-gather of bf16[16,16] and f32[8] over 4 devices
  assert ag.kind == 'all-gather' and ag.buffer_bytes == 4 * (16 * 16 * 2 + 8 * 4)
  assert ag.moved_bytes == 3 * (16 * 16 * 2 + 8 * 4)
  rs = found['rs']          # inside async-start's computation; iota groups [2,4]<=[8]
  assert rs.kind == 'reduce-scatter' and rs.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
  assert rs.buffer_bytes == 64 * 16 * 2 and rs.moved_bytes == 0.75 * 64 * 16 * 2
  ar = found['ars']         # all-reduce-start in a loop of 3: iota groups transposed
  assert ar.kind == 'all-reduce' and ar.count == 3 and not ar.loop
  assert ar.groups == ((0, 4), (1, 5), (2, 6), (3, 7)) and ar.moved_bytes == 128 * 4
  cp = found['cp']          # a loop of unknown trip count: per iteration
  assert cp.kind == 'collective-permute' and cp.loop and cp.groups == ((0, 1), (1, 0))
  a2a = found['a2a']        # replica_groups={}: every device
  assert a2a.groups == (tuple(range(8)),) and a2a.moved_bytes == 7 / 8 * 32
  per_call = ag.moved_bytes + rs.moved_bytes + 3 * ar.moved_bytes + a2a.moved_bytes
  assert collectives.moved_bytes(list(found.values())) == per_call
  assert collectives.moved_bytes(list(found.values()), per_iteration=True) == 512


def test_replica_groups_forms():
  assert collectives.replica_groups('replica_groups={{0,2},{1,3}}', 4) == ((0, 2), (1, 3))
  assert collectives.replica_groups('replica_groups=[1,4]<=[4]', 4) == ((0, 1, 2, 3),)
  assert collectives.replica_groups('replica_groups=[2,2]<=[2,2]T(1,0)', 4) == ((0, 2), (1, 3))
  assert collectives.replica_groups('replica_groups={}', 3) == ((0, 1, 2),)
  # The TPU compiler's mesh form: groups along the named axes of an iota-numbered mesh.
  mesh = "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, use_global_device_ids=true"
  assert collectives.replica_groups(mesh, 8) == ((0, 1, 2, 3), (4, 5, 6, 7))
  mesh = "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}"
  assert collectives.replica_groups(mesh, 8) == ((0, 4), (1, 5), (2, 6), (3, 7))
  mesh = "replica_groups=mesh['a'=2,'b'=2,'c'=2] {'a','c'}"
  assert collectives.replica_groups(mesh, 8) == ((0, 1, 4, 5), (2, 3, 6, 7))


def test_a_loop_the_compiler_does_not_annotate_counts_by_its_condition():
  """The TPU compiler prints no known_trip_count: a condition `i < 7` of a constant counts
  7 iterations; a condition of any other form stays a loop of unknown trip count."""
  hlo = '''HloModule m, num_partitions=2

%cond (p: (s32[], f32[4])) -> pred[] {
  %seven = s32[]{:T(128)} constant(7)
  %p = (s32[]{:T(128)}, f32[4]{0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %seven), direction=LT
}

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[]{:T(128)}, f32[4]{0}) parameter(0)
  %v = f32[4]{0} get-tuple-element(%p), index=1
  %ar = f32[4]{0} all-reduce(%v), channel_id=1, replica_groups=mesh['x'=2] {'x'}, to_apply=%add
  ROOT %o = (s32[]{:T(128)}, f32[4]{0}) tuple(%i, %ar)
}

%open (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[]{:T(128)}, f32[4]{0}) parameter(0)
  %n = s32[] get-tuple-element(%p), index=0
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %t = (s32[], f32[4]{0}) tuple(%z, %x)
  %w = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%body
  %u = (s32[], f32[4]{0}) while(%w), condition=%open, body=%body
  ROOT %r = f32[4]{0} get-tuple-element(%u), index=1
}
'''
  got = sorted((c.count, bool(c.loop), c.groups) for c in collectives.parse(hlo))
  assert got == [(1, True, ((0, 1),)), (7, False, ((0, 1),))]


V5P, H200 = targets.INTERCONNECTS['v5p'], targets.INTERCONNECTS['h200']


def _coll(kind, groups, size=1e9, count=1):
  return collectives.Collective(kind, 'c', size, tuple(groups), count)


def test_seconds_on_a_torus_a_switch_and_across_domains():
  # 8 chips in a 2x2x2 torus block: ids 0..3 at z=0, 4..7 at z=1; one slice.
  coords = tuple((i % 2, i // 2 % 2, i // 4) for i in range(8))
  torus = collectives.Placement((0,) * 8, coords)
  gb = 1e9
  ag_x = _coll('all-gather', [(0, 1)])                  # along x only: one axis, both ways
  assert collectives.seconds([ag_x], V5P, torus) == pytest.approx(0.5e9 / (2 * 100 * gb))
  ag_all = _coll('all-gather', [tuple(range(8))])       # spans x, y and z
  assert collectives.seconds([ag_all], V5P, torus) == pytest.approx(7 / 8 * 1e9 / (6 * 100 * gb))
  ar = _coll('all-reduce', [(0, 4)], count=3)
  assert collectives.seconds([ar], V5P, torus) == pytest.approx(3 * 1e9 / (2 * 100 * gb))
  a2a = _coll('all-to-all', [(0, 1)])                   # bisection: S n / 8 per link
  assert collectives.seconds([a2a], V5P, torus) == pytest.approx(1e9 * 2 / 8 / (100 * gb))
  # Two slices of 4: a group across them runs at DCN's rate.
  sliced = collectives.Placement((0, 0, 0, 0, 1, 1, 1, 1), coords)
  assert collectives.seconds([ar], V5P, sliced) == pytest.approx(3 * 1e9 / (6.25 * gb))
  # H200: through NVSwitch at one link's rate in a node, the network across nodes.
  node = collectives.Placement((0,) * 8, (None,) * 8)
  assert collectives.seconds([ag_all], H200, node) == pytest.approx(7 / 8 * 1e9 / (450 * gb))
  hosts = collectives.Placement((0,) * 4 + (1,) * 4, (None,) * 8)
  assert collectives.seconds([ag_all], H200, hosts) == pytest.approx(7 / 8 * 1e9 / (50 * gb))
  perm = _coll('collective-permute', [(0, 1), (3, 4)])
  assert collectives.seconds([perm], H200, hosts) == pytest.approx(1e9 / (50 * gb))
  assert collectives.seconds([ag_all], None, node) == 0.0


def test_interconnect_by_hardware():
  hw = config_lib.Hardware(topology='v5p:4x4x4', platform='tpu')
  assert targets.interconnect(hw) is V5P
  gpu = config_lib.Hardware(platform='gpu', name='8 x NVIDIA H200 (one node)')
  assert targets.interconnect(gpu) is H200
  assert targets.interconnect(config_lib.Hardware(platform='cpu')) is None
  for net in targets.INTERCONNECTS.values():
    assert net.source and net.link_gbps > net.network_gbps > 0


def test_collectives_join_the_step_time_overlapped_and_serial():
  """The update's collectives times updates_per_batch; the sampler's per call and per decode
  step; overlapped, a part takes the larger; serial, they add."""
  t = results.StepTime(weights=2.0, update=1.0, frozen=0.5, decode_steps=100)
  programs = [results.ProgramReport('train step', '', collective_s=0.75),
              results.ProgramReport('sampler', '', collective_s=0.1, collective_step_s=0.01),
              results.ProgramReport('reference', '', collective_s=0.2)]
  stage = types.SimpleNamespace(updates_per_batch=2)
  ff = types.SimpleNamespace(name='reference', calls=3)
  kind = types.SimpleNamespace(frozen_forwards=lambda s: [ff], sampler_calls=None,
                               sampler_sizes=lambda s: dict(rows=8, prompt_len=4,
                                                            max_new_tokens=100))
  sampler = types.SimpleNamespace(engine='one_call', call_shape=lambda r, p, m: (4, 100, 4))
  got = step_time.with_collectives(t, programs, stage, kind, sampler)
  assert got.collective_update == 1.5 and got.collective_frozen == pytest.approx(0.6)
  assert got.collective_sampling == pytest.approx(2 * 0.1 + 100 * 0.01)   # 2 chunks of 4 rows
  assert got.bound == pytest.approx(max(2.0, 1.2) + max(1.0, 1.5) + max(0.5, 0.6))
  assert got.serial == pytest.approx(2.0 + 1.2 + 1.0 + 1.5 + 0.5 + 0.6)
  assert t.bound == t.serial == 3.5                     # nothing compiled: as before
  assert np.isclose(got.collective, 1.2 + 1.5 + 0.6)


@pytest.mark.heavy
def test_a_stage_plan_prices_its_programs_collectives(tmp_path):
  """The tiny GRPO stage on a (2, 2, 2) mesh priced as on v5p: the train step's and the
  sampler's collectives join the step time, and the page shows them."""
  from launch import step_time_page  # pylint: disable=g-import-not-at-top
  from launch.plan import stages  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location('plan_tests', pathlib.Path(__file__).parent
                                                / 'test_plan.py')
  test_plan = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(test_plan)
  path = tmp_path / 'tiny_plan.py'
  path.write_text(test_plan.TINY_CONFIG)
  config = test_plan._load(str(path))  # pylint: disable=protected-access
  config.hardware.update(peak_tflops=1.0, hbm_gbps=10.0, platform='tpu', topology='v5p:2x2x2')
  p = config_lib.validate(config)
  tgt = targets.Target(tuple(jax.devices('cpu')), 'cpu', '8 CPUs', 0)
  [rep] = stages.collective_plan(p, tgt, stages=['add_rl'])
  by = {q.name: q for q in rep.programs}
  assert by['train step'].collectives and by['train step'].collective_s > 0
  t = rep.time
  assert t.collective_update == pytest.approx(by['train step'].collective_s)
  assert t.collective_sampling > 0 and t.serial == pytest.approx(
      t.sampling + t.update + t.collective_sampling + t.collective_update)
  assert 'collectives per device per call: ' in report.format_stage(rep)
  text = step_time_page.page({'tiny': p}, command='c', date='d', compile_=True, backend='cpu')
  row = next(l for l in text.splitlines() if l.startswith('| add_rl |'))
  assert 'not compiled' not in row and 'collectives priced on: TPU v5p ICI' in text


def test_a_ragged_all_to_all_counts_its_smaller_buffer():
  hlo = '''HloModule m, num_partitions=4

ENTRY %main (x: bf16[32,8], o: bf16[128,8], a: s32[4]) -> bf16[128,8] {
  %x = bf16[32,8]{1,0} parameter(0)
  %o = bf16[128,8]{1,0} parameter(1)
  %a = s32[4]{0} parameter(2)
  ROOT %r = bf16[128,8]{1,0} ragged-all-to-all(%x, %o, %a, %a, %a, %a), channel_id=1, replica_groups={{0,1,2,3}}
}
'''
  [c] = collectives.parse(hlo)
  assert c.kind == 'ragged-all-to-all' and c.buffer_bytes == 32 * 8 * 2
  assert c.moved_bytes == 0.75 * 32 * 8 * 2
