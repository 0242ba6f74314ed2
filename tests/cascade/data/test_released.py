"""The released Nemotron-Cascade datasets read as they are (cascade/data/released.py).

Small files written in the releases' schemas (cascade/data/released.py says which
field names are seen in NeMo-Gym or third-party loaders and which inferred) load
through `cascade.data.readers.load` with the paper configs' own dataset specs, and every
record passes its domain's verifier check; the mappings are checked value by
value, scored by the real verifiers where that is cheap, and every unknown
value is a one-line error naming the field.
"""

import glob
import importlib
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cascade import config as config_lib
from cascade import verifier_set
from cascade.data import readers
from cascade.data import released
from cascade.kinds import sft
from foundation import chat
import verifiers

GOLD_PATCH = ('--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n'
              '-    return a - b\n+    return a + b\n')
SCHEMA = {'type': 'object', 'properties': {'name': {'type': 'string'},
                                             'age': {'type': 'integer'}}}
TOOLS_FLAT = [  # the Responses API's flat function form, as NeMo-Gym's workplace rows list tools
    {'type': 'function', 'name': 'email_send_email', 'description': 'Sends an email.',
     'parameters': {'type': 'object', 'properties': {
         'recipient': {'type': 'string'}, 'subject': {'type': 'string'},
         'body': {'type': 'string'}}, 'required': ['recipient', 'subject', 'body'],
         'additionalProperties': False}, 'strict': False}]
GYM_IF = {'type': 'responses_api_agents', 'name': 'instruction_following_simple_agent'}


def _gym_input(*messages):
  return {'input': [{'role': r, 'content': c} for r, c in messages], 'tools': [],
          'parallel_tool_calls': False}


# ---------------------------------------------------------------- rows in the releases' schemas

def sft_plain():
  return {'messages': [
      {'role': 'system', 'content': 'You are a helpful and harmless assistant.'},
      {'role': 'user', 'content': 'What is 2 + 3?'},
      {'role': 'assistant', 'content': '<think>\n2 plus 3 is 5.\n</think>\n\nThe answer is 5.'}],
      'category': 'math', 'license': 'cc-by-4.0', 'uuid': 'u-1'}


def sft_instruct():
  return {'messages': [{'role': 'user', 'content': 'Say hi.'},
                       {'role': 'assistant', 'content': '<think>\n\n</think>\n\nHi!'}]}


def sft_tools():
  return {'messages': [
      {'role': 'system', 'content': 'You can send emails.'},
      {'role': 'user', 'content': 'Email Raj that the build is green.'},
      {'role': 'assistant', 'content': '<think>\nUse the tool.\n</think>\n\n', 'tool_calls': [
          {'id': 'call_0', 'type': 'function', 'function': {
              'name': 'email_send_email',
              'arguments': '{"recipient": "raj@atlas.com", "subject": "Build", '
                           '"body": "green"}'}}]},
      {'role': 'tool', 'tool_call_id': 'call_0', 'content': '{"status": "sent"}'},
      {'role': 'assistant', 'content': 'Done: Raj has been emailed.'}],
      'tools': json.dumps([{'type': 'function', 'function': {
          'name': 'email_send_email', 'description': 'Sends an email.',
          'parameters': TOOLS_FLAT[0]['parameters']}}])}


def c1_rlhf():
  return {'prompt': [{'role': 'user', 'content': 'Write a haiku about tides.'}], 'source': 'x'}


def c1_if():
  return {'id': 7, 'prompt': [{'role': 'user', 'content': 'Describe Paris in lowercase.'}],
          'instruction_id_list': ['change_case:english_lowercase', 'length_constraints:number_words'],
          'kwargs': [None, {'num_words': 50, 'relation': 'less than', 'keyword': None}]}


def c1_math():
  return {'problem': 'Compute 7 * 6.', 'answer': '42', 'source': 'aops'}


def c1_swe():
  return {'instance_id': 'calc__calc-1', 'problem_statement': 'add() subtracts.',
          'relevant_file_contents': {'calc.py': 'def add(a, b):\n    return a - b\n'},
          'patch': GOLD_PATCH}


def c2_if():
  text = 'Describe Rome. Your response should be in lowercase letters.'
  return {'id': 8654, 'instruction_id_list': ['change_case:english_lowercase'], 'prompt': text,
          'kwargs': [{}], 'responses_create_params': _gym_input(('user', text)),
          'agent_ref': GYM_IF}


