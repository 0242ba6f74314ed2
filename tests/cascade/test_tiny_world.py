"""Tests of the tiny world: determinism, disjoint splits, record schema, gold answers
scored by the real verifiers (and corrupted ones scored lower), the tokenizer, and the
demo's cached world (build.py: pinned content, stamp reuse, the command line)."""

import filecmp
import hashlib
import json
import os
import random
import re
import subprocess
import sys

import pytest

from cascade import config as config_lib
from cascade.data import readers
from foundation import chat as chat_lib
from foundation import tokenizer as tokenizer_lib
from tiny_world import build as world_build
from tiny_world import chat
from tiny_world import common
from tiny_world import instruction
from tiny_world import world
import verifiers

SIZES = dict(sft=60, rl=60, heldout=40, preference=80, preference_heldout=20)
VERIFIER = {'chat': chat.VERIFIER_NAME, 'instruction_following': 'instruction_following',
            'math': 'math', 'code': 'code', 'swe': 'swe'}


def _read(path):
  with open(path, encoding='utf-8') as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope='module')
def built(tmp_path_factory):
  out = str(tmp_path_factory.mktemp('world'))
  return out, world.write(out, seed=3, **SIZES)


def test_build_is_deterministic_for_a_seed(built, tmp_path):
  out, paths = built
  again = world.write(str(tmp_path / 'again'), seed=3, **SIZES)
  for domain in world.DOMAINS:
    for name, path in paths[domain].items():
      assert filecmp.cmp(path, again[domain][name], shallow=False), (domain, name)
  # The .model file records its own path; the pieces and scores must match.
  vocab = lambda model: model[:-len('.model')] + '.vocab'
  assert filecmp.cmp(vocab(paths['tokenizer']), vocab(again['tokenizer']), shallow=False)
  other = world.generate('math', seed=4, sft=60, rl=60, heldout=40)
  assert other['sft_train'] != _read(paths['math']['sft_train'])


def test_record_counts_and_schema(built):
  out, paths = built
  manifest = json.load(open(paths['manifest'], encoding='utf-8'))
  assert manifest['seed'] == 3
  fmt = {'sft_train': 'sft', 'sft_heldout': 'sft', 'rl_train': 'prompt', 'heldout': 'prompt',
         'preference_train': 'preference', 'preference_heldout': 'preference'}
  want = {'sft_train': 60, 'rl_train': 60, 'heldout': 40, 'sft_heldout': 40,
          'preference_train': 80, 'preference_heldout': 20}
  for domain in world.DOMAINS:
    for name, path in paths[domain].items():
      records = _read(path)
      assert len(records) == want[name] == manifest['counts'][domain][name]
      assert len({r['id'] for r in records}) == len(records)
      spec = config_lib.Dataset(name=f'{domain}/{name}', format=fmt[name],
                                record_type=fmt[name], path=path)
      loaded = readers.load(spec, domains=world.DOMAINS)  # cascade's own reader accepts them.
      assert [r['domain'] for r in loaded] == [domain] * len(records)
      for r in records:
        assert r['messages'][0]['role'] == 'user' and r['messages'][0]['content'].strip()
        if fmt[name] == 'prompt':
          verifiers.validate(VERIFIER[domain], r['metadata'], f'{path}:{r["id"]}')
        elif fmt[name] == 'sft':
          assert r['response'].strip() and r['thinking'].strip()
  # Held-out prompt records and their SFT twins are the same problems, in order.
  for domain in world.DOMAINS:
    prompts, golds = _read(paths[domain]['heldout']), _read(paths[domain]['sft_heldout'])
    assert [p['messages'] for p in prompts] == [g['messages'] for g in golds]


