"""IFEval and IFBench suites: the released files read, fixture completions graded in both modes,
the reference's four accuracies (checked by hand, and against lm-eval's copy of Google's
reference on generated responses)."""

import json
import os
import random

import pytest

from cascade import suites
from cascade.suites import base
from cascade.suites import instruction

FIXTURES = os.path.join(os.path.dirname(__file__), '..', '..', 'fixtures', 'suites')


def _read(name):
  return suites.get(name).read(os.path.join(FIXTURES, name))


def test_registered_under_their_names():
  assert suites.get('ifeval') is instruction.ifeval and suites.get('ifbench') is instruction.ifbench
  assert (instruction.ifeval.metric, instruction.ifbench.metric) == ('prompt-level strict',
                                                                     'prompt-level loose')


def test_records_as_released():
  ifeval = _read('ifeval')   # jsonl: 'key', 'prompt', 'instruction_id_list', 'kwargs'
  assert [r['id'] for r in ifeval] == ['1000', '1001', '1005']
  assert ifeval[0]['messages'][0]['content'].startswith('Write a 300+ word summary')
  assert ifeval[0]['metadata']['kwargs'][2] == {'relation': 'at least', 'num_words': 300}
  ifbench = _read('ifbench')   # parquet: kwargs as Arrow structs (None where unused, 5.0)
  assert [r['id'] for r in ifbench] == ['0', '1']
  assert ifbench[1]['metadata']['instruction_id_list'] == ['format:title_case',
                                                           'count:word_count_range']
  assert ifbench[1]['metadata']['kwargs'][1]['max_words'] == 8.0


def test_bad_records_name_file_and_line(tmp_path):
  (tmp_path / 'ifeval_input_data.jsonl').write_text(
      json.dumps({'key': 1, 'prompt': 'p', 'instruction_id_list': ['punctuation:no_comma'],
                  'kwargs': [{}]}) + '\n' +
      json.dumps({'key': 2, 'prompt': 'p', 'instruction_id_list': ['bogus:id'], 'kwargs': [{}]}))
  with pytest.raises(base.BadRecord, match=r"ifeval_input_data.jsonl:2: .*unknown instruction "
                                           r"id 'bogus:id'"):
    suites.get('ifeval').read(str(tmp_path))


def test_fixture_completions_graded_in_both_modes():
  records = _read('ifeval')
  with suites.get('ifeval').grader(workers=1) as grader:
    grades = grader.grade_batch(records[1:2], [[
        'Day one we sail to Kyoto and rest',          # no comma: followed
        'Sure, here it is:\nDay one we sail',         # the comma is on the first line only
        '<think>Plan it</think>Hark, thou traveller']])[0]
  assert [g.score for g in grades] == [1.0, 0.0, 0.0]   # IFEval's grade: prompt-level strict
  assert [(g.info['strict_followed'], g.info['loose_followed'], g.info['instructions'])
          for g in grades] == [(1, 1, 1), (0, 1, 1), (0, 0, 1)]
  record = _read('ifbench')[0]   # between 5 and 10 words
  with suites.get('ifbench').grader(workers=1) as grader:
    grades = grader.grade(record, [
        'A beam sweeps the dark sea tonight.',
        'Here is my short description of the lighthouse for you:\nA beam sweeps the dark sea.',
        'A single beam of pale light sweeps slowly across the black and restless sea.'])
  assert [g.score for g in grades] == [1.0, 1.0, 0.0]   # IFBench's grade: prompt-level loose
  assert [g.info['strict_followed'] for g in grades] == [1, 0, 0]


def test_four_accuracies_by_hand():
  records = _read('ifeval')[:2]   # 3 instructions, then 1
  g = lambda score, strict, loose, n: base.Graded(score=score, info={
      'strict_followed': strict, 'loose_followed': loose, 'instructions': n})
  grades = [[g(1, 3, 3, 3), g(0, 1, 2, 3)], [g(0, 0, 1, 1), g(1, 1, 1, 1)]]
  out = suites.get('ifeval').summarize(records, grades)
  assert out['prompt_level_strict_acc'] == pytest.approx(50.0)     # 2 of 4 responses
  assert out['inst_level_strict_acc'] == pytest.approx(62.5)       # (3+1+0+1) / (3+3+1+1)
  assert out['prompt_level_loose_acc'] == pytest.approx(75.0)      # 3 of 4
  assert out['inst_level_loose_acc'] == pytest.approx(87.5)        # (3+2+1+1) / 8
  assert out['value'] == out['prompt_level_strict_acc'] and out['stderr'] == pytest.approx(0.0)
  # IFBench's value is the loose one.
  out = suites.get('ifbench').summarize(records, [[g(1, 3, 3, 3), g(1, 1, 3, 3)],
                                                  [g(1, 0, 1, 1), g(0, 0, 0, 1)]])
  assert out['value'] == pytest.approx(75.0) == out['prompt_level_loose_acc']
  assert out['prompt_level_strict_acc'] == pytest.approx(25.0)