def c2_mcqa():
  return {'uuid': 'q-1', 'responses_create_params': _gym_input(
      ('user', 'Which gas do plants absorb?\nA) Oxygen\nB) Carbon dioxide\nC) Helium')),
      'options': [{'A': 'Oxygen'}, {'B': 'Carbon dioxide'}, {'C': 'Helium'}],
      'expected_answer': 'B', 'grading_mode': 'lenient_boxed', 'template_metadata': None,
      'agent_ref': {'type': 'responses_api_agents', 'name': 'mcqa_simple_agent'}}


def c2_structured():
  return {'responses_create_params': _gym_input(('user', 'Give a person as JSON.')),
          'schema_str': json.dumps(SCHEMA), 'schema_type': 'json', 'schema_fields_count': 2,
          'agent_ref': {'type': 'responses_api_agents', 'name': 'structured_outputs_simple_agent'}}


def c2_workplace():
  params = _gym_input(('system', "Today's date is Thursday, 2023-11-30."),
                      ('user', 'Email raj@atlas.com that the build is green.'))
  params['tools'] = TOOLS_FLAT
  return {'id': 297, 'responses_create_params': params, 'ground_truth': [
      {'name': 'email_send_email',
       'arguments': '{"recipient": "raj@atlas.com", "subject": "Build", "body": "green"}'}],
      'category': 'workplace_assistant_email', 'environment_name': 'workbench',
      'agent_ref': {'type': 'responses_api_agents', 'name': 'workplace_assistant_simple_agent'}}


def c2_mopd_math():
  return {'dataset': 'acereason', 'question': 'Compute 2^10.', 'expected_answer': 1024,
          'agent_ref': {'type': 'responses_api_agents', 'name': 'math_with_judge_simple_agent'}}


# dataset name -> rows of its release (the configs name these datasets; CASCADE*_RELEASE).
CASCADE1_ROWS = {
    'sft_stage1': [sft_plain(), sft_instruct()], 'sft_stage2': [sft_plain(), sft_tools()],
    'sft_swe': [sft_plain()], 'rlhf_train': [c1_rlhf()], 'if_train': [c1_if()],
    'math_train': [c1_math()], 'swe_train': [c1_swe()]}
CASCADE2_ROWS = {
    'sft_stage1': [sft_plain(), sft_tools()], 'if_train': [c2_if()],
    'multi_domain_train': [c2_mcqa(), c2_structured(), c2_workplace()],
    'mopd_train': [c2_mopd_math(), c2_if(), c2_mcqa(), c2_structured(), c2_workplace()]}
# Stage datasets that are no Nemotron-Cascade release (docs/released_data.md: staged in the canonical formats).
NOT_RELEASED = {'rm_pairs', 'code_train', 'ifbench_train', 'long_context_train', 'rlhf_train',
                'swe_agent_train'}


def _write_jsonl(path, rows):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    for r in rows:
      f.write(json.dumps(r) + '\n')


def _file_for(pattern: str) -> str:
  """A file name the config's path (a file or a glob) names."""
  return pattern.replace('*/*', 'subset/part').replace('*', 'train')


def _checker(plan):
  vs = verifier_set.VerifierSet(plan, rm_scorer=lambda stage: None, rm_ready=lambda s: False)
  return vs.check_metadata


@pytest.mark.parametrize('name,rows', [('nemotron_cascade_14b', CASCADE1_ROWS),
                                       ('nemotron_cascade_8b', CASCADE1_ROWS),
                                       ('nemotron_cascade2', CASCADE2_ROWS)])
