"""vLLM's own example programs run on `maxtext.inference.LLM` with the import line changed, and the model: vLLM's
offline-inference example (examples/offline_inference/basic/basic.py of vLLM 0.32) and the `LLM.chat` example of
vLLM's "Generative Models" page, transcribed below. The Hugging Face hub cannot be reached here, so the model they
name becomes the README's example model (SmolLM2-135M-Instruct, a GGUF file with its chat template); every other
line is vLLM's.
"""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
VLLM_IMPORT = "from vllm import LLM, SamplingParams"
OUR_IMPORT = "from maxtext.inference import LLM, SamplingParams"

BASIC = """
from vllm import LLM, SamplingParams

# Sample prompts.
prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
# Create a sampling params object.
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)


def main():
    # Create an LLM.
    llm = LLM(model="facebook/opt-125m")
    # Generate texts from the prompts.
    # The output is a list of RequestOutput objects
    # that contain the prompt, generated text, and other information.
    outputs = llm.generate(prompts, sampling_params)
    # Print the outputs.
    print("\\nGenerated Outputs:\\n" + "-" * 60)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt:    {prompt!r}")
        print(f"Output:    {generated_text!r}")
        print("-" * 60)


if __name__ == "__main__":
    main()
"""

CHAT = """
from vllm import LLM, SamplingParams

llm = LLM(model="meta-llama/Meta-Llama-3-8B-Instruct")
conversation = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I assist you today?"},
    {"role": "user", "content": "Write an essay about the importance of higher education."},
]
outputs = llm.chat(conversation)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")

llm = LLM(model="facebook/opt-125m")
params = SamplingParams(temperature=0)
outputs = llm.generate("Hello, my name is", params)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
"""

MODELS = ("facebook/opt-125m", "meta-llama/Meta-Llama-3-8B-Instruct")


def _ported(program: str, model: str) -> str:
  """`program` with only the import line and the model names changed."""
  assert program.count(VLLM_IMPORT) == 1
  ported = program.replace(VLLM_IMPORT, OUR_IMPORT)
  for name in MODELS:
    ported = ported.replace(f'model="{name}"', f"model={model!r}")
  changed = [(a, b) for a, b in zip(program.splitlines(), ported.splitlines()) if a != b]
  assert len(changed) == 1 + sum(program.count(f'model="{name}"') for name in MODELS)
  return ported


def _run(program: str, tmp_path: pathlib.Path) -> subprocess.CompletedProcess:
  path = tmp_path / "program.py"
  path.write_text(program, encoding="utf-8")
  return subprocess.run(
      [sys.executable, str(path)], capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path
  )


@pytest.mark.slow
def test_vllms_basic_example_runs_with_the_import_changed(example_gguf, tmp_path):
  done = _run(_ported(BASIC, example_gguf), tmp_path)
  assert done.returncode == 0, done.stderr[-3000:]
  prompts = [line for line in done.stdout.splitlines() if line.startswith("Prompt:    ")]
  answers = [line for line in done.stdout.splitlines() if line.startswith("Output:    ")]
  assert [p.removeprefix("Prompt:    ") for p in prompts] == [
      "'Hello, my name is'",
      "'The president of the United States is'",
      "'The capital of France is'",
      "'The future of AI is'",
  ]
  assert len(answers) == 4 and all(len(a) > len("Output:    ''") for a in answers)  # 16 sampled tokens each
  assert "generating: 100%" in done.stderr  # vLLM's default progress bar


@pytest.mark.slow
def test_vllms_chat_and_greedy_examples_run_with_the_import_changed(example_gguf, tmp_path):
  done = _run(_ported(CHAT, example_gguf), tmp_path)
  assert done.returncode == 0, done.stderr[-3000:]
  chat, greedy = done.stdout.splitlines()
  # The rendered chat template (SmolLM2's ChatML) is the prompt; the reply follows the assistant turn.
  assert chat.startswith("Prompt: '<|im_start|>system\\nYou are a helpful assistant<|im_end|>\\n")
  assert chat.split(", Generated text: ")[0].endswith("<|im_start|>assistant\\n'")
  head = "Prompt: 'Hello, my name is', Generated text: "
  assert greedy.startswith(head) and len(greedy) > len(head) + 20  # 16 greedy tokens
