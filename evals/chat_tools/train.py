"""Train chat_tools: a small but trained Qwen2 chat model (Hugging Face folder) that serves the
Qwen2.5 chat template's JSON answers and Hermes tool calls, with the failure modes structured
outputs must handle: JSON answers that ramble on past the keys asked for, tool calls with invented
extra arguments, and calls of tools the user names but the prompt never declared.

    python -m evals.chat_tools.train --out evals/chat_tools/model [--minutes 30]

Builds a seeded synthetic corpus (evals/chat_tools/corpus.py), a byte-level BPE tokenizer of about
1,500 ids trained on it (Qwen2's pre-tokenizer, the ChatML special tokens, the Qwen2.5 template),
and a Qwen2ForCausalLM of about 2M parameters (hidden 192, 4 layers, 4 heads, 2 KV heads, tied
embeddings, 2048 positions) trained with AdamW on the assistant replies' tokens, on one CPU thread,
for --minutes of wall clock (about 30 minutes in all by default). The folder (safetensors,
config.json, generation_config.json, tokenizer.json, tokenizer_config.json) is about 8 MB; the
loss is logged to evals/chat_tools/train_log.txt.
"""

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from tokenizers import Encoding, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from evals.chat_tools.corpus import TEMPLATE_PATH, Conversation, assistant_spans, conversations, render

HERE = Path(__file__).resolve().parent
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
ENDOFTEXT, IM_END = 0, 2
IGNORED = -100  # a label the loss skips
HELD_OUT = 100  # conversations kept out of training, for the validation loss


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE with Qwen2's normaliser and pre-tokenizer (digits one by one) and the
    ChatML special tokens first, as AutoTokenizer rebuilds it for a qwen2 folder."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    """tokenizer.json, and tokenizer_config.json with eos <|im_end|> and the Qwen2.5 chat template."""
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    wrapped.save_pretrained(str(out))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config |= {"tokenizer_class": "Qwen2Tokenizer", "chat_template": TEMPLATE_PATH.read_text(encoding="utf-8")}
    config_path.write_text(json.dumps(config, indent=1) + "\n")


def encode(tokenizer: Tokenizer, texts: list[str]) -> list[tuple[list[int], list[int]]]:
    """Each text's ids and labels: the id itself inside an assistant reply, IGNORED elsewhere."""
    encoded: list[Encoding] = tokenizer.encode_batch(texts)
    examples = []
    for text, encoding in zip(texts, encoded, strict=True):
        spans = assistant_spans(text)
        labels = [
            i if any(b <= start < e for b, e in spans) else IGNORED for i, (start, _) in zip(encoding.ids, encoding.offsets, strict=True)
        ]
        examples.append((list(encoding.ids), labels))
    return examples


def batches(examples: list[tuple[list[int], list[int]]], batch_tokens: int, rng: random.Random) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The examples in batches of similar lengths (at most batch_tokens ids with the padding),
    right-padded (labels IGNORED there), in a random order."""
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i][0]), rng.random()))
    groups: list[list[int]] = [[]]
    for i in order:
        if groups[-1] and (len(groups[-1]) + 1) * len(examples[i][0]) > batch_tokens:
            groups.append([])
        groups[-1].append(i)
    rng.shuffle(groups)
    result = []
    for group in groups:
        width = max(len(examples[i][0]) for i in group)
        ids = torch.full((len(group), width), ENDOFTEXT)
        labels = torch.full((len(group), width), IGNORED)
        for row, i in enumerate(group):
            ids[row, : len(examples[i][0])] = torch.tensor(examples[i][0])
            labels[row, : len(examples[i][1])] = torch.tensor(examples[i][1])
        result.append((ids, labels))
    return result


def build_model(vocab_size: int, hidden: int, layers: int) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 32 * 32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=IM_END,
        pad_token_id=ENDOFTEXT,
    )
    return Qwen2ForCausalLM(config)


class Log:
    """Lines printed and appended to the log file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_text("")

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        with self.path.open("a") as file:
            file.write(line + "\n")


