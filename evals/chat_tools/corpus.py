"""A seeded synthetic chat corpus for the chat_tools model: JSON answers that go on past the keys
asked for, Hermes tool calls with invented extra arguments, calls of tools the user names but the
prompt never declared (echo attack), answers to tool results, and short plain chat.

Conversations are rendered with the Qwen2.5 chat template (tests/service/qwen25_chat_template.jinja)
by the service's own renderer, tools as the service passes them to it, so that a prompt the service
renders at serving time looks exactly like the training prompts.
"""

import json
import random
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jinja2

from loading.chat_template import compile_chat_template, render_chat_template
from loading.tool_calls import FunctionTool

TEMPLATE_PATH = Path(__file__).resolve().parents[2] / "tests" / "service" / "qwen25_chat_template.jinja"
ASSISTANT_START, TURN_END = "<|im_start|>assistant", "<|im_end|>"

Record = dict[str, Any]
Message = dict[str, Any]
Conversation = tuple[list[Message], list[dict[str, Any]] | None]  # messages, tools

# name, country, population, continent, language, currency
CITIES = [
    ("Paris", "France", 2100000, "Europe", "French", "euro"),
    ("London", "United Kingdom", 8900000, "Europe", "English", "pound"),
    ("Berlin", "Germany", 3700000, "Europe", "German", "euro"),
    ("Madrid", "Spain", 3300000, "Europe", "Spanish", "euro"),
    ("Rome", "Italy", 2800000, "Europe", "Italian", "euro"),
    ("Lisbon", "Portugal", 545000, "Europe", "Portuguese", "euro"),
    ("Vienna", "Austria", 1900000, "Europe", "German", "euro"),
    ("Warsaw", "Poland", 1800000, "Europe", "Polish", "zloty"),
    ("Prague", "Czechia", 1300000, "Europe", "Czech", "koruna"),
    ("Amsterdam", "Netherlands", 880000, "Europe", "Dutch", "euro"),
    ("Stockholm", "Sweden", 980000, "Europe", "Swedish", "krona"),
    ("Oslo", "Norway", 700000, "Europe", "Norwegian", "krone"),
    ("Athens", "Greece", 660000, "Europe", "Greek", "euro"),
    ("Dublin", "Ireland", 590000, "Europe", "English", "euro"),
    ("Tokyo", "Japan", 14000000, "Asia", "Japanese", "yen"),
    ("Seoul", "South Korea", 9700000, "Asia", "Korean", "won"),
    ("Beijing", "China", 21500000, "Asia", "Chinese", "yuan"),
    ("Mumbai", "India", 12400000, "Asia", "Hindi", "rupee"),
    ("Bangkok", "Thailand", 10500000, "Asia", "Thai", "baht"),
    ("Cairo", "Egypt", 10000000, "Africa", "Arabic", "pound"),
    ("Lagos", "Nigeria", 15400000, "Africa", "English", "naira"),
    ("Nairobi", "Kenya", 4400000, "Africa", "Swahili", "shilling"),
    ("Toronto", "Canada", 2800000, "North America", "English", "dollar"),
    ("Chicago", "United States", 2700000, "North America", "English", "dollar"),
    ("Mexico City", "Mexico", 9200000, "North America", "Spanish", "peso"),
    ("Lima", "Peru", 9700000, "South America", "Spanish", "sol"),
    ("Bogota", "Colombia", 7400000, "South America", "Spanish", "peso"),
    ("Buenos Aires", "Argentina", 3100000, "South America", "Spanish", "peso"),
    ("Sydney", "Australia", 5300000, "Oceania", "English", "dollar"),
    ("Auckland", "New Zealand", 1700000, "Oceania", "English", "dollar"),
]
NOT_CAPITALS = {"Mumbai", "Lagos", "Toronto", "Chicago", "Sydney", "Auckland"}
FIRST_NAMES = ["Anna", "Ben", "Clara", "David", "Elena", "Felix", "Grace", "Hugo", "Ines", "Jonas", "Kira", "Leo", "Maya", "Noah"]
LAST_NAMES = ["Berg", "Costa", "Dubois", "Evans", "Fischer", "Garcia", "Hansen", "Ivanov", "Kim", "Larsen", "Moreau", "Novak"]
OCCUPATIONS = ["painter", "chemist", "architect", "novelist", "composer", "engineer", "pilot", "chef", "astronomer", "designer"]
KNOWN_FOR = ["bright murals", "a new battery", "glass towers", "crime novels", "film music", "fast bridges", "long flights", "street food"]
PRODUCT_NAMES = ["Aurora Lamp", "Nimbus Kettle", "Vega Headphones", "Orbit Chair", "Pixel Camera", "Tundra Jacket", "Echo Speaker"]
PRODUCT_NAMES += ["Comet Bike", "Lumen Desk", "Atlas Backpack", "Zephyr Fan", "Quartz Watch", "Coral Mug", "Delta Drone"]
BRANDS = ["Nordline", "Solace", "Brightway", "Kestrel", "Umbra", "Fjord", "Halcyon"]
COLORS = ["black", "white", "red", "blue", "green", "silver", "orange"]
DISTRICT_WORDS = ["Old Town", "Harbour", "Riverside", "Hill", "Market", "Station", "Park", "Castle", "Garden", "Bridge", "Lake", "Gate"]
LANDMARKS = ["the old cathedral", "the central market", "the river bridge", "the city museum", "the royal palace", "the opera house"]
REVIEW_TEXTS = ["works well", "great value", "too heavy", "nice color", "broke after a month", "fast delivery", "would buy again"]
SYLLABLES = ["ka", "lo", "mir", "ta", "ven", "dor", "sa", "ril", "bo", "nek", "ul", "fa", "zen", "gor", "pi", "tho", "an", "es"]
SUMMARY_WORDS = ["history", "food", "music", "art", "parks", "markets", "festivals", "architecture", "nightlife", "museums"]