# --- Differential test: the four numbers equal the reference's --------------------------------
# The reference is lm-eval's ifeval task (a copy of Google's instruction_following_eval). Two ids
# are left out because the reference needs nltk's punkt data, which cannot be downloaded here:
# length_constraints:number_sentences (punkt's sentence splitter) and
# change_case:capital_word_frequency (nltk.word_tokenize).
NEEDS_PUNKT = ('length_constraints:number_sentences', 'change_case:capital_word_frequency')

_WORDS = ('river light stone garden window morning quiet market story bridge winter paper '
          'music travel harbor forest city school coffee table yellow green ocean road').split()
_KEYWORDS = ('planet', 'guitar', 'lemon', 'cactus', 'violin', 'rocket', 'pepper', 'saddle')
_ENGLISH = ('The museum opens early on weekdays and closes late on Fridays. Visitors can walk '
            'through the old galleries and see paintings from many different centuries. The '
            'guides explain the history of each room and answer questions from the visitors.')
_OTHER = {
    'fr': ("Le musée ouvre tôt en semaine et ferme tard le vendredi. Les visiteurs peuvent "
           "parcourir les anciennes galeries et voir des tableaux de plusieurs siècles."),
    'de': ('Das Museum öffnet an Wochentagen früh und schließt am Freitag spät. Die Besucher '
           'können durch die alten Galerien gehen und Gemälde aus vielen Jahrhunderten sehen.'),
    'es': ('El museo abre temprano entre semana y cierra tarde los viernes. Los visitantes '
           'pueden recorrer las antiguas galerías y ver pinturas de muchos siglos distintos.'),
}
_END_PHRASES = ('Is there anything else I can help with?', 'Any other questions?')


def _words(rng, n):
  return ' '.join(rng.choice(_WORDS) for _ in range(n))


def _para(rng):
  return _words(rng, rng.randint(5, 12)).capitalize() + '.'


def _count(rng, token, n):
  """A text holding `token` n times among plain words."""
  return ' '.join(_para(rng)[:-1] + ' ' + token for _ in range(n)) + ' ' + _para(rng)


def _relation_counts(rng, f):
  """(relation, a count that follows it, one that does not) for threshold f."""
  relation = rng.choice(('less than', 'at least'))
  return relation, *((f - 1, f) if relation == 'less than' else (f, f - 1))


