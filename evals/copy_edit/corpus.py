"""A seeded synthetic corpus of copy-editing tasks for the copy_edit model: plain-text completion
prompts whose answers copy most of their input, for measuring prompt-lookup (n-gram) speculative
decoding.

Each example is

    <instruction>
    Text: <text>
    <header>: <answer><|endoftext|>

with two task kinds:

- "Fix the typos." / "Fixed:": the text carries 0-3 injected typos (two letters swapped, a letter
  dropped, a letter doubled, a letter in the wrong case), the answer is the clean text;
- "Copy the text." / "Copy:": the answer is the text itself, character for character (typos included
  when it has some).

Typos only ever go into lower-case dictionary words (dictionary(): the words of this file's
vocabulary and the frequent words of Tiny Shakespeare, four letters or more), never into names,
numbers or made-up words, so that a rare word of a prompt is one to copy, not one to "fix".

Texts mix template prose (names, places, objects, dates, prices), addresses and invoices, lists,
small Python functions, word salads (which only copying predicts: they make copying come early)
and, when /work/shared/data/tinyshakespeare/train.txt is there, runs of Tiny Shakespeare lines
(read at run time, never stored here); they run from a few words to about 130, as long as the
evaluation prompts (evals/copy_edit/prompts.jsonl).
"""

import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


def words(text: str) -> list[str]:
    """A vocabulary written as one space-separated string, as a list."""
    return text.split()


SHAKESPEARE = Path("/work/shared/data/tinyshakespeare/train.txt")
TASKS = {"fix": ("Fix the typos.", "Fixed:"), "copy": ("Copy the text.", "Copy:")}  # kind: (instruction, answer header)

FIRST_NAMES = "Anna Ben Clara David Elena Felix Grace Hugo Ines Jonas Kira Leo Maya Noah Olga Paul Rosa Sam Tara Victor Wanda Yusuf Zoe"
FIRST_NAMES += " Amir Bianca Carlos Dana Emil Fatima Greta Hassan Irene Jakub Lena Marco Nadia Oscar Priya Rafael Sofia Tomas Uma"
LAST_NAMES = "Berg Costa Dubois Evans Fischer Garcia Hansen Ivanov Kim Larsen Moreau Novak Okafor Patel Quinn Rossi Schmidt Tanaka"
LAST_NAMES += " Walsh Young Silva Nowak Brennan Lindqvist Morales Haddad Petrov Sato Keller Murphy"
CITIES = "Paris London Berlin Madrid Rome Lisbon Vienna Warsaw Prague Amsterdam Stockholm Oslo Athens Dublin Tokyo Seoul Cairo"
CITIES += " Lagos Nairobi Toronto Chicago Lima Bogota Sydney Auckland Porto Lyon Munich Krakow Geneva Boston Denver Austin Leeds"
STREET_NAMES = "Harbour Station Market Church Mill Bridge Garden Castle Park River Oak Elm Maple Hill Lake Green Queen King North South"
STREET_KINDS = ["Street", "Road", "Avenue", "Lane", "Square", "Way", "Drive", "Place"]
MONTHS = words("January February March April May June July August September October November December")
WEEKDAYS = words("Monday Tuesday Wednesday Thursday Friday Saturday Sunday")
OBJECTS = "lamp kettle chair table window bottle letter ticket basket blanket camera bicycle jacket umbrella notebook pencil"
OBJECTS += " hammer ladder carpet mirror pillow bucket candle wallet helmet backpack cushion drawer printer battery charger"
ANIMALS = "horse rabbit sparrow donkey kitten puppy goose turtle squirrel badger pigeon"
FOODS = "bread cheese apples butter coffee flour honey lemons onions potatoes rice sugar tomatoes yogurt carrots eggs milk"
ADJECTIVES = "small large heavy bright quiet broken yellow green purple silver wooden cheap expensive simple strange careful"
ADJECTIVES += " friendly famous little sudden gentle narrow modern ancient clever happy"
COLORS = "black white red blue green silver orange brown grey pink"
PLACES = "library station market bakery harbour museum garden office school hospital kitchen warehouse theatre hotel"
JOBS = "teacher doctor baker driver painter farmer writer nurse pilot engineer gardener lawyer manager student"
VERBS_PAST = "bought sold found lost painted repaired carried ordered cleaned returned borrowed delivered packed collected"
VERBS_PAST += " checked moved shipped counted wrapped"
VERBS_NOW = "buy sell fix paint clean pack return check move ship wrap order find carry"
CLAUSES = [
    "because the weather was bad",
    "after the long meeting",
    "before the shop closed",
    "while everyone was asleep",
    "although nobody asked",
    "as soon as possible",
    "without telling anyone",
    "during the morning break",
    "since the office was empty",
    "until the evening train arrived",
    "when the rain finally stopped",
    "for the second time this week",
    "with great care",
    "in a hurry",
    "at the very last minute",
]
CURRENCIES = ["euro", "dollars", "pounds", "francs", "EUR", "USD", "GBP"]
SYLLABLES = words("ka lo mir ta ven dor sa ril bo nek ul fa zen gor pi tho an es ri mon quel var is tu")

