"""Build the embedded tiny datasets and tokenizer that ship inside ``padless/tiny``.

Everything here is synthetic and offline: datasets come from templates and word lists with a seeded RNG,
and the byte-level BPE tokenizer is trained on that text plus a hand-written prose corpus. Re-running the
script reproduces the committed files byte for byte, which the test-suite checks.

Lengths are deliberately long-tailed (most examples are short, a few are ~10x longer) so that the cost of
padding to the longest sequence in a batch is visible when padless is compared with padded training.

Usage: ``python scripts/build_tiny.py [--out DIR]`` (DIR defaults to ``padless/tiny``).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "padless" / "tiny"
CORPUS_PATH = DEFAULT_OUT / "corpus.txt"  # hand-written input, always read from the source tree

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 in this order
VOCAB_SIZE = 4096
MAX_FILE_BYTES = 300_000

# GPT-2 style split, except that every digit is its own piece (helps a tiny model with arithmetic).
# A newline is never glued to the word after it, so "<|im_start|>assistant\n" tokenizes the same whether
# or not content follows.
SPLIT_PATTERN = r"'(?:s|t|re|ve|m|ll|d)| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# Qwen2-style ChatML. Assistant content plus its <|im_end|> sit inside {% generation %} so transformers
# can build an assistant-token mask; the header and the trailing newline stay outside it. With tools, a
# system turn names them, and an assistant's tool calls are written <call>{"name": ..., "arguments": ...}
# </call> after its text (RESPONSE_TEMPLATE reads them back); without tools the rendering is unchanged.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\ntools: ' + (tools | map(attribute='function.name') | join(', '))"
    " + '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}{{ '<call>' + (call['function'] | tojson) + '</call>' }}"
    "{% endfor %}{{ '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# transformers' response parsing of CHAT_TEMPLATE's assistant turns: text, then <call>{json}</call> calls.
RESPONSE_TEMPLATE = {
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "content": {"close": "<call>", "content": "text"},
        "tool_calls": {
            "open": "<call>",
            "close": "</call>",
            "content": "json",
            "repeats": True,
            "transform": {"type": "function", "function": "{content}"},
        },
    },
}

# (file stem, seed, row count): eval splits use the same generators with a different seed.
SPLITS: list[tuple[str, int, int]] = [
    ("sft", 1001, 400),
    ("sft_prompt_completion", 1002, 200),
    ("preference", 1003, 300),
    ("rl", 1004, 300),
    ("sft_eval", 2001, 40),
    ("preference_eval", 2003, 40),
]

# --------------------------------------------------------------------------------------------------
# Word lists
# --------------------------------------------------------------------------------------------------

COLOURED_THINGS: list[tuple[str, str]] = [
    ("a banana", "yellow"),
    ("grass", "green"),
    ("the sky on a clear day", "blue"),
    ("snow", "white"),
    ("coal", "black"),
    ("a ripe tomato", "red"),
    ("a carrot", "orange"),
    ("a plum", "purple"),
    ("a lemon", "yellow"),
    ("a strawberry", "red"),
    ("a pumpkin", "orange"),
    ("a lime", "green"),
    ("milk", "white"),
    ("chocolate", "brown"),
    ("a crow", "black"),
    ("a flamingo", "pink"),
    ("a blueberry", "blue"),
    ("a cherry", "red"),
    ("an elephant", "grey"),
    ("a polar bear", "white"),
    ("a frog", "green"),
    ("a fire engine", "red"),
    ("a school bus", "yellow"),
    ("an aubergine", "purple"),
    ("a walnut shell", "brown"),
    ("a mouse", "grey"),
    ("a sunflower", "yellow"),
    ("a pine tree", "green"),
    ("the sea", "blue"),
    ("cinnamon", "brown"),
    ("a pig", "pink"),
    ("an orange", "orange"),
    ("a raven", "black"),
    ("a lettuce", "green"),
    ("salt", "white"),
    ("a violet", "purple"),
    ("an egg yolk", "yellow"),
    ("a rain cloud", "grey"),
    ("a ruby", "red"),
    ("a sapphire", "blue"),
]
COLOURS = sorted({colour for _, colour in COLOURED_THINGS})
COLOUR_NOTES = {
    "black": "Black is the darkest colour, the colour of a night with no moon.",
    "blue": "Blue is a cool colour that many people find calm and peaceful.",
    "brown": "Brown is an earthy colour, like soil, wood and bread crust.",
    "green": "Green is the colour of most leaves, so it reminds people of plants and growing things.",
    "grey": "Grey sits between black and white, like a cloudy winter sky.",
    "orange": "Orange is a warm colour that sits between red and yellow.",
    "pink": "Pink is a soft colour made by mixing red with white.",
    "purple": "Purple is a rich colour made by mixing red with blue.",
    "red": "Red is a strong, warm colour that is easy to spot from far away.",
    "white": "White is the lightest colour, the colour of fresh snow.",
    "yellow": "Yellow is a bright, warm colour, like sunshine.",
}

# (name, plural, sound or None, legs, fact)
ANIMALS: list[tuple[str, str, str | None, int, str]] = [
    ("cow", "cows", "moo", 4, "Cows spend most of the day eating grass and chewing it slowly."),
    ("dog", "dogs", "woof", 4, "Dogs are loyal animals, and many of them love to play fetch."),
    ("cat", "cats", "meow", 4, "Cats are quiet hunters, and they sleep for many hours each day."),
    ("duck", "ducks", "quack", 2, "Ducks have waterproof feathers and webbed feet for swimming."),
    ("sheep", "sheep", "baa", 4, "Sheep grow thick wool that farmers shear in the summer."),
    ("horse", "horses", "neigh", 4, "Horses are strong runners, and they can doze while standing up."),
    ("owl", "owls", "hoot", 2, "Owls hunt at night and can turn their heads a long way round."),
    ("frog", "frogs", "croak", 4, "Frogs start life as tadpoles that swim in ponds."),
    ("lion", "lions", "roar", 4, "Lions live together in groups called prides."),
    ("pig", "pigs", "oink", 4, "Pigs are clever, and they roll in mud to keep cool."),
    ("bee", "bees", "buzz", 6, "Bees collect nectar from flowers and turn it into honey."),
    ("hen", "hens", "cluck", 2, "Hens lay eggs and scratch the ground looking for seeds."),
    ("snake", "snakes", "hiss", 0, "Snakes move by bending their long bodies from side to side."),
    ("mouse", "mice", "squeak", 4, "Mice are small and quick, and they like seeds and grain."),
    ("goat", "goats", "bleat", 4, "Goats are good climbers and can stand on narrow rocky ledges."),
    ("crow", "crows", "caw", 2, "Crows are clever birds that can solve simple puzzles."),
    ("donkey", "donkeys", "hee-haw", 4, "Donkeys are patient and can carry heavy loads."),
    ("wolf", "wolves", "howl", 4, "Wolves live and hunt together in packs."),
    ("spider", "spiders", None, 8, "Spiders spin silk webs to catch insects."),
    ("ant", "ants", None, 6, "Ants live in large colonies and work together to find food."),
    ("beetle", "beetles", None, 6, "Beetles have hard wing cases that protect their soft wings."),
]
LEG_COUNTS = [0, 2, 4, 6, 8]

CAPITALS: list[tuple[str, str]] = [
    ("France", "Paris"),
    ("Japan", "Tokyo"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Egypt", "Cairo"),
    ("Canada", "Ottawa"),
    ("Kenya", "Nairobi"),
    ("Peru", "Lima"),
    ("Norway", "Oslo"),
    ("Germany", "Berlin"),
    ("Greece", "Athens"),
    ("Australia", "Canberra"),
    ("Portugal", "Lisbon"),
    ("Ireland", "Dublin"),
    ("Sweden", "Stockholm"),
    ("Austria", "Vienna"),
    ("Poland", "Warsaw"),
    ("Chile", "Santiago"),
    ("Thailand", "Bangkok"),
    ("Argentina", "Buenos Aires"),
]
OPPOSITES: list[tuple[str, str]] = [
    ("hot", "cold"),
    ("big", "small"),
    ("up", "down"),
    ("fast", "slow"),
    ("happy", "sad"),
    ("light", "dark"),
    ("open", "closed"),
    ("early", "late"),
    ("full", "empty"),
    ("loud", "quiet"),
    ("hard", "soft"),
    ("wet", "dry"),
    ("tall", "short"),
    ("heavy", "light"),
    ("clean", "dirty"),
    ("near", "far"),
    ("thick", "thin"),
    ("first", "last"),
    ("rich", "poor"),
    ("strong", "weak"),
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]

WORD_TABLE = (
    "apple garden window rabbit pencil candle bottle orange purple yellow basket butter castle dragon forest "
    "guitar hammer island jacket kitten ladder market needle pepper rocket silver ticket turtle violin "
    "wizard "
    "bridge cloud flower lantern mountain picnic pirate puzzle river shadow spider sunset thunder tomato "
    "umbrella village whistle blanket cabbage dolphin feather giraffe harbour kettle lemon meadow notebook "
    "octopus pebble quilt rainbow saddle teapot velvet walrus yogurt zipper acorn biscuit compass doorway "
    "engine fountain glacier honey igloo jigsaw kayak lighthouse marble nectar orchard parrot level noon "
    "anchor balloon cactus dinosaur elbow falcon goblin helmet insect jelly koala lobster magnet nutmeg "
    "oyster pancake quarry raccoon scissors trumpet unicorn vulture waffle xylophone yacht zebra almond "
    "bramble cobweb dragonfly eyebrow fiddle gravel hedgehog iceberg juggler knapsack leopard mushroom "
    "nightingale omelette pyjamas quiver reindeer snowflake tortoise vinegar wheelbarrow yesterday "
    "alphabet blizzard cupboard daffodil envelope flamingo grasshopper hurricane invention journey keyboard "
    "library microscope nephew ostrich penguin question radish skeleton telescope uniform volcano "
    "waterfall breakfast chimney dustpan emerald firework gingerbread hospital jasmine kingfisher "
    "mermaid noodle paddle racket sandwich tambourine vegetable whisker carpet sparrow treasure"
)
WORDS = WORD_TABLE.split()

NAMES: list[tuple[str, str]] = [
    ("Ada", "she"),
    ("Ben", "he"),
    ("Chloe", "she"),
    ("Dev", "he"),
    ("Ella", "she"),
    ("Finn", "he"),
    ("Grace", "she"),
    ("Hugo", "he"),
    ("Iris", "she"),
    ("Jon", "he"),
    ("Kira", "she"),
    ("Leo", "he"),
    ("Maya", "she"),
    ("Nico", "he"),
    ("Omar", "he"),
    ("Priya", "she"),
    ("Rosa", "she"),
    ("Sam", "he"),
    ("Tara", "she"),
    ("Uma", "she"),
    ("Yusuf", "he"),
    ("Zoe", "she"),
]
PRONOUNS = {"he": ("he", "him", "his"), "she": ("she", "her", "her")}

STORY_HEROES: list[tuple[str, str, str]] = [
    ("a small fox", "Pip", "he"),
    ("a curious girl", "Mira", "she"),
    ("an old lighthouse keeper", "Tom", "he"),
    ("a shy robot", "Bolt", "he"),
    ("a brave little hen", "Hetty", "she"),
    ("a young baker", "Lena", "she"),
    ("a sleepy bear", "Bruno", "he"),
    ("a clever mouse", "Nell", "she"),
    ("a kind farmer", "Owen", "he"),
    ("a quiet owl", "Willa", "she"),
    ("a cheerful postman", "Arlo", "he"),
    ("a tiny dragon", "Ember", "she"),
]
STORY_OBJECTS = [
    "a silver key",
    "an old map",
    "a red kite",
    "a tiny lantern",
    "a singing shell",
    "a blue feather",
    "a wooden box",
    "a golden acorn",
    "a lost mitten",
    "a glass marble",
    "a paper boat",
    "a brass compass",
]
STORY_PLACES = [
    "the forest",
    "the harbour",
    "the hills",
    "the old orchard",
    "the market",
    "the river bank",
    "the meadow",
    "the village square",
    "the beach",
    "the mill",
]
STORY_ANIMALS = ["rabbit", "squirrel", "goose", "badger", "hedgehog", "robin", "deer", "mole"]  # all take "a"

STORY_SETUP = [
    "One morning {name} walked to {place} to look for {object}.",
    "{Name} had heard that {object} was hidden somewhere near {place}, and {pron} wanted to find it.",
    "Everyone in the village talked about {object}, and one day {name} set off to find it.",
]
STORY_MIDDLE = [
    "{Pron} searched behind every rock and under every bush.",
    "The wind was cold, so {name} pulled {poss} scarf a little tighter.",
    "A friendly {animal} stopped to say hello and offered to help.",
    "{Name} felt tired, but {pron} did not want to give up.",
    "At noon {pron} sat down on a log and ate some bread and an apple.",
    "Suddenly {pron} heard a soft sound coming from {place}.",
    "The path was long, and it wound up and down over the hills.",
    "{Name} remembered what {poss} grandmother always said: take one step at a time.",
    "The sun came out from behind a cloud, and everything looked brighter.",
    "A little rain began to fall, so {name} waited under a tall tree.",
    "{Pron} counted {n} birds sitting in a row on a fence.",
    "{Name} asked a {animal} for directions, and the {animal} pointed towards {place}.",
    "When {pron} looked closely, {pron} saw something shining in the grass.",
    "{Name} laughed, because the {animal} had a leaf stuck on its nose.",
    "The stream was too wide to jump, so {name} crossed on an old wooden bridge.",
    "{Pron} wrote a note in {poss} notebook so {pron} would not forget the way.",
    "{Name} shared {poss} lunch with a hungry {animal}.",
    "For a while {pron} was not sure which way to go.",
    "A {animal} and a {animal2} were arguing about who had the best nest, and {name} helped them make peace.",
    "{Name} climbed a small hill to see further across {place}.",
    "The air smelled of pine needles and wet earth.",
    "{Pron} found {n} smooth stones and put them in {poss} pocket.",
    "A boat with a white sail drifted slowly past.",
    "{Name} hummed a song to keep {poss} spirits up.",
    "The {animal} said that it had seen {object} near {place} the day before.",
    "{Pron} thanked the {animal} and hurried on.",
    "Clouds gathered, and for a moment everything was very still.",
    "An old woman selling apples waved at {name} and gave {obj} one for free.",
    "{Name} stopped to tie {poss} boots, which had come loose again.",
]
STORY_ENDINGS = [
    "In the end {name} found {object} and carried it home carefully.",
    "From that day on, {name} kept {object} on the shelf beside {poss} bed.",
    "{Name} finally found {object}, smiled, and knew it had been a very good day.",
    "When {pron} got home with {object}, {name} told everyone about the adventure.",
]

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a patient tutor for young learners. Explain your answers clearly and kindly.",
    "You are a concise assistant. Keep answers short and accurate.",
    "You are a friendly assistant who enjoys simple puzzles, stories and arithmetic.",
    "You are a careful assistant. Check your work before you answer.",
]
OPENERS = ["Sure!", "Good question.", "Of course.", "Here is the answer.", "Happy to help."]
CLOSERS = [
    "Let me know if you would like another one.",
    "I hope that helps!",
    "Feel free to ask me something else.",
    "That was a nice question to think about.",
]
UNHELPFUL = [
    "I don't know.",
    "Figure it out yourself.",
    "Why would you ask me that?",
    "That is not something I want to talk about.",
    "Whatever. Ask someone else.",
    "No idea, sorry.",
]
FOLLOW_UP_CONNECTORS = [
    "Thanks! ",
    "Great. ",
    "One more question: ",
    "Okay, next one. ",
    "",
    "Nice. Now this: ",
]

Size = str  # "short" | "medium" | "long"


@dataclass
class QA:
    """One question/answer pair plus a fluent but wrong answer, used as a rejected response."""

    question: str
    answer: str
    wrong: str


def cap(text: str) -> str:
    """Upper-case the first character only (str.capitalize would lower-case the rest)."""
    return text[:1].upper() + text[1:]


def spaced(word: str) -> str:
    """Spell a word with dashes between letters; keeps each letter a separate token."""
    return "-".join(word)


def join_list(items: list[str]) -> str:
    return ", ".join(items)


def maybe_closer(rng: random.Random, text: str, p: float = 0.4) -> str:
    """Add a friendly opener and/or closer now and then, so answers are not all the same shape."""
    if rng.random() < p:
        text = f"{rng.choice(OPENERS)} {text}"
    if rng.random() < p:
        text = f"{text} {rng.choice(CLOSERS)}"
    return text


# --------------------------------------------------------------------------------------------------
# Question families. Each returns a QA of roughly the requested size.
# --------------------------------------------------------------------------------------------------


def family_colour(rng: random.Random, size: Size) -> QA:
    if size == "short":
        thing, colour = rng.choice(COLOURED_THINGS)
        question = rng.choice(
            [
                f"What colour is {thing}?",
                f"Tell me the usual colour of {thing}.",
                f"If you picture {thing}, what colour do you see?",
            ]
        )
        others = [t for t, c in COLOURED_THINGS if c == colour and t != thing]
        extra = ""
        if len(others) >= 2:
            pair = rng.sample(others, 2)
            extra = f" Other things that are usually {colour} include {pair[0]} and {pair[1]}."
        wrong_colour = rng.choice([c for c in COLOURS if c != colour])
        answer = maybe_closer(rng, f"{cap(thing)} is usually {colour}. {COLOUR_NOTES[colour]}{extra}")
        wrong = f"{cap(thing)} is usually {wrong_colour}."
        return QA(question, answer, wrong)
    count = rng.randint(8, 16) if size == "medium" else len(COLOURED_THINGS)
    picked = rng.sample(COLOURED_THINGS, count)
    question = "Give the usual colour of each of these things: " + join_list([t for t, _ in picked]) + "."
    lines = [f"- {t}: {c}" for t, c in picked]
    answer = "Here are the usual colours:\n" + "\n".join(lines)
    bad = list(picked)
    for i in rng.sample(range(count), max(1, count // 4)):
        t, c = bad[i]
        bad[i] = (t, rng.choice([x for x in COLOURS if x != c]))
    wrong = "Here are the usual colours:\n" + "\n".join(f"- {t}: {c}" for t, c in bad)
    return QA(question, answer, wrong)


def family_animal(rng: random.Random, size: Size) -> QA:
    if size != "short":
        count = rng.randint(6, 12) if size == "medium" else len(ANIMALS)
        picked = rng.sample(ANIMALS, count)
        question = "How many legs does each of these animals have? " + join_list([a[0] for a in picked])
        answer = "Here is the number of legs for each animal:\n" + "\n".join(
            f"- {name}: {legs}" for name, _, _, legs, _ in picked
        )
        wrong = "Here is the number of legs for each animal:\n" + "\n".join(
            f"- {name}: {rng.choice([x for x in LEG_COUNTS if x != legs]) if rng.random() < 0.4 else legs}"
            for name, _, _, legs, _ in picked
        )
        return QA(question, answer, wrong)
    name, plural, sound, legs, fact = rng.choice(ANIMALS)
    if sound is not None and rng.random() < 0.5:
        question = rng.choice([f"What sound does a {name} make?", f"What noise do {plural} make?"])
        other = rng.choice([a[2] for a in ANIMALS if a[2] is not None and a[2] != sound])
        answer = maybe_closer(rng, f'A {name} says "{sound}". {cap(plural)} have {legs} legs. {fact}')
        wrong = f'A {name} says "{other}". {fact}'
        return QA(question, answer, wrong)
    question = rng.choice([f"How many legs does a {name} have?", f"Count the legs on a {name} for me."])
    legs_text = "no legs at all" if legs == 0 else f"{legs} legs"
    wrong_legs = rng.choice([x for x in LEG_COUNTS if x != legs])
    sound_text = f" When {plural} call to each other, they {sound}." if sound else ""
    answer = maybe_closer(rng, f"A {name} has {legs_text}. {fact}{sound_text}")
    wrong = f"A {name} has {wrong_legs} legs. {fact}{sound_text}"
    return QA(question, answer, wrong)


def family_fact(rng: random.Random, size: Size) -> QA:
    kind = rng.randrange(4)
    if size != "short":
        count = rng.randint(6, 12) if size == "medium" else len(CAPITALS)
        picked = rng.sample(CAPITALS, count)
        question = "Name the capital city of each country: " + join_list([c for c, _ in picked]) + "."
        answer = "\n".join(f"- The capital of {c} is {city}." for c, city in picked)
        swapped = [city for _, city in picked]
        i, j = rng.sample(range(count), 2)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        wrong = "\n".join(
            f"- The capital of {c} is {city}." for (c, _), city in zip(picked, swapped, strict=True)
        )
        return QA(question, answer, wrong)
    if kind == 0:
        country, city = rng.choice(CAPITALS)
        other = rng.choice([c for _, c in CAPITALS if c != city])
        question = rng.choice(
            [f"What is the capital of {country}?", f"Which city is the capital of {country}?"]
        )
        answer = (
            f"The capital of {country} is {city}. A capital is the city where a country's government "
            "is based."
        )
        return QA(question, maybe_closer(rng, answer), f"The capital of {country} is {other}.")
    if kind == 1:
        word, opposite = rng.choice(OPPOSITES)
        if rng.random() < 0.5:
            word, opposite = opposite, word
        other = rng.choice([w for pair in OPPOSITES for w in pair if w not in (word, opposite)])
        question = f'What is the opposite of "{word}"?'
        answer = (
            f'The opposite of "{word}" is "{opposite}". For example, if something is not {word}, '
            f"it might be {opposite}."
        )
        return QA(question, maybe_closer(rng, answer), f'The opposite of "{word}" is "{other}".')
    seq, unit = (DAYS, "day") if kind == 2 else (MONTHS, "month")
    i = rng.randrange(len(seq))
    if rng.random() < 0.5:
        target, rel = seq[(i + 1) % len(seq)], "after"
    else:
        target, rel = seq[i - 1], "before"
    other = rng.choice([x for x in seq if x not in (target, seq[i])])
    question = f"Which {unit} comes {rel} {seq[i]}?"
    answer = (
        f"The {unit}s go in this order: {join_list(seq)}. "
        f"So the {unit} that comes {rel} {seq[i]} is {target}."
    )
    return QA(question, maybe_closer(rng, answer), f"The {unit} that comes {rel} {seq[i]} is {other}.")


def family_spelling(rng: random.Random, size: Size) -> QA:
    if size != "short":
        count = rng.randint(5, 10) if size == "medium" else rng.randint(65, 80)
        picked = [rng.choice(WORDS) for _ in range(count)]
        question = "Spell each of these words backwards: " + join_list(picked) + "."
        answer = "\n".join(f"- {w} -> {w[::-1]}" for w in picked)
        wrong = "\n".join(f"- {w} -> {w[::-1] if rng.random() < 0.6 else w}" for w in picked)
        return QA(question, answer, wrong)
    word = rng.choice(WORDS)
    kind = rng.randrange(3)
    if kind == 0:
        rev = word[::-1]
        question = rng.choice(
            [f'Spell the word "{word}" backwards.', f'What is "{word}" written in reverse?']
        )
        note = " It reads the same both ways, so it is a palindrome." if rev == word else ""
        answer = (
            f'Reading from the last letter to the first, "{word}" becomes "{rev}". '
            f"Letter by letter: {spaced(rev)}.{note}"
        )
        letters = list(rev)
        k = rng.randrange(len(letters) - 1)
        letters[k], letters[k + 1] = letters[k + 1], letters[k]
        bad = "".join(letters) if "".join(letters) != rev else rev[1:]
        wrong = f'Reading from the last letter to the first, "{word}" becomes "{bad}".'
        return QA(question, maybe_closer(rng, answer), wrong)
    if kind == 1:
        question = rng.choice(
            [f'How many letters are in the word "{word}"?', f'Count the letters in "{word}".']
        )
        counted = ", ".join(f"{ch} is {k}" for k, ch in enumerate(word, start=1))
        answer = (
            f'The word "{word}" is spelled {spaced(word)}. Counting them: {counted}. '
            f"That makes {len(word)} letters."
        )
        bad = len(word) + rng.choice([-2, -1, 1, 2])
        wrong = f'The word "{word}" is spelled {spaced(word)}. That makes {bad} letters.'
        return QA(question, maybe_closer(rng, answer), wrong)
    question = f'What are the first and last letters of "{word}"?'
    answer = f'The word "{word}" starts with "{word[0]}" and ends with "{word[-1]}".'
    wrong = f'The word "{word}" starts with "{word[-1]}" and ends with "{word[0]}".'
    if word[0] == word[-1]:
        wrong = f'The word "{word}" starts with "{word[1]}" and ends with "{word[-2]}".'
    return QA(question, maybe_closer(rng, answer), wrong)


def list_length(
    rng: random.Random, size: Size, short: tuple[int, int], medium: tuple[int, int], long: tuple[int, int]
) -> int:
    lo, hi = {"short": short, "medium": medium, "long": long}[size]
    return rng.randint(lo, hi)


def family_list(rng: random.Random, size: Size) -> QA:
    kind = rng.randrange(4)
    if kind == 0:
        n = list_length(rng, size, (4, 8), (14, 26), (120, 150))
        words = rng.sample(WORDS, n) if n <= len(WORDS) else [rng.choice(WORDS) for _ in range(n)]
        ordered = sorted(words)
        question = "Sort these words into alphabetical order: " + join_list(words) + "."
        bad = list(ordered)
        i = rng.randrange(n - 1)
        bad[i], bad[-1] = bad[-1], bad[i]
        if bad == ordered:
            bad = list(reversed(ordered))
        return QA(
            question,
            "In alphabetical order: " + join_list(ordered) + ".",
            "In alphabetical order: " + join_list(bad) + ".",
        )
    if kind == 1:
        n = list_length(rng, size, (4, 9), (15, 30), (65, 85))
        nums = [rng.randint(1, 99) for _ in range(n)]
        question = "Reverse this list of numbers: " + join_list([str(x) for x in nums]) + "."
        rev = nums[::-1]
        bad = rev[:-1] if n > 4 else nums
        return QA(
            question,
            "Here is the list reversed: " + join_list([str(x) for x in rev]) + ".",
            "Here is the list reversed: " + join_list([str(x) for x in bad]) + ".",
        )
    if kind == 2:
        n = list_length(rng, size, (5, 10), (15, 30), (120, 160))
        nums = [rng.randint(1, 99) for _ in range(n)]
        question = "Which is the largest number in this list? " + join_list([str(x) for x in nums])
        biggest = max(nums)
        others = sorted(set(nums) - {biggest})
        not_biggest = rng.choice(others) if others else biggest - 1
        return QA(
            question,
            f"The largest number in the list is {biggest}.",
            f"The largest number in the list is {not_biggest}.",
        )
    n = list_length(rng, size, (6, 12), (25, 50), (230, 290))
    pool = rng.sample([a[0] for a in ANIMALS], 4)
    items = [rng.choice(pool) for _ in range(n)]
    target = rng.choice(pool)
    k = items.count(target)
    question = f'How many times does the word "{target}" appear in this list? ' + join_list(items)
    answer = f'The word "{target}" appears {k} time{"s" if k != 1 else ""} in the list.'
    bad = max(0, k + rng.choice([-2, -1, 1, 2]))
    if bad == k:
        bad = k + 1
    return QA(question, answer, f'The word "{target}" appears {bad} times in the list.')


def explain_sum(a: int, b: int, op: str) -> str:
    """A short worked explanation, so answers carry reasoning and not only the number."""
    if op == "x":
        terms = " + ".join([str(a)] * b) if b > 1 else str(a)
        groups = f"{b} group{'s' if b != 1 else ''} of {a}"
        return f"{a} x {b} means {groups}: {terms} = {a * b}. So {a} x {b} = {a * b}."
    res = a + b if op == "+" else a - b
    tens, ones = (b // 10) * 10, b % 10
    if tens and ones:
        mid = a + tens if op == "+" else a - tens
        return (
            f"Split {b} into {tens} and {ones}. "
            f"First {a} {op} {tens} = {mid}, then {mid} {op} {ones} = {res}. "
            f"So {a} {op} {b} = {res}."
        )
    return f"{a} {op} {b} = {res}."


def family_arithmetic(rng: random.Random, size: Size) -> QA:
    if size != "short":
        n = rng.randint(10, 20) if size == "medium" else rng.randint(34, 42)
        nums = [rng.randint(1, 9) for _ in range(n)]
        question = "Add up these numbers and show a running total: " + join_list([str(x) for x in nums]) + "."
        steps, total = [f"Start with {nums[0]}."], nums[0]
        wrong_steps, wrong_total = list(steps), nums[0]
        slip = rng.randrange(1, n)
        for i, x in enumerate(nums[1:], start=1):
            steps.append(f"{total} + {x} = {total + x}.")
            new_wrong = wrong_total + x + (1 if i == slip else 0)
            wrong_steps.append(f"{wrong_total} + {x} = {new_wrong}.")
            total, wrong_total = total + x, new_wrong
        answer = " ".join(steps) + f" The total is {total}."
        wrong = " ".join(wrong_steps) + f" The total is {wrong_total}."
        return QA(question, answer, wrong)
    op = rng.choice(["+", "+", "-", "-", "x"])
    if op == "x":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
    elif op == "+":
        a, b = rng.randint(2, 60), rng.randint(2, 40)
    else:
        a = rng.randint(10, 90)
        b = rng.randint(2, a)
    res = a * b if op == "x" else (a + b if op == "+" else a - b)
    word = {"+": "plus", "-": "minus", "x": "times"}[op]
    question = rng.choice(
        [f"What is {a} {op} {b}?", f"What is {a} {word} {b}?", f"Please work out {a} {op} {b}."]
    )
    bad = res + rng.choice([-10, -2, -1, 1, 2, 10])
    return QA(question, maybe_closer(rng, explain_sum(a, b, op)), f"{a} {op} {b} = {bad}.")


def story_text(rng: random.Random, hero: tuple[str, str, str], obj: str, sentences: int) -> str:
    desc, name, pron = hero
    subj, objp, poss = PRONOUNS[pron]

    def fill(template: str) -> str:
        a1, a2 = rng.sample(STORY_ANIMALS, 2)
        return template.format(
            name=name,
            Name=name,
            pron=subj,
            Pron=cap(subj),
            obj=objp,
            poss=poss,
            object=obj,
            place=rng.choice(STORY_PLACES),
            animal=a1,
            animal2=a2,
            n=rng.randint(2, 9),
        )

    body = [f"Once upon a time there was {desc} called {name}.", fill(rng.choice(STORY_SETUP))]
    deck: list[str] = []
    for _ in range(max(0, sentences - 3)):
        if not deck:  # deal the middle sentences like cards, so long stories repeat as little as possible
            deck = list(STORY_MIDDLE)
            rng.shuffle(deck)
        body.append(fill(deck.pop()))
    body.append(fill(rng.choice(STORY_ENDINGS)))
    if sentences < 10:
        return " ".join(body)
    paragraphs, i = [], 0
    while i < len(body):
        step = rng.randint(4, 6)
        paragraphs.append(" ".join(body[i : i + step]))
        i += step
    return "\n\n".join(paragraphs)


def family_story(rng: random.Random, size: Size) -> QA:
    hero = rng.choice(STORY_HEROES)
    obj = rng.choice(STORY_OBJECTS)
    n = list_length(rng, size, (3, 5), (8, 14), (36, 46))
    desc, name, _ = hero
    if size == "short":
        question = f"Write a very short story about {desc} called {name} who finds {obj}."
    elif size == "medium":
        question = f"Write a story of about {n} sentences about {desc} called {name} who finds {obj}."
    else:
        question = (
            f"Write a long, gentle story, at least {n - 4} sentences, about {desc} called {name} who "
            f"goes looking for {obj}. Use several paragraphs."
        )
    answer = story_text(rng, hero, obj, n)
    other_hero = rng.choice([h for h in STORY_HEROES if h != hero])
    other_obj = rng.choice([o for o in STORY_OBJECTS if o != obj])
    wrong = story_text(
        rng, other_hero, other_obj, max(3, n // 2)
    )  # off-topic: ignores who and what was asked
    return QA(question, answer, wrong)


FAMILIES: dict[str, Callable[[random.Random, Size], QA]] = {
    "colour": family_colour,
    "animal": family_animal,
    "fact": family_fact,
    "spelling": family_spelling,
    "list": family_list,
    "arithmetic": family_arithmetic,
    "story": family_story,
}
LONG_FAMILIES = ["list", "list", "arithmetic", "story", "story", "spelling"]  # each gives ~500-700 tokens


LONG_EVERY = 20  # exactly one row in 20 is long: a guaranteed tail even in the 40-row eval splits


def make_qa(rng: random.Random, size: Size | None = None) -> QA:
    """Random family; without a size, 85% short and 15% medium (long rows are scheduled by the caller)."""
    size = size or ("medium" if rng.random() < 0.15 else "short")
    name = rng.choice(LONG_FAMILIES) if size == "long" else rng.choice(sorted(FAMILIES))
    return FAMILIES[name](rng, size)


# --------------------------------------------------------------------------------------------------
# Dataset rows
# --------------------------------------------------------------------------------------------------


def sft_row(rng: random.Random, long: bool) -> dict:
    messages: list[dict[str, str]] = []
    if rng.random() < 0.2:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    r = 1.0 if long else rng.random()
    if r < 0.07:
        # A genuine follow-up that depends on the first answer.
        a, b = rng.randint(2, 50), rng.randint(2, 30)
        c = rng.randint(2, 20)
        messages += [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": explain_sum(a, b, "+")},
            {"role": "user", "content": f"Now add {c} to that result."},
            {
                "role": "assistant",
                "content": f"The previous result was {a + b}. " + explain_sum(a + b, c, "+"),
            },
        ]
    elif r < 0.2:
        first, second = make_qa(rng, "short"), make_qa(rng)
        messages += [
            {"role": "user", "content": first.question},
            {"role": "assistant", "content": first.answer},
            {"role": "user", "content": rng.choice(FOLLOW_UP_CONNECTORS) + second.question},
            {"role": "assistant", "content": second.answer},
        ]
    else:
        qa = make_qa(rng, "long" if long else None)
        messages += [{"role": "user", "content": qa.question}, {"role": "assistant", "content": qa.answer}]
    return {"messages": messages}


def prompt_completion_row(rng: random.Random, long: bool) -> dict:
    qa = make_qa(rng, "long" if long else None)
    # The completion starts with a space, so tokenizing prompt and completion separately gives the same ids as
    # tokenizing their concatenation.
    return {"prompt": f"Question: {qa.question}\nAnswer:", "completion": " " + qa.answer}


def truncate(rng: random.Random, text: str) -> str | None:
    words = text.split(" ")
    if len(words) < 8:
        return None
    keep = max(2, int(len(words) * rng.uniform(0.3, 0.6)))
    return " ".join(words[:keep]).rstrip(".,:;!")


def garble(rng: random.Random, text: str) -> str | None:
    words = text.split()
    if len(words) < 5:
        return None
    shuffled = list(words)
    for _ in range(10):
        rng.shuffle(shuffled)
        if shuffled != words:
            return " ".join(shuffled)
    return None


def preference_row(rng: random.Random, long: bool) -> dict:
    qa = make_qa(rng, "long" if long else None)
    r = rng.random()
    rejected: str | None = None
    if r < 0.2:
        rejected = truncate(rng, qa.answer)
    elif r < 0.32:
        rejected = garble(rng, qa.answer)
    elif r < 0.45:
        rejected = rng.choice(UNHELPFUL)
    if rejected is None:
        rejected = qa.wrong
    assert rejected != qa.answer, qa
    # Plain-text pairs: the prompt ends where an answer starts, and completions begin with a space.
    return {
        "prompt": f"Question: {qa.question}\nAnswer:",
        "chosen": " " + qa.answer,
        "rejected": " " + rejected,
    }


def rl_row(rng: random.Random, long: bool) -> dict:
    suffix = rng.choice(
        ["Answer with just the number.", "Reply with only the number.", "Give just the number."]
    )
    r = rng.random() * 0.1 if long else 0.1 + rng.random() * 0.9
    if r < 0.06:
        # Long context: a story, then a question about numbers that appear only in the question.
        hero = rng.choice(STORY_HEROES)
        story = story_text(rng, hero, rng.choice(STORY_OBJECTS), rng.randint(10, 16))
        name = hero[1]
        a, b = rng.randint(3, 20), rng.randint(2, 15)
        if rng.random() < 0.5:
            q, ans = (
                f"After the adventure, {name} had {a} apples and picked {b} more. How many apples now?",
                a + b,
            )
        else:
            a += b
            q, ans = f"{name} had {a} stickers and gave {b} of them away. How many stickers are left?", a - b
        return {
            "prompt": f"Read the story, then answer the question.\n\n{story}\n\nQuestion: {q} {suffix}",
            "answer": str(ans),
        }
    if r < 0.10:
        nums = [rng.randint(1, 9) for _ in range(rng.randint(30, 45))]
        return {
            "prompt": f"What is the sum of these numbers: {join_list([str(x) for x in nums])}? {suffix}",
            "answer": str(sum(nums)),
        }
    if r < 0.22:
        name, pron = rng.choice(NAMES)
        thing = rng.choice(["apples", "marbles", "pencils", "shells", "stickers", "coins", "books"])
        a, b = rng.randint(3, 30), rng.randint(1, 20)
        if rng.random() < 0.5:
            return {
                "prompt": f"{name} has {a} {thing}. {cap(pron)} gets {b} more. How many {thing} does "
                f"{name} have now? {suffix}",
                "answer": str(a + b),
            }
        a += b
        return {
            "prompt": f"{name} has {a} {thing}. {cap(pron)} gives away {b}. How many {thing} does {name} "
            f"have left? {suffix}",
            "answer": str(a - b),
        }
    if r < 0.34:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return {"prompt": f"What is {a} x {b}? {suffix}", "answer": str(a * b)}
    if rng.random() < 0.55:
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        return {
            "prompt": rng.choice([f"What is {a} + {b}? {suffix}", f"Compute {a} plus {b}. {suffix}"]),
            "answer": str(a + b),
        }
    a = rng.randint(0, 60)
    b = rng.randint(0, a)
    return {
        "prompt": rng.choice([f"What is {a} - {b}? {suffix}", f"Compute {a} minus {b}. {suffix}"]),
        "answer": str(a - b),
    }


ROW_MAKERS: dict[str, Callable[[random.Random, bool], dict]] = {
    "sft": sft_row,
    "sft_prompt_completion": prompt_completion_row,
    "preference": preference_row,
    "rl": rl_row,
    "sft_eval": sft_row,
    "preference_eval": preference_row,
}


def generate_split(name: str, seed: int, count: int, exclude: set[str] | None = None) -> list[dict]:
    """Draw `count` distinct rows, also skipping rows in `exclude` (the train rows, for eval splits)."""
    rng = random.Random(seed)
    make = ROW_MAKERS[name]
    seen: set[str] = set(exclude or ())
    rows: list[dict] = []
    while len(rows) < count:
        row = make(rng, len(rows) % LONG_EVERY == LONG_EVERY // 2)
        key = json.dumps(row, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        rows.append(row)
    rng.shuffle(rows)  # the long rows should not sit at regular positions
    return rows


def generate_all() -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for name, seed, count in SPLITS:
        train = name.removesuffix("_eval")
        exclude = {json.dumps(r, sort_keys=True) for r in out[train]} if name.endswith("_eval") else None
        out[name] = generate_split(name, seed, count, exclude)
    return out


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------


def training_texts(corpus: str, datasets: dict[str, list[dict]]) -> Iterator[str]:
    """Plain text for BPE training, in a fixed order (special tokens are left out: they are never merged)."""
    yield from (p.strip() for p in corpus.split("\n\n") if p.strip())
    for name, _, _ in SPLITS:
        for row in datasets[name]:
            if "messages" in row:
                for m in row["messages"]:
                    yield f"{m['role']}\n{m['content']}"
            else:
                yield from (
                    row[k] for k in ("prompt", "completion", "chosen", "rejected", "answer") if k in row
                )


def train_tokenizer(texts: list[str]):  # -> tokenizers.Tokenizer
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps every character (spaces too) mapped to a token; the assistant mask needs it.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=0,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    got = tok.get_vocab_size()
    if got != VOCAB_SIZE:
        raise RuntimeError(f"trained vocab has {got} entries, expected {VOCAB_SIZE}; the corpus is too small")
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def tokenizer_config() -> dict:
    """Written by hand (not save_pretrained) so the file is stable across transformers versions."""
    return {
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, t in enumerate(SPECIAL_TOKENS)
        },
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "response_template": RESPONSE_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "extra_special_tokens": ["<|im_start|>"],
        "model_max_length": 2048,
        "pad_token": "<|endoftext|>",
        "padding_side": "right",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def write_tokenizer(tok, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"), pretty=True)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")


# --------------------------------------------------------------------------------------------------
# Output + stats
# --------------------------------------------------------------------------------------------------


def write_jsonl(rows: list[dict], path: Path) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    size = len(text.encode())
    if size > MAX_FILE_BYTES:
        raise RuntimeError(f"{path.name} is {size} bytes, over the {MAX_FILE_BYTES} budget")
    path.write_text(text)


def row_token_length(tokenizer, row: dict) -> int:
    """Tokens in the sequence a trainer would actually see for this row (chosen side for preferences)."""
    if "messages" in row:
        return len(
            tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"]
        )
    second = row.get("completion", row.get("chosen", row.get("answer")))
    return len(tokenizer(row["prompt"] + second, add_special_tokens=False)["input_ids"])


def print_stats(out: Path, datasets: dict[str, list[dict]]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out / "tokenizer")
    print(f"tokenizer: {type(tokenizer).__name__}, vocab {len(tokenizer)}")
    print(f"{'file':<24}{'rows':>6}{'median':>8}{'p90':>6}{'max':>6}{'max/med':>9}{'KB':>7}")
    for name, _, _ in SPLITS:
        lengths = sorted(row_token_length(tokenizer, r) for r in datasets[name])
        med = statistics.median(lengths)
        p90 = lengths[int(0.9 * (len(lengths) - 1))]
        kb = (out / "data" / f"{name}.jsonl").stat().st_size / 1000
        ratio = lengths[-1] / med
        print(f"{name:<24}{len(lengths):>6}{med:>8.0f}{p90:>6}{lengths[-1]:>6}{ratio:>9.1f}{kb:>7.0f}")


WARM_START = "tiny-llama-arith"
WARM_START_EPOCHS = 40


def build_warm_start(out: Path) -> None:
    """Fine-tune the embedded Llama on the answers of the ``tiny:rl`` prompts (padless SFT, 40 epochs, fixed
    seeds; ~3 minutes on 2 CPU cores) and save it in bf16 as ``<out>/tiny-llama-arith``: a policy that
    answers some prompts right, so the RL examples show reward rising. Reproducible with the same torch on
    the same kind of machine, not byte for byte everywhere (which is why it is a separate step)."""
    import sys
    import tempfile

    import torch

    sys.path.insert(0, str(REPO_ROOT))
    from transformers import AutoModelForCausalLM

    from padless.config.loading import load_config
    from padless.config.schema import SFTConfig
    from padless.trainers.sft import run_sft

    rows = [json.loads(line) for line in (out / "data" / "rl.jsonl").read_text().splitlines()]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "answers.jsonl"
        chats = [
            [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["answer"]}]
            for r in rows
        ]
        data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
        overrides = [
            "model.name=tiny-llama",
            f"data.train={data}",
            f"train.output_dir={Path(tmp) / 'run'}",
            f"train.num_epochs={WARM_START_EPOCHS}",
            "train.learning_rate=3e-3",
            "train.warmup_ratio=0.05",
            "train.max_tokens_per_batch=2048",
            "train.report_to=[]",
            "train.progress_bar=false",
        ]
        run_sft(load_config(SFTConfig, None, overrides))
        checkpoint = max((Path(tmp) / "run").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
        model.generation_config.pad_token_id = SPECIAL_TOKENS.index("<|endoftext|>")
        model.save_pretrained(out / WARM_START)
    print(f"wrote {out / WARM_START}")


TOOL_WARM_START = "tiny-llama-calc"
# SFT stages of tool_chats, each from the last: (seed, count) of the fresh prompts, direct answers per tool
# call on the tiny:rl prompts, epochs, learning rate. The first learns the call syntax and when to call; the
# second, on fresh prompts seen once each, the copying (the first alone copies a number into the call or the
# result into the answer right about half the time) but then calls on nearly every prompt; the third,
# tiny:rl prompts only, half with a call, brings that down to about a fifth of the episodes.
TOOL_STAGES: list[tuple[tuple[int, int], int, int, float]] = [
    ((1005, 500), 3, 10, 2e-3),
    ((1006, 10_000), 3, 1, 2e-3),
    ((1007, 0), 1, 2, 1e-3),
]
# The two-number question forms of rl_row, and the calculate() expression each one asks for.
TOOL_QUESTIONS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"(?:What is|Compute) (\d+) (\+|-|x|plus|minus) (\d+)[?.] "), r"\1 \2 \3"),
    (re.compile(r" has (\d+) \w+\. \w+ gets (\d+) more\."), r"\1 + \2"),
    (re.compile(r" has (\d+) \w+\. \w+ gives away (\d+)\."), r"\1 - \2"),
]


def tool_expression(prompt: str) -> str | None:
    """The calculate() expression a ``tiny:rl`` prompt asks for; None for the story and list prompts."""
    for pattern, expression in TOOL_QUESTIONS:
        m = pattern.search(prompt)
        if m is not None:
            return m.expand(expression)
    return None


def tool_chats(rows: list[dict], tokenizer, fresh: tuple[int, int], direct_copies: int) -> list[list[dict]]:
    """SFT conversations for the calculator. Per ``tiny:rl`` prompt with two numbers: one that calls
    calculate (the template's own call syntax, from a structured ``tool_calls``), reads the tool message and
    answers, and ``direct_copies`` that answer at once (the other prompts: answered at once); then
    ``fresh`` = (seed, count) new prompts of the same forms, each with a tool call: their answers cannot be
    remembered, so the model learns to copy the numbers into the call and the tool's result into the
    answer.

    SFT rows carry no ``tools``, so the template's tools preamble (what an episode's prompt starts with) is
    put in as the system message that renders the same text, checked per conversation against the rendering
    with ``tools=``: a template change fails the build instead of training on another format."""
    from padless.rl.environments import calculate, tool_schema

    schemas = [tool_schema("calculate", calculate)]

    def render(messages: list[dict], **kwargs) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)

    def with_call(row: dict, expression: str) -> list[dict]:
        assert calculate(expression) == row["answer"], (row, expression)
        arguments = {"expression": expression}
        call = {"type": "function", "function": {"name": "calculate", "arguments": arguments}}
        return [
            {"role": "user", "content": row["prompt"]},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculate", "content": calculate(expression)},
            {"role": "assistant", "content": row["answer"]},
        ]

    probe = [{"role": "user", "content": "x"}]
    with_tools, without = render(probe, tools=schemas), render(probe)
    head, tail = render([{"role": "system", "content": "\ue000"}]).split("\ue000")
    preamble = with_tools[: len(with_tools) - len(without)]
    assert with_tools.endswith(without) and preamble.startswith(head) and preamble.endswith(tail), preamble
    system = {"role": "system", "content": preamble[len(head) : len(preamble) - len(tail)]}
    chats = []
    for r in rows:
        direct = [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["answer"]}]
        expression = tool_expression(r["prompt"])
        if expression is not None:
            chats.append(with_call(r, expression))
        chats += [direct] * (1 if expression is None else direct_copies)
    seed, count = fresh
    rng, seen, fresh = random.Random(seed), {r["prompt"] for r in rows}, 0
    while fresh < count:
        row = rl_row(rng, False)
        expression = tool_expression(row["prompt"])
        if expression is not None and row["prompt"] not in seen:
            seen.add(row["prompt"])
            chats.append(with_call(row, expression))
            fresh += 1
    random.Random(seed).shuffle(chats)
    for chat in chats:
        assert render([system, *chat]) == render(chat, tools=schemas), chat
    return [[system, *chat] for chat in chats]


def build_tool_warm_start(out: Path) -> None:
    """Fine-tune the shipped ``tiny-llama-arith`` on :func:`tool_chats` of the ``tiny:rl`` prompts in the
    ``TOOL_STAGES`` (padless SFT, fixed seeds; about 15 minutes on 2 CPU cores) and save it in bf16 as
    ``<out>/tiny-llama-calc``: a policy that calls the calculator on some episodes and answers directly on
    the others, so GRPO with the ``calculator`` environment has tool use to learn. Reproducible like
    :func:`build_warm_start`."""
    import shutil
    import sys
    import tempfile

    import torch

    sys.path.insert(0, str(REPO_ROOT))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from padless.config.loading import load_config
    from padless.config.schema import SFTConfig
    from padless.trainers.sft import run_sft

    rows = [json.loads(line) for line in (out / "data" / "rl.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(out / "tokenizer")
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / WARM_START  # the shipped warm start and the embedded tokenizer, as one folder
        shutil.copytree(out / WARM_START, model)
        shutil.copytree(out / "tokenizer", model, dirs_exist_ok=True)
        for stage, (fresh, direct_copies, epochs, lr) in enumerate(TOOL_STAGES):
            data = Path(tmp) / f"calculator-{stage}.jsonl"
            chats = tool_chats(rows, tokenizer, fresh, direct_copies)
            data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
            run = Path(tmp) / f"run-{stage}"
            overrides = [
                f"model.name={model}",
                f"data.train={data}",
                f"train.output_dir={run}",
                f"train.num_epochs={epochs}",
                f"train.learning_rate={lr}",
                "train.warmup_ratio=0.05",
                "train.max_tokens_per_batch=1024",
                "train.report_to=[]",
                "train.progress_bar=false",
            ]
            run_sft(load_config(SFTConfig, None, overrides))
            model = max(run.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
            shutil.copytree(out / "tokenizer", model, dirs_exist_ok=True)
        trained = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
        trained.generation_config.pad_token_id = SPECIAL_TOKENS.index("<|endoftext|>")
        trained.save_pretrained(out / TOOL_WARM_START)
    print(f"wrote {out / TOOL_WARM_START}")


DISTILL_TEACHER = "tiny-llama-arith-rl"


def build_distill_teacher(out: Path) -> None:
    """Sharpen the shipped ``tiny-llama-arith`` with GRPO as ``examples/grpo_tiny.yaml`` trains it (60
    rollouts of the first 16 ``tiny:rl`` prompts, seed 42; minutes on 2 CPU cores) and save it in
    fp16 as ``<out>/tiny-llama-arith-rl``: a teacher that answers those prompts right far more often than
    the warm start (greedy 5 -> 9 of 16, the shipped copy), so ``examples/distill_tiny.yaml`` has something to
    distil into the warm start without a reward. Deterministic for one padless version, torch and kind of
    machine; GRPO's trajectory follows padless's own code, so a later rebuild gives another sharpened copy
    (rebuilt at 005b989 its fp16 weights differed from the shipped ones by up to 0.022)."""
    import shutil
    import sys
    import tempfile

    import torch

    sys.path.insert(0, str(REPO_ROOT))
    from transformers import AutoModelForCausalLM

    from padless.config.loading import load_config
    from padless.config.schema import GRPOConfig
    from padless.trainers.grpo import run_grpo

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / WARM_START  # the shipped warm start and the embedded tokenizer, as one folder
        shutil.copytree(out / WARM_START, model)
        shutil.copytree(out / "tokenizer", model, dirs_exist_ok=True)
        run = Path(tmp) / "run"
        overrides = [
            f"model.name={model}",
            f"train.output_dir={run}",
            "train.eval_steps=0",
            "train.save_steps=0",
            "train.report_to=[]",
            "train.progress_bar=false",
        ]
        run_grpo(load_config(GRPOConfig, REPO_ROOT / "examples" / "grpo_tiny.yaml", overrides))
        checkpoint = max(run.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        # fp16, not bf16: with its weights rounded to bf16 this model's packed-vs-alone round-off reached
        # 2.1x the load-time probe's bound (1.0e-4 > 4.8e-5, fp32 compute), and padless refused it; in fp16
        # (10 mantissa bits, its weights all below 3) it is 9.5e-6, as in fp32
        trained = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float16)
        trained.generation_config.pad_token_id = SPECIAL_TOKENS.index("<|endoftext|>")
        trained.save_pretrained(out / DISTILL_TEACHER)
    print(f"wrote {out / DISTILL_TEACHER}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="output dir (gets data/ and tokenizer/)"
    )
    parser.add_argument(
        "--stats", action="store_true", help="print token-length statistics (loads transformers)"
    )
    parser.add_argument(
        "--warm-start",
        action="store_true",
        help=f"only (re)build the shipped RL warm starts {WARM_START}, then {TOOL_WARM_START}, from --out's "
        "data (trains: minutes)",
    )
    parser.add_argument(
        "--tool-warm-start",
        action="store_true",
        help=f"only (re)build {TOOL_WARM_START}, the calculator warm start, from --out's {WARM_START}",
    )
    parser.add_argument(
        "--distill-teacher",
        action="store_true",
        help=f"only (re)build {DISTILL_TEACHER}, the distillation example's teacher, from {WARM_START}",
    )
    args = parser.parse_args(argv)
    if args.distill_teacher:
        build_distill_teacher(args.out)
        return
    if args.warm_start or args.tool_warm_start:
        if args.warm_start:
            build_warm_start(args.out)
        build_tool_warm_start(args.out)
        build_distill_teacher(args.out)
        return

    datasets = generate_all()
    (args.out / "data").mkdir(parents=True, exist_ok=True)
    for name, rows in datasets.items():
        write_jsonl(rows, args.out / "data" / f"{name}.jsonl")
    texts = list(training_texts(CORPUS_PATH.read_text(), datasets))
    write_tokenizer(train_tokenizer(texts), args.out / "tokenizer")
    print(f"wrote {len(datasets)} datasets and a {VOCAB_SIZE}-token tokenizer to {args.out}")
    if args.stats:
        print_stats(args.out, datasets)


if __name__ == "__main__":
    main()