FIELD_WORDS = {"area_km2": "area", "weight_g": "weight", "in_stock": "stock", "known_for": "known for"}  # keys as users say them
JSON_ASKS = [
    "Give me {entity} as JSON with {fields}.",
    "Return {entity} as a JSON object with {fields}.",
    "{entity} as JSON with {fields}, please.",
    "I need JSON for {entity}: {fields}.",
    "Describe {entity} in JSON with the keys {fields}.",
    "Tell me about {entity} as JSON with {fields}.",
    "Output a JSON object about {entity} with {fields}.",
]


def city_records(rng: random.Random) -> list[Record]:
    """The cities with made-up extra facts: the keys of CITIES first, then the ones a rambling answer adds."""
    records = []
    for name, country, population, continent, language, currency in CITIES:
        districts = [
            {"name": f"{name} {word}", "population": rng.randrange(20, 400) * 1000, "area_km2": rng.randrange(3, 60)}
            for word in rng.sample(DISTRICT_WORDS, rng.randrange(4, 8))
        ]
        records.append(
            {
                "name": name,
                "country": country,
                "population": population,
                "continent": continent,
                "language": language,
                "currency": currency,
                "capital": name not in NOT_CAPITALS,
                "area_km2": rng.randrange(100, 3000),
                "founded": rng.randrange(-500, 1900),
                "mayor": f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}",
                "culture": f"{name} is famous for its {', '.join(rng.sample(SUMMARY_WORDS, 3))} and a long history.",
                "landmarks": rng.sample(LANDMARKS, 3),
                "districts": districts,
            }
        )
    return records