def test_every_stage_of_the_paper_configs_reads_the_released_files(tmp_path, name, rows):
  """Each stage's released datasets load through `readers.load` with the config's own spec, and
  every record passes its domain's verifier check; each RL stage finds records of each of its
  domains that train on a release."""
  c = importlib.import_module(f'configs.{name}').get_config(f'data_root={tmp_path}')
  plan = config_lib.validate(c)
  released_sets = {n for n, s in plan.datasets.items() if s.format in released.ADAPTERS}
  assert released_sets == set(rows)
  for n in released_sets:
    _write_jsonl(_file_for(plan.datasets[n].path), rows[n])
  check = _checker(plan)
  loaded = {n: readers.load(plan.datasets[n], domains=list(plan.domains), check_metadata=check)
            for n in released_sets}
  for n, recs in loaded.items():
    assert len(recs) == len(rows[n])
  for st in plan.stages:
    for ds in st.datasets:
      if ds in NOT_RELEASED:
        continue
      assert ds in loaded, f'stage {st.name}: dataset {ds} is neither released nor listed'
      if st.BY_DOMAIN:
        for d in st.domains:
          if plan.domains[d].train == ds:
            assert any(r['domain'] == d for r in loaded[ds]), (st.name, d)
  if name == 'nemotron_cascade2':
    # MOPD trains every domain of its subset (math, IF, MCQA, workplace, structured output).
    mopd = plan.stage('mopd')
    assert {r['domain'] for r in loaded['mopd_train']} <= set(mopd.domains)


def test_released_paths_are_under_the_download_directories():
  """The config names each release by its Hugging Face name under data_root, the directory
  `huggingface-cli download ... --local-dir $DATA/<name>` fills."""
  c1 = importlib.import_module('configs.nemotron_cascade_14b').get_config('data_root=/D')
  c2 = importlib.import_module('configs.nemotron_cascade2').get_config('data_root=/D')
  assert c1.datasets['math_train']['path'] == '/D/Nemotron-Cascade-RL-Math/*.jsonl'
  assert c1.datasets['sft_swe']['path'] == '/D/Nemotron-Cascade-SFT-SWE/*.jsonl'
  assert c2.datasets['mopd_train']['path'] == '/D/Nemotron-Cascade-2-RL-data/MOPD/train.jsonl'
  assert c2.datasets['sft_stage1']['path'] == '/D/Nemotron-Cascade-2-SFT-Data/*/*.jsonl'


# ---------------------------------------------------------------- the mappings, value by value

def test_sft_single_answer_keeps_the_reasoning_as_thinking():
  rec = released.adapt_sft(sft_plain())
  assert rec == {'id': 'u-1', 'messages': [
      {'role': 'system', 'content': 'You are a helpful and harmless assistant.'},
      {'role': 'user', 'content': 'What is 2 + 3?'}],
      'response': 'The answer is 5.', 'thinking': '2 plus 3 is 5.'}
  # An empty thinking block is an instruct-mode answer: no 'thinking', the answer alone.
  assert released.adapt_sft(sft_instruct()) == {
      'messages': [{'role': 'user', 'content': 'Say hi.'}], 'response': 'Hi!'}
  # reasoning_content (OpenAI's field) reads the same as a <think> block.
  row = sft_plain()
  row['messages'][2] = {'role': 'assistant', 'content': 'The answer is 5.',
                        'reasoning_content': '2 plus 3 is 5.'}
  assert released.adapt_sft(row) == released.adapt_sft(sft_plain())


def test_sft_tool_conversation_is_a_demonstration_with_its_calls_and_results():
  rec = released.adapt_sft(sft_tools())
  call = chat.render_tool_call('email_send_email', {
      'recipient': 'raj@atlas.com', 'subject': 'Build', 'body': 'green'})
  assert rec['messages'] == [{'role': 'system', 'content': 'You can send emails.'},
                             {'role': 'user', 'content': 'Email Raj that the build is green.'}]
  assert rec['turns'] == [{'role': 'assistant', 'content': call},
                          {'role': 'tool', 'content': '{"status": "sent"}'},
                          {'role': 'assistant', 'content': 'Done: Raj has been emailed.'}]
  assert rec['tools'][0]['function']['name'] == 'email_send_email'
  # Without a tools column (the system turn describes them) it is the same demonstration.
  no_schemas = released.adapt_sft({k: v for k, v in sft_tools().items() if k != 'tools'})
  assert no_schemas == {k: v for k, v in rec.items() if k != 'tools'}
  # A conversation whose `tools` column is empty (an empty list or its text) has none.
  for empty in ('', '[]', []):
    assert 'tools' not in released.adapt_sft(dict(sft_plain(), tools=empty))
  # The demonstration's opening renders with its tools, and the learned call parses back.
  assert 'email_send_email' in chat.render(rec['messages'], tools=rec['tools'])
  parsed = chat.parse_tool_calls(rec['turns'][0]['content'])
  assert [(c.name, c.arguments) for c in parsed.calls] == [
      ('email_send_email', {'recipient': 'raj@atlas.com', 'subject': 'Build', 'body': 'green'})]