def _gen(instruction_id, rng, prompt):
  """(kwargs, responses): responses that follow the instruction and ones that do not, in strict
  and in loose mode only (first/last line or asterisks in the way)."""
  i = instruction_id
  if i == 'keywords:existence':
    a, b = rng.sample(_KEYWORDS, 2)
    return {'keywords': [a, b]}, [f'{_para(rng)} {a} {b}. {_para(rng)}', f'{_para(rng)} {a}.',
                                  f'{_para(rng)} {a} {b[:2]}*{b[2:]}.']
  if i == 'keywords:frequency':
    k, f = rng.choice(_KEYWORDS), rng.randint(2, 4)
    relation, good, bad = _relation_counts(rng, f)
    loose = (f'{k}\n' + _count(rng, k, f - 1) if relation == 'less than' else
             _count(rng, k, f - 1) + f' {k[:2]}*{k[2:]}.')
    return ({'keyword': k, 'frequency': f, 'relation': relation},
            [_count(rng, k, good), _count(rng, k, bad), loose])
  if i == 'keywords:forbidden_words':
    a, b = rng.sample(_KEYWORDS, 2)
    return {'forbidden_words': [a, b]}, [_para(rng), f'{_para(rng)} {b} {_para(rng)}',
                                        f'Note: {a}\n{_para(rng)}']
  if i == 'keywords:letter_frequency':
    letter, f = rng.choice('xzqj'), rng.randint(2, 5)
    relation, good, bad = _relation_counts(rng, f)
    loose = f'{letter}\n' + _count(rng, letter, f - 1) if relation == 'less than' else None
    return ({'letter': letter, 'let_frequency': f, 'let_relation': relation},
            [_count(rng, letter, good), _count(rng, letter.upper(), bad)] + [loose] * bool(loose))
  if i == 'language:response_language':
    language = rng.choice(('en',) + tuple(_OTHER))
    other = rng.choice([x for x in ('en',) + tuple(_OTHER) if x != language])
    text = lambda lang: _ENGLISH if lang == 'en' else _OTHER[lang]
    return {'language': language}, [text(language), text(other)]
  if i == 'length_constraints:number_paragraphs':
    n = rng.randint(2, 4)
    return {'num_paragraphs': n}, ['\n***\n'.join(_para(rng) for _ in range(n)),
                                   ' *** '.join(_para(rng) for _ in range(n + 1)),
                                   '***\n' + '\n***\n'.join(_para(rng) for _ in range(n)),
                                   '\n***\n***\n'.join(_para(rng) for _ in range(n))]
  if i == 'length_constraints:number_words':
    n = rng.randint(10, 40)
    relation, good, bad = _relation_counts(rng, n)
    loose = (f'{_words(rng, 5)}\n{_words(rng, n - 5)}' if relation == 'less than' else
             f'{_words(rng, n - 1)} one*two')
    return ({'num_words': n, 'relation': relation},
            [_words(rng, good), _words(rng, bad), loose])
  if i == 'length_constraints:nth_paragraph_first_word':
    n = rng.randint(2, 4)
    nth, first = rng.randint(1, n), rng.choice(_KEYWORDS)
    paras = [_para(rng) for _ in range(n)]
    good = list(paras)
    good[nth - 1] = f'{first.capitalize()}, {paras[nth - 1].lower()}'
    return ({'num_paragraphs': n, 'nth_paragraph': nth, 'first_word': first},
            ['\n\n'.join(good), '\n\n'.join(paras), '\n\n'.join(good + [_para(rng)]),
             '\n\n'.join(good) + '\n\n\n\n'])
  if i == 'detectable_content:number_placeholders':
    n = rng.randint(1, 4)
    return {'num_placeholders': n}, [_count(rng, '[name]', n), _count(rng, '[place]', n - 1),
                                     _count(rng, '[na\nme]', n)]
  if i == 'detectable_content:postscript':
    marker = rng.choice(('P.S.', 'P.P.S'))
    return {'postscript_marker': marker}, [f'{_para(rng)}\n\n{marker} {_para(rng)}',
                                           _para(rng), f'{_para(rng)}\n\n**{marker}** thanks']
  if i == 'detectable_format:number_bullet_lists':
    n = rng.randint(2, 4)
    bullets = lambda m: '\n'.join(f'* {_para(rng)}' for _ in range(m))
    return {'num_bullets': n}, [bullets(n), bullets(n + 1), f'* Intro\n{bullets(n)}',
                                '\n'.join(f'- {_para(rng)}' for _ in range(n))]
  if i == 'detectable_format:constrained_response':
    return {}, ['My answer is yes.', 'Yes, I think so.', 'Let me think.\nMy answer is maybe.']
  if i == 'detectable_format:number_highlighted_sections':
    n = rng.randint(1, 3)
    return {'num_highlights': n}, [_count(rng, '*key point*', n), _count(rng, '*note*', n - 1),
                                   _count(rng, '**bold part**', n)]
  if i == 'detectable_format:multiple_sections':
    splitter, n = rng.choice(('Section', 'SECTION', 'PARAGRAPH')), rng.randint(2, 4)
    sections = lambda m: '\n'.join(f'{splitter} {j}\n{_para(rng)}' for j in range(1, m + 1))
    return ({'section_spliter': splitter, 'num_sections': n},
            [sections(n), sections(n - 1), sections(n).lower()])
  if i == 'detectable_format:json_format':
    obj = json.dumps({w: rng.randint(0, 9) for w in rng.sample(_WORDS, 3)})
    return {}, [obj, f'```json\n{obj}\n```', f'Here is the JSON:\n{obj}', obj[:-1]]
  if i == 'detectable_format:title':
    return {}, [f'<<{_words(rng, 3).title()}>>\n{_para(rng)}', _para(rng),
                f'<<>>\n{_para(rng)}', f'<< >>\n{_para(rng)}']
  if i == 'combination:two_responses':
    a, b = _para(rng), _para(rng)
    return {}, [f'{a}\n******\n{b}', f'{a}\n******\n{a}', f'{a}\n******\n\n******\n{b}', a]
  if i == 'combination:repeat_prompt':
    return {'prompt_to_repeat': prompt}, [f'{prompt} {_para(rng)}', _para(rng),
                                          f'Sure.\n{prompt} {_para(rng)}']
  if i == 'startend:end_checker':
    phrase = rng.choice(_END_PHRASES)
    return {'end_phrase': phrase}, [f'{_para(rng)} {phrase}', f'{phrase} {_para(rng)}',
                                    f'{_para(rng)} {phrase}\nThanks', f'"{_para(rng)} {phrase}"']
  if i == 'change_case:english_capital':
    return {}, [_ENGLISH.upper(), _ENGLISH, f'Here it is:\n{_ENGLISH.upper()}',
                _OTHER['de'].upper()]
  if i == 'change_case:english_lowercase':
    return {}, [_ENGLISH.lower(), _ENGLISH, f'Sure:\n{_ENGLISH.lower()}', _OTHER['fr'].lower()]
  if i == 'punctuation:no_comma':
    return {}, [_para(rng), f'{_words(rng, 3)}, {_para(rng)}', f'Sure, here:\n{_para(rng)}']
  if i == 'startend:quotation':
    return {}, [f'"{_para(rng)}"', _para(rng), f'Here it is:\n"{_para(rng)}"', '"']
  raise AssertionError(f'no generator for {i}')


