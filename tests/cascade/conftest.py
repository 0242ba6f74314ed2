"""Stand-ins shared by the fast stage-wiring tests: a character tokenizer, a sampler that answers
each prompt with its own record's answer, a verifier that pays each row its own record's value,
and a small validated plan (two toy domains, every training kind) with a tiny model."""

import re
import threading
import types

import ml_collections
import numpy as np
import pytest

from cascade import config as config_lib
from rl import sampler as sampler_lib


class CharTokenizer:
  """One id per character (ids = ord % 256), enough for rendering and decoding."""

  vocab_size = 256
  pad_id = 0
  eos_id = 1
  added_tokens = ()

  def encode(self, text):
    return [ord(c) % 256 for c in text]

  def decode(self, ids, skip_special=False):
    del skip_special
    return ''.join(chr(i) for i in ids)


_ASK = re.compile(r'(?:Copy|After) (\d+)')


class OwnAnswerSampler:
  """Reads each prompt's number and answers it, so every row's text names its own prompt.

  Rows are prompt-major like `rl.sampler.Sampler.generate` (prompt i's G samples are rows
  i*G .. i*G+G-1). `right(number, g)` decides whether sample g is the right answer (else the
  wrong answer 'x'); `ramble(number, g)` makes it fill max_new_tokens (truncated). A token id
  past the tokenizer's vocabulary is appended where it fits (a padded embedding row): decoding
  must drop it.
  """

  def __init__(self, answer=lambda n: str(n), right=lambda n, g: True,
               ramble=lambda n, g: False, junk_id=None):
    self.answer, self.right, self.ramble, self.junk_id = answer, right, ramble, junk_id
    self.calls = []

  def generate(self, params, prompts, rng, sp, num_samples=1):
    del rng
    self.calls.append(dict(params=params, prompts=[list(p) for p in prompts], sp=sp,
                           num_samples=num_samples))
    n_new = sp.max_new_tokens
    texts, trunc = [], []
    for ids in prompts:
      num = int(_ASK.findall(''.join(chr(i) for i in ids))[-1])
      for g in range(num_samples):
        t = self.answer(num) if self.right(num, g) else 'x'
        long = self.ramble(num, g)
        texts.append((t + ' ' * n_new)[:n_new] if long else t)
        trunc.append(long)
    b = len(texts)
    toks = np.zeros((b, n_new), np.int32)
    lens = np.array([len(t) for t in texts], np.int32)
    for i, t in enumerate(texts):
      toks[i, :len(t)] = [ord(c) for c in t]
      if self.junk_id is not None and len(t) < n_new:
        toks[i, len(t)] = self.junk_id
        lens[i] += 1
    mask = (np.arange(n_new)[None] < lens[:, None]).astype(np.int32)
    p = max(len(x) for x in prompts)
    ptoks = np.zeros((b, p), np.int32)
    pmask = np.zeros((b, p), np.int32)
    for i, ids in enumerate(prompts):
      rows = slice(i * num_samples, (i + 1) * num_samples)
      ptoks[rows, p - len(ids):] = ids
      pmask[rows, p - len(ids):] = 1
    z = np.zeros((b, n_new), np.float32)
    return sampler_lib.SampleOutput(prompt_tokens=ptoks, prompt_mask=pmask, tokens=toks,
                                    mask=mask, logprobs=z, sampling_logprobs=z, lengths=lens,
                                    truncated=np.array(trunc))


class ValueVerifier:
  """Reward of a right answer: the record's `value` (distinct per record); a wrong one: -1."""

  def __init__(self, domain):
    self.domain, self.seen = domain, []

  def score(self, samples):
    self.seen += samples
    out = []
    for s in samples:
      assert s.metadata['domain'] == self.domain, (self.domain, s.metadata)
      ok = s.completion.strip() == s.metadata['answer']
      out.append(types.SimpleNamespace(reward=s.metadata['value'] if ok else -1.0,
                                       info={'id': s.metadata['id']}))
    return out


def Sample(**kw):  # pylint: disable=invalid-name
  return types.SimpleNamespace(**kw)


def record(domain, i, num):
  """A prompt record whose answer and reward value identify it."""
  ask = f'Copy {num}.' if domain == 'a' else f'After {num}?'
  answer = str(num if domain == 'a' else num + 1)
  return {'id': f'{domain}{i}', 'domain': domain,
          'messages': [{'role': 'user', 'content': ask}],
          'metadata': {'id': f'{domain}{i}', 'domain': domain, 'answer': answer,
                       'value': 1.0 + i + (0.5 if domain == 'b' else 0.0)}}


