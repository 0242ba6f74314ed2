"""benchmarks.stream_filter: rounds and stream keep the same batch; the counts add up."""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.heavy

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_rounds_and_stream_keep_the_same_batch_and_report_their_work():
  out = subprocess.run(
      [sys.executable, '-m', 'benchmarks.stream_filter', '--prompts=4', '--group=4',
       '--new_tokens=32', '--batch=8', '--slots=8', '--repeats=1', '--score_ms=1'],
      cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
  result = json.loads(out.strip().splitlines()[-1])
  sides = result['sides']
  assert set(sides) == {'rounds, one-call sampler', 'rounds, paged engine',
                        'stream, paged engine'}
  # (The benchmark asserts every side kept the same groups and useful tokens.)
  assert result['groups'] == 4 and result['useful_tokens'] > 0
  rounds, stream = sides['rounds, paged engine'], sides['stream, paged engine']
  assert rounds['scored_rows'] == rounds['prompts_fed'] * 4
  # The stream scores the groups handed over that may be kept; the others ended unscored (behind
  # a full batch) or were cancelled.
  assert (stream['scored_rows'] + stream['rows_cancelled'] + stream['rows_unscored']
          == stream['prompts_fed'] * 4)
  # The batch's last group is in the rounds' last round: the stream fed at least as far.
  assert stream['prompts_fed'] >= rounds['prompts_fed']
  assert stream['decode_slots'] >= stream['generated_tokens'] > 0
  assert result['stream_vs_engine_rounds'] == pytest.approx(
      rounds['median_s'] / stream['median_s'])
  assert result['floor_s'] > 0 and 'floor of the useful work' in out
