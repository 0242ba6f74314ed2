"""Long-context QA verifier: SQuAD normalisation, token F1, exact match and containment, by hand."""

import json
import time

import pytest

import verifiers
from verifiers import long_context_qa as lcqa

S = verifiers.Sample


@pytest.mark.parametrize('text, normalised', [
    ('The Eiffel Tower!', 'eiffel tower'),
    ('  an   apple,  a pear  ', 'apple pear'),
    ("Newton's “laws” — three", 'newtons laws three'),
    ('state-of-the-art', 'stateoftheart'),
    # Letters of any script stay; only punctuation goes.
    ('Zürich, «Schweiz»', 'zürich schweiz'),
    ('北京。', '北京'),
    ('Theatre and another', 'theatre and another'),
    ('', ''),
])
def test_normalize_is_squads(text, normalised):
  assert lcqa.normalize(text) == normalised


@pytest.mark.parametrize('answer, references, metric, value', [
    # 'paris france' vs 'paris france europe': P = 1, R = 2/3, F1 = 2 * (2/3) / (5/3) = 0.8.
    ('Paris, France.', ['Paris, France, Europe'], 'f1', 0.8),
    # 'in paris france' has 3 words, more than 1.5 x the reference's 1: not scored.
    ('In Paris, France.', ['Paris'], 'f1', 0.0),
    # 'paris france' vs 'paris ile de france': 2 shared, P = 2/2, R = 2/4 -> 2 * 0.5 / 1.5 = 2/3.
    ('Paris France', ['Paris, Ile de France'], 'f1', 2 / 3),
    # 'tower is in paris' vs 'eiffel tower paris': 2 shared, P = 2/4, R = 2/3 -> 4/7.
    ('The tower is in Paris.', ['Eiffel Tower, Paris'], 'f1', 4 / 7),
    # Max over references: 'eiffel tower' vs ['tower of london' (1 shared: P=1/2,R=1/3 -> 0.4),
    # 'eiffel tower' (1.0)].
    ('The Eiffel Tower', ['the Tower of London', 'Eiffel tower'], 'f1', 1.0),
    ('the Eiffel Tower', ['the Tower of London'], 'f1', 0.4),
    # Tokens count as multisets: 'b b c' vs 'b c c' share one b and one c, P = R = 2/3.
    ('b b c', ['b c c'], 'f1', 2 / 3),
    ('nothing shared', ['Paris'], 'f1', 0.0),
    ('The Paris.', ['paris'], 'exact', 1.0),
    ('In Paris', ['paris', 'Paris, France'], 'exact', 0.0),
    # 'in room 4221' (3 words) holds 'room 4221' (2 words, at most 3 allowed).
    ('In room 4221.', ['421', 'Room 4221'], 'contains', 1.0),
    ('In Parisian France.', ['Paris France'], 'contains', 0.0),
    # 5 words against a 2-word reference: too long to be scored, though it contains it.
    ('It is in Paris, France.', ['Paris France'], 'contains', 0.0),
])
def test_metrics_by_hand(answer, references, metric, value):
  assert lcqa.score(answer, references, metric)[0] == pytest.approx(value)


@pytest.mark.parametrize('answer, reference, value', [
    ('', '', 1.0), ('', 'paris', 0.0), ('paris', '', 0.0), ('paris', 'paris', 1.0),
])
def test_f1_of_empty_strings(answer, reference, value):
  assert lcqa.f1(answer, reference) == value


def test_non_ascii_letters_count():
  assert lcqa.score('Zärich', ['Zürich'], 'exact')[0] == 0.0
  assert lcqa.score('Zürich', ['Zürich'], 'exact')[0] == 1.0


def test_record_metric_as_read_from_jsonl():
  # Strings read from a file are not the verifier's literals: compared by value, not identity.
  records = json.loads(json.dumps([{'answer': 'France', 'metric': m} for m in lcqa.METRICS]))
  with verifiers.get('long_context_qa', metric='contains', max_length_ratio=2) as v:
    r = v.score([S('q', 'Paris, France.', md) for md in records])
  assert [x.reward for x in r] == [pytest.approx(2 / 3), 0.0, 1.0]
  assert [x.info['metric'] for x in r] == list(lcqa.METRICS)


def test_verifier_scores_after_thinking_and_reports():
  with verifiers.get('long_context_qa') as v:
    r = v.score([
        S('q', '<think>It is in Paris, I read.</think>\n\nParis, France.',
          {'answers': ['Paris, France, Europe']}),
        S('q', '<think>Paris</think>London', {'answer': 'Paris'}),
        S('q', 'Paris, Ile de France.', {'answer': 'Ile de France', 'metric': 'contains'}),
        S('q', '<think>Paris', {'answer': 'Paris'}),
        S('q', 'The.', {'answer': 'Paris'}),
        S('q', 'In Paris, France.', {'answer': 'Paris'}),
    ])
  assert [x.reward for x in r] == [0.8, 0.0, 1.0, 0.0, 0.0, 0.0]
  assert r[0].info == {'metric': 'f1', 'reference': 0, 'reason': 'f1 0.800 against reference 0'}
  assert r[2].info['metric'] == 'contains'
  assert r[4].info['reason'] == 'empty answer'
  assert r[5].info['reason'].startswith('not a committed answer: longer than 1.5 times')