def test_splits_are_disjoint_and_seed_independent():
  for domain, gen in world.GENERATORS.items():
    key_of = getattr(gen, 'split_key', lambda k: k)
    draw = lambda split, seed: common.draw_unique(
        domain, split, 150, gen.HELDOUT_PERCENT, gen.draw_key, gen.realize,
        random.Random(seed), split_key=getattr(gen, 'split_key', None))
    train, held = draw(common.TRAIN, 0), draw(common.HELDOUT, 0)
    assert not {key_of(p.key) for p in train} & {key_of(p.key) for p in held}, domain
    assert not {p.prompt for p in train} & {p.prompt for p in held}, domain
    assert len({p.key for p in train}) == 150
    # Another seed draws other problems, but never across the line.
    held_other = draw(common.HELDOUT, 1)
    assert all(common.split_of(domain, key_of(p.key), gen.HELDOUT_PERCENT) == common.HELDOUT
               for p in held_other)
  with pytest.raises(ValueError, match=r'chat/heldout: asked for 5000 distinct'):
    world.generate('chat', seed=0, sft=0, rl=0, heldout=5000)  # ~1.4K held-out prompts.


def test_chat_topics_of_heldout_are_unseen_in_training(built):
  out, paths = built
  topic = lambda r: r['metadata']['topic']
  train = {topic(r) for r in _read(paths['chat']['rl_train'])}
  held = {topic(r) for r in _read(paths['chat']['heldout'])}
  sft = _read(paths['chat']['sft_train'])
  sft_topics = {t for r in sft for t in common.ALL_TOPICS
                if re.search(rf'\b{t}\b', r['messages'][0]['content'])}
  assert held and not held & (train | sft_topics)


def test_quality_rule():
  q = chat.quality('The fox moves quickly and rests in safe places.', 'fox')
  assert q.score == 1.0 and all(q.criteria.values())
  assert chat.quality('The wolf moves quickly and rests in safe places.', 'fox').criteria == {
      'on_topic': False, 'complete': True, 'not_repetitive': True, 'sensible_length': True}
  assert not chat.quality('The fox moves quickly and rests', 'fox').criteria['complete']
  assert not chat.quality('The fox fox moves quickly and rests.', 'fox').criteria[
      'not_repetitive']
  assert not chat.quality('The fox is nice. The fox is nice.', 'fox').criteria['not_repetitive']
  assert chat.quality('The fox.', 'fox').score == 0.75
  # `pea` is not mentioned by `peach`.
  assert not chat.quality('I like the peach a lot today.', 'pea').criteria['on_topic']


def test_preference_pairs_follow_the_hidden_rule(built):
  out, paths = built
  for r in _read(paths['chat']['preference_train']):
    topic = next(t for t in common.ALL_TOPICS
                 if re.search(rf'\b{t}\b', r['messages'][0]['content']))
    assert chat.quality(r['chosen'], topic).score > chat.quality(r['rejected'], topic).score


def _completion(gold, thinking_mode):
  return chat_lib.render_response(gold['response'], gold['thinking'] if thinking_mode else None)


_IF_BREAK = {
    'change_case:english_lowercase': lambda t, kw: t.upper(),
    'change_case:english_capital': lambda t, kw: t.lower(),
    'length_constraints:number_words': lambda t, kw: (
        ' '.join([t] * 4) if kw['relation'] == 'less than' else 'Short.'),
    'keywords:existence': lambda t, kw: re.sub(kw['keywords'][0], 'x', t, flags=re.I),
    'keywords:forbidden_words': lambda t, kw: f'{kw["forbidden_words"][0]} {t}',
    'startend:end_checker': lambda t, kw: t + ' Okay',
    'punctuation:no_comma': lambda t, kw: t.replace(' ', ', ', 1),
    'detectable_format:title': lambda t, kw: re.sub(r'<<[^\n]*>>', '', t),
    'startend:quotation': lambda t, kw: t.strip('"'),
    'detectable_content:postscript': lambda t, kw: re.sub(r'P\.S\..*', '', t, flags=re.I),
}


