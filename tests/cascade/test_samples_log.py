"""Generated samples logged per RL step (`rl.Draws.log_samples` -> `metrics.Writer.write_samples`):
samples.jsonl rows paired with the step's own rewards, TensorBoard text, `log_samples=0`, the
writer process only, and untrusted text cut and made encodable.

The stand-ins of tests/cascade/conftest.py answer each prompt from its own text and pay each
record its own value, so a row whose reward, completion, id or verifier info came from another
row shows. No model is built: each test takes well under a second.
"""

import dataclasses
import glob
import json
import struct
import types

import jax
import numpy as np
import pytest

from cascade import config as config_lib
from cascade import metrics
from cascade import rollout
from cascade import schema
from cascade.data import readers
from cascade.kinds import rl


class _Writer(metrics.Writer):
  """The real writer, counting what it was asked to log."""

  def __init__(self, workdir, enabled=True):
    super().__init__(workdir, enabled=enabled)
    self.calls = []

  def write_samples(self, stage, step, samples):
    self.calls.append((step, samples))
    super().write_samples(stage, step, samples)


def _ctx(fakes, stage, sampler, writer, log_samples, domains=('a',)):
  plan = fakes.toy_config([stage])
  plan = dataclasses.replace(plan, eval=dataclasses.replace(plan.eval, log_samples=log_samples))
  verifiers = {d: fakes.ValueVerifier(d) for d in domains}
  return types.SimpleNamespace(
      plan=plan, sampler=sampler, tokenizer=fakes.CharTokenizer(), sample_cls=fakes.Sample,
      verifiers=types.SimpleNamespace(train_verifier=verifiers.__getitem__),
      domain_index={d: i for i, d in enumerate(sorted(plan.domains))}, writer=writer)


def _run_steps(fakes, tmp_path, stage, sampler, log_samples, steps=1, records=None,
               domains=('a',), enabled=True):
  """Collects `steps` steps' batches with a writer on tmp_path; -> (writer, [(rows, rewards,
  valid, fill, metrics)] per step, records)."""
  records = records or [fakes.record(d, i, (10 if d == 'a' else 30) + i)
                        for d in domains for i in range(10)]
  writer = _Writer(str(tmp_path), enabled=enabled)
  ctx = _ctx(fakes, stage, sampler, writer, log_samples, domains)
  st = ctx.plan.stages[0]
  loader = readers.Loader(records, 0, st.prompts_per_step, shuffle=False)
  out = []
  for step in range(steps):
    draws = rl.Draws(ctx, st, loader, step, jax.random.fold_in(jax.random.key(0), step), 'params')
    out.append((*draws.collect(), draws.metrics()))
  writer.close()
  return writer, out, records


def _lines(tmp_path):
  with open(tmp_path / 'samples.jsonl', encoding='utf-8') as f:
    return [json.loads(l, parse_constant=_no_constant) for l in f]


def _no_constant(name):
  raise AssertionError(f'non-standard JSON constant {name} in samples.jsonl')


def _tb_texts(tmp_path):
  """(step, tag, text) of every text summary in the run's TensorBoard event files."""
  metrics._import_tensorboardx()
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  out = []
  for path in sorted(glob.glob(str(tmp_path / 'tb' / 'events.out.tfevents.*'))):
    with open(path, 'rb') as f:
      data = f.read()
    pos = 0
    while pos < len(data):                     # TFRecord: length, crc, payload, crc
      (n,) = struct.unpack('<Q', data[pos:pos + 8])
      ev = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
      pos += 12 + n + 4
      for v in ev.summary.value:
        if v.metadata.plugin_data.plugin_name == 'text':
          out.append((ev.step, v.tag, v.tensor.string_val[0].decode('utf-8')))
  return out


def _record_of(records, line):
  return next(r for r in records if r['id'] == line['id'])


# ------------------------------------------------------------------ which rows, paired right