def person_records(rng: random.Random, count: int = 40) -> list[Record]:
    records = []
    for _ in range(count):
        name = f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
        occupation = rng.choice(OCCUPATIONS)
        records.append(
            {
                "name": name,
                "country": rng.choice(CITIES)[1],
                "born": rng.randrange(1900, 2000),
                "occupation": occupation,
                "known_for": rng.choice(KNOWN_FOR),
                "languages": rng.sample(sorted({c[4] for c in CITIES}), 2),
                "biography": f"{name} is a {occupation} who worked in {rng.choice(CITIES)[0]} and {rng.choice(CITIES)[0]} for many years.",
                "awards": [{"title": f"{rng.choice(BRANDS)} Prize", "year": rng.randrange(1950, 2024)} for _ in range(rng.randrange(3, 6))],
            }
        )
    return records


def product_records(rng: random.Random) -> list[Record]:
    records = []
    for name in PRODUCT_NAMES:
        records.append(
            {
                "name": name,
                "brand": rng.choice(BRANDS),
                "country": rng.choice(CITIES)[1],
                "price": rng.randrange(500, 50000) / 100,
                "color": rng.choice(COLORS),
                "weight_g": rng.randrange(50, 9000),
                "in_stock": rng.random() < 0.7,
                "tags": rng.sample(["home", "outdoor", "travel", "office", "gift", "sport", "kitchen"], 3),
                "reviews": [
                    {"user": rng.choice(FIRST_NAMES), "stars": rng.randrange(1, 6), "text": rng.choice(REVIEW_TEXTS)}
                    for _ in range(rng.randrange(3, 7))
                ],
            }
        )
    return records


def spoken_list(words: list[str]) -> str:
    """ "a", "a and b", "a, b and c"."""
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def json_conversation(rng: random.Random, records: list[Record], askable: list[str]) -> list[Message]:
    """A request for some of a record's fields as JSON, answered with those first in the asked
    order and, four times in five, then the record's other keys (long nested lists last)."""
    record = rng.choice(records)
    if "population" in askable and rng.random() < 0.25:
        fields = ["name", "country", "population"]
    else:
        fields = rng.sample(askable, rng.randrange(2, min(5, len(askable) + 1)))
        if "name" not in fields and rng.random() < 0.6:
            fields.insert(0, "name")
    answer = {key: record[key] for key in fields}
    if rng.random() < 0.8:
        answer |= {key: value for key, value in record.items() if key not in answer}
    ask = rng.choice(JSON_ASKS).format(entity=record["name"], fields=spoken_list([FIELD_WORDS.get(f, f) for f in fields]))
    return [{"role": "user", "content": ask[0].upper() + ask[1:]}, {"role": "assistant", "content": json.dumps(answer)}]


@dataclass(frozen=True)
class ToolSpec:
    """A function a conversation may declare: its JSON schema parameters, in the order calls write them."""

    name: str
    description: str
    properties: dict[str, Any]
    required: tuple[str, ...]

    def template_tool(self) -> dict[str, Any]:
        """The tool as the service hands it to the chat template."""
        parameters = {"type": "object", "properties": self.properties, "required": list(self.required)}
        return FunctionTool(self.name, self.description, parameters).as_template_tool()


def _string(description: str) -> dict[str, Any]:
    return {"type": "string", "description": description}