def test_sft_multi_turn_context_keeps_earlier_tool_calls_and_results():
  """Only what follows the last user message is learned; earlier turns are the prompt."""
  row = sft_tools()
  row['messages'] += [{'role': 'user', 'content': 'Thanks!'},
                      {'role': 'assistant', 'content': "You're welcome."}]
  row.pop('tools')
  rec = released.adapt_sft(row)
  assert rec['response'] == "You're welcome." and 'turns' not in rec
  assert [m['role'] for m in rec['messages']] == ['system', 'user', 'assistant', 'tool',
                                                  'assistant', 'user']
  assert rec['messages'][2]['tool_calls'][0]['arguments']['recipient'] == 'raj@atlas.com'
  assert '<tool_response>\n{"status": "sent"}\n</tool_response>' in chat.render(rec['messages'])


def test_sft_records_train_on_the_answer_and_calls_only(fakes):
  """Through the SFT stage's tokenization (cascade/kinds/sft.py): the learned tokens are the
  reasoning and answer, or the demonstration's assistant turns; prompts and tool results
  are context."""
  tok = fakes.CharTokenizer()

  def learned(rec):
    toks, mask = sft.example(rec, tok, True, 100_000)
    return tok.decode([t for t, m in zip(toks, mask) if m])

  plain = learned(released.adapt_sft(sft_plain()))
  assert '2 plus 3 is 5.' in plain and plain.rstrip().endswith(f'The answer is 5.{chat.IM_END}')
  assert 'What is 2 + 3?' not in plain
  tools = learned(released.adapt_sft(sft_tools()))
  call = chat.render_tool_call('email_send_email', {
      'recipient': 'raj@atlas.com', 'subject': 'Build', 'body': 'green'})
  assert tools == f'{call}{chat.IM_END}Done: Raj has been emailed.{chat.IM_END}'


def test_cascade1_rl_rows_map_to_their_verifier_metadata():
  assert released.adapt_cascade1_rl_math(c1_math()) == {
      'messages': [{'role': 'user', 'content': f'Compute 7 * 6.\n{released.BOXED_INSTRUCTION}'}],
      'metadata': {'answer': '42'}}
  rec = released.adapt_cascade1_rl_if(c1_if())
  assert rec['id'] == '7' and rec['messages'][0]['content'] == 'Describe Paris in lowercase.'
  assert rec['metadata'] == {
      'instruction_id_list': ['change_case:english_lowercase', 'length_constraints:number_words'],
      'kwargs': [{}, {'num_words': 50, 'relation': 'less than'}]}
  rec = released.adapt_cascade1_rl_swe(c1_swe())
  assert rec['metadata'] == {'gold_patch': GOLD_PATCH}
  assert 'File calc.py:\n```\ndef add(a, b):\n    return a - b\n\n```' in rec['messages'][0]['content']
  assert released.adapt_cascade1_rl_rlhf(c1_rlhf())['metadata'] == {}


def test_multi_domain_rows_route_by_agent_and_score_as_nemo_gym_does():
  """MCQA, structured output and workplace rows: each to its domain, scored by our verifiers
  with the release's semantics (a letter among the options; NeMo-Gym's strict schema; the gold
  calls against the row's tools)."""
  mc = released.adapt_cascade2_multi_domain_rl(c2_mcqa())
  st = released.adapt_cascade2_multi_domain_rl(c2_structured())
  wp = released.adapt_cascade2_multi_domain_rl(c2_workplace())
  assert (mc['domain'], st['domain'], wp['domain']) == ('mcqa', 'structured', 'tool_calling')
  assert mc['metadata'] == {'answer': 'B', 'options': ['Oxygen', 'Carbon dioxide', 'Helium']}
  assert st['metadata']['schema']['required'] == ['name', 'age']
  assert st['metadata']['schema']['additionalProperties'] is False
  assert wp['metadata']['calls'] == [{'name': 'email_send_email', 'arguments': {
      'recipient': 'raj@atlas.com', 'subject': 'Build', 'body': 'green'}}]
  # The tools are listed in the system turn, as the rollout renders the prompt.
  assert wp['messages'][0]['content'].startswith("Today's date is Thursday, 2023-11-30.\n\n# Tools")
  assert '"name": "email_send_email"' in wp['messages'][0]['content']

  def score(name, rec, *completions):
    v = verifiers.get(name)
    try:
      return [r.reward for r in v.score([verifiers.Sample('p', c, rec['metadata'])
                                         for c in completions])]
    finally:
      v.close()

  assert score('mcqa', mc, 'So \\boxed{B}', 'So \\boxed{A}') == [1.0, 0.0]
  # Strict as NeMo-Gym validates: a missing property or an extra one fails.
  assert score('structured', st, '{"name": "Ada", "age": 36}', '{"name": "Ada"}',
               '{"name": "Ada", "age": 36, "x": 1}') == [1.0, 0.0, 0.0]
  good = chat.render_tool_call('email_send_email', {'recipient': 'raj@atlas.com',
                                                    'subject': 'Build', 'body': 'green'})
  bad = chat.render_tool_call('email_send_email', {'recipient': 'raj@atlas.com',
                                                   'subject': 'Build', 'body': 'red'})
  assert score('tool_call', wp, good, bad) == [1.0, 0.0]