def test_which_rows_are_logged():
  assert rl.sample_rows(8, 2, 2) == [0, 2]                    # first completion of prompts 0, 1
  assert rl.sample_rows(8, 2, 6) == [0, 2, 4, 6, 1, 3]        # then their second completions
  assert sorted(rl.sample_rows(8, 2, 50)) == list(range(8))   # never more than the batch
  assert rl.sample_rows(6, 3, 3) == [0, 3, 1]
  assert rl.sample_rows(8, 2, 0) == []


def test_each_logged_row_carries_its_own_reward_completion_and_info(fakes, tmp_path):
  """Dynamic filtering drops the groups that are all right (numbers 10, 12) and refills from a
  later round, so the kept batch is not the first round's rows in order: every logged field must
  still belong to the row it names. Sample 0 of each prompt is right (reward: the record's value),
  sample 1 wrong ('x', -1), so a reward taken from a neighbour row shows."""
  sampler = fakes.OwnAnswerSampler(right=lambda n, g: g == 0 or n in (10, 12))
  stage = fakes.rl_stage('rl', ['a'], dynamic_filter=True, refill_cap=2)
  writer, steps, records = _run_steps(fakes, tmp_path, stage, sampler, log_samples=6, steps=2)
  lines = _lines(tmp_path)
  assert len(lines) == 12 and [l['step'] for l in lines] == [1] * 6 + [2] * 6
  for s, (rows, rewards, valid, fill, _) in enumerate(steps):
    assert fill['rounds'] == 2 and valid.all()
    got = lines[6 * s:6 * s + 6]
    assert [l['row'] for l in got] == [0, 2, 4, 6, 1, 3]
    for l in got:
      i = l['row']
      rec = _record_of(records, l)
      num = int(rec['metadata']['answer'])
      right = i % 2 == 0
      assert set(l) == {'stage', 'stage_index', 'kind', 'step', 'row', 'domain', 'id', 'thinking',
                        'reward', 'length', 'truncated', 'group_kept', 'prompt', 'completion',
                        'info'}
      assert (l['stage'], l['stage_index'], l['kind']) == ('rl', 0, 'grpo')
      assert l['reward'] == float(rewards[i])                      # the step's own reward
      assert l['reward'] == (rec['metadata']['value'] if right else -1.0)
      assert l['completion'] == (str(num) if right else 'x')
      # The batch's own tokens of that row spell the logged completion.
      s_out = rows['samples']
      assert ''.join(map(chr, s_out.tokens[i, :s_out.lengths[i]])) == l['completion']
      assert l['length'] == len(l['completion']) and l['truncated'] is False
      assert l['prompt'] == rollout.prompt_text(rec, None) and f'Copy {num}.' in l['prompt']
      assert l['info'] == {'id': rec['id']}                        # what the verifier saw
      assert (l['domain'], l['thinking'], l['group_kept']) == ('a', None, True)
  # Step 0 keeps a1, a3 of its first round (a0, a2 dropped) and a4, a5 of its refill; step 1
  # draws on (a8, a9, a0 dropped, a1; then a2 dropped, a3). Rows 0, 2, 4, 6, 1, 3 are prompts
  # 0, 1, 2, 3, 0, 1.
  assert [l['id'] for l in lines] == ['a1', 'a3', 'a4', 'a5', 'a1', 'a3',
                                      'a8', 'a9', 'a1', 'a3', 'a8', 'a9']
  assert [c[0] for c in writer.calls] == [1, 2]


