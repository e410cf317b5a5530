from loading.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer

PLAY = "KING HENRY:\nNow, lords,  for France!\n\nEXETER:\nMy liege.\n"


def test_layout_tokenizer_round_trips_text_exactly() -> None:
    tokenizer = Tokenizer.train([PLAY * 3, "Another  line\n\nand more\n"] * 50, vocab_size=320, keep_layout=True)
    for text in (PLAY, "  two leading spaces\n\n\nthree newlines", "Ünïcödé ✓ 漢字"):
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert b"".join(tokenizer.piece_bytes(i) for i in ids).decode("utf-8") == text


def test_sentence_tokenizer_round_trips_and_has_fixed_special_ids() -> None:
    sentences = ["A man in a blue shirt.", "Ein Mann in einem blauen Hemd."] * 100
    tokenizer = Tokenizer.train(sentences, vocab_size=300)
    assert (tokenizer.sp.pad_id(), tokenizer.sp.unk_id(), tokenizer.sp.bos_id(), tokenizer.sp.eos_id()) == (PAD_ID, UNK_ID, BOS_ID, EOS_ID)
    for s in sentences[:2] + ["Zwölf Äpfel!"]:
        assert tokenizer.decode(tokenizer.encode(s)) == s
    assert tokenizer.decode([BOS_ID] + tokenizer.encode("A man.") + [EOS_ID, PAD_ID]) == "A man."
