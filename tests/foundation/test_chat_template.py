"""A checkpoint's own chat template renders what transformers' apply_chat_template renders.

The three templates below are small restatements (written for these tests, not copied) of
the shapes of Qwen3's template (`enable_thinking`, thinking kept only after the last query),
Llama-3's (bos_token, header tokens, strftime_now, raise_exception) and a Nemotron-style one
(the switch read from '/think' / '/no_think' in the messages).
"""

import functools
import json

import pytest
import tokenizers

from foundation import chat
from foundation import chat_template
from foundation import tokenizer as tokenizer_lib

transformers = pytest.importorskip('transformers')

QWEN3 = r"""
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages|length - 1, searching=true) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.searching and message.role == 'user' %}
        {%- set ns.searching = false %}
        {%- set ns.last_query = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\n<tool_response>\n' + content + '\n</tool_response><|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

LLAMA3 = r"""
{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\nToday Date: " + date_string + "\n\n" }}
{{- system_message + "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant', 'ipython'] %}
        {{- raise_exception('Unknown role: ' + message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

NEMOTRON = r"""
{%- set ns = namespace(thinking=true, system='') -%}
{%- for message in messages -%}
  {%- if message.role in ['system', 'user'] -%}
    {%- if '/no_think' in message.content -%}{%- set ns.thinking = false -%}
    {%- elif '/think' in message.content -%}{%- set ns.thinking = true -%}{%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if messages[0].role == 'system' -%}
  {%- set ns.system = messages[0].content.replace('/no_think', '').replace('/think', '').strip() -%}
{%- endif -%}
{{- '<SPECIAL_10>System\n' + ns.system + '\n' -}}
{%- for message in messages -%}
  {%- if message.role == 'user' -%}
    {{- '<SPECIAL_11>User\n' + message.content.replace('/no_think', '').replace('/think', '').strip() + '\n' -}}
  {%- elif message.role == 'assistant' -%}
    {%- set content = message.content.split('</think>')[-1].strip() -%}
    {{- '<SPECIAL_11>Assistant\n<think></think>' + content + '\n<SPECIAL_12>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<SPECIAL_11>Assistant\n' -}}
  {%- if ns.thinking -%}{{- '<think>\n' -}}{%- else -%}{{- '<think></think>' -}}{%- endif -%}
{%- endif -%}
"""

# name -> (template, special tokens, the end-of-turn token, how the switch is mapped)
FAMILIES = {
    'qwen3': (QWEN3, {'eos_token': '<|im_end|>', 'bos_token': None}, 'kwarg'),
    'llama3': (LLAMA3, {'bos_token': '<|begin_of_text|>', 'eos_token': '<|eot_id|>'}, None),
    'nemotron': (NEMOTRON, {'bos_token': '<s>', 'eos_token': '<SPECIAL_12>'}, 'marker'),
}
SPECIALS = ['<|im_start|>', '<|im_end|>', '<think>', '</think>', '<|begin_of_text|>',
            '<|start_header_id|>', '<|end_header_id|>', '<|eot_id|>', '<s>', '<SPECIAL_10>',
            '<SPECIAL_11>', '<SPECIAL_12>']
CONVERSATIONS = [
    [{'role': 'user', 'content': 'What is 2 + 3?'}],
    [{'role': 'system', 'content': 'You are terse. 東京 🙂'},
     {'role': 'user', 'content': 'Name a prime.'}],
    [{'role': 'user', 'content': 'Hi'},
     {'role': 'assistant', 'content': '<think>\nsay hello\n</think>\n\nHello!'},
     {'role': 'user', 'content': '  Write "x" <b>twice</b>.  '}],
]


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
  corpus = [json.dumps(c) for c in CONVERSATIONS] * 10 + ['the model adds numbers 0123456789']
  hf_tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  hf_tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf_tok.decoder = tokenizers.decoders.ByteLevel()
  hf_tok.train_from_iterator(corpus, tokenizers.trainers.BpeTrainer(
      vocab_size=400, special_tokens=SPECIALS,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  return hf_tok.to_str()


def write_checkpoint(d, name: str):
  """Writes a fixture instruct checkpoint's tokenizer files (FAMILIES[name]'s template) to d."""
  source, specials, _ = FAMILIES[name]
  (d / 'tokenizer.json').write_text(_tokenizer_json())
  (d / 'tokenizer_config.json').write_text(json.dumps(
      {'tokenizer_class': 'PreTrainedTokenizerFast', 'chat_template': source,
       'clean_up_tokenization_spaces': False, **specials}))
  return d


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory):
  """name -> a fixture instruct checkpoint's tokenizer directory with its own template."""
  return {name: write_checkpoint(tmp_path_factory.mktemp(name), name) for name in FAMILIES}


@pytest.mark.parametrize('name', sorted(FAMILIES))
def test_renders_what_apply_chat_template_renders(checkpoints, name):
  d = checkpoints[name]
  auto = transformers.AutoTokenizer.from_pretrained(d)
  tok = chat_template.attach(tokenizer_lib.load(d), chat_template.read(d))
  tmpl = chat_template.of(tok)
  assert tmpl.switch == FAMILIES[name][2]
  modes = (None, True, False) if tmpl.switch else (None,)
  for conv in CONVERSATIONS:
    for prompt in (True, False):
      for mode in modes:
        if mode is None:
          conv_hf, kw = conv, {}
        elif tmpl.switch == 'kwarg':
          conv_hf, kw = conv, {'enable_thinking': mode}
        else:   # Nemotron-style: the switch is written into the last user turn.
          conv_hf = [dict(m) for m in conv]
          conv_hf[-1 if conv[-1]['role'] == 'user' else -2]['content'] += (
              ' /think' if mode else ' /no_think')
          kw = {}
        want = auto.apply_chat_template(conv_hf, tokenize=False, add_generation_prompt=prompt,
                                        **kw)
        got = tmpl.render(conv, thinking=mode, add_generation_prompt=prompt)
        assert got == want, (name, conv, mode, prompt)
        ids = auto.apply_chat_template(conv_hf, tokenize=True, add_generation_prompt=prompt, **kw)
        ids = list(ids['input_ids'] if hasattr(ids, 'keys') else ids)
        assert tok.encode(got) == ids


def test_thinking_switches_change_the_prompt(checkpoints):
  conv = CONVERSATIONS[0]
  qwen = chat_template.read(checkpoints['qwen3'])
  assert qwen.render(conv, thinking=False).endswith('<|im_start|>assistant\n<think>\n\n</think>\n\n')
  assert qwen.render(conv, thinking=True) == qwen.render(conv)
  nemo = chat_template.read(checkpoints['nemotron'])
  assert nemo.render(conv, thinking=False).endswith('<think></think>')
  assert nemo.render(conv, thinking=True).endswith('<think>\n')
  llama = chat_template.read(checkpoints['llama3'])
  with pytest.raises(ValueError, match=r'tokenizer_config.json: chat_template: the chat template '
                                       r'has no thinking switch'):
    llama.render(conv, thinking=True)
  with pytest.raises(ValueError, match='Unknown role: tool'):
    llama.render([{'role': 'tool', 'content': 'x'}])


def test_our_export_template_read_back_renders_as_builtin():
  ours = chat_template.CheckpointTemplate(chat.TEMPLATE)
  assert ours.switch == 'kwarg'
  for conv in CONVERSATIONS:
    for mode in (None, True, False):
      assert ours.render(conv, thinking=mode) == chat.render(conv, thinking=mode)


def test_response_is_the_continuation_of_the_prompt(checkpoints):
  qwen = chat_template.read(checkpoints['qwen3'])
  conv = CONVERSATIONS[0]
  assert qwen.render_response(conv, '5', None, False) == '5<|im_end|>\n'
  assert qwen.render_response(conv, '5', 'add', True) == '<think>\nadd\n</think>\n\n5<|im_end|>\n'
  llama = chat_template.read(checkpoints['llama3'])
  assert llama.render_response(conv, ' 5 ', None, None) == '5<|eot_id|>'
  nemo = chat_template.read(checkpoints['nemotron'])   # the turn re-renders the empty thinking
  with pytest.raises(ValueError, match='not render an assistant turn as the continuation'):
    nemo.render_response(conv, '5', 'add', True)


def test_missing_or_broken_template_is_one_line(tmp_path):
  (tmp_path / 'tokenizer_config.json').write_text('{}')
  with pytest.raises(ValueError, match=r"tokenizer_config.json: no chat_template .*'builtin'"):
    chat_template.read(tmp_path)
  (tmp_path / 'chat_template.jinja').write_text('{% if %}')
  with pytest.raises(ValueError, match=r'chat_template.jinja: the chat template does not compile'):
    chat_template.read(tmp_path)
  (tmp_path / 'chat_template.jinja').unlink()
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps(
      {'chat_template': [{'name': 'tool_use', 'template': 'T'}, {'name': 'default',
                                                               'template': 'D{{ bos_token }}'}],
       'bos_token': {'content': '<s>'}}))
  assert chat_template.read(tmp_path).render([]) == 'D<s>'


def test_sandboxed():
  evil = chat_template.CheckpointTemplate("{{ ''.__class__.__mro__ }}")
  with pytest.raises(ValueError, match='failed'):
    evil.render(CONVERSATIONS[0])
  with pytest.raises(ValueError, match='may not start with _'):
    chat_template.CheckpointTemplate('{% set ns = namespace(_x=1) %}x').render([])


# Tools, the generation tag and transformers' always-defined `tools` / `documents`.
EXTRAS = r"""
{%- if tools is defined and tools is not none %}{{- 'TOOLS:' + tools | tojson + '\n' }}{%- endif %}
{%- if documents is defined %}{{- 'DOCS:' + (documents is none) | string + '\n' }}{%- endif %}
{%- for m in messages %}
  {%- if m.role == 'assistant' %}{% generation %}{{- 'A:' + m.content + '\n' }}{% endgeneration %}
  {%- else %}{{- m.role + ':' + m.content + '\n' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- 'A:' }}{%- endif %}
"""


def test_tools_generation_tag_and_documents_as_transformers_passes_them(tmp_path):
  write_checkpoint(tmp_path, 'qwen3')
  config = json.loads((tmp_path / 'tokenizer_config.json').read_text())
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps(dict(config, chat_template=EXTRAS)))
  auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
  tmpl = chat_template.read(tmp_path)
  tools = [{'type': 'function', 'function': {'name': 'search', 'description': 'Zürich',
                                             'parameters': {'type': 'object'}}}]
  conv = CONVERSATIONS[2]
  for t in (None, tools):
    want = auto.apply_chat_template(conv, tools=t, tokenize=False, add_generation_prompt=True)
    assert tmpl.render(conv, tools=t) == want
  assert 'DOCS:True' in want and 'Zürich' in want