def test_padding_groups_and_mixed_domains_are_labelled(fakes, tmp_path):
  """Every sample right: no group has signal, the batch is padding (group_kept False); two
  domains, each row scored and logged with its own domain and value."""
  recs = [fakes.record('a', 0, 10), fakes.record('b', 0, 30), fakes.record('a', 1, 11),
          fakes.record('b', 1, 31)]
  sampler = fakes.OwnAnswerSampler(answer=lambda n: str(n if n < 30 else n + 1))
  stage = fakes.rl_stage('rl', ['a', 'b'], dynamic_filter=True, refill_cap=0)
  _, steps, _ = _run_steps(fakes, tmp_path, stage, sampler, log_samples=4, records=recs,
                           domains=('a', 'b'))
  lines = _lines(tmp_path)
  rewards = steps[0][1]
  assert [(l['id'], l['domain'], l['reward'], l['group_kept']) for l in lines] == [
      ('a0', 'a', 1.0, False), ('b0', 'b', 1.5, False), ('a1', 'a', 2.0, False),
      ('b1', 'b', 2.5, False)]
  assert [l['reward'] for l in lines] == [float(rewards[i]) for i in (0, 2, 4, 6)]
  assert lines[1]['completion'] == '31' and 'After 30?' in lines[1]['prompt']


def test_thinking_mode_and_truncation_are_logged(fakes, tmp_path):
  sampler = fakes.OwnAnswerSampler(right=lambda n, g: g == 0, ramble=lambda n, g: g == 1)
  stage = fakes.rl_stage('rl', ['a'], thinking_fraction=1.0, max_response_len=6)
  _, _, records = _run_steps(fakes, tmp_path, stage, sampler, log_samples=8)
  lines = _lines(tmp_path)
  assert len(lines) == 8 and [l['row'] for l in lines] == [0, 2, 4, 6, 1, 3, 5, 7]
  for l in lines:
    # The prompt as the model saw it: the chat template rendered in the row's mode.
    assert l['thinking'] is True
    assert l['prompt'] == rollout.prompt_text(_record_of(records, l), True) != \
        rollout.prompt_text(_record_of(records, l), None)
    assert l['truncated'] is (l['row'] % 2 == 1)
    assert l['length'] == (6 if l['truncated'] else len(l['completion']))


# ------------------------------------------------------------------ TensorBoard text

def test_tensorboard_text_at_the_step_under_the_stage_tag(fakes, tmp_path):
  sampler = fakes.OwnAnswerSampler(right=lambda n, g: g == 0)
  _run_steps(fakes, tmp_path, fakes.rl_stage('math_rl', ['a']), sampler, log_samples=2, steps=2)
  texts = _tb_texts(tmp_path)
  assert [(s, t) for s, t, _ in texts] == [(1, 'math_rl/samples/text_summary'),
                                           (2, 'math_rl/samples/text_summary')]
  first, second = texts[0][2], texts[1][2]
  assert first.count('**sample ') == 2 and '"a0"' in first and '"a1"' in first
  assert 'Copy 10.' in first and '--- completion:\n    10' in first
  assert '"a4"' in second and '"a5"' in second and '"a0"' not in second
  # Every line of a sample is inside its indented code block.
  for block in first.split('\n\n')[1::2]:
    assert all(line.startswith('    ') for line in block.split('\n'))


# ------------------------------------------------------------------ off, other processes, no RNG

def _batch_signature(steps):
  out = []
  for rows, rewards, valid, fill, m in steps:
    s = rows['samples']
    out.append((sorted(rows), [np.asarray(f).tolist() for f in s], rows['domain'].tolist(),
                rewards.tolist(), valid.tolist(), fill,
                {k: v for k, v in m.items() if not k.endswith('_s')}))
  return out


@pytest.mark.parametrize('dynamic_filter', [True, False])
def test_log_samples_0_writes_nothing_and_logging_changes_no_batch(fakes, tmp_path,
                                                                   dynamic_filter):
  stage = fakes.rl_stage('rl', ['a'], dynamic_filter=dynamic_filter)
  mk = lambda: fakes.OwnAnswerSampler(right=lambda n, g: g == 0 or n == 11)
  on_sampler, off_sampler = mk(), mk()
  _, on, _ = _run_steps(fakes, tmp_path / 'on', stage, on_sampler, log_samples=3, steps=2)
  writer, off, _ = _run_steps(fakes, tmp_path / 'off', stage, off_sampler, log_samples=0, steps=2)
  assert len(_lines(tmp_path / 'on')) == 6
  assert not (tmp_path / 'off' / 'samples.jsonl').exists() and writer.calls == []
  assert not _tb_texts(tmp_path / 'off')
  assert _batch_signature(on) == _batch_signature(off)
  assert on_sampler.calls == off_sampler.calls
  # The rows handed back are the kind's usual ones: no bookkeeping field leaks into training.
  assert sorted(on[0][0]) == ['domain', 'samples']