FUNCTION_NAMES = "add_tax total_price count_words scale clamp average parse_line first_item is_even area greet merge_lists"
FUNCTION_NAMES += " normalize score shift label_for"
PARAMS = words("x y n a b items price rate text values name width height count limit")


def dictionary(shakespeare: list[str]) -> frozenset[str]:
    """The words typos may go into: this file's lower-case vocabulary and the Shakespeare words seen
    20 times or more, all of them lower-case letters only, 4 letters or more."""
    vocabulary = " ".join([OBJECTS, ANIMALS, FOODS, ADJECTIVES, COLORS, PLACES, JOBS, VERBS_PAST, VERBS_NOW, *CLAUSES]).split()
    vocabulary += [w for template in PROSE for w in re.findall(r"[a-z]+", template.split("{")[0])]
    counts = Counter(w for line in shakespeare for w in re.findall(r"[A-Za-z]+", line))
    vocabulary += [w for w, n in counts.items() if n >= 20]
    return frozenset(w for w in vocabulary if w.isalpha() and w.islower() and len(w) >= 4)


def shakespeare_lines(path: Path = SHAKESPEARE) -> list[str]:
    """The non-empty lines of Tiny Shakespeare's train.txt that are not speaker names; [] without the file."""
    if not path.exists():
        return []
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line and not line.endswith(":")]


PROSE = [
    "{name} {verb} {count} {adj} {objects} at the {place} in {city} on {weekday}.",
    "On {date}, {name} took the {time} train from {city} to {city2}.",
    "The {adj} {object} on the table belongs to {name}, who works as a {job} in {city}.",
    "Your order of {count} {objects} will arrive at {address} by {date}.",
    "A {color} {object} costs {price} {currency} at the {place} near {street}.",
    "The meeting with {name} moved to {time} on {weekday}, {date}.",
    "{name} and {name2} {verb} the {object} {clause}.",
    "The {animal} sleeps under the {adj} {object} near the {place}.",
    "Please send the {object} to {fullname}, {address}, before {date}.",
    "We need {count} kilos of {food}, {food2} and some {food3} for the party on {weekday}.",
    "The {job} from {city} said the {object} was {adj} and {adj2}.",
    "{name} called at {time} to ask about invoice {invoice}, which is still open.",
    "Every {weekday}, the {place} sells {food} for {price} {currency} a kilo.",
    "There were {count} {animals} in the {place} {clause}.",
    "My {job} lives at {address} and drives a {color} car.",
    "The {object} you {verb} last {month} was {adj}, so {name} kept it.",
    "Call {fullname} on {phone} if the {object} is not ready by {time}.",
    "In {year}, {fullname} opened a small {place} in {city} with {count} friends.",
    "It is {adj} that the {object} {clause} was {verb} by a {job}.",
    "Flight {flight} to {city} leaves from gate {gate} at {time} on {date}.",
    '{name} said: "I {verb} the {object} {clause}."',
    "The {color} {animal} ran past the {place} and into the {adj} {place2}.",
]


