"""The detokenizers' shared memo of each token's bytes gives what the tokenizer gives."""

from loading.checkpoint import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR, load_checkpoint
from loading.tokenizer import TextTokenizer
from service.engine.detokenizer import IncrementalDetokenizer, PieceBytes


class CountingTokenizer:
    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer, self.calls = tokenizer, 0

    def piece_bytes(self, token_id: int) -> bytes:
        self.calls += 1
        return self.tokenizer.piece_bytes(token_id)


def test_piece_bytes_are_the_tokenizers_computed_once_each() -> None:
    for checkpoint in (DEFAULT_TRANSLATOR, DEFAULT_GENERATOR):
        tokenizer = load_checkpoint(checkpoint)[1]
        counting = CountingTokenizer(tokenizer)
        pieces = PieceBytes(counting)
        ids = list(range(tokenizer.vocab_size))
        assert [pieces.piece_bytes(i) for i in ids + ids] == [tokenizer.piece_bytes(i) for i in ids + ids]
        assert counting.calls == len(ids)


def test_a_detokenizer_over_the_memo_streams_the_tokenizers_text() -> None:
    tokenizer = load_checkpoint(DEFAULT_TRANSLATOR)[1]
    ids = tokenizer.encode("Zwei Männer stehen am Herd und bereiten Essen zu.")
    detokenizer = IncrementalDetokenizer(PieceBytes(tokenizer), strip_leading_space=True)
    text = "".join(detokenizer.add(i) for i in ids) + detokenizer.flush()
    assert text == tokenizer.decode(ids)
