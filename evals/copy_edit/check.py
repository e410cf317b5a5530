"""Check copy_edit: greedy answers to evals/copy_edit/prompts.jsonl, exact matches and how much of
them prompt lookup (n-gram speculative decoding) would have guessed.

    python -m evals.copy_edit.check [--model evals/copy_edit/model] [--prompts evals/copy_edit/prompts.jsonl]

Each line of the prompts file is {"prompt": ..., "expected": ..., "output_tokens": ...} (vllm bench
serve's custom dataset reads "prompt" and "output_tokens" and ignores "expected"; the prompts are
plain completions, so run it with --skip-chat-template, and with --custom-output-len -1 to take
output_tokens, the expected answer's token count with eos). For every prompt
the model (loaded with transformers) greedily writes its answer, up to 1.3 times the input text's
token count, stopping at eos. Printed per prompt and overall:

- exact: whether the answer is " " + expected, character for character;
- lookup@2: the fraction of answer tokens (eos left out) that prompt lookup with 2-grams predicts:
  the last 2 tokens of the context (prompt, bos included, then the answer so far) occur earlier in
  it and the token after their earliest earlier occurrence (vLLM's choice) is the next answer token;
- tokens/step: the answer tokens per target-model step if vLLM's n-gram proposer (prompt_lookup_min
  2, prompt_lookup_max 4, 4 speculative tokens) drafted for this very answer: each step accepts the
  draft's longest prefix that agrees with the answer, plus one token of the model's own.
"""

import argparse
import json
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerBase

HERE = Path(__file__).resolve().parent


def lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's n-gram proposal for the context tokens: up to k tokens that follow the earliest
    earlier occurrence of the context's longest suffix of min_n to max_n tokens ([] if none)."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def lookup_hits(prompt: list[int], answer: list[int]) -> int:
    """How many answer tokens the 2-gram lookup predicts from the prompt and the answer before them."""
    context = list(prompt)
    hits = 0
    for token in answer:
        hits += lookup(context, 2, 2, 1) == [token]
        context.append(token)
    return hits


def speculative_steps(prompt: list[int], answer: list[int], k: int = 4) -> int:
    """The target-model steps greedy speculative decoding with n-gram drafts (2 to 4 grams, k
    tokens) takes to write the answer: each step keeps the agreeing draft prefix and one more token."""
    steps, done = 0, 0
    while done < len(answer):
        draft = lookup([*prompt, *answer[:done]], 2, 4, k)
        accepted = 0
        while accepted < len(draft) and done + accepted < len(answer) and draft[accepted] == answer[done + accepted]:
            accepted += 1
        done += accepted + 1
        steps += 1
    return steps


def text_of(prompt: str) -> str:
    """The input text of a prompt: what follows "Text: " up to the answer header's line."""
    return prompt.split("\nText: ", 1)[1].rsplit("\n", 1)[0]


@torch.no_grad()
def answer(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The greedy answer's ids after the prompt, up to max_new_tokens, eos included if it came."""
    ids = torch.tensor([prompt_ids])
    output = model.generate(  # type: ignore[misc]  # transformers types generate() with two selves
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return [int(i) for i in output[0, len(prompt_ids) :]]


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m evals.copy_edit.check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=HERE / "model", help="the model folder")
    parser.add_argument("--prompts", type=Path, default=HERE / "prompts.jsonl")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    model = AutoModelForCausalLM.from_pretrained(str(args.model))
    assert isinstance(model, LlamaForCausalLM), f"{args.model} holds a {type(model).__name__}, not a LlamaForCausalLM"
    model.eval()
    records = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    exact = hits = tokens = steps = 0
    for number, record in enumerate(records, 1):
        prompt_ids = tokenizer.encode(record["prompt"])
        budget = math.ceil(1.3 * len(tokenizer.encode(" " + text_of(record["prompt"]), add_special_tokens=False)))
        generated = answer(model, tokenizer, prompt_ids, budget)
        body = generated[:-1] if generated and generated[-1] == tokenizer.eos_token_id else generated
        right = tokenizer.decode(body) == " " + record["expected"] and len(body) < len(generated)
        exact += right
        record_hits, record_steps = lookup_hits(prompt_ids, body), speculative_steps(prompt_ids, body)
        hits, tokens, steps = hits + record_hits, tokens + len(body), steps + record_steps
        kind = record["prompt"].split("\n", 1)[0]
        print(
            f"{number:3d} {kind:15s} exact {'yes' if right else 'NO '} answer {len(body):4d} tokens "
            f"lookup@2 {record_hits / max(1, len(body)):.3f} tokens/step {len(body) / max(1, record_steps):.2f}",
            flush=True,
        )
        if not right:
            print(f"    expected: {record['expected']!r}\n    answered: {tokenizer.decode(generated)!r}")
    print(
        f"overall: exact {exact}/{len(records)} ({exact / len(records):.1%}), lookup@2 {hits / max(1, tokens):.3f} "
        f"of {tokens} answer tokens, tokens/step {tokens / max(1, steps):.2f} (n-gram 2-4, 4 speculative tokens)"
    )


if __name__ == "__main__":
    main()