def test_mopd_rows_route_to_each_domain():
  recs = [released.adapt_cascade2_mopd(r) for r in CASCADE2_ROWS['mopd_train']]
  assert [r['domain'] for r in recs] == ['math', 'instruction_following', 'mcqa', 'structured',
                                         'tool_calling']
  assert recs[0]['metadata'] == {'answer': '1024'}
  assert recs[0]['messages'][0]['content'].startswith('Compute 2^10.\n')


@pytest.mark.parametrize('fmt,rows', [
    ('cascade2_multi_domain_rl', CASCADE2_ROWS['multi_domain_train']),
    ('nemotron_cascade_sft', [sft_plain(), sft_tools(), sft_instruct()]),
    ('cascade1_rl_if', [c1_if()]),
])
def test_parquet_export_reads_as_the_jsonl(tmp_path, fmt, rows):
  """The hub's Parquet export (one schema for all rows: absent keys null, one-key option
  objects as structs of every letter, messages as structs of every message key) gives the
  records of the JSONL file."""
  _write_jsonl(str(tmp_path / 'train.jsonl'), rows)
  columns = sorted({k for r in rows for k in r})
  pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in columns} for r in rows]),
                 str(tmp_path / 'train.parquet'))
  specs = [config_lib.Dataset(name='d', format=fmt, record_type=released.ADAPTERS[fmt][0],
                              path=str(tmp_path / f'train.{ext}'), domain='chat')
           for ext in ('jsonl', 'parquet')]
  as_jsonl, as_parquet = (readers.load(s) for s in specs)
  assert as_parquet == as_jsonl
  if fmt == 'cascade2_multi_domain_rl':
    options = pq.read_table(str(tmp_path / 'train.parquet')).column('options').type
    assert options.value_type.num_fields == 3     # {A, B, C}, two of them null in each entry


def test_a_row_without_a_grading_signal_is_skipped_and_counted_while_training(tmp_path, capsys):
  """Past the checked prefix, a released row its format refuses (here a structured-output row
  without its schema) is skipped by the training loader, counted and logged, not trained on."""
  rows = [c2_mcqa(), c2_structured(), {k: v for k, v in c2_structured().items()
                                        if k != 'schema_str'}, c2_workplace()]
  path = str(tmp_path / 'train.jsonl')
  _write_jsonl(path, rows)
  spec = config_lib.Dataset(name='md', format='cascade2_multi_domain_rl', record_type='prompt',
                            path=path)
  loader = readers.Loader(readers.Records(spec, cache_dir=str(tmp_path / 'cache')), seed=0,
                       batch_size=3, shuffle=False)
  assert [r['domain'] for r in loader.next()] == ['mcqa', 'structured', 'tool_calling']
  assert loader.malformed == 1
  assert "train.jsonl:3: missing field 'schema_str'" in capsys.readouterr().out


# ---------------------------------------------------------------- unknown values are errors

