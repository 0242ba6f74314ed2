"""The tokenize-once cache's key spells each dataset explicitly (`token_cache.spelling`): the
spelling is frozen at what `repr` of the config's Dataset printed when the cache was
introduced, so a cache prepared then keeps its key whatever the config class becomes."""

import dataclasses

from cascade import config as config_lib
from cascade.data import readers
from cascade.data import token_cache

_FORMATS = {k: v.record_type for k, v in readers.FORMATS.items()}

# `repr(config.Dataset.parse(...))` of each spec, printed by the Dataset dataclass before it
# became a schema section (and its attribute `tfds_name` the config field's name, `tfds`).
SPELLED = [
    (('sft', dict(path='/d/sft-*.jsonl', format='sft', limit=100, skip=3)),
     "Dataset(name='sft', format='sft', record_type='sft', path='/d/sft-*.jsonl', "
     "tfds_name='', split='train', data_dir='', domain='', limit=100, skip=3, domains=None)"),
    (('math_eval', dict(tfds='tiny_math', data_dir='/tmp/tfds', split='test', format='prompt',
                        domain='math')),
     "Dataset(name='math_eval', format='prompt', record_type='prompt', path='', "
     "tfds_name='tiny_math', split='test', data_dir='/tmp/tfds', domain='math', limit=0, "
     "skip=0, domains=None)"),
    (('md', dict(path='/d/md.jsonl', format='cascade2_multi_domain_rl')),
     "Dataset(name='md', format='cascade2_multi_domain_rl', record_type='prompt', "
     "path='/d/md.jsonl', tfds_name='', split='train', data_dir='', domain='', limit=0, skip=0, "
     "domains=('mcqa', 'tool_calling', 'structured'))"),
    (('rlhf', dict(path='/d/rlhf.jsonl', format='cascade1_rl_rlhf', domain='chat')),
     "Dataset(name='rlhf', format='cascade1_rl_rlhf', record_type='prompt', "
     "path='/d/rlhf.jsonl', tfds_name='', split='train', data_dir='', domain='chat', limit=0, "
     "skip=0, domains=('chat',))"),
]


@dataclasses.dataclass(frozen=True)
class _Stage:
  """The fields of a stage config the key reads (name, kind and its settings)."""
  name: str = 'toy'
  kind: str = 'sft'
  max_len: int = 64


def _make(i, rec):
  return None if rec % 3 == 0 else ([i, rec], [1, 1])


def test_a_dataset_is_spelled_as_before():
  for (name, spec), want in SPELLED:
    assert token_cache.spelling(config_lib.Dataset.parse(name, spec, _FORMATS)) == want


def test_the_key_of_a_cache_prepared_before_is_unchanged():
  """The whole key of a TFDS dataset's stage (no files to fingerprint), pinned before the
  Dataset class changed: the same inputs give the same key."""
  spec = config_lib.Dataset.parse(*SPELLED[1][0], _FORMATS)
  got = token_cache.key(_Stage(), None, [spec], list(range(10)), _make)
  assert got == '9b945a276974788df95e6184107fec25ced39e48831bc1cf42bc5a6807c9f50e'


def test_a_changed_read_setting_is_a_new_key():
  (name, raw), _ = SPELLED[0]
  base = config_lib.Dataset.parse(name, raw, _FORMATS)
  keys = {token_cache.spelling(base)}
  for change in (dict(limit=99), dict(skip=4), dict(path='/d/other.jsonl'), dict(domain='x'),
                 dict(format='prompt')):
    keys.add(token_cache.spelling(config_lib.Dataset.parse(name, {**raw, **change}, _FORMATS)))
  assert len(keys) == 6