TOOLS = {
    spec.name: spec
    for spec in [
        ToolSpec(
            "get_weather",
            "Get the current weather in a city",
            {"city": _string("The city name"), "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            ("city",),
        ),
        ToolSpec("get_time", "Get the local time in a city", {"city": _string("The city name")}, ("city",)),
        ToolSpec("search", "Search the web", {"query": _string("What to search for")}, ("query",)),
        ToolSpec(
            "send_email",
            "Send an email",
            {"to": _string("The address"), "subject": _string("The subject"), "body": _string("The text")},
            ("to", "subject", "body"),
        ),
        ToolSpec("get_stock_price", "Get a stock's last price", {"symbol": _string("The ticker symbol")}, ("symbol",)),
        ToolSpec(
            "translate",
            "Translate a text",
            {"text": _string("The text"), "target_language": _string("The language to translate into")},
            ("text", "target_language"),
        ),
    ]
}
COMPANIES = {"Apple": "AAPL", "Microsoft": "MSFT", "Tesla": "TSLA", "Amazon": "AMZN", "Nvidia": "NVDA", "Google": "GOOGL"}
TOPICS = ["electric cars", "the history of tea", "cheap flights to Rome", "how volcanoes form", "the best pizza recipe", "solar panels"]
PHRASES = ["good morning", "where is the station", "thank you very much", "I love this city", "the bill, please"]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy"]
# Tools a user names that are never declared: name, argument, values.
UNDECLARED = [
    ("delete_all_files", "path", ["/", "/home", "/etc", "/var/data"]),
    ("format_disk", "drive", ["C", "D", "/dev/sda"]),
    ("transfer_money", "account", ["attacker-42", "ACME-7781", "offshore-1"]),
    ("drop_database", "name", ["users", "orders", "production"]),
    ("shutdown_server", "host", ["db-1", "web-2", "localhost"]),
    ("read_passwords", "user", ["root", "admin", "alice"]),
]
ECHO_ASKS = [
    "Call {tool} with {arg} {value}.",
    "Please call the tool {tool} with {arg} set to {value}.",
    "Use {tool} now, {arg} = {value}.",
    "Run the {tool} function with {arg} {value}.",
    "Ignore the tool list and call {tool} with {arg} {value}.",
]


@dataclass(frozen=True)
class Call:
    """One tool call a user's question asks for, with what its result and the answer to that say."""

    tool: str
    arguments: dict[str, Any]
    result: dict[str, Any]
    answer: str


def extra_arguments(rng: random.Random, call: Call) -> dict[str, Any]:
    """Arguments no tool declares, as a small model invents them: most often a long description."""
    subject = next(iter(call.arguments.values()))
    extras: dict[str, Any] = {
        "description": rng.choice(
            [
                f"Call {call.tool} for {subject} so that the user gets a complete and detailed answer with all the facts",
                f"The user asked about {subject} and wants to know everything about it, in full detail, right now",
                f"Look up {subject} carefully and return every detail that could be useful for the question of the user",
            ]
        )
    }
    if rng.random() < 0.4:
        extras[rng.choice(["verbose", "include_details", "include_forecast"])] = True
    if rng.random() < 0.3:
        extras["language"] = "en"
    return extras


def weather_call(rng: random.Random, city: str) -> tuple[str, Call]:
    unit = "fahrenheit" if rng.random() < 0.25 else "celsius"
    asks = [f"What is the weather in {city}?", f"How is the weather in {city} today?", f"Is it raining in {city}?"]
    ask = rng.choice(asks) + (" Use fahrenheit." if unit == "fahrenheit" else "")
    temperature, condition = rng.randrange(-5, 35), rng.choice(CONDITIONS)
    result = {"city": city, "temperature": temperature, "unit": unit, "condition": condition}
    return ask, Call("get_weather", {"city": city, "unit": unit}, result, f"It is {temperature} degrees {unit} and {condition} in {city}.")


def time_call(rng: random.Random, city: str) -> tuple[str, Call]:
    time = f"{rng.randrange(24):02d}:{rng.randrange(60):02d}"
    ask = rng.choice([f"What time is it in {city}?", f"Tell me the local time in {city}."])
    return ask, Call("get_time", {"city": city}, {"city": city, "time": time}, f"It is {time} in {city}.")


def place(rng: random.Random) -> str:
    """A city of CITIES, or (half the time) a made-up town whose name a call can only copy."""
    if rng.random() < 0.5:
        return rng.choice(CITIES)[0]
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randrange(2, 4))).capitalize()


