"""The lm-evaluation-harness backend (cascade/harness.py): its log-likelihoods equal a direct
computation from the model's logits (numpy, float64), its rolling windows cover a text once, and
on a tiny HF checkpoint lm-eval runs a task built from a local jsonl (no hub) through it, scoring
by our forward and generating through our sampler."""

import functools
import math
import textwrap

import jax
import lm_eval.api.model
import numpy as np
import pytest
from flax import nnx

from cascade import harness
from cascade.suites import checkpoint
from cascade.suites import run
from models import config as config_lib
from models import transformer


WIDTH = 80          # the direct computation's row (the model's max_seq_len is 64)


class Req:
  """An lm-eval `Instance` as the backend reads it (its args)."""

  def __init__(self, *args):
    self.args = args


@pytest.fixture(scope='module')
def tiny(fakes):
  model = transformer.create(config_lib.ModelConfig.tiny(max_seq_len=64, num_layers=1), seed=3)
  graphdef, params = nnx.split(model)
  tok = fakes.CharTokenizer()
  loaded = checkpoint.Loaded(policy=run.Policy(None, None, tok, 'tiny'), graphdef=graphdef,
                             params=params, cfg=model.cfg, mesh=None, rules=None)
  return model, tok, loaded


@functools.lru_cache(maxsize=None)
def _logits_fn(graphdef):
  return jax.jit(lambda params, ids: nnx.merge(graphdef, params)(ids))


def direct(model, ids):
  """log softmax of the model's logits over the row, in numpy float64: [T-1] log-probs of each
  next token and whether it is the argmax. One causal pass over the row with no padding mask
  and nothing else in its batch: the row's ids, then filler after it (which a causal model's
  logits at the row's positions never see), so a single shape compiles."""
  t = len(ids)
  assert t <= WIDTH
  graphdef, params = nnx.split(model)
  row = np.zeros((1, WIDTH), np.int32)
  row[0, :t] = ids
  logits = np.asarray(_logits_fn(graphdef)(params, row), np.float64)[0, :t - 1]
  logp = logits - logits.max(-1, keepdims=True)
  logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
  nxt = np.asarray(ids[1:])
  return logp[np.arange(t - 1), nxt], logits.argmax(-1) == nxt


def test_loglikelihood_equals_the_models_logits_computed_directly(tiny):
  model, tok, loaded = tiny
  lm = harness.CascadeLM(loaded=loaded, batch_size=3)
  reqs = [('Copy 12 ', 'then 13'), ('Q: 2+2=', '4'), ('', 'an empty context'),
          ('a' * 80, ' tail past max_length')]          # 101 tokens: cut to the last 65
  got = lm.loglikelihood([Req(*r) for r in reqs])
  assert len(got) == 4
  for (ctx, cont), (lp, greedy) in zip(reqs, got):
    spaces = len(ctx) - len(ctx.rstrip())               # trailing space joins the continuation
    c_ids = tok.encode(ctx[:len(ctx) - spaces]) or [tok.eos_id]
    n_ids = tok.encode(ctx[len(ctx) - spaces:] + cont)
    ids = (c_ids + n_ids)[-65:]
    lps, hits = direct(model, ids)
    assert lp == pytest.approx(float(lps[-len(n_ids):].sum()), rel=1e-5, abs=1e-4)
    assert greedy == bool(hits[-len(n_ids):].all())
  # A continuation the model's argmax makes: greedy True, and its log-prob is the argmax's.
  ids = tok.encode('Copy 7')
  graphdef, params = nnx.split(model)
  row = np.zeros((1, WIDTH), np.int32)
  row[0, :len(ids)] = ids
  best = int(np.asarray(_logits_fn(graphdef)(params, row))[0, len(ids) - 1].argmax())
  (lp, greedy), = lm.loglikelihood([Req('Copy 7', chr(best))])
  assert greedy and lp == pytest.approx(float(direct(model, ids + [best])[0][-1]), abs=1e-4)
  with pytest.raises(ValueError, match='empty continuation'):
    lm.loglikelihood([Req('x', '')])


