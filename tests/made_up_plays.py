"""Made-up Tiny Shakespeare texts of several plays, each with a cast of its own: what training/data.py's
whole-play split needs to find plays in a test's data."""

import random

LINES = [
    "But soft, what light through yonder window breaks?",
    "Now is the winter of our discontent",
    "A horse! a horse! my kingdom for a horse!",
    "The quality of mercy is not strain'd;",
    "What's in a name? that which we call a rose",
]


def plays_text(lengths: list[int], shared_name: str | None = None, seed: int = 0) -> tuple[str, list[int]]:
    """A text of plays of about the given lengths in characters, each with a cast of its own (named
    speakers in capitals) and a generic "Messenger" in every play; shared_name, if given, speaks
    now and then in the last tenth of each play and the first tenth of the next, as MONTAGUE does.
    Returns the text and where each play begins."""
    rng = random.Random(seed)
    text, starts = "", []
    for i, length in enumerate(lengths):
        starts.append(len(text))
        cast = [f"{title} {chr(ord('A') + i)}" for title in ("KING", "QUEEN", "LORD", "LADY", "DUKE")]
        begin = len(text)
        while len(text) - begin < length:
            done = (len(text) - begin) / length
            near_an_edge = (done < 0.1 and i > 0) or (done > 0.9 and i < len(lengths) - 1)
            speaker = rng.choice(cast + ["Messenger"])
            if shared_name and near_an_edge and rng.random() < 0.05:
                speaker = shared_name
            text += f"{speaker}:\n{rng.choice(LINES)}\n{rng.choice(LINES)}\n\n"
        # the play's first speech is one of its own cast's
        first = text.index(":", begin)
        if not text[begin:first].startswith(tuple(cast)):
            text = text[:begin] + f"{cast[0]}:\n{LINES[0]}\n\n" + text[begin:]
    return text, starts