def _corrupt(domain, gold, metadata, rng):
  """A worse answer for one gold answer (breaks what the domain's verifier checks)."""
  text = gold['response']
  if domain == 'chat':
    return chat._break(text, metadata['topic'], 'off_topic', rng)
  if domain == 'instruction_following':
    first = metadata['instruction_id_list'][0]
    return _IF_BREAK[first](text, metadata['kwargs'][0])
  if domain == 'math':
    return re.sub(r'\\boxed\{(\d+)\}', lambda m: f'\\boxed{{{int(m[1]) + 1}}}', text)
  if domain == 'code':
    return re.sub(r'return (.*)', r'return (\1) if 0 else None', text)
  if domain == 'swe':
    return re.sub(r'\n\+(.*)$', r'\n+\1  # fix?', text)
  raise AssertionError(domain)


@pytest.mark.parametrize('domain', world.DOMAINS)
def test_gold_scores_max_and_corrupted_lower(built, domain):
  out, paths = built
  prompts, golds = _read(paths[domain]['heldout']), _read(paths[domain]['sft_heldout'])
  prompts, golds = prompts[:24], golds[:24]
  rng = random.Random(0)
  samples = []
  for p, g in zip(prompts, golds):
    prompt = chat_lib.render(p['messages'], thinking=False)
    samples += [verifiers.Sample(prompt, _completion(g, False), p['metadata']),
                verifiers.Sample(prompt, _completion(g, True), p['metadata']),
                verifiers.Sample(prompt, chat_lib.render_response(
                    _corrupt(domain, g, p['metadata'], rng)), p['metadata'])]
  with verifiers.get(VERIFIER[domain]) as v:
    results = v.score(samples)
  for i in range(0, len(samples), 3):
    gold_i, gold_t, bad = results[i:i + 3]
    assert gold_i.reward == 1.0, (samples[i].completion, gold_i.info)
    assert gold_t.reward == 1.0, (samples[i + 1].completion, gold_t.info)
    assert bad.reward < 1.0, (samples[i + 2].completion, bad.info)


def test_instruction_check_matches_gold_and_breaks():
  rng = random.Random(5)
  for _ in range(300):
    p = None
    while p is None:
      p = instruction.realize(instruction.draw_key(rng), rng)
    kinds = [k for k, _ in p.key[1]]
    for kind, kw in zip(kinds, p.metadata['kwargs']):
      assert instruction.check(p.answer, kind, kw), (p.prompt, p.answer)
    first = p.metadata['instruction_id_list'][0]
    broken = _IF_BREAK[first](p.answer, p.metadata['kwargs'][0])
    assert not instruction.check(broken, kinds[0], p.metadata['kwargs'][0]), (p.prompt, broken)


def test_tokenizer_round_trips_the_world(built):
  out, paths = built
  tok = tokenizer_lib.load(paths['tokenizer'])
  assert tok.vocab_size <= 1024
  for special in chat_lib.SPECIAL_TOKENS:
    assert len(tok.encode(special)) == 1, special
  texts = []
  for domain in world.DOMAINS:
    for name in ('sft_train', 'sft_heldout'):
      recs = _read(paths[domain][name])
      texts += world.corpus(recs)
  for text in texts:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids.count(tok.token_to_id(chat_lib.IM_START)) == text.count(chat_lib.IM_START)
  # Digits are one token each (arithmetic is learnable digit by digit).
  assert len(tok.encode('12345')) == 5


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# sha256 of seed 0's demo world as the configs' `prepare` step writes it. The
# README's demo matrix and docs/science.md's tables were measured on exactly these files:
# a change here (a generator, a size, a flaw rate) means re-measuring them.
DEMO_WORLD_SHA256 = {
    'sft_mixed.jsonl': '8d824b6b01b9f19fa498a158ad7911793a6f31ccd3de057b603134098ec940f3',
    'tokenizer.vocab': '59cacf6b1b46018e5f86c502b9dee939c9340f8261a689e08759e7d18c25eb59',
    'manifest.json': '03df0e263e7de51e039d8dd4404f0082243d27456c244d6d838b89dc3482cd42',
    'math/rl_train.jsonl': 'caef2c4441a8e6cc84380c0eac0166eada0a501c640061440d1c6bd8bb223cc7',
    'chat/preference_train.jsonl':
        'cb08f0d1a6871740b4b23bc57dd09f4272ba76ca8d6f1612302db8b02b5bfe92',
    'swe/heldout.jsonl': 'da54ebc4229a424c91eed1b60e9601651f6e6f00dadee1f7b78bc922d243a930',
    # The tiny judge's verdict records (rm=generative; docs/tiny_generative_rm.md).
    'judge_sft.jsonl': '95b6069f67295d0d48938949050b84df7d24b48f1bd0400797bd15bcecc4f3c8',
}