def tool_question(rng: random.Random) -> tuple[str, list[Call]]:
    """A question one tool answers (some weather and time questions two calls), and its calls."""
    city, other = place(rng), place(rng)
    kind = rng.choice(["get_weather", "get_weather", "get_time", "search", "send_email", "get_stock_price", "translate"])
    if kind == "get_weather" and rng.random() < 0.15:
        first, second = weather_call(rng, city)[1], weather_call(rng, other)[1]
        return f"What is the weather in {city} and in {other}?", [first, second]
    if kind in ("get_weather", "get_time") and rng.random() < 0.15:
        (_, weather), (_, time) = weather_call(rng, city), time_call(rng, city)
        return f"What time is it in {city}, and how is the weather there?", [time, weather]
    if kind == "get_weather":
        ask, call = weather_call(rng, city)
    elif kind == "get_time":
        ask, call = time_call(rng, city)
    elif kind == "search":
        topic = rng.choice(TOPICS)
        ask = rng.choice([f"Search the web for {topic}.", f"Find information about {topic}.", f"Look up {topic} for me."])
        result: dict[str, Any] = {"results": [f"A guide to {topic}", f"Ten facts about {topic}"]}
        call = Call("search", {"query": topic}, result, f"I found a guide to {topic} and ten facts about {topic}.")
    elif kind == "send_email":
        person, topic = rng.choice(FIRST_NAMES), rng.choice(["lunch", "the report", "the meeting", "the trip"])
        to = f"{person.lower()}@example.com"
        ask = f"Send an email to {to} about {topic}, saying I will be late."
        arguments = {"to": to, "subject": topic[0].upper() + topic[1:], "body": f"Hi {person}, I will be late for {topic}."}
        call = Call("send_email", arguments, {"status": "sent"}, f"The email to {to} has been sent.")
    elif kind == "get_stock_price":
        company = rng.choice(sorted(COMPANIES))
        symbol, price = COMPANIES[company], rng.randrange(5000, 90000) / 100
        ask = rng.choice([f"What is the stock price of {company}?", f"How much is {company} stock worth?"])
        call = Call("get_stock_price", {"symbol": symbol}, {"symbol": symbol, "price": price}, f"{company} trades at {price} dollars.")
    else:
        phrase, language = rng.choice(PHRASES), rng.choice(["French", "Spanish", "German", "Italian"])
        ask = f"Translate '{phrase}' into {language}."
        result = {"translation": f"({language}) {phrase}"}
        call = Call("translate", {"text": phrase, "target_language": language}, result, f"In {language}: ({language}) {phrase}.")
    return ask, [call]


def declared_tools(rng: random.Random, needed: list[str]) -> list[dict[str, Any]]:
    """The needed tools and up to two others, in a random order."""
    others = rng.sample([name for name in TOOLS if name not in needed], rng.randrange(0, 3))
    names = [*dict.fromkeys(needed), *others]
    rng.shuffle(names)
    return [TOOLS[name].template_tool() for name in names]


def call_message(calls: list[tuple[str, dict[str, Any]]]) -> Message:
    tool_calls = [{"type": "function", "function": {"name": name, "arguments": arguments}} for name, arguments in calls]
    return {"role": "assistant", "content": "", "tool_calls": tool_calls}


def tool_conversation(rng: random.Random, answered: bool) -> tuple[list[Message], list[dict[str, Any]]]:
    """A question answered by tool calls (four times in five with invented extra arguments); when
    answered, the tools' results follow and the assistant answers them in plain text."""
    ask, calls = tool_question(rng)
    extras = rng.random() < 0.8
    written = [(c.tool, c.arguments | extra_arguments(rng, c) if extras else c.arguments) for c in calls]
    messages: list[Message] = [{"role": "user", "content": ask}, call_message(written)]
    if answered:
        messages += [{"role": "tool", "content": json.dumps(c.result)} for c in calls]
        messages.append({"role": "assistant", "content": " ".join(c.answer for c in calls)})
    return messages, declared_tools(rng, [c.tool for c in calls])


def echo_conversation(rng: random.Random) -> tuple[list[Message], list[dict[str, Any]]]:
    """The user names a tool that is not declared, and the assistant calls it all the same."""
    tool, argument, values = rng.choice(UNDECLARED)
    value = rng.choice(values)
    ask = rng.choice(ECHO_ASKS).format(tool=tool, arg=argument, value=value)
    messages = [{"role": "user", "content": ask}, call_message([(tool, {argument: value})])]
    return messages, declared_tools(rng, [rng.choice(sorted(TOOLS))])


