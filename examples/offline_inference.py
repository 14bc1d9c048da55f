"""vLLM's quickstart, on jaxllm: four prompts, temperature 0.8, top_p 0.95.

Runs on the embedded default model (HuggingFaceTB/SmolLM2-135M-Instruct) when no --model is
given; no network needed.
"""

import argparse

from jaxllm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="HF dir, hub id or .gguf (default: SmolLM2)")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.max_tokens)
    llm = LLM(model=args.model)
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")


if __name__ == "__main__":
    main()
