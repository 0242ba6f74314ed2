"""benchmarks.compile_profile's reading of a libtpu dump, on dump files and HLO made here.

The run itself needs libtpu (not installed in the test environment): without it the command
stops with a usage error naming what it needs.
"""

import os

import pytest
from absl import app

from benchmarks import compile_profile as cp

HLO = """\
HloModule jit_step, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

FileNames
1 "/home/u/cascade/models/layers.py"
2 "/home/u/cascade/models/mamba.py"
3 "/home/u/cascade/models/hybrid.py"
4 "/x/site-packages/flax/nnx/module.py"

FunctionNames
1 "_matmul"
2 "Mamba2Mixer.__call__"
3 "run"
4 "__call__"

FileLocations
1 {file_name_id=1 function_name_id=1 line=33 end_line=33 column=0 end_column=0}
2 {file_name_id=2 function_name_id=2 line=178 end_line=178 column=0 end_column=0}
3 {file_name_id=3 function_name_id=3 line=145 end_line=145 column=0 end_column=0}
4 {file_name_id=4 function_name_id=4 line=9 end_line=9 column=0 end_column=0}

StackFrames
1 {file_location_id=3 parent_frame_id=0}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=1 parent_frame_id=3}
4 {file_location_id=1 parent_frame_id=2}
5 {file_location_id=4 parent_frame_id=0}

%fused_computation.1 (param_0: f32[8]) -> f32[8] {
  %param_0 = f32[8]{0} parameter(0)
  ROOT %exp.1 = f32[8]{0} exponential(%param_0), metadata={op_name="jit(step)/exp" stack_frame_id=2}
}

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %fusion.7 = f32[8]{0:T(256)} fusion(%p), kind=kLoop, calls=%fused_computation.1, metadata={op_name="jit(step)/while/body/mamba/mul" stack_frame_id=3}
  %fusion.8 = f32[8]{0} fusion(%p), kind=kLoop, calls=%fused_computation.1, metadata={op_name="jit(step)/dot_general" stack_frame_id=4}
  %convolution_add_fusion.2 = (f32[8]{0}, f32[8]{0}) fusion(%fusion.7), kind=kOutput, calls=%fused_computation.1, metadata={op_name="jit(step)/dot_general" stack_frame_id=5}
  %fusion.9 = f32[8]{0} fusion(%p), kind=kLoop, calls=%fused_computation.1, metadata={op_name="jit(step)/x" source_file="/y/cascade/rl/sft.py" source_line=3}
  %all-reduce.3 = f32[8]{0} all-reduce(%fusion.7), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %sort.4 = (s32[8]{0}, f32[8]{0}) sort(%p, %p), dimensions={0}, to_apply=%compare
  ROOT %copy.5 = f32[8]{0} copy(%fusion.7)
}
"""

def _unit(directory, name, start, seconds, index=0):
  path = directory / f'{int(start * 1e9)}-{name}-{index:02d}-final_hlo-static-per-bundle.txt'
  path.write_text('x\n')
  end = start + seconds
  os.utime(path, ns=(int(end * 1e9), int(end * 1e9)))


def test_units_are_read_from_file_names_and_times(tmp_path):
  _unit(tmp_path, 'fusion.7', 1000.0, 2.5)
  _unit(tmp_path, 'all-reduce.3', 1001.0, 1.0)
  _unit(tmp_path, 'TLP', 999.0, 10.0)                      # whole-program entries: not units
  _unit(tmp_path, '<late-initialization>', 999.0, 10.0)
  (tmp_path / 'notes.txt').write_text('not a unit')
  units = cp.read_units(tmp_path)
  assert [u.name for u in units] == ['fusion.7', 'all-reduce.3']
  assert units[0].seconds == pytest.approx(2.5, abs=1e-3)
  assert units[1].start == pytest.approx(1001.0)


def test_hlo_instructions_carry_opcode_stack_files_and_op_name():
  src = cp.hlo_sources(HLO)
  # Frame 3 is layers.py, called from frame 2 (mamba.py), called from frame 1 (hybrid.py):
  # a printed parent_frame_id is the parent's id + 1 (0: none).
  assert src['fusion.7'] == cp.Source('fusion', ('/home/u/cascade/models/layers.py',
                                                 '/home/u/cascade/models/mamba.py',
                                                 '/home/u/cascade/models/hybrid.py'),
                                      'jit(step)/while/body/mamba/mul', (33, 178, 145),
                                      'f32[8]{0:T(256)}')
  assert src['fusion.8'].files == ('/home/u/cascade/models/layers.py',
                                   '/home/u/cascade/models/hybrid.py')
  assert src['convolution_add_fusion.2'].opcode == 'fusion'        # a tuple-shaped result
  assert src['fusion.9'].files == ('/y/cascade/rl/sft.py',)        # an inline source_file
  assert src['fusion.9'].lines == (3,)
  assert src['convolution_add_fusion.2'].shape == '(f32[8]{0}, f32[8]{0})'
  assert src['all-reduce.3'] == cp.Source('all-reduce', (), '', (), 'f32[8]{0}')
  assert src['sort.4'].opcode == 'sort' and src['copy.5'].opcode == 'copy'