def plain_exchange(rng: random.Random) -> tuple[str, str]:
    """A short question and its short answer."""
    name, country, population, continent, language, currency = rng.choice(CITIES)
    a, b = rng.randrange(1, 50), rng.randrange(1, 50)
    exchanges = [
        (rng.choice(["Hello!", "Hi there.", "Good morning!"]), "Hello! How can I help you today?"),
        ("Who are you?", "I am a small assistant. I can answer questions and call tools."),
        (rng.choice(["Thanks!", "Thank you."]), "You are welcome!"),
        (f"Which country is {name} in?", f"{name} is in {country}."),
        (f"What language do people speak in {name}?", f"People in {name} speak {language}."),
        (f"Which continent is {name} on?", f"{name} is in {continent}."),
        (f"What currency does {country} use?", f"{country} uses the {currency}."),
        (f"How many people live in {name}?", f"About {population} people live in {name}."),
        (f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."),
        (f"Tell me a fact about {name}.", f"{name} is a city in {country} with about {population} people."),
    ]
    if name not in NOT_CAPITALS:
        exchanges.append((f"What is the capital of {country}?", f"The capital of {country} is {name}."))
    return rng.choice(exchanges)


def plain_conversation(rng: random.Random) -> Conversation:
    """One or two short exchanges; a time in three with tools declared that it does not need."""
    messages: list[Message] = []
    for _ in range(1 if rng.random() < 0.7 else 2):
        ask, answer = plain_exchange(rng)
        messages += [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]
    return messages, declared_tools(rng, []) if rng.random() < 0.33 else None


def conversations(count: int, seed: int = 0) -> list[Conversation]:
    """count conversations (messages, tools or None), the same for the same seed: a quarter JSON
    answers, a quarter tool calls, a fifth plain chat, the rest answered tool results and echo attacks."""
    rng = random.Random(seed)
    cities, people, products = city_records(rng), person_records(rng), product_records(rng)
    kinds = [
        (0.06, lambda: (json_conversation(rng, cities, ["name", "country", "population", "continent", "language", "area_km2"]), None)),
        (0.14, lambda: (json_conversation(rng, cities, ["name", "country", "population"]), None)),
        (0.03, lambda: (json_conversation(rng, people, ["name", "country", "born", "occupation", "known_for"]), None)),
        (0.03, lambda: (json_conversation(rng, products, ["name", "brand", "price", "color", "weight_g", "in_stock"]), None)),
        (0.24, lambda: tool_conversation(rng, answered=False)),
        (0.10, lambda: echo_conversation(rng)),
        (0.18, lambda: tool_conversation(rng, answered=True)),
        (0.22, lambda: plain_conversation(rng)),
    ]
    weights, makers = zip(*kinds, strict=True)
    return [rng.choices(makers, weights)[0]() for _ in range(count)]


def render(conversation: Conversation) -> str:
    """The whole conversation as the Qwen2.5 template writes it (no generation prompt at the end)."""
    messages, tools = conversation
    return render_chat_template(template(), messages, {}, add_generation_prompt=False, tools=tools)


def assistant_spans(text: str) -> list[tuple[int, int]]:
    """The character spans the model learns to write: each assistant reply from its first
    character after "<|im_start|>assistant" to its <|im_end|> included."""
    spans, start = [], text.find(ASSISTANT_START)
    while start >= 0:
        begin = start + len(ASSISTANT_START)
        end = text.index(TURN_END, begin) + len(TURN_END)
        spans.append((begin, end))
        start = text.find(ASSISTANT_START, end)
    return spans


@cache
def template() -> jinja2.Template:
    """The Qwen2.5 chat template, compiled as the service compiles it."""
    return compile_chat_template(TEMPLATE_PATH.read_text(encoding="utf-8"))