def _sha256(path):
  with open(path, 'rb') as f:
    return hashlib.sha256(f.read()).hexdigest()


def test_demo_world_from_the_command_line_is_pinned_and_fits_its_sizes(tmp_path):
  """`python -m tiny_world.build` writes seed 0's world: pinned bytes, sizes, flaws."""
  root = tmp_path / 'worlds'
  p = subprocess.run([sys.executable, '-m', 'tiny_world.build', '--seed=0', f'--root={root}'],
                     cwd=REPO, capture_output=True, text=True, timeout=300)  # ~6 s, idle core.
  assert p.returncode == 0, p.stderr[-3000:]
  out = root / 'seed0'
  assert p.stdout.strip() == str(out) == world_build.directory(0, str(root))
  got = {name: _sha256(out / name) for name in DEMO_WORLD_SHA256}
  assert got == DEMO_WORLD_SHA256
  sizes = world_build.SIZES
  counts = json.loads((out / 'manifest.json').read_text())['counts']
  for domain in world.DOMAINS:
    assert counts[domain]['sft_train'] == sizes['sft'][domain]
    assert counts[domain]['heldout'] == sizes['heldout']
    assert counts[domain]['rl_train'] == sizes['rl']
    flawed = sum(bool(r.get('flawed')) for r in _read(out / domain / 'sft_train.jsonl'))
    assert abs(flawed / sizes['sft'][domain] - world_build.FLAW_RATE[domain]) < 0.05, domain
  assert counts['chat']['preference_train'] == sizes['preference']
  mixed = _read(out / 'sft_mixed.jsonl')
  assert len(mixed) == sum(sizes['sft'].values())
  thinking = sum('thinking' in r for r in mixed) / len(mixed)
  assert abs(thinking - world_build.SFT_THINKING_FRACTION) < 0.01, thinking
  assert json.loads((out / 'stamp.json').read_text()) == world_build.stamp(0)
  assert world_build.DOMAINS == world.DOMAINS


def test_build_reuses_a_current_world_and_rebuilds_a_stale_one(tmp_path, monkeypatch):
  small = dict(sft=dict.fromkeys(world_build.DOMAINS, 30), rl=20, heldout=10, preference=40,
               preference_heldout=10)
  monkeypatch.setattr(world_build, 'SIZES', small)
  writes = []
  real_write = world.write
  monkeypatch.setattr(world, 'write', lambda *a, **k: writes.append(a) or real_write(*a, **k))
  root = str(tmp_path)
  out = world_build.build(7, root)
  assert out == os.path.join(root, 'seed7') and len(writes) == 1
  stamp_path = os.path.join(out, 'stamp.json')
  with open(stamp_path, encoding='utf-8') as f:
    assert json.load(f) == world_build.stamp(7)
  assert len(_read(os.path.join(out, 'sft_mixed.jsonl'))) == 5 * 30
  mixed = _sha256(os.path.join(out, 'sft_mixed.jsonl'))
  assert world_build.build(7, root) == out and len(writes) == 1          # current: reused
  stale = dict(world_build.stamp(7), source='0' * 16)   # as after a generator change
  with open(stamp_path, 'w', encoding='utf-8') as f:
    json.dump(stale, f)
  assert world_build.build(7, root) == out and len(writes) == 2          # stale: rebuilt
  assert _sha256(os.path.join(out, 'sft_mixed.jsonl')) == mixed          # to the same bytes
  os.remove(stamp_path)                                 # as after a crash mid-build
  world_build.build(7, root)
  assert len(writes) == 3 and os.path.exists(stamp_path)
  monkeypatch.setattr(world_build, 'FLAW_RATE', dict(world_build.FLAW_RATE, math=0.0))
  world_build.build(7, root)                            # a changed flaw rate is a new world
  assert len(writes) == 4


