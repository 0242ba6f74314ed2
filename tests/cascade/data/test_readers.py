"""Dataset readers, format adapters, malformed-record errors and the resumable grain loader."""

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cascade import config as config_lib
from cascade.data import readers


def spec(path='', fmt='prompt', domain='math', name='ds', **kw):
  return config_lib.Dataset(name=name, format=fmt, record_type=readers.FORMATS[fmt].record_type,
                            path=str(path), domain=domain, **kw)


def write_jsonl(path, rows):
  with open(path, 'w') as f:
    for r in rows:
      f.write((r if isinstance(r, str) else json.dumps(r)) + '\n')
  return path


def user(text):
  return [{'role': 'user', 'content': text}]


def test_canonical_records_and_defaults(tmp_path):
  p = write_jsonl(tmp_path / 'a.jsonl', [
      {'id': 'q1', 'messages': user('1+1?'), 'metadata': {'answer': '2'}},
      {'messages': user('2+2?'), 'metadata': {'answer': '4'}, 'domain': 'other'},
  ])
  recs = readers.load(spec(p), domains=['math', 'other'])
  assert recs[0] == {'id': 'q1', 'domain': 'math', 'messages': user('1+1?'),
                     'metadata': {'answer': '2'}}
  assert recs[1]['id'] == 'ds:1' and recs[1]['domain'] == 'other'

  sft = write_jsonl(tmp_path / 's.jsonl', [{'messages': user('hi'), 'response': 'hello',
                                            'thinking': 'greet'}])
  assert readers.load(spec(sft, 'sft'))[0]['thinking'] == 'greet'
  pref = write_jsonl(tmp_path / 'p.jsonl', [{'messages': user('hi'), 'chosen': 'a',
                                             'rejected': 'b'}])
  assert readers.load(spec(pref, 'preference'))[0]['chosen'] == 'a'


def test_parquet_reader(tmp_path):
  rows = [{'question': 'Tom has 3 apples and buys 4. How many?',
           'answer': 'He has 3+4=7.\n#### 7'},
          {'question': 'What is 1,000 + 1?', 'answer': '... #### 1,001'}]
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / 'g.parquet')
  recs = readers.load(spec(tmp_path / 'g.parquet', 'gsm8k'))
  assert recs[0]['metadata'] == {'answer': '7'}
  assert recs[1]['metadata'] == {'answer': '1001'}
  assert recs[0]['messages'][0]['content'].startswith('Tom has 3 apples')
  assert '\\boxed{}' in recs[0]['messages'][0]['content']


def test_common_format_adapters(tmp_path):
  he = write_jsonl(tmp_path / 'he.jsonl', [{
      'task_id': 'HumanEval/0', 'prompt': 'def f(x):\n  """Doubles x."""\n',
      'test': 'def check(c):\n  assert c(2) == 4\n', 'entry_point': 'f',
      'canonical_solution': '  return 2 * x\n'}])
  rec = readers.load(spec(he, 'humaneval', domain='code'))[0]
  assert rec['id'] == 'HumanEval/0'
  assert rec['metadata'] == {'prompt': 'def f(x):\n  """Doubles x."""\n',
                             'test': 'def check(c):\n  assert c(2) == 4\n', 'entry_point': 'f'}
  assert 'def f(x)' in rec['messages'][0]['content']

  ife = write_jsonl(tmp_path / 'if.jsonl', [{
      'key': 1000, 'prompt': 'Write a poem in all caps.',
      'instruction_id_list': ['change_case:english_capital', 'length_constraints:number_words'],
      'kwargs': [{}, {'relation': 'at least', 'num_words': 30, 'keyword': None}]}])
  rec = readers.load(spec(ife, 'ifeval', domain='if'))[0]
  assert rec['id'] == '1000'
  assert rec['metadata']['kwargs'] == [{}, {'relation': 'at least', 'num_words': 30}]

  nm = write_jsonl(tmp_path / 'nm.jsonl', [
      {'uuid': 'u1', 'question': 'Find x.', 'expected_answer': '\\frac{1}{2}',
       'responses_create_params': {'input': [{'role': 'user', 'content': 'Find x. Box it.'}]}},
      {'problem': 'Find y.', 'answer': 3}])
  recs = readers.load(spec(nm, 'nemotron_math'))
  assert recs[0]['id'] == 'u1' and recs[0]['messages'] == user('Find x. Box it.')
  assert recs[0]['metadata'] == {'answer': '\\frac{1}{2}'}
  assert recs[1]['metadata'] == {'answer': '3'}
  assert recs[1]['messages'][0]['content'].startswith('Find y.')

  nif = write_jsonl(tmp_path / 'nif.jsonl', [{
      'id': 7, 'instruction_id_list': ['keywords:existence'], 'kwargs': [None],
      'responses_create_params': {'input': [{'role': 'system', 'content': 'Be brief.'},
                                            {'role': 'user', 'content': 'Say hi.'}]}}])
  rec = readers.load(spec(nif, 'nemotron_if', domain='if'))[0]
  assert rec['messages'][0]['role'] == 'system' and rec['metadata']['kwargs'] == [{}]


