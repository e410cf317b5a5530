"""The documents of shakespeare_next_line: which line comes next, from the generator's validation text.

From each held-out play of training.data.shakespeare_split (text a generator trained on it never saw),
DOCUMENTS / (number of held-out plays) speeches of three or more lines, chosen with SEED: the
context is the speaker's line and the speech's first line, the true choice its second line; three
distractors are lines of other speeches of the same play. Every line keeps its newline.
"""

import random
import re
from pathlib import Path

import datasets

from training.data import SHARED_DATA, shakespeare_split

DOCUMENTS = 20
DISTRACTORS = 3
SEED = 0


def next_line_documents(data_dir: str = str(SHARED_DATA), **_: object) -> dict[str, datasets.Dataset]:
    """{"test": documents of context (str), choices (list of 1 + DISTRACTORS str) and label (the
    true choice's index)}, in text order; the same for the same train.txt. lm-eval passes its
    metadata (the model's arguments among them) as further keywords: they are not used."""
    text = (Path(data_dir) / "tinyshakespeare" / "train.txt").read_text(encoding="utf-8")
    rng = random.Random(SEED)
    documents = []
    plays = shakespeare_split(text).validation
    for begin, end in plays:
        speeches = [[line + "\n" for line in speech.split("\n")] for speech in re.split(r"\n\n+", text[begin:end].strip("\n"))]
        for i in sorted(rng.sample([i for i, lines in enumerate(speeches) if len(lines) >= 3], DOCUMENTS // len(plays))):
            speaker, first, second = speeches[i][:3]
            others = sorted({line for j, lines in enumerate(speeches) if j != i for line in lines[1:]} - {second})
            choices = rng.sample(others, DISTRACTORS)
            label = rng.randrange(DISTRACTORS + 1)
            choices.insert(label, second)
            documents.append({"context": speaker + first, "choices": choices, "label": label})
    return {"test": datasets.Dataset.from_list(documents)}
