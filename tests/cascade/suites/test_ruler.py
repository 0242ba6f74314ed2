"""RULER-style suites: generated from a seed to the length in the given tokenizer, RULER's
templates, and RULER's string-match grading."""

import dataclasses
import types

import pytest

from cascade import suites
from cascade.suites import ruler


class Bytes:
  """One token per UTF-8 byte."""

  def encode(self, text):
    return list(text.encode())


class Pairs:
  """Two tokens per UTF-8 byte: the same text is twice as long."""

  def encode(self, text):
    return list(text.encode()) * 2


def _small(name, records=3, tokenizer=Bytes()):
  return dataclasses.replace(suites.get(name), records=records).with_tokenizer(tokenizer)


def test_twenty_suites_registered_by_task_and_length():
  names = [n for n in suites.names() if n.startswith('ruler_')]
  assert len(names) == 20
  assert suites.get('ruler_vt_128k') is ruler.vt_128k and ruler.vt_128k.length == 131072
  assert suites.get('ruler_niah_single_8k').protocol.greedy
  assert ruler.qa_8k.protocol.max_new_tokens == 32
  assert ruler.vt_8k.protocol_hash() != ruler.vt_16k.protocol_hash()


@pytest.mark.parametrize('name', ['ruler_niah_single_8k', 'ruler_niah_multikey_8k',
                                  'ruler_vt_8k', 'ruler_qa_8k'])
def test_prompts_fill_the_length_in_the_tokenizer(name):
  suite = _small(name)
  budget = suite.length - ruler.ANSWER_TOKENS[suite.task]
  for r in suite.read():
    text = r['messages'][0]['content']
    assert r['metadata']['tokens'] == len(text.encode()) <= budget
    assert len(text.encode()) > budget - 400       # one more haystack unit would not fit
    for value in r['metadata']['expected']:
      assert value in text
  halved = _small(name, tokenizer=Pairs()).read()
  assert all(budget // 2 - 400 < len(r['messages'][0]['content'].encode()) <= budget // 2
             for r in halved)


def test_generation_is_deterministic_and_seeded():
  a, b = _small('ruler_vt_8k').read(), _small('ruler_vt_8k').read()
  assert a == b
  other = dataclasses.replace(_small('ruler_vt_8k'), seed=1).read()
  assert [r['metadata']['expected'] for r in other] != [r['metadata']['expected'] for r in a]


def test_128k_prompt_and_templates():
  record, = _small('ruler_niah_multikey_128k', records=1).read()
  text = record['messages'][0]['content']
  assert 131072 - 128 - 400 < len(text.encode()) <= 131072 - 128
  assert text.startswith('Some special magic numbers are hidden within the following text.')
  assert text.endswith(f'What are all the special magic numbers for {record["metadata"]["key"]} '
                       'mentioned in the provided text?')
  assert text.count('One of the special magic numbers for') == 4     # the needle, 3 distractors


def test_no_tokenizer_is_a_one_line_error():
  with pytest.raises(ValueError, match=r"suite 'ruler_vt_8k' measures lengths in the policy's "
                                       r'tokenizer: call suite.with_tokenizer'):
    ruler.vt_8k.read()
  with pytest.raises(ValueError, match=r"suite 'ruler_qa_8k': the template alone is over"):
    dataclasses.replace(ruler.qa_8k, length=40).with_tokenizer(Bytes()).read()


def test_string_match_recall_as_ruler_grades():
  vt, = _small('ruler_vt_8k', records=1).read()
  names = vt['metadata']['expected']
  qa, = _small('ruler_qa_8k', records=1).read()
  answer = qa['metadata']['expected'][0]
  grader = ruler.StringMatchGrader()
  grades = grader.grade(vt, [' '.join(names).lower(), ', '.join(names[:3]), 'none',
                             '<think>' + ' '.join(names)])
  assert [g.score for g in grades] == [1.0, 0.6, 0.0, 0.0]
  assert grades[3].info['reason'] == 'thinking block never closed'
  assert [g.score for g in grader.grade(qa, [f'<think>hm</think>It is {answer}.', 'Nowhere'])] \
      == [1.0, 0.0]
  summary = ruler.vt_8k.summarize([vt, vt], [[grades[0]], [grades[1]]])
  assert summary['value'] == pytest.approx(80.0) and summary['metric'] == 'string match'


def test_its_runners_give_it_the_policys_tokenizer(tiny_hf, tmp_path, monkeypatch):
  """`cascade.evaluate` (checkpoint.for_tokenizer) and a run (evaluation.suite_sets) read RULER's
  records with the policy's tokenizer; suites that do not need one never load it."""
  from cascade import evaluation  # pylint: disable=g-import-not-at-top
  from cascade.suites import checkpoint  # pylint: disable=g-import-not-at-top
  from foundation import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  small = dataclasses.replace(ruler.niah_single_8k, length=400, records=2)
  assert small.NEEDS_TOKENIZER and not suites.get('aime25').NEEDS_TOKENIZER
  got, plain = checkpoint.for_tokenizer([small, suites.get('aime25')],
                                        checkpoint.Source(hf_dir=str(tiny_hf)))
  assert plain is suites.get('aime25')
  tok = tokenizer_lib.load(tiny_hf)
  recs = got.read()
  assert len(recs) == 2 and all(
      len(tok.encode(r['messages'][-1]['content'])) <= 400 - ruler.ANSWER_TOKENS['niah_single']
      for r in recs)
  no_tokenizer = checkpoint.Source(hf_dir=str(tmp_path))     # nothing loadable there
  assert checkpoint.for_tokenizer([plain], no_tokenizer) == [plain]
  # A run's suite sets: the config's suites, RULER's read with the run's tokenizer.
  monkeypatch.setattr(evaluation.suites_lib, 'get', lambda name: small)
  ev = types.SimpleNamespace(suites=('ruler_niah_single_8k',), suite_data='', suite_prompts=1,
                             suite_settings=lambda name: small.protocol)
  [(suite, records)] = evaluation.suite_sets(types.SimpleNamespace(eval=ev), tok)
  assert suite.tokenizer is tok and [r['id'] for r in records] == [recs[0]['id']]
