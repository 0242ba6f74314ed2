"""Learnability probe of the tiny world: SFT on all domains, then GRPO on each domain alone.

  python -m cascade.tiny_world.probe --workdir=/tmp/tw_probe

Not a test (minutes on 2 cores). It builds the world, trains a small
Qwen3-like model with SFT on the mixture of every domain's SFT records
(instruct and thinking modes half and half), evaluates every domain's
held-out prompts greedily in instruct mode with the domain's real verifier,
then, from the SFT weights, runs GRPO on one domain at a time (strictly
on-policy, token-level loss, no KL, groups with all-equal rewards refilled)
and evaluates that domain again. Chat's GRPO reward here is the hidden
quality rule itself (the cascade's RLHF stage uses a learned reward model
instead); the probe asks only whether the task leaves room and signal.
Scores are mean reward x 100 (SWE rewards lie in [-1, 1]).

Findings (world seed 0, 0.92M-parameter model: width 128, 4 layers; SFT
lr 1e-3 cosine, 48 examples a step; GRPO lr 1e-4, 16 prompts x 8, one
update per batch; 256 held-out prompts per domain, greedy; 2 shared cores
under load 3-20, so ~2-3.5 s per SFT step and 5-10 s per GRPO step):

  held-out after SFT     chat  IF    math  code  swe
  step 200               71.8  33.6   3.9   6.6  23.2
  step 400               76.9  60.9   5.5  66.4  77.4

  GRPO from step 400 (temperature 0.7), held-out after 20 / 40 / 60 steps:
  chat 77.5 / 74.3 / 77.6; IF 64.8 / 59.0 / 65.2; code 70.3 / 83.2 / 82.8
  (+16 points, sampled reward 0.42 -> 0.55); math 5.1 / 5.5 / 2.7 (2-4 of
  16 groups had any signal).
  An earlier run (temperature 1.0, harder math) gave: chat 69.6 -> 77.0 /
  75.8 / 75.0; IF 64.8 -> 67.2 / 67.6 / 67.6; code 41.0 -> 37.5 / 39.1 /
  42.2 (sampled reward 0.07 -> 0.13 while greedy stayed put: temperature 1
  is far from the greedy policy of an under-trained model); SWE 46.8 ->
  73.2 / 77.4 / 76.0; math 7.8 -> 4.3 (no signal).
  Math-only SFT (all 48 examples a step math): 6.6 after 150 steps, 32.4
  after 300 (a jump: nll 0.21 -> 0.08); GRPO from there at lr 1e-4 LOST
  ground (21.9 / 17.6 after 20 / 40 steps, sampled reward ~0.16): try a
  smaller learning rate for math.

What fails after SFT is mostly copying from the prompt: the chat topic
("Tell me about the needle." -> "The vine can teach us a lot about life."),
the IF topic, the code function's name ("def get" -> "def make", which the
code verifier rightly fails), the SWE letter; and arithmetic facts in math
("10-4=12"). Code (+16 at temperature 0.7, flat at 1.0) and
SWE (+30 in 40 steps; its similarity reward is dense) clear issue 7's +10
target; chat and IF moved 0-8 points in 60 steps, and math needs more SFT
before GRPO has signal. Levers for configs/tiny.py, in the order
this probe suggests: a larger model (copying is what small transformers
learn late), ~300 steps' worth of math in SFT (a larger math share of the
mix), GRPO temperature 0.6-0.8, more prompts per GRPO step than 16, and a
per-domain GRPO learning rate (SWE and chat took 1e-4; math lost ground).
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any, Sequence

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cascade import tiny_world
from cascade.tiny_world import chat as tw_chat
from models import chat as chat_lib
from models import config as config_lib
from models import tokenizer as tokenizer_lib
from models import transformer
from rl import batch as batch_lib
from rl import grpo
from rl import sampler as sampler_lib
from rl import sft as sft_lib
from rl import train_step as ts
import verifiers

_WORKDIR = flags.DEFINE_string('workdir', '/tmp/tw_probe', 'Where the world and results go.')
_SEED = flags.DEFINE_integer('seed', 0, 'World and model seed.')
_SFT_STEPS = flags.DEFINE_string('sft_steps', '150,300', 'Evaluate after these SFT steps; '
                                 'GRPO starts from the last.')
_SFT_LR = flags.DEFINE_float('sft_lr', 1e-3, 'SFT learning rate.')
_SFT_EXAMPLES = flags.DEFINE_integer('sft_examples', 48, 'Examples per SFT step.')
_GRPO_STEPS = flags.DEFINE_integer('grpo_steps', 60, 'GRPO steps per domain (0 = none).')
_GRPO_LR = flags.DEFINE_float('grpo_lr', 1e-4, 'GRPO learning rate.')
_TEMPERATURE = flags.DEFINE_float('temperature', 0.7, 'GRPO sampling temperature.')
_PROMPTS = flags.DEFINE_integer('prompts', 16, 'GRPO prompts per step.')
_GROUP = flags.DEFINE_integer('group', 8, 'GRPO samples per prompt.')
_EVAL_N = flags.DEFINE_integer('eval_n', 256, 'Held-out prompts evaluated per domain.')
_DOMAINS = flags.DEFINE_list('domains', list(tiny_world.DOMAINS), 'Domains to probe.')
_SHOW = flags.DEFINE_integer('show', 0, 'Log this many held-out completions per evaluation.')
_SFT_PARAMS = flags.DEFINE_string('sft_params', '', 'An .npz of SFT weights: load it and skip '
                                  'SFT if it exists, else write it after SFT.')
_LENGTHS_ONLY = flags.DEFINE_bool('lengths_only', False, 'Print token lengths and stop.')
_WIDTH = flags.DEFINE_integer('width', 128, 'Model width (embed_dim).')
_LAYERS = flags.DEFINE_integer('layers', 4, 'Transformer blocks.')

VERIFIER = {'chat': tw_chat.VERIFIER_NAME, 'instruction_following': 'instruction_following',
            'math': 'math', 'code': 'code', 'swe': 'swe'}
MAX_NEW = {'chat': 32, 'instruction_following': 64, 'math': 32, 'code': 32, 'swe': 48}
ROW_LEN, ROWS = 256, 16


def _read(path: str) -> list[dict[str, Any]]:
  with open(path, encoding='utf-8') as f:
    return [json.loads(line) for line in f]


def model_config(vocab_size: int) -> config_lib.ModelConfig:
  w = _WIDTH.value
  return config_lib.ModelConfig(family='qwen3', vocab_size=vocab_size, embed_dim=w,
                                num_layers=_LAYERS.value, num_heads=4, num_kv_heads=2,
                                head_dim=w // 4, mlp_dim=3 * w, max_seq_len=512)


def sft_example(tok, rec: dict[str, Any], thinking: bool) -> tuple[list[int], list[int]]:
  """(tokens, mask) of one SFT record: the prompt unlearned, the response learned."""
  prompt = tok.encode(chat_lib.render(rec['messages'], thinking=thinking))
  answer = tok.encode(chat_lib.render_response(rec['response'],
                                               rec['thinking'] if thinking else None))
  return prompt + answer, [0] * len(prompt) + [1] * len(answer)


def sft_batch(tok, records, rng: random.Random) -> batch_lib.TrainBatch:
  """A fixed-shape [ROWS, ROW_LEN] packed batch of up to --sft_examples random examples."""
  examples = [sft_example(tok, rng.choice(records), rng.random() < 0.5)
              for _ in range(_SFT_EXAMPLES.value)]
  while True:
    try:
      return sft_lib.pack(examples, ROW_LEN, num_rows=ROWS, pad_id=tok.pad_id)
    except ValueError:
      examples.pop()


def lengths(tok, paths, domains) -> dict[str, dict[str, tuple[float, int]]]:
  """Token lengths (mean, max) per domain of the SFT train records, in the world's tokenizer.

  Keys: 'prompt' and 'response' (bare texts), 'thinking', and 'instruct' /
  'think' (the whole rendered conversation, chat template included).
  """
  out = {}
  for d in domains:
    recs = _read(paths[d]['sft_train'])
    n = {'prompt': [len(tok.encode(r['messages'][0]['content'])) for r in recs],
         'response': [len(tok.encode(r['response'])) for r in recs],
         'thinking': [len(tok.encode(r['thinking'])) for r in recs],
         'instruct': [sum(len(x) for x in sft_example(tok, r, False)[:1]) for r in recs],
         'think': [sum(len(x) for x in sft_example(tok, r, True)[:1]) for r in recs]}
    out[d] = {k: (float(np.mean(v)), int(max(v))) for k, v in n.items()}
  return out


def decode(tok, out: sampler_lib.SampleOutput) -> list[str]:
  """Completion texts (with the stop token, as the verifiers expect)."""
  return [tok.decode(row[:n].tolist()) for row, n in zip(out.tokens, out.lengths)]


def evaluate(samp, params, tok, domain: str, records, verifier, key, log=None) -> float:
  """Greedy instruct-mode held-out score of one domain, mean reward x 100.

  With `log`, also logs the first --show completions with their rewards.
  """
  prompts = [chat_lib.render(r['messages'], thinking=False) for r in records]
  rewards = []
  for i in range(0, len(records), 128):
    chunk = records[i:i + 128]
    out = samp.generate(params, [tok.encode(p) for p in prompts[i:i + 128]], key,
                        sampler_lib.SamplingParams(greedy=True, max_new_tokens=MAX_NEW[domain]))
    texts = decode(tok, out)
    res = verifier.score([verifiers.Sample(p, c, r['metadata'])
                          for p, c, r in zip(prompts[i:i + 128], texts, chunk)])
    rewards += [x.reward for x in res]
    if log is not None and i == 0:
      for r, c, x in list(zip(chunk, texts, res))[:_SHOW.value]:
        log(f'    [{domain} {x.reward:+.2f}] {r["messages"][0]["content"]!r} -> {c!r} '
            f'({x.info.get("reason", "")})')
  return 100.0 * float(np.mean(rewards))


def grpo_domain(graphdef, params, samp, tok, domain, train, held, verifier, key, log):
  """GRPO on one domain from `params`; returns the held-out score after each 20 steps."""
  opt = ts.make_optimizer(ts.OptimizerConfig(learning_rate=_GRPO_LR.value))
  state = ts.init_state(jax.tree.map(jnp.copy, params), opt)
  step = ts.make_train_step(graphdef, 'grpo', grpo.GrpoConfig(), opt)
  sp = sampler_lib.SamplingParams(temperature=_TEMPERATURE.value, max_new_tokens=MAX_NEW[domain])
  rng = random.Random(_SEED.value)
  g = _GROUP.value
  scores, history = [], []

  def draw(n):
    recs = [rng.choice(train) for _ in range(n)]
    prompts = [chat_lib.render(r['messages'], thinking=False) for r in recs]
    nonlocal key
    key, sub = jax.random.split(key)
    out = samp.generate(state.params, [tok.encode(p) for p in prompts], sub, sp, num_samples=g)
    texts = decode(tok, out)
    res = verifier.score([verifiers.Sample(prompts[i // g], t, recs[i // g]['metadata'])
                          for i, t in enumerate(texts)])
    rewards = np.array([x.reward for x in res], np.float32)
    history.append(float(rewards.mean()))
    return out, rewards

  start = time.time()
  for i in range(1, _GRPO_STEPS.value + 1):
    filled = grpo.fill_groups(draw, num_groups=_PROMPTS.value, group_size=g, max_rounds=2)
    batch = batch_lib.from_samples(filled.rows, grpo.advantages(filled.rewards, g),
                                   valid=filled.valid)
    state, metrics = step(state, batch)
    if i % 20 == 0 or i == _GRPO_STEPS.value:
      key, sub = jax.random.split(key)
      scores.append((i, evaluate(samp, state.params, tok, domain, held, verifier, sub)))
      log(f'  grpo {domain} step {i}: train reward {np.mean(history[-10:]):.3f}, '
          f'kept {filled.groups_kept}/{_PROMPTS.value} groups, held-out {scores[-1][1]:.1f} '
          f'({time.time() - start:.0f} s)')
  return scores


def main(argv: Sequence[str]) -> None:
  del argv
  workdir = _WORKDIR.value
  os.makedirs(workdir, exist_ok=True)
  logf = open(os.path.join(workdir, 'probe.log'), 'a', encoding='utf-8')

  def log(msg):
    print(msg, flush=True)
    logf.write(msg + '\n')
    logf.flush()

  t0 = time.time()
  paths = tiny_world.build(os.path.join(workdir, 'world'), seed=_SEED.value)
  tok = tokenizer_lib.load(paths['tokenizer'])
  log(f'world built in {time.time() - t0:.1f} s; vocab {tok.vocab_size}')
  domains = _DOMAINS.value
  log('tokens (mean/max)  ' + '  '.join(f'{k:>9s}' for k in
                                        ('prompt', 'response', 'thinking', 'instruct', 'think')))
  for d, row in lengths(tok, paths, domains).items():
    log(f'{d:22s}' + '  '.join(f'{m:5.1f}/{x:3d}' for m, x in row.values()))
  if _LENGTHS_ONLY.value:
    return
  sft_records = [r for d in domains for r in _read(paths[d]['sft_train'])]
  held = {d: _read(paths[d]['heldout'])[:_EVAL_N.value] for d in domains}
  cfg = model_config(tok.vocab_size)
  model = transformer.create(cfg, seed=_SEED.value)
  graphdef, params = nnx.split(model)
  log(f'model: {cfg.num_params() / 1e6:.2f}M parameters')
  samp = sampler_lib.Sampler(graphdef, cfg, eos_ids=(tok.eos_id,), pad_id=tok.pad_id)
  vs = {d: verifiers.get(VERIFIER[d]) for d in domains}
  key = jax.random.key(_SEED.value)
  marks = sorted(int(s) for s in _SFT_STEPS.value.split(','))
  opt = ts.make_optimizer(ts.OptimizerConfig(learning_rate=_SFT_LR.value, warmup_steps=20,
                                             schedule='cosine', decay_steps=marks[-1],
                                             min_lr_ratio=0.1))
  state = ts.init_state(params, opt)
  step = ts.make_train_step(graphdef, 'sft', sft_lib.SftConfig(), opt)
  rng = random.Random(_SEED.value)
  t0 = time.time()
  results: dict[str, Any] = {'sft': {}, 'grpo': {}}
  saved = _SFT_PARAMS.value
  if saved and os.path.exists(saved):
    leaves, treedef = jax.tree.flatten(state.params)
    with np.load(saved) as z:
      state = state._replace(params=jax.tree.unflatten(
          treedef, [jnp.asarray(z[f'p{i}']) for i in range(len(leaves))]))
    log(f'SFT weights loaded from {saved}')
    marks = [marks[-1]]
  else:
    for i in range(1, marks[-1] + 1):
      state, metrics = step(state, sft_batch(tok, sft_records, rng))
      if i % 50 == 0:
        log(f'sft step {i}: nll {float(metrics["nll"]):.3f} ({time.time() - t0:.0f} s)')
      if i in marks[:-1]:
        row = {}
        for d in domains:
          key, sub = jax.random.split(key)
          row[d] = evaluate(samp, state.params, tok, d, held[d], vs[d], sub)
        results['sft'][i] = row
        log(f'after SFT step {i}: ' + ', '.join(f'{d} {s:.1f}' for d, s in row.items()))
    if saved:
      leaves = jax.tree.leaves(state.params)
      np.savez(saved, **{f'p{i}': np.asarray(x) for i, x in enumerate(leaves)})
  row = {}
  for d in domains:
    key, sub = jax.random.split(key)
    row[d] = evaluate(samp, state.params, tok, d, held[d], vs[d], sub, log)
  results['sft'][marks[-1]] = row
  log(f'after SFT step {marks[-1]}: ' + ', '.join(f'{d} {s:.1f}' for d, s in row.items()))
  base = results['sft'][marks[-1]]
  if _GRPO_STEPS.value:
    for d in domains:
      train = _read(paths[d]['rl_train'])
      key, sub = jax.random.split(key)
      scores = grpo_domain(graphdef, state.params, samp, tok, d, train, held[d], vs[d], sub, log)
      results['grpo'][d] = {'before': base[d], 'after': scores}
      log(f'GRPO {d}: {base[d]:.1f} -> ' + ' -> '.join(f'{s:.1f}@{n}' for n, s in scores))
  for v in vs.values():
    v.close()
  with open(os.path.join(workdir, 'probe.json'), 'w', encoding='utf-8') as f:
    json.dump(results, f, indent=1)
  log(f'done in {time.time() - t0:.0f} s')


if __name__ == '__main__':
  app.run(main)