def test_only_the_writer_process_logs(fakes, tmp_path):
  writer, _, _ = _run_steps(fakes, tmp_path, fakes.rl_stage('rl', ['a']),
                            fakes.OwnAnswerSampler(), log_samples=2, enabled=False)
  assert writer.calls == [] and not (tmp_path / 'samples.jsonl').exists()


def test_an_env_without_a_writer_logs_nothing(fakes):
  ctx = _ctx(fakes, fakes.rl_stage('rl', ['a']), fakes.OwnAnswerSampler(), None, 2)
  del ctx.writer
  st = ctx.plan.stages[0]
  loader = readers.Loader([fakes.record('a', i, 10 + i) for i in range(4)], 0, 4, shuffle=False)
  rows, rewards, _, _ = rl.Draws(ctx, st, loader, 0, jax.random.key(0), 'p').collect()
  assert rewards.shape == (8,) and sorted(rows) == ['domain', 'samples']


# ------------------------------------------------------------------ untrusted text

class _Stage:
  name, index, kind = 'rl', 2, 'grpo'


def _all_strings(x):
  if isinstance(x, str):
    yield x
  elif isinstance(x, dict):
    for k, v in x.items():
      yield k
      yield from _all_strings(v)
  elif isinstance(x, list):
    for v in x:
      yield from _all_strings(v)