def test_nemotron_if_reads_allenai_if_rlvr_rows(tmp_path):
  # allenai/IF_multi_constraints_upto5: 'messages' and a 'ground_truth' string holding a
  # one-item list, written as Python's repr (single quotes, None) or as JSON.
  gt = {'instruction_id': ['punctuation:no_comma', 'copy:repeat_phrase'],
        'kwargs': [None, {'phrase': 'a b c', 'small_n': 2, 'N': None}]}
  rows = [{'key': 'ifeval_1', 'messages': user('Say it.'), 'ground_truth': str([gt]),
           'dataset': 'ifeval', 'constraint_type': 'x', 'constraint': 'y'},
          {'messages': user('Say it.'), 'ground_truth': json.dumps([json.dumps(gt)])}]
  recs = readers.load(spec(write_jsonl(tmp_path / 'r.jsonl', rows), 'nemotron_if', domain='if'))
  assert recs[0]['id'] == 'ifeval_1' and recs[0]['messages'] == user('Say it.')
  for rec in recs:
    assert rec['metadata'] == {'instruction_id_list': gt['instruction_id'],
                               'kwargs': [{}, {'phrase': 'a b c', 'small_n': 2}]}


@pytest.mark.parametrize('ground_truth, message', [
    ('[{"instruction_id": ["a"], "kwargs": [{}]}, {}]',
     "field 'ground_truth' holds 2 constraint sets; expected one"),
    ("[{'instruction_id': ['a'], 'kwargs': []}]",
     "ground_truth: field 'kwargs' must be a list with one entry per instruction"),
    ('[__import__("os")]', "field 'ground_truth' is neither JSON nor a Python literal"),
    ('[3]', "field 'ground_truth' must hold an object with 'instruction_id'"),
    ('[' * 100_000, "field 'ground_truth' is"),
])
def test_nemotron_if_refuses_malformed_ground_truth(tmp_path, ground_truth, message):
  p = write_jsonl(tmp_path / 'g.jsonl', [{'messages': user('x'), 'ground_truth': ground_truth}])
  with pytest.raises(readers.DataError, match=re.escape(':1: ' + message)):
    readers.load(spec(p, 'nemotron_if', domain='if'))


def test_tfds_data_source_with_mock_data():
  tfds = pytest.importorskip('tensorflow_datasets')
  import tensorflow_datasets.text  # noqa: F401  (registers gsm8k)
  ds = config_lib.Dataset(name='gsm', format='gsm8k', record_type='prompt', tfds='gsm8k',
                          split='train', domain='math')
  with tfds.testing.mock_data(num_examples=5):
    recs = readers.load(ds)
  assert len(recs) == 5
  assert all(r['metadata']['answer'] and r['domain'] == 'math' for r in recs)


@pytest.mark.parametrize('line,fmt,message', [
    ('{"messages": [', 'prompt', ':2: not valid JSON'),
    ('[1, 2]', 'prompt', ':2: a record must be a JSON object'),
    ('{"metadata": {}}', 'prompt', ":2: missing field 'messages'"),
    ('{"messages": "hi", "metadata": {}}', 'prompt', ":2: field 'messages' must be a non-empty list"),
    ('{"messages": [{"role": "bot", "content": "x"}], "metadata": {}}', 'prompt',
     ":2: messages[0].role='bot'"),
    ('{"messages": [{"role": "user", "content": "x"}], "metadata": [1]}', 'prompt',
     ":2: field 'metadata' must be an object"),
    ('{"messages": [{"role": "user", "content": "x"}]}', 'sft', ":2: missing field 'response'"),
    ('{"messages": [{"role": "user", "content": "x"}], "response": 3}', 'sft',
     ":2: field 'response' must be a string, got int"),
    ('{"question": "q", "answer": "no final answer"}', 'gsm8k', ":2: field 'answer' has no '####"),
    ('{"key": 1, "prompt": "p", "instruction_id_list": ["a", "b"], "kwargs": [{}]}', 'ifeval',
     ":2: field 'kwargs' must be a list with one entry per instruction"),
    ('{"messages": [{"role": "user", "content": "x"}], "metadata": {}, "domain": "poetry"}',
     'prompt', ":2: domain 'poetry' is not a configured domain"),
])
def test_malformed_record_names_file_and_line(tmp_path, line, fmt, message):
  good = {'prompt': {'messages': user('ok'), 'metadata': {'answer': '1'}},
          'sft': {'messages': user('ok'), 'response': 'fine'},
          'gsm8k': {'question': 'q', 'answer': '#### 1'},
          'ifeval': {'key': 0, 'prompt': 'p', 'instruction_id_list': ['a'], 'kwargs': [{}]}}[fmt]
  p = write_jsonl(tmp_path / 'bad.jsonl', [good, line])
  with pytest.raises(readers.DataError) as e:
    readers.load(spec(p, fmt), domains=['math'])
  assert str(p) + message in str(e.value), str(e.value)