@dataclass(frozen=True)
class Example:
    """One task: the kind ("fix" or "copy"), its input text and its answer."""

    kind: str
    text: str
    answer: str

    def prompt(self) -> str:
        """What the model is given: instruction, text and answer header, ending where the answer begins."""
        instruction, header = TASKS[self.kind]
        return f"{instruction}\nText: {self.text}\n{header}"

    def full(self) -> str:
        """prompt() followed by a space and the answer (the eos token is not part of the string)."""
        return f"{self.prompt()} {self.answer}"


class TextMaker:
    """Random texts (prose, invoices, lists, code, Shakespeare) of a target length, from one rng."""

    def __init__(self, rng: random.Random, shakespeare: list[str]) -> None:
        self.rng = rng
        self.shakespeare = shakespeare
        self.shakespeare_words = sorted({w for line in shakespeare for w in line.split()})

    def pick(self, vocabulary: str | list[str]) -> str:
        return self.rng.choice(words(vocabulary) if isinstance(vocabulary, str) else vocabulary)

    def coined(self) -> str:
        """A made-up capitalised word (a name the model has never seen) from 2-3 syllables."""
        return "".join(self.rng.choices(SYLLABLES, k=self.rng.randint(2, 3))).capitalize()

    def name(self) -> str:
        return self.coined() if self.rng.random() < 0.15 else self.pick(FIRST_NAMES)

    def fullname(self) -> str:
        return f"{self.name()} {self.coined() if self.rng.random() < 0.15 else self.pick(LAST_NAMES)}"

    def city(self) -> str:
        return self.coined() if self.rng.random() < 0.1 else self.pick(CITIES)

    def date(self) -> str:
        r = self.rng
        day, month, year = r.randint(1, 28), r.randint(1, 12), r.randint(1990, 2030)
        return r.choice([f"{day} {MONTHS[month - 1]} {year}", f"{MONTHS[month - 1]} {day}, {year}", f"{year}-{month:02d}-{day:02d}"])

    def time(self) -> str:
        hour, minute = self.rng.randint(6, 21), self.rng.choice([0, 5, 10, 15, 20, 30, 40, 45, 50])
        return f"{hour}:{minute:02d}" if self.rng.random() < 0.7 else f"{hour % 12 or 12}:{minute:02d} {'am' if hour < 12 else 'pm'}"

    def price(self) -> str:
        return f"{self.rng.randint(1, 999)}.{self.rng.randint(0, 99):02d}" if self.rng.random() < 0.8 else str(self.rng.randint(1, 5000))

    def street(self) -> str:
        return f"{self.rng.randint(1, 240)} {self.pick(STREET_NAMES)} {self.pick(STREET_KINDS)}"

    def address(self) -> str:
        return f"{self.street()}, {self.city()} {self.rng.randint(1000, 99999)}"

    def sentence(self) -> str:
        r = self.rng
        object_, animal = self.pick(OBJECTS), self.pick(ANIMALS)
        slots = {
            "name": self.name(),
            "name2": self.name(),
            "fullname": self.fullname(),
            "city": self.city(),
            "city2": self.city(),
            "verb": self.pick(VERBS_PAST),
            "count": str(r.randint(2, 60)),
            "adj": self.pick(ADJECTIVES),
            "adj2": self.pick(ADJECTIVES),
            "object": object_,
            "objects": object_ + "s",
            "animal": animal,
            "animals": animal + "s",
            "place": self.pick(PLACES),
            "place2": self.pick(PLACES),
            "weekday": self.pick(WEEKDAYS),
            "date": self.date(),
            "time": self.time(),
            "job": self.pick(JOBS),
            "address": self.address(),
            "color": self.pick(COLORS),
            "price": self.price(),
            "currency": self.pick(CURRENCIES),
            "street": self.street(),
            "clause": self.pick(CLAUSES),
            "food": self.pick(FOODS),
            "food2": self.pick(FOODS),
            "food3": self.pick(FOODS),
            "invoice": str(r.randint(100, 99999)),
            "month": self.pick(MONTHS),
            "phone": f"+{r.randint(1, 49)} {r.randint(100, 999)} {r.randint(1000, 9999)}",
            "year": str(r.randint(1950, 2030)),
            "flight": f"{r.choice('ABCDEFKLU')}{r.choice('AXYZLH')}{r.randint(10, 9999)}",
            "gate": f"{r.choice('ABCD')}{r.randint(1, 40)}",
        }
        text = self.pick(PROSE).format(**slots)
        return text[0].upper() + text[1:]

    def prose(self, target: int) -> str:
        sentences = [self.sentence()]
        while len(" ".join(sentences).split()) < target:
            sentences.append(self.sentence())
        return " ".join(sentences)

    def invoice(self, target: int) -> str:
        r = self.rng
        lines = [f"Invoice {r.randint(100, 99999)}", f"Bill to: {self.fullname()}", self.address()]
        total = 0.0
        while len(" ".join(lines).split()) < target - 4:
            count, unit = r.randint(1, 12), r.randint(100, 9999) / 100
            total += count * unit
            lines.append(f"{count} x {self.pick(ADJECTIVES)} {self.pick(OBJECTS)} at {unit:.2f}")
        lines += [f"Total: {total:.2f} {self.pick(CURRENCIES)}", f"Due: {self.date()}"]
        return "\n".join(lines)

    def listing(self, target: int) -> str:
        r = self.rng
        style = r.choice(["numbered", "dashes", "inline"])
        title = r.choice(["Shopping list", "To do", "Packing list", "Notes", "Agenda"])
        items: list[str] = []
        while len(" ".join(items).split()) < target - 2:
            items.append(
                r.choice(
                    [
                        f"{r.randint(1, 9)} {self.pick(FOODS)}",
                        f"call {self.name()} at {self.time()}",
                        f"{self.pick(VERBS_NOW)} the {self.pick(OBJECTS)}",
                        f"meet {self.fullname()} at the {self.pick(PLACES)}",
                        f"pay {self.price()} {self.pick(CURRENCIES)} for the {self.pick(OBJECTS)}",
                    ]
                )
            )
        if style == "inline":
            return f"{title}: {', '.join(items)}."
        bullets = [f"{i}. {item}" if style == "numbered" else f"- {item}" for i, item in enumerate(items, 1)]
        return f"{title}:\n" + "\n".join(bullets)

    def function(self) -> str:
        r = self.rng
        params = r.sample(PARAMS, r.randint(1, 3))
        p, num = params[0], r.randint(1, 100)
        body = r.choice(
            [
                [f"    return {p} {r.choice('+-*')} {num}"],
                [f"    result = {p} * {num}", f"    return result + {r.randint(1, 9)}"],
                [f"    if {p} > {num}:", f"        return {num}", f"    return {p}"],
                ["    total = 0", f"    for item in {p}:", "        total += item", "    return total"],
                [f"    print({p})", f"    return len({p})"],
                [f'    return f"{{{p}}}: {self.pick(ADJECTIVES)}"'],
            ]
        )
        return "\n".join([f"def {self.pick(FUNCTION_NAMES)}({', '.join(params)}):", *body])

    def code(self, target: int) -> str:
        functions = [self.function()]
        while len("\n".join(functions).split()) < target:
            functions.append(self.function())
        return "\n\n".join(functions)

    def verse(self, target: int) -> str:
        start = self.rng.randrange(len(self.shakespeare))
        lines = [self.shakespeare[start]]
        while len(" ".join(lines).split()) < target and start + len(lines) < len(self.shakespeare):
            lines.append(self.shakespeare[start + len(lines)])
        return ("\n" if self.rng.random() < 0.5 else " ").join(lines)

    def salad(self, target: int) -> str:
        """Words in no order (vocabulary words, made-up words, numbers, codes): a text that only
        copying can predict, there to make the model learn to copy early."""
        r = self.rng
        pool = " ".join([FIRST_NAMES, CITIES, OBJECTS, ANIMALS, FOODS, ADJECTIVES, PLACES, JOBS, VERBS_PAST]).split()
        makers: list[Callable[[], str]] = [
            lambda: r.choice(pool),
            lambda: r.choice(pool),
            lambda: r.choice(self.shakespeare_words) if self.shakespeare_words else r.choice(pool),
            self.coined,
            lambda: str(r.randint(0, 99999)),
            lambda: "".join(r.choices("ABCDEFGHJKLMNPQRSTUVWXYZ0123456789", k=r.randint(2, 6))),
        ]
        return " ".join(r.choice(makers)() for _ in range(target))

    def text(self) -> str:
        """A text of 3 to about 130 words: 40% short (up to 40 words), 60% long (40-125 words)."""
        r = self.rng
        target = r.randint(3, 40) if r.random() < 0.4 else r.randint(40, 125)
        makers: list[tuple[float, Callable[[int], str]]] = [
            (0.30, self.prose),
            (0.10, self.invoice),
            (0.10, self.listing),
            (0.10, self.code),
            (0.20 if self.shakespeare else 0.0, self.verse),
            (0.20, self.salad),
        ]
        weights, functions = zip(*makers, strict=True)
        return r.choices(functions, weights)[0](target)