def test_rolling_loglikelihood_scores_every_token_once_over_windows(tiny):
  model, tok, loaded = tiny
  text = 'The quick brown fox jumps over the lazy dog. ' * 3      # 135 tokens, windows of 64
  lm = harness.CascadeLM(loaded=loaded, batch_size=2)
  (got,) = lm.loglikelihood_rolling([Req(text)])
  ids = tok.encode(text)
  # lm-eval's disjoint windows: every token scored once, on as much context as fits.
  import lm_eval.utils  # pylint: disable=g-import-not-at-top
  want = 0.0
  for ctx, cont in map(lm_eval.utils.make_disjoint_window,
                       lm_eval.utils.get_rolling_token_windows(ids, tok.eos_id, 64, 1)):
    whole = ctx + cont
    want += float(direct(model, whole)[0][-len(cont):].sum())
  assert got == pytest.approx(want, rel=1e-5)
  assert len(ids) > 64 and math.isfinite(got)
  assert sum(len(c) for _, c in map(lm_eval.utils.make_disjoint_window, lm_eval.utils.get_rolling_token_windows(ids, tok.eos_id, 64, 1))) == len(ids)


def _write_tasks(tmp_path):
  """Three lm-eval tasks over a local jsonl (lm-eval's `json` dataset: no hub)."""
  data = tmp_path / 'arith.jsonl'
  rows = [{'question': f'What is {a} + {a + 1}?', 'choices': [str(2 * a + 1), str(2 * a + 2)],
           'label': 0} for a in range(6)]
  data.write_text(''.join(__import__('json').dumps(r) + '\n' for r in rows))
  (tmp_path / 'tasks').mkdir()
  common = textwrap.dedent(f"""\
      dataset_path: json
      dataset_kwargs:
        data_files:
          test: {data}
      test_split: test
      doc_to_text: "{{{{question}}}} Answer:"
      """)
  (tmp_path / 'tasks' / 'arith_mc.yaml').write_text(common + textwrap.dedent("""\
      task: cascade_arith_mc
      output_type: multiple_choice
      doc_to_choice: "{{choices}}"
      doc_to_target: label
      metric_list:
        - metric: acc
      """))
  (tmp_path / 'tasks' / 'arith_gen.yaml').write_text(common + textwrap.dedent("""\
      task: cascade_arith_gen
      output_type: generate_until
      doc_to_target: "{{choices[0]}}"
      generation_kwargs:
        until: ["\\n"]
        max_gen_toks: 8
        do_sample: false
      metric_list:
        - metric: exact_match
      """))
  (tmp_path / 'tasks' / 'arith_ppl.yaml').write_text(common.replace(
      'doc_to_text: "{{question}} Answer:"', '') + textwrap.dedent("""\
      task: cascade_arith_ppl
      output_type: loglikelihood_rolling
      doc_to_text: ""
      doc_to_target: "{{question}}"
      metric_list:
        - metric: word_perplexity
      """))
  return tmp_path / 'tasks'