def test_importing_the_world_registers_its_chat_quality_verifier():
  """The framework does not know 'tiny_chat_quality'; importing tiny_world (as the tiny configs
  do) registers chat.QualityVerifier under it through `verifiers.register`."""
  code = ('import verifiers\n'
          'assert "tiny_chat_quality" not in verifiers.names()\n'
          'from configs import tiny\n'
          'assert "tiny_chat_quality" in verifiers.names()\n'
          'v = verifiers.get("tiny_chat_quality")\n'
          'from tiny_world import chat\n'
          'assert type(v) is chat.QualityVerifier, type(v)\n'
          'r = v.score([verifiers.Sample("", "The fox is quick and clever.", {"topic": "fox"})])\n'
          'print(r[0].reward)\n')
  p = subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True, text=True,
                     timeout=120)
  assert p.returncode == 0, p.stderr[-3000:]
  assert float(p.stdout.strip()) == 1.0


@pytest.mark.parametrize('domain', world.DOMAINS)
def test_flawed_demonstrations_score_below_gold(domain):
  """Each domain's flawed SFT answers are what its verifier scores lower; only SFT gets them."""
  clean = world.generate(domain, seed=2, sft=80, rl=20, heldout=20)
  flawed = world.generate(domain, seed=2, sft=80, rl=20, heldout=20, flaw_rate=0.5)
  for name in ('rl_train', 'heldout', 'sft_heldout'):
    assert flawed[name] == clean[name], name
  marked = [i for i, r in enumerate(flawed['sft_train']) if r.get('flawed')]
  assert 20 <= len(marked) <= 60, len(marked)                     # ~ half of 80
  for i, (a, b) in enumerate(zip(clean['sft_train'], flawed['sft_train'])):
    assert a['messages'] == b['messages'] and a['thinking'] == b['thinking']
    assert (a['response'] != b['response']) == (i in marked)
  # Score the flawed answers against the problems' metadata (RL records of the
  # same generator, rebuilt from the same draws).
  gen = world.GENERATORS[domain]
  problems = common.draw_unique(domain, common.TRAIN, 100, gen.HELDOUT_PERCENT, gen.draw_key,
                                gen.realize, world._rng(2, domain, common.TRAIN),
                                split_key=getattr(gen, 'split_key', None))[:80]
  rng = random.Random(0)
  samples = [verifiers.Sample('', chat_lib.render_response(gen.flaw(problems[i], rng)),
                              problems[i].metadata) for i in marked]
  with verifiers.get(VERIFIER[domain]) as v:
    rewards = [r.reward for r in v.score(samples)]
  # Chat's flaws break two of the four criteria; the others fail outright.
  assert max(rewards) <= (0.5 if domain == 'chat' else 0.0), rewards
  with pytest.raises(ValueError, match='flaw_rate'):
    world.generate(domain, seed=2, sft=1, rl=1, heldout=1, flaw_rate=1.5)