def typo(word: str, rng: random.Random) -> str:
    """The word with one typo: two neighbouring letters swapped, a letter dropped or doubled, or a
    letter other than the first put in upper case; never the word itself."""
    while True:
        i = rng.randrange(1, len(word))
        kind = rng.choice(["swap", "drop", "double", "case"])
        if kind == "swap":
            changed = word[: i - 1] + word[i] + word[i - 1] + word[i + 1 :]
        elif kind == "drop":
            changed = word[:i] + word[i + 1 :]
        elif kind == "double":
            changed = word[:i] + word[i] + word[i:]
        else:
            changed = word[:i] + word[i].upper() + word[i + 1 :]
        if changed != word:
            return changed


def inject_typos(text: str, count: int, known: frozenset[str], rng: random.Random) -> str:
    """The text with typos in up to count distinct dictionary words (fewer when it has fewer)."""
    spans = [m.span() for m in re.finditer(r"(?<![\w.])[a-z]+(?![\w(])", text) if m.group() in known]
    chosen = sorted(rng.sample(spans, min(count, len(spans))), reverse=True)
    for begin, end in chosen:
        text = text[:begin] + typo(text[begin:end], rng) + text[end:]
    return text


def examples(count: int, seed: int = 0, shakespeare: list[str] | None = None) -> list[Example]:
    """count examples, the same for the same seed and Shakespeare lines (read from SHAKESPEARE when
    None): 70% "fix" with 0-3 typos, 30% "copy" (a fifth of them with 1-3 typos kept as they are)."""
    rng = random.Random(seed)
    lines = shakespeare_lines() if shakespeare is None else shakespeare
    known = dictionary(lines)
    maker = TextMaker(rng, lines)
    result = []
    for _ in range(count):
        clean = maker.text()
        if rng.random() < 0.7:
            typos = rng.choices([0, 1, 2, 3], [0.15, 0.3, 0.3, 0.25])[0]
            result.append(Example("fix", inject_typos(clean, typos, known, rng), clean))
        else:
            text = inject_typos(clean, rng.randint(1, 3), known, rng) if rng.random() < 0.2 else clean
            result.append(Example("copy", text, text))
    return result