@pytest.mark.parametrize('fmt,row,message', [
    ('nemotron_cascade_sft',
     {'messages': [{'role': 'user', 'content': 'hi'}, {'role': 'robot', 'content': 'x'}]},
     "messages[1].role='robot': expected one of"),
    ('nemotron_cascade_sft',
     {'messages': [{'role': 'user', 'content': 'hi'},
                   {'role': 'assistant', 'content': 'x', 'audio': {'id': 1}}]},
     'messages[1].audio: unknown message field'),
    ('nemotron_cascade_sft', {'messages': [{'role': 'user', 'content': 'hi'}]},
     'nothing follows the last user message'),
    ('cascade2_multi_domain_rl', c2_mopd_math(),
     "agent_ref.name='math_with_judge_simple_agent': not an agent of subset multi-domain-RL"),
    ('cascade2_if_rl', c2_mcqa(), "agent_ref.name='mcqa_simple_agent': not an agent of subset "
                                  'IF-RL'),
    ('cascade2_multi_domain_rl', dict(c2_mcqa(), grading_mode='by_vibes'),
     "grading_mode='by_vibes': unknown"),
    ('cascade2_multi_domain_rl', dict(c2_mcqa(), options=[{'A': 'x'}, {'C': 'y'}]),
     "field 'options': letters AC are not A.. in sequence"),
    ('cascade2_multi_domain_rl', dict(c2_structured(), schema_type='yaml'),
     "schema_type='yaml': only \"json\" is scored here"),
    ('cascade2_mopd', {k: v for k, v in c2_if().items() if k != 'agent_ref'},
     "missing field 'agent_ref'"),
    ('cascade1_rl_if', {'prompt': 'x'}, "missing field: the constraints"),
    ('cascade1_rl_swe', {'problem_statement': 'x'}, 'missing field: the gold diff'),
])
def test_unknown_or_missing_values_are_one_line_errors_naming_the_field(tmp_path, fmt, row,
                                                                        message):
  path = str(tmp_path / 'rows.jsonl')
  _write_jsonl(path, [row])
  spec = config_lib.Dataset(name='d', format=fmt, record_type=released.ADAPTERS[fmt][0],
                            path=path, domain='chat')
  with pytest.raises(readers.DataError) as e:
    readers.load(spec)
  text = str(e.value)
  assert text.startswith(f'{path}:1: ') and message in text and '\n' not in text, text


def test_a_verifier_rejecting_released_metadata_names_the_row(tmp_path):
  """Released rows pass through the domain's verifier check. Cascade 2's IF domain is scored
  by `verifiers.ifbench`, which takes every instruction id of the release (IFEval's, IFBench's,
  IFEvalG's training ones: issue #56); an id no verifier knows stops the load at that row."""
  c = importlib.import_module('configs.nemotron_cascade2').get_config(f'data_root={tmp_path}')
  plan = config_lib.validate(c)
  assert plan.domains['instruction_following'].verifier == 'ifbench'
  ifbench = dict(c2_if(), instruction_id_list=['count:word_count_range'],
                 kwargs=[{'min_words': 10, 'max_words': 50}])
  ifevalg = dict(c2_if(), instruction_id_list=['last_word:last_word_answer'],
                 kwargs=[{'last_word': 'rome'}])
  bad = dict(c2_if(), instruction_id_list=['count:no_such_check'], kwargs=[{}])
  spec = plan.datasets['if_train']
  _write_jsonl(spec.path, [c2_if(), ifbench, ifevalg, bad])
  with pytest.raises(readers.DataError, match=r'train\.jsonl:4: .*count:no_such_check'):
    readers.load(spec, domains=list(plan.domains), check_metadata=_checker(plan))
  _write_jsonl(spec.path, [c2_if(), ifbench, ifevalg])
  recs = readers.load(spec, domains=list(plan.domains), check_metadata=_checker(plan))
  assert [r['metadata']['instruction_id_list'] for r in recs] == [
      ['change_case:english_lowercase'], ['count:word_count_range'],
      ['last_word:last_word_answer']]
  # The IFEval-only verifier (Cascade 2's before #56) refuses the IFBench row.
  c.domains.instruction_following.verifier = 'instruction_following'
  with pytest.raises(readers.DataError, match=r'train\.jsonl:2: .*count:word_count_range'):
    readers.load(spec, domains=list(plan.domains), check_metadata=_checker(config_lib.validate(c)))
  assert glob.glob(str(tmp_path / 'Nemotron-Cascade-2-RL-data' / 'IF-RL' / '*.jsonl'))