@pytest.mark.heavy
def test_lm_eval_runs_a_local_task_on_a_tiny_checkpoint(tiny_hf, tmp_path):
  import lm_eval  # pylint: disable=g-import-not-at-top
  from lm_eval import tasks as lm_tasks  # pylint: disable=g-import-not-at-top
  _write_tasks(tmp_path)
  lm = harness.CascadeLM(checkpoint=str(tiny_hf), batch_size=4)
  manager = lm_tasks.TaskManager(include_path=str(tmp_path / 'tasks'))
  out = lm_eval.simple_evaluate(model=lm, tasks=['cascade_arith_mc', 'cascade_arith_gen',
                                                 'cascade_arith_ppl'],
                                task_manager=manager, log_samples=True)
  res = out['results']
  # Multiple choice: acc is the share of questions whose right choice has the higher
  # log-likelihood, each the backend's own loglikelihood of that pair.
  samples = out['samples']['cascade_arith_mc']
  assert len(samples) == 6
  acc = np.mean([float(np.argmax([r[0] for r in s['filtered_resps']]) == 0) for s in samples])
  assert res['cascade_arith_mc']['acc,none'] == pytest.approx(acc)
  s = samples[0]
  got = lm.loglikelihood([Req(*a) for a in s['arguments'].values()] if isinstance(
      s['arguments'], dict) else [Req(*a) for a in s['arguments']])
  assert [g[0] for g in got] == pytest.approx([r[0] for r in s['filtered_resps']], abs=1e-5)
  # Generation went through our sampler, greedily, cut at the task's newline.
  gen = out['samples']['cascade_arith_gen']
  assert len(gen) == 6 and all('\n' not in g['filtered_resps'][0] for g in gen)
  assert 0.0 <= res['cascade_arith_gen']['exact_match,none'] <= 1.0
  assert math.isfinite(res['cascade_arith_ppl']['word_perplexity,none'])
  # The same prompts give the same greedy text again (deterministic decoding).
  again = lm.generate_until([Req(g['arguments']['gen_args_0']['arg_0']
                                 if isinstance(g['arguments'], dict) else g['arguments'][0][0],
                                 {'until': ['\n'], 'max_gen_toks': 8, 'do_sample': False})
                             for g in gen])
  assert again == [g['resps'][0][0] for g in gen]


def _samples(out_dir) -> dict[str, list]:
  """lm-eval's --log_samples files under out_dir: task -> (doc_id, resps, filtered_resps) rows."""
  import json  # pylint: disable=g-import-not-at-top
  out = {}
  for path in sorted(out_dir.rglob('samples_*.jsonl')):
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    task = path.name[len('samples_'):].rsplit('_', 1)[0]
    out[task] = sorted((r['doc_id'], r['resps'], r['filtered_resps']) for r in rows)
  return out