def toy_config(stages, every=2, validation=False, domains=None, max_seq_len=128, model=None,
               tokenizer=None, guard=None):
  """A validated plan over domains 'a' (copy) and 'b' (next number); nothing is loaded.

  `validation`: the domains name validation sets ('a_val', 'b_val').
  `domains`: domain name -> fields replacing that domain's (e.g. an agentic domain's env).
  `model`: config.model in place of the tiny dense one (e.g. a mixture-of-experts preset).
  `tokenizer`: config.tokenizer in place of a path that is never loaded.
  `guard`: config.guard (regression guards; None: the section is absent).
  """
  c = ml_collections.ConfigDict()
  c.seed = 3
  c.model = model or dict(preset='tiny', overrides=dict(vocab_size=320, embed_dim=32,
                                                        num_layers=1, num_heads=2,
                                                        num_kv_heads=1, head_dim=16,
                                                        mlp_dim=64, max_seq_len=max_seq_len))
  c.tokenizer = tokenizer or dict(path='/nonexistent/tok.model')
  c.mesh = dict(shape=None)
  c.sampler = dict()
  c.ckpt = dict(every_n_steps=every, keep=3)
  c.eval = dict(num_samples=1, temperature=1.0, top_p=1.0, max_new_tokens=8, max_prompt_len=64,
                num_prompts=0, batch_size=8)
  c.datasets = dict(sft=dict(path='/s.jsonl', format='sft'),
                    a_train=dict(path='/a.jsonl', format='prompt', domain='a'),
                    b_train=dict(path='/b.jsonl', format='prompt', domain='b'),
                    a_val=dict(path='/a_val.jsonl', format='prompt', domain='a'),
                    b_val=dict(path='/b_val.jsonl', format='prompt', domain='b'))
  c.domains = dict(a=dict(verifier='math', train='a_train', eval='a_train'),
                   b=dict(verifier='math', train='b_train', eval='b_train'))
  if validation:
    c.domains.a.validation, c.domains.b.validation = 'a_val', 'b_val'
  for name, fields in (domains or {}).items():
    c.domains[name] = dict(fields)
  c.stages = stages
  if guard is not None:
    c.guard = dict(guard)
  return config_lib.validate(c, known_verifiers=['math'], known_formats={
      'sft': 'sft', 'prompt': 'prompt', 'preference': 'preference'})


def rl_stage(name, domains, **kw):
  return dict(dict(name=name, kind='grpo', domains=domains, steps=4, optimizer=dict(lr=1e-3),
                   prompts_per_step=4, group_size=2, max_prompt_len=100, max_response_len=8,
                   dynamic_filter=False), **kw)


SFT_STAGE = dict(name='sft', kind='sft', domains=['a', 'b'], datasets=['sft'], steps=6,
                 batch_size=4, max_len=16, optimizer=dict(lr=1e-2))


def score_on_hosts(ros, verifiers_of_host, sample_cls):
  """rollout.score on `len(verifiers_of_host)` simulated hosts (threads) sharing an in-memory
  exchange; host -> (rewards, infos), or the exception it raised. A host still waiting after
  60 s fails the test (a hang)."""
  from cascade import rollout  # pylint: disable=g-import-not-at-top
  count = len(verifiers_of_host)
  ros = ros if isinstance(ros, list) else [ros] * count
  return on_hosts(count, lambda hosts: rollout.score(
      ros[hosts.index], verifiers_of_host[hosts.index].__getitem__, sample_cls, hosts=hosts))


def on_hosts(count, run):
  """run(hosts) on `count` simulated hosts (threads) sharing an in-memory exchange; host ->
  its result, or the exception it raised. A host still waiting after 60 s fails the test."""
  from cascade import rollout  # pylint: disable=g-import-not-at-top
  payloads, out = [None] * count, {}
  barrier = threading.Barrier(count, timeout=20)

  def host(h):
    def exchange(data):
      payloads[h] = data
      barrier.wait()
      got = list(payloads)
      barrier.wait()
      return got
    try:
      out[h] = run(rollout.Hosts(h, count, exchange))
    except Exception as e:  # pylint: disable=broad-except
      out[h] = e

  threads = [threading.Thread(target=host, args=(h,)) for h in range(count)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  assert not any(t.is_alive() for t in threads), 'a host is still waiting: a hang'
  return out


@pytest.fixture(scope='session')
def fakes():
  """The stand-ins above, for the tests in this folder."""
  return types.SimpleNamespace(CharTokenizer=CharTokenizer, OwnAnswerSampler=OwnAnswerSampler,
                               ValueVerifier=ValueVerifier, Sample=Sample, record=record,
                               toy_config=toy_config, rl_stage=rl_stage, SFT_STAGE=SFT_STAGE,
                               score_on_hosts=score_on_hosts, on_hosts=on_hosts)