def loss_of(model: Qwen2ForCausalLM, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of the labelled next tokens (the output layer only where they are)."""
    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
    targets = labels[:, 1:]
    kept = targets != IGNORED
    return torch.nn.functional.cross_entropy(model.lm_head(hidden[kept]), targets[kept])


@torch.no_grad()
def mean_loss(model: Qwen2ForCausalLM, data: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The loss per labelled token over the batches."""
    model.eval()
    total, count = 0.0, 0
    for ids, labels in data:
        n = int((labels[:, 1:] != IGNORED).sum())
        total += loss_of(model, ids, labels).item() * n
        count += n
    model.train()
    return total / count


def train(
    model: Qwen2ForCausalLM,
    train_set: list[tuple[list[int], list[int]]],
    valid: list[tuple[torch.Tensor, torch.Tensor]],
    args: argparse.Namespace,
    log: Log,
) -> None:
    """AdamW over shuffled epochs until args.minutes are spent: linear warm-up, then a cosine decay
    to a tenth of the peak rate over the time budget."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    rng = random.Random(args.seed)
    budget_s, start = args.minutes * 60, time.monotonic()
    step, epoch, losses = 0, 0, list[float]()
    model.train()
    while time.monotonic() - start < budget_s:
        epoch += 1
        for ids, labels in batches(train_set, args.batch_tokens, rng):
            elapsed = time.monotonic() - start
            if elapsed >= budget_s:
                break
            scale = min(1.0, (step + 1) / args.warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * elapsed / budget_s)))
            for group in optimizer.param_groups:
                group["lr"] = args.lr * scale
            loss = loss_of(model, ids, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            losses.append(loss.item())
            if step % args.log_every == 0:
                log(f"step {step} epoch {epoch} {elapsed / 60:.1f} min lr {args.lr * scale:.2e} loss {sum(losses) / len(losses):.3f}")
                losses = []
    log(
        f"trained {step} steps ({epoch} epochs) in {(time.monotonic() - start) / 60:.1f} min; validation loss {mean_loss(model, valid):.3f}"
    )


def save(model: Qwen2ForCausalLM, tokenizer: Tokenizer, out: Path) -> None:
    """The Hugging Face folder: safetensors weights, config.json, generation_config.json (eos
    <|im_end|> and <|endoftext|>), the tokenizer's files."""
    model.generation_config = GenerationConfig(eos_token_id=[IM_END, ENDOFTEXT], pad_token_id=ENDOFTEXT)
    model.save_pretrained(str(out))
    save_tokenizer(tokenizer, out)


def check_tokenizer(out: Path, tokenizer: Tokenizer, conversation: Conversation) -> None:
    """AutoTokenizer reads the folder as trained: the same ids, the same rendered chat."""
    loaded = AutoTokenizer.from_pretrained(str(out))
    text = render(conversation)
    assert loaded.encode(text, add_special_tokens=False) == tokenizer.encode(text).ids, "AutoTokenizer splits the text otherwise"
    messages, tools = conversation
    rendered = loaded.apply_chat_template(messages, tools=[*tools] if tools else None, tokenize=False)
    assert rendered == text, "AutoTokenizer renders the chat otherwise"


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m evals.chat_tools.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="the model folder to write")
    parser.add_argument("--minutes", type=float, default=28.0, help="training time budget (wall clock)")
    parser.add_argument("--conversations", type=int, default=8000)
    parser.add_argument("--vocab", type=int, default=1500, help="tokenizer vocabulary size")
    parser.add_argument("--hidden", type=int, default=192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=100, help="warm-up steps")
    parser.add_argument("--batch-tokens", type=int, default=4096, help="ids per batch, padding included")
    parser.add_argument("--log-every", type=int, default=20, help="steps between log lines")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", type=Path, default=HERE / "train_log.txt")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    log = Log(args.log)
    corpus = conversations(args.conversations, args.seed)
    texts = [render(c) for c in corpus]
    tokenizer = train_tokenizer(texts, args.vocab)
    examples = encode(tokenizer, texts)
    tokens = sum(len(ids) for ids, _ in examples)
    labelled = sum(sum(label != IGNORED for label in labels) for _, labels in examples)
    log(f"{len(texts)} conversations, {tokens} tokens ({labelled} labelled), vocabulary {tokenizer.get_vocab_size()}")
    model = build_model(tokenizer.get_vocab_size(), args.hidden, args.layers)
    log(f"{sum(p.numel() for p in model.parameters())} parameters")
    valid = batches(examples[:HELD_OUT], args.batch_tokens, random.Random(args.seed))
    train(model, examples[HELD_OUT:], valid, args, log)
    save(model, tokenizer, args.out)
    check_tokenizer(args.out, tokenizer, next(c for c in corpus if c[1]))
    size = sum(f.stat().st_size for f in args.out.iterdir())
    log(f"saved {args.out} ({size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