def test_hetero_world_has_long_math_chains_scored_right_and_the_other_domains_unchanged(
    tmp_path, monkeypatch):
  """`build(world='hetero')`: math's three-step problems with a long trace (gold and trace
  checked by recomputing them; the math verifier takes the gold and rejects the flaw and a
  wrong step); most math SFT records in thinking mode; the other domains' files are the
  default world's byte for byte; an unknown world is refused by name."""
  from tiny_world import arithmetic_long  # pylint: disable=g-import-not-at-top
  small = dict(sft=dict.fromkeys(world_build.DOMAINS, 200), rl=40, heldout=40,
               preference=40, preference_heldout=10)
  monkeypatch.setattr(world_build, 'SIZES', small)
  root = str(tmp_path)
  het = world_build.build(4, root, world='hetero')
  default = world_build.build(4, root)
  assert het == os.path.join(root, 'hetero_seed4') and default == os.path.join(root, 'seed4')
  assert json.loads(open(os.path.join(het, 'stamp.json')).read())['world'] == 'hetero'
  for d in world_build.DOMAINS:
    if d != 'math':
      for name in ('sft_train', 'rl_train', 'heldout'):
        assert filecmp.cmp(os.path.join(het, d, f'{name}.jsonl'),
                           os.path.join(default, d, f'{name}.jsonl'), shallow=False), (d, name)
  golds = _read(os.path.join(het, 'math', 'sft_heldout.jsonl'))
  prompts = _read(os.path.join(het, 'math', 'heldout.jsonl'))
  ops = {'+': lambda a, b: a + b, '-': lambda a, b: a - b, '×': lambda a, b: a * b,
         '÷': lambda a, b: a // b}
  step_re = re.compile(r'(\d+)([-+×÷])(\d+)=(\d+)')
  samples, want = [], []
  for g, p in zip(golds, prompts):
    forward = step_re.findall(g['response'])
    assert len(forward) == 3 and g['response'].endswith(f'\\boxed{{{forward[-1][3]}}}')
    for a, op, b, c in step_re.findall(g['response'] + ' ' + g['thinking']):
      assert ops[op](int(a), int(b)) == int(c), g
    start = re.search(r'has (\d+) ', p['messages'][0]['content']).group(1)
    assert forward[0][0] == start and g['thinking'].endswith(f'Back to {start}, so '
                                                             f'{forward[-1][3]}.')
    assert p['metadata'] == {'answer': forward[-1][3]}
    wrong = g['response'].replace(f'\\boxed{{{forward[-1][3]}}}',
                                  f'\\boxed{{{int(forward[-1][3]) + 1}}}')
    flawed = arithmetic_long.flaw(common.Problem(None, '', g['response'], g['thinking'], {}),
                                  random.Random(0))
    samples += [verifiers.Sample('', chat_lib.render_response(t, g['thinking']), p['metadata'])
                for t in (g['response'], wrong, flawed)]
    # The flaw boxes the first step's value: wrong unless the chain comes back to it.
    want += [1.0, 0.0, float(forward[0][3] == forward[-1][3])]
  with verifiers.get('math') as v:
    rewards = [r.reward for r in v.score(samples)]
  assert rewards == want and want.count(0.0) > 1.8 * len(golds)
  tok = tokenizer_lib.load(os.path.join(het, 'tokenizer.model'))
  think = sum(len(tok.encode(chat_lib.render_response(g['response'], g['thinking'])))
              for g in golds) / len(golds)
  chat_len = sum(len(tok.encode(chat_lib.render_response(g['response']))) for g in _read(
      os.path.join(het, 'chat', 'sft_heldout.jsonl'))) / len(golds)
  assert think > 5 * chat_len, (think, chat_len)          # several-fold longer
  mixed = _read(os.path.join(het, 'sft_mixed.jsonl'))
  share = lambda d: (sum('thinking' in r for r in mixed if r['domain'] == d)
                     / sum(r['domain'] == d for r in mixed))
  assert share('math') > 0.8 and share('chat') < 0.4, (share('math'), share('chat'))
  with pytest.raises(ValueError, match="tiny world 'long': expected one of"):
    world_build.build(4, root, world='long')