def test_metadata_rejected_by_verifier_names_record(tmp_path):
  p = write_jsonl(tmp_path / 'm.jsonl', [
      {'messages': user('a'), 'metadata': {'answer': '1'}},
      {'messages': user('b'), 'metadata': {'solution': '1'}}])
  def check(domain, md, where):
    if 'answer' not in md:
      raise ValueError(f"{where}: metadata['answer'] is missing")
  with pytest.raises(readers.DataError, match=r"m\.jsonl:2: metadata\['answer'\] is missing "
                                           r"\(rejected by the 'math' verifier\)"):
    readers.load(spec(p), check_metadata=check)


def test_missing_file_and_limit(tmp_path):
  with pytest.raises(readers.DataError, match='no such file'):
    readers.load(spec(tmp_path / 'nope.jsonl'))
  p = write_jsonl(tmp_path / 'a.jsonl', [{'messages': user(str(i)), 'metadata': {}}
                                          for i in range(10)])
  assert len(readers.load(spec(p, limit=3))) == 3
  # skip leaves out the first rows, then limit counts kept records.
  got = readers.load(spec(p, skip=4, limit=3, name='val'))
  assert [r['messages'][0]['content'] for r in got] == ['4', '5', '6']
  assert [r['id'] for r in got] == ['val:0', 'val:1', 'val:2']
  with pytest.raises(readers.DataError, match='holds no records'):
    readers.load(spec(p, skip=10))


def test_loader_is_seeded_reshuffles_epochs_and_resumes():
  recs = [{'id': str(i)} for i in range(10)]
  ids = lambda batch: [r['id'] for r in batch]
  a = readers.Loader(recs, seed=1, batch_size=4)
  first = [ids(a.next()) for _ in range(5)]                    # 20 draws = 2 epochs
  b = readers.Loader(recs, seed=1, batch_size=4)
  assert [ids(b.next()) for _ in range(5)] == first            # seeded
  flat = sum(first, [])
  assert sorted(flat[:10]) == sorted(str(i) for i in range(10))  # an epoch is a permutation
  assert flat[:10] != flat[10:20]                              # a fresh one each epoch
  assert ids(readers.Loader(recs, seed=2, batch_size=4).next()) != first[0]

  c = readers.Loader(recs, seed=1, batch_size=4)
  c.next(), c.next()
  state = json.loads(json.dumps(c.get_state()))                # JSON-able
  d = readers.Loader(recs, seed=1, batch_size=4)
  d.set_state(state)
  assert [ids(d.next()) for _ in range(3)] == first[2:]


@pytest.mark.parametrize('raw, message', [
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}], "metadata": {}}', ':2: not UTF-8'),
    (b'[' * 100_000 + b']' * 100_000, ':2: '),
    (b'{"messages": [{"role": "user", "content": "x\\ud800"}], "metadata": {}}',
     ':2: a string holds a lone surrogate'),
    (b'{"messages": [{"role": "user", "content": "x"}], "metadata": {"\\udfff": 1}}',
     ':2: a string holds a lone surrogate'),
])
def test_undecodable_lines_name_file_and_line(tmp_path, raw, message):
  """Bytes that are not UTF-8, nesting past the decoder's depth and lone surrogates."""
  p = tmp_path / 'bad.jsonl'
  good = json.dumps({'messages': user('ok'), 'metadata': {'answer': '1'}}).encode()
  p.write_bytes(good + b'\n' + raw + b'\n')
  with pytest.raises(readers.DataError) as e:
    readers.load(spec(p, 'prompt'), domains=['math'])
  assert str(p) + message in str(e.value), str(e.value)