def test_parts_name_collectives_model_files_and_the_rest():
  src = cp.hlo_sources(HLO)
  assert cp.part('fusion.7', src['fusion.7']) == 'models/mamba.py'    # past the helper
  assert cp.part('fusion.8', src['fusion.8']) == 'models/hybrid.py'
  assert cp.part('exp.1', src['exp.1']) == 'models/mamba.py'
  assert cp.part('fusion.9', src['fusion.9']) == 'rl/sft.py'
  assert cp.part('convolution_add_fusion.2', src['convolution_add_fusion.2']) == 'module.py'
  assert cp.part('x', cp.Source('fusion', ('/c/models/layers.py',), '')) == 'models/layers.py'
  assert cp.part('all-reduce.3', src['all-reduce.3']) == 'collective'
  assert cp.part('all-gather-start.9', None) == 'collective'
  assert cp.part('sort.4', src['sort.4']) == 'unattributed'
  assert cp.part('fusion.99', None) == 'unattributed'
  # The line: the same file as the part, at its frame's line.
  assert cp.site(src['fusion.7']) == 'models/mamba.py:178'
  assert cp.site(src['fusion.8']) == 'models/hybrid.py:145'
  assert cp.site(src['fusion.9']) == 'rl/sft.py:3'
  assert cp.site(src['sort.4']) == '' and cp.site(None) == ''


def test_units_go_to_the_program_whose_compile_holds_their_start_and_are_summed(tmp_path):
  _unit(tmp_path, 'fusion.7', 10.0, 3.0)
  _unit(tmp_path, 'all-reduce.3', 11.0, 1.0)
  _unit(tmp_path, 'fusion.7', 20.5, 0.5)     # the same name in the next program
  _unit(tmp_path, 'sort.4', 21.0, 2.0)
  progs = [cp.Program('train step', 9.0, 15.0, 6.0, 11.0, HLO),
           cp.Program('sampler', 20.0, 24.0, 4.0, 7.0, HLO)]
  units = cp.read_units(tmp_path)
  mine = cp.assign(units, progs)
  assert [u.name for u in mine['train step']] == ['fusion.7', 'all-reduce.3']
  assert [u.name for u in mine['sampler']] == ['fusion.7', 'sort.4']
  parts = cp.by_part(mine['sampler'], cp.hlo_sources(HLO))
  assert [(p, round(s, 2), n) for p, s, n in parts] == [('unattributed', 2.0, 1),
                                                        ('models/mamba.py', 0.5, 1)]
  lines = cp.report(progs, units, top=1)
  text = '\n'.join(lines)
  assert '## train step' in text and '## sampler' in text
  assert 'compile 6.0 s wall, 11.0 s CPU (with the dump); 2 units, 4.0 s in all' in text
  assert '| models/mamba.py | 3.0 | 75.0 % | 1 |' in text
  assert '| collective | 1.0 | 25.0 % | 1 |' in text
  assert '| sort.4 | 2.00 | unattributed |  | (s32[8]{0}, f32[8]{0}) |  |' in text
  assert '| fusion.7 | 3.00 | models/mamba.py | models/mamba.py:178 | f32[8]{0:T(256)} |' in text          # top=1: the slowest only
  assert '| fusion.7 | 0.50 |' not in text


def test_libtpu_args_name_the_dump_directory():
  args = cp.libtpu_args('/tmp/d')
  assert '--xla_jf_dump_to=/tmp/d' in args and 'final_hlo' in args


def test_without_libtpu_the_command_says_what_it_needs():
  pytest.importorskip('launch.plan')
  try:
    import libtpu  # noqa: F401  pylint: disable=unused-import
  except ImportError:
    pass
  else:
    pytest.skip('libtpu is installed here')
  with pytest.raises(app.UsageError, match='needs libtpu'):
    cp.main(['compile_profile'], top=5, out=None)


def test_hlo_dir_gets_each_programs_optimized_hlo_in_order(tmp_path):
  progs = [cp.Program('train step (8 rows x 16 tokens)', 0.0, 1.0, 1.0, 1.0, HLO),
           cp.Program('sampler prefill (8 prompts)', 2.0, 3.0, 1.0, 1.0, 'HloModule p')]
  paths = cp.write_hlo(progs, tmp_path / 'hlo')
  assert [p.name for p in paths] == ['00_train_step.hlo.txt', '01_sampler_prefill.hlo.txt']
  assert paths[0].read_text() == HLO and paths[1].read_text() == 'HloModule p'