def test_long_and_odd_text_is_cut_and_always_encodes(tmp_path):
  cyclic = []
  cyclic.append(cyclic)
  long_completion = 'HEAD' + 'z' * 5000 + '\\boxed{42}'
  odd = 'lone \ud800 high, lone \udfff low, pair \ud83d\ude00, nul \x00, bell \x07, bom \ufeff'
  hostile = '```\n</pre><script>alert(1)</script>\n# heading\n\r\u2028end'
  info = {'stderr': 'e' * 3000, 'score': float('nan'), 'inf': np.float32('inf'),
          'arr': np.arange(3), 'np_bool': np.bool_(True), 'bytes': b'\xff\xfe', 'odd': odd,
          'cyclic': cyclic, (1, 2): 'tuple key', 'nested': {'deep': [odd, float('nan')]},
          **{f'k{i}': i for i in range(30)}}
  samples = [dict(row=0, domain='a', id='x\ud800', thinking=None, reward=np.float32(0.5),
                  length=np.int64(5012), truncated=np.bool_(True), group_kept=True,
                  prompt='P' * 3000, completion=long_completion, info=info),
             dict(row=2, domain='a', id=None, thinking=True, reward=float('nan'), length=3,
                  truncated=False, group_kept=True, prompt=hostile, completion=odd, info=None)]
  w = metrics.Writer(str(tmp_path), enabled=True)
  w.write_samples(_Stage, 7, samples)
  w.close()
  raw = (tmp_path / 'samples.jsonl').read_bytes()
  raw.decode('utf-8')                                         # strict
  a, b = _lines(tmp_path)                                     # strict: no NaN / Infinity
  for s in _all_strings([a, b]):
    s.encode('utf-8')                                         # no lone surrogate survives
    assert len(s) <= metrics.SAMPLE_TEXT_CHARS + 40
  assert (a['stage'], a['stage_index'], a['kind'], a['step']) == ('rl', 2, 'grpo', 7)
  assert (a['reward'], a['length'], a['truncated']) == (0.5, 5012, True)
  # A long text keeps its head and its tail (the final answer), and says how much was cut.
  c = a['completion']
  assert c.startswith('HEAD') and c.endswith('\\boxed{42}')
  assert f'…[{len(long_completion) - metrics.SAMPLE_TEXT_CHARS} characters cut]…' in c
  assert c.count('z') == metrics.SAMPLE_TEXT_CHARS - len('HEAD') - len('\\boxed{42}')
  assert a['prompt'].count('P') == metrics.SAMPLE_TEXT_CHARS
  # Surrogates: lone ones replaced, a pair joined into its character.
  assert b['completion'] == ('lone \ufffd high, lone \ufffd low, pair \U0001F600, nul \x00, '
                             'bell \x07, bom \ufeff')
  assert a['id'] == 'x\ufffd' and b['id'] is None and b['info'] == {}
  assert b['reward'] == 'nan' and b['prompt'] == hostile
  # The info is kept short: 16 keys, each value cut to SAMPLE_INFO_CHARS.
  inf = a['info']
  assert len(inf) == metrics.SAMPLE_INFO_KEYS + 1 and inf['…'] == f'{len(info) - 16} more keys'
  assert inf['stderr'].startswith('e' * 100) and len(inf['stderr']) < 250
  assert (inf['score'], inf['inf'], inf['arr'], inf['np_bool']) == ('nan', 'inf', '[0, 1, 2]',
                                                                     True)
  assert inf['bytes'] == repr(b'\xff\xfe') and inf['(1, 2)'] == 'tuple key'
  # Containers are kept as their JSON text (ASCII escapes: no raw surrogate inside).
  assert inf['nested'] == json.dumps({'deep': [odd, float('nan')]}) and inf['arr'] == '[0, 1, 2]'
  assert '\ufffd' in inf['odd'] and inf['cyclic'].startswith('[[')
  # TensorBoard took the same text (protobuf needs valid UTF-8) and no line escapes its block.
  ((step, tag, text),) = _tb_texts(tmp_path)
  assert (step, tag) == (7, 'rl/samples/text_summary')
  assert '\\boxed{42}' in text and '\U0001F600' in text and '\ud800' not in text
  for block in text.split('\n\n')[1::2]:
    assert all(line.startswith('    ') for line in block.split('\n'))
  assert '\n# heading' not in text and '\n</pre>' not in text


def test_cutting_is_exact_at_the_limit():
  assert metrics.clean_text('abcdef', 6) == 'abcdef'
  assert metrics.clean_text('abcdefg', 6) == 'abc …[1 characters cut]… efg'
  assert metrics.clean_text('abcdefg', 5) == 'ab …[2 characters cut]… efg'
  assert metrics.clean_text(b'\x00', 10) == "b'\\x00'"


def test_the_pipeline_cuts_its_text(fakes, tmp_path, monkeypatch):
  monkeypatch.setattr(metrics, 'SAMPLE_TEXT_CHARS', 12)
  _run_steps(fakes, tmp_path, fakes.rl_stage('rl', ['a']), fakes.OwnAnswerSampler(),
             log_samples=1)
  (l,) = _lines(tmp_path)
  full = rollout.prompt_text(fakes.record('a', 0, 10), None)
  assert l['prompt'] == f'{full[:6]} …[{len(full) - 12} characters cut]… {full[-6:]}'
  assert l['completion'] == '10'


# ------------------------------------------------------------------ the config field

def _eval(**kw):
  base = dict(num_samples=1, temperature=1.0, top_p=1.0, max_new_tokens=8, max_prompt_len=64,
              num_prompts=0, batch_size=8)
  return schema.from_mapping(config_lib.Eval, dict(base, **kw), 'config.eval', sep='.')


def test_config_eval_log_samples():
  assert _eval().log_samples == 2
  assert _eval(log_samples=0).log_samples == 0
  assert _eval(log_samples=5).log_samples == 5
  for bad in (-1, 1.5, 'two', True):
    with pytest.raises(config_lib.ConfigError, match=r'config\.eval\.log_samples='):
      _eval(log_samples=bad)