@pytest.mark.heavy
def test_lm_eval_console_script_runs_the_cascade_model_as_the_module_command_does(
    tiny_hf, tmp_path, hooked_python):
  """`lm_eval --model cascade --model_args checkpoint=DIR` (docs/evaluation.md): lm-eval's own
  console script, the model found through the installed hook (cascade/lm_eval_hook.py), gives
  the numbers `python -m cascade.harness run` gives, sample by sample (log-likelihoods and
  generations); a missing checkpoint is one line. Where this Python has no cascade-lm-eval.pth
  (cascade not installed since the hook came), the script runs under `hooked_python`, a Python
  with the same line in its site-packages."""
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  import site  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from cascade import lm_eval_hook  # pylint: disable=g-import-not-at-top
  tasks = _write_tasks(tmp_path)
  repo = pathlib.Path(__file__).resolve().parents[3]
  env = {k: v for k, v in os.environ.items() if not k.startswith('PYTHON')}
  env.update(PYTHONPATH=str(repo), JAX_PLATFORMS='cpu')
  script = pathlib.Path(sys.executable).parent / 'lm_eval'
  assert script.is_file(), f'no lm_eval console script beside {sys.executable}'
  installed = any((pathlib.Path(d) / lm_eval_hook.PTH_NAME).is_file()
                  for d in site.getsitepackages())
  lm_eval_cmd = [str(script)] if installed else [str(hooked_python), str(script)]
  common = ['--model', 'cascade', '--model_args', f'checkpoint={tiny_hf},batch_size=4',
            '--tasks', 'cascade_arith_mc,cascade_arith_gen', '--include_path', str(tasks),
            '--limit', '4', '--log_samples']
  results = {}
  for name, cmd in (('lm_eval', lm_eval_cmd),
                    ('module', [sys.executable, '-m', 'cascade.harness', 'run'])):
    out = subprocess.run(cmd + common + ['--output_path', str(tmp_path / name)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, (name, out.stderr[-3000:])
    assert 'cascade_arith_mc' in out.stdout and '|acc' in out.stdout.replace(' ', '')
    (result,) = list((tmp_path / name).rglob('results_*.json'))
    results[name] = (json.loads(result.read_text())['results'], _samples(tmp_path / name))
  (res, samples), (want_res, want_samples) = results['lm_eval'], results['module']
  assert set(samples) == {'cascade_arith_mc', 'cascade_arith_gen'}
  assert [len(v) for v in samples.values()] == [4, 4]
  assert samples == want_samples                   # every log-likelihood and generation
  for task in samples:
    assert {k: v for k, v in res[task].items() if k != 'alias'} == {
        k: v for k, v in want_res[task].items() if k != 'alias'}
  assert 0.0 <= res['cascade_arith_mc']['acc,none'] <= 1.0
  bad = subprocess.run(lm_eval_cmd + ['--model', 'cascade', '--tasks', 'cascade_arith_mc',
                                      '--include_path', str(tasks)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
                       check=False)
  assert bad.returncode != 0 and 'model_args needs checkpoint=DIR' in bad.stderr


def test_the_hooks_placeholder_becomes_the_class_and_lm_eval_finds_it():
  """cascade/lm_eval_hook.py registers 'cascade.harness:CascadeLM' before this module may be
  imported; importing it upgrades the name to the class (lm-eval's placeholder upgrade), and
  registering again adds nothing."""
  import lm_eval.api.registry as registry  # pylint: disable=g-import-not-at-top
  from cascade import lm_eval_hook  # pylint: disable=g-import-not-at-top
  assert registry.get_model('cascade') is harness.CascadeLM
  fresh = registry.Registry('model', base_cls=lm_eval.api.model.LM)
  assert lm_eval_hook.register(fresh) and not lm_eval_hook.register(fresh)
  assert dict(fresh.items())['cascade'] == 'cascade.harness:CascadeLM'
  fresh.register('cascade')(harness.CascadeLM)      # what importing cascade.harness does
  assert fresh.get('cascade') is harness.CascadeLM
  assert not lm_eval_hook.register(fresh)


def test_model_args_batch_size_wins_over_the_command_lines_own(tiny):
  """lm-eval's CLI passes --batch_size (1 unless given, as text when given) beside
  --model_args; model_args' batch_size= wins instead of clashing, and a bad one is one line."""
  loaded = tiny[2]
  make = harness.CascadeLM.create_from_arg_string
  assert make('batch_size=4', {'loaded': loaded, 'batch_size': 1}).batch_size == 4
  assert make('', {'loaded': loaded, 'batch_size': '16', 'device': None}).batch_size == 16
  assert make('batch_size=auto', {'loaded': loaded}).batch_size == 8
  assert harness.CascadeLM.create_from_arg_obj(
      {'batch_size': 2}, {'loaded': loaded, 'batch_size': 'auto:4'}).batch_size == 2
  for bad in ('0', 'many', True):
    with pytest.raises(harness.config_lib.ConfigError, match='batch_size='):
      harness.CascadeLM(loaded=loaded, batch_size=bad)


def test_lm_eval_reads_no_model_plugins_so_the_backend_registers_through_a_pth_hook():
  """docs/evaluation.md says why `lm_eval --model cascade` goes through a .pth start-up hook:
  lm-eval finds models only in its own MODEL_MAPPING and reads no entry-point group. This fails
  once an installed lm-eval reads entry points (then an entry point in setup.py should replace
  the hook)."""
  import importlib.metadata  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top

  import lm_eval  # pylint: disable=g-import-not-at-top
  import lm_eval.models  # pylint: disable=g-import-not-at-top
  root = pathlib.Path(lm_eval.__file__).parent
  readers = sorted(str(p.relative_to(root)) for p in root.rglob('*.py')
                   if 'tasks' not in p.relative_to(root).parts
                   and 'entry_points(' in p.read_text(encoding='utf-8', errors='replace'))
  assert not readers, f'lm-eval {lm_eval.__version__} now reads entry points in {readers}'
  assert 'cascade' not in lm_eval.models.MODEL_MAPPING
  dist = importlib.metadata.distribution('lm_eval')
  assert {e.group for e in dist.entry_points} == {'console_scripts'}