def test_metric_option_and_answer_cap():
  with verifiers.get('long_context_qa', metric='exact', max_answer_chars=20) as v:
    r = v.score([S('q', 'the Eiffel Tower', {'answers': ['Eiffel Tower']}),
                 S('q', 'Eiffel Tower and then a very long tail', {'answers': ['Eiffel Tower']}),
                 S('q', 'x' * 30 + ' Eiffel Tower', {'answers': ['Eiffel Tower'],
                                                      'metric': 'contains'})])
  assert [x.reward for x in r] == [1.0, 0.0, 0.0]
  assert r[1].info['cut'] == 'scored the first 20 characters'
  with pytest.raises(ValueError, match='metric must be one of'):
    verifiers.get('long_context_qa', metric='rouge')


@pytest.mark.parametrize('metric', ['f1', 'contains'])
@pytest.mark.parametrize('k', [2, 3, 5, 110])
@pytest.mark.parametrize('join', [' ', ', ', ' or ', '\n', '; '])
def test_hedging_scores_below_committing(metric, k, join):
  # k candidates, one of them right: committing to one at random earns 1/k on average (and 1 when
  # it is the right one), so a hedge must earn less than 1/k. Plain F1 paid 2 / (k + 1), plain
  # containment 1.
  names = ['Paris', 'Lyon', 'Nice', 'Lille'] + [f'city{i}' for i in range(k)]
  hedge = join.join(names[:k])
  with verifiers.get('long_context_qa', metric=metric) as v:
    r_hedge, r_commit = v.score([S('q', hedge, {'answer': 'Paris'}),
                                 S('q', 'Paris', {'answer': 'Paris'})])
  assert r_hedge.reward < 1 / k and r_commit.reward == 1.0
  assert r_hedge.info['reason'].startswith('not a committed answer')


@pytest.mark.parametrize('answer, reference, value', [
    # 3 words, within 1.5 x 3, but 'or' offers two answers: plain F1 paid 2/3, more than the 1/2
    # of committing to either word.
    ('Eiffel or Paris', 'Eiffel Tower Paris', 0.0),
    ('Eiffel, either Paris', 'Eiffel Tower Paris', 0.0),
    ('Eiffel and/or Paris', 'Eiffel Tower Paris', 0.0),
    ('Eiffel', 'Eiffel Tower Paris', 0.5),
    # A reference that says 'or' itself may be answered with it.
    ('Now or never', 'Now or Never', 1.0),
    # Two candidates as long as the reference never fit under the default 1.5.
    ('Eiffel Tower Louvre Museum', 'Eiffel Tower', 0.0),
])
def test_hedge_words_and_length_cap(answer, reference, value):
  assert lcqa.score(answer, [reference], 'f1')[0] == pytest.approx(value)


def test_length_ratio_option():
  # At 2 a two-candidate hedge fits again: the option lets evaluation score LongBench's way.
  assert lcqa.score('Paris Lyon', ['Paris'], 'f1', max_length_ratio=2)[0] == pytest.approx(2 / 3)
  assert lcqa.score('Paris Lyon', ['Paris'], 'f1')[0] == 0.0
  for bad in (0.5, 0, float('nan')):
    with pytest.raises(ValueError, match='max_length_ratio must be >= 1'):
      verifiers.get('long_context_qa', max_length_ratio=bad)


def test_answer_cap_bounds():
  with verifiers.get('long_context_qa', metric='exact', max_answer_chars=1) as v:
    r = v.score([S('q', 'x y', {'answer': 'x y'}), S('q', 'y', {'answer': 'y'})])
  assert [x.reward for x in r] == [0.0, 1.0]
  assert r[0].info['cut'] == 'scored the first 1 characters' and 'cut' not in r[1].info
  for bad in (0, -1):
    with pytest.raises(ValueError, match='max_answer_chars must be >= 1'):
      verifiers.get('long_context_qa', max_answer_chars=bad)


def test_megabyte_answer_is_cut_and_fast():
  text = 'Paris ' + 'the, ' * 200_000
  with verifiers.get('long_context_qa') as v:
    start = time.perf_counter()
    (r,) = v.score([S('q', text, {'answer': 'Paris'})])
  assert time.perf_counter() - start < 0.5
  assert r.info['cut'] == 'scored the first 1000 characters' and r.reward == 1.0


@pytest.mark.parametrize('metadata, message', [
    ({}, r"metadata\['answer'\] is missing"),
    ({'answer': ['Paris']}, r"metadata\['answer'\] must be str"),
    ({'answers': 'Paris'}, r"metadata\['answers'\] must be list"),
    ({'answers': []}, r'metadata\["answers"\] is empty'),
    ({'answers': ['Paris', 3]}, r'metadata\["answers"\]\[1\] must be str'),
    ({'answers': ['Paris', 'The...']}, r'metadata\["answers"\]\[1\] \'The...\' is empty after'),
    ({'answer': 'x', 'answers': ['x']}, r'give metadata\["answers"\] .* not both'),
    ({'answer': 'Paris', 'metric': 'bleu'}, r'metadata\["metric"\] must be one of'),
])
def test_validate_names_the_field(metadata, message):
  with pytest.raises(ValueError, match=r'^eval/long_context.jsonl:4: ' + message):
    verifiers.validate('long_context_qa', metadata, 'eval/long_context.jsonl:4')
  verifiers.validate('long_context_qa', {'answers': ['a b'], 'metric': 'exact'}, 'x')
