"""Greedy output of flowlang and llama.cpp on the same GGUF file (issue 53, item 1): how many of
a set of prompts continue identically, and how far the two agree where they part.

    python examples/benchmarks/llama_cpp_agreement.py [--llama-server BUILD/bin/llama-server] \
        [--gguf FILE] [--f32-gguf F32_FILE] [--new-tokens 32]

FILE defaults to the registry's Q4_1 GGUF of the default model (the file flowlang decodes on by
default); F32_FILE, the same weights as F32, shows what llama.cpp's quantized activations
change. Both engines get the same token ids (the default model's chat template around each
prompt), greedy, up to EOS or the token count (a trailing EOS left out of the comparison).
llama.cpp answers one prompt at a time (one slot); flowlang runs them as one batch. llama.cpp
multiplies Q4_1 weights by activations quantized to 8 bits per 32-block (Q8_1); flowlang's
block GEMM keeps the activations as given (path (a)), so the two differ by those roundings, not
by the weights. flowlang runs on the file's blocks in bf16 and fp32 (its default) and
dequantized in fp32 (`--no-gguf-blocks`). SmolLM2-135M's next-token distributions are often
flat (the first token after "What is the capital of France?": "The" -1.88 and "L" -1.96 in
llama.cpp's F32), so a rounding can change a greedy continuation.

flowlang also rounds activations as llama.cpp does on request (`--quantize-activations`, path
(b)): those rows show what that does, against flowlang's own exact reference (fp32 on the
dequantized weights) always, and against llama.cpp where `--llama-server` is given.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from llama_cpp_bench import LlamaServer

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three primary colors.",
    "How do I make a cup of tea?",
    "What is 17 times 23?",
    "Give me a synonym for happy.",
    "Who wrote Romeo and Juliet?",
    "Describe a cat to someone who has never seen one.",
    "What does a compiler do?",
    "Name a planet with rings.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water in Celsius?",
    "Suggest a name for a pet goldfish.",
    "What is a prime number?",
    "Summarize the plot of Cinderella in two sentences.",
    "What is the opposite of cold?",
    "How many legs does a spider have?",
    "Write a Python function that adds two numbers.",
]
EOS_ID = 2  # SmolLM2's <|im_end|>: both engines stop on it
FLOWLANG = {
    "bf16, blocks (default)": dict(dtype="bfloat16"),
    "fp32, blocks (default)": dict(dtype="float32"),
    "fp32, dequantized": dict(dtype="float32", gguf_blocks=False),
    "bf16, blocks, int8 activations": dict(dtype="bfloat16", quantize_activations=True),
    "fp32, blocks, int8 activations": dict(dtype="float32", quantize_activations=True),
}
REFERENCE = "fp32, dequantized"  # flowlang's exact reference: every row is compared with it


def prompt_ids(tokenizer) -> list[list[int]]:
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in PROMPTS
    ]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def flowlang_outputs(model: str, ids: list[list[int]], n: int, settings: dict) -> list[list[int]]:
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.protocol import GenerateRequest, SamplingParams

    sampling = SamplingParams(temperature=0, max_new_tokens=n)
    with Engine(EngineConfig(model=model, max_kv_tokens=8192, **settings)) as engine:
        results = engine.generate([GenerateRequest(input_ids=p, sampling=sampling) for p in ids])
        eos = set(engine.arch.eos_token_ids)
    return [
        r.output_ids[:-1] if r.output_ids[-1:] and r.output_ids[-1] in eos else r.output_ids
        for r in results
    ]


def without_eos(ids: list[int]) -> list[int]:
    """`ids` less a trailing end-of-turn token (the default model's `<|im_end|>`)."""
    return ids[:-1] if ids[-1:] == [EOS_ID] else ids


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def llama_outputs(binary: str, gguf: Path, ids: list[list[int]], n: int) -> list[list[int]]:
    server = LlamaServer(binary, gguf, slots=1, slot_tokens=1024)
    try:  # one at a time: nothing shares a batch with it
        return [without_eos(server.complete([p], n)[0][0]) for p in ids]
    finally:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", help="default: flowlang against its reference only")
    parser.add_argument("--gguf", type=Path, help="default: the registry's GGUF of the model")
    parser.add_argument(
        "--f32-gguf", type=Path, help="the same weights as F32: llama.cpp without quantization"
    )
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    from runtime.model.gguf_blocks import source_gguf
    from runtime.model.loader import load_tokenizer
    from runtime.model.registry import DEFAULT_MODEL, resolve_model

    gguf = args.gguf or source_gguf(DEFAULT_MODEL)
    ids = prompt_ids(load_tokenizer(resolve_model(DEFAULT_MODEL)))
    files = {gguf.name: gguf, **({"F32": args.f32_gguf} if args.f32_gguf else {})}
    model = str(args.gguf) if args.gguf else DEFAULT_MODEL
    ours = {
        label: flowlang_outputs(model, ids, args.new_tokens, settings)
        for label, settings in FLOWLANG.items()
    }
    theirs = {f"flowlang {REFERENCE}": ours[REFERENCE]}
    if args.llama_server:
        for name, path in files.items():
            theirs[f"llama.cpp {name}"] = llama_outputs(
                args.llama_server, path, ids, args.new_tokens
            )
    print(f"{len(PROMPTS)} prompts, up to {args.new_tokens} greedy tokens each")
    print("| flowlang | against | identical | mean tokens agreeing before they part |")
    print("| --- | --- | ---: | ---: |")
    for label, outputs in ours.items():
        for name, reference in theirs.items():
            same = sum(a == b for a, b in zip(outputs, reference, strict=True))
            agree = sum(map(common_prefix, outputs, reference)) / len(ids)
            print(f"| {label} | {name} | {same}/{len(ids)} | {agree:.1f} |")


if __name__ == "__main__":
    main()