# The ids whose checks call langdetect: unseeded in the reference, so only clear texts (the
# generator's own) are given to them, never another instruction's random words.
_LANGDETECT = ('language:response_language', 'change_case:english_capital',
               'change_case:english_lowercase')


def _generated(seed=0, per_id=8):
  """Records of one or two instructions, each with 2 responses (the suite's k), at least one
  following and one not following every instruction id in each mode."""
  from verifiers import ifeval  # pylint: disable=g-import-not-at-top
  rng = random.Random(seed)
  ids = sorted(set(ifeval.INSTRUCTIONS) - set(NEEDS_PUNKT))
  records, responses = [], []
  for instruction_id in ids:
    for v in range(per_id):
      prompt = f'{_para(rng)} Write about it.'
      kwargs, texts = _gen(instruction_id, rng, prompt)
      id_list, kwargs_list = [instruction_id], [kwargs]
      if v % 2 and instruction_id not in _LANGDETECT:
        other = rng.choice([x for x in ids if x not in _LANGDETECT + (instruction_id,)])
        id_list.append(other)
        kwargs_list.append(_gen(other, rng, prompt)[0])
      for j in range(0, len(texts) - 1, 2):   # pairs of responses, k = 2
        records.append({'id': f'{instruction_id}-{v}-{j}', 'messages': [
            {'role': 'user', 'content': prompt}], 'metadata': {
                'instruction_id_list': id_list, 'kwargs': kwargs_list}})
        responses.append(texts[j:j + 2])
  return records, responses


@pytest.fixture(scope='module')
def lm_eval_ifeval(tmp_path_factory):
  """lm-eval's ifeval task utils, importable offline: nltk finds an (empty) punkt_tab entry, so
  the module's import-time download is not attempted. langdetect draws at random unless seeded
  (the reference leaves it unseeded; all-capital English came out 'en' or not from run to run):
  it is seeded as the verifier seeds it, so both read the same language."""
  nltk = pytest.importorskip('nltk')
  pytest.importorskip('lm_eval')
  import langdetect  # pylint: disable=g-import-not-at-top
  langdetect.DetectorFactory.seed = 0
  data = tmp_path_factory.mktemp('nltk_data')
  (data / 'tokenizers' / 'punkt_tab').mkdir(parents=True)
  nltk.data.path.insert(0, str(data))
  from lm_eval.tasks.ifeval import utils  # pylint: disable=g-import-not-at-top
  return utils


@pytest.mark.heavy
def test_four_accuracies_equal_the_reference_implementation(lm_eval_ifeval):
  import verifiers  # pylint: disable=g-import-not-at-top
  records, responses = _generated()
  for r in records:
    verifiers.validate('instruction_following', r['metadata'], r['id'])
  n_responses = sum(map(len, responses))
  assert n_responses >= 500
  suite = suites.get('ifeval')
  with suite.grader(workers=2) as grader:
    grades = grader.grade_batch(records, responses)
  ours = suite.summarize(records, grades)
  theirs = {k: [] for k in instruction.ACCURACIES}
  for record, texts, row in zip(records, responses, grades):
    doc = {'key': record['id'], 'prompt': record['messages'][0]['content'],
           **record['metadata']}
    for text, grade in zip(texts, row):
      ref = lm_eval_ifeval.process_results(doc, [text])
      assert (grade.info['strict'], grade.info['loose']) == (
          ref['inst_level_strict_acc'], ref['inst_level_loose_acc']), (record, text)
      for k in instruction.ACCURACIES:
        theirs[k].append(ref[k])
  for k in instruction.ACCURACIES:
    reference = (lm_eval_ifeval.agg_inst_level_acc(theirs[k]) if k.startswith('inst') else
                 sum(theirs[k]) / len(theirs[k]))
    assert ours[k] == pytest.approx(100.0 * reference, abs=1e-9), k
  # Every id is followed and not followed in each mode somewhere.
  for mode in ('strict', 'loose'):
    seen = {}
    for record, row in zip(records, grades):
      for grade in row:
        for instruction_id, ok in zip(record['metadata']['instruction_id_list'],
                                      grade.info[mode]):
          seen.setdefault(instruction_id, set()).add(ok)
    assert all(v == {True, False} for v in seen.values()), (mode, seen)
