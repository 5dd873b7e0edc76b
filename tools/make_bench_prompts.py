"""Generate jaxserve/bench/data/bench_prompts.jsonl, the workload of `jaxserve bench serve`.

    python -m tools.make_bench_prompts [--out jaxserve/bench/data/bench_prompts.jsonl] [--seed 1234]

Real English prompts, fixed seed, one JSON object per line:
{"prompt": str, "output_len": int, "prompt_len": int, "source": str}. prompt_len is the
prompt's length in SmolLM2 tokens (without special tokens); output_len the number of tokens
to generate (16..256, mean ~128, drawn by the kind of task: short answers get fewer, stories
and explanations more).

Where the text comes from (all available offline):
  * questions and instructions written for this file (explain, summarise, list, compare,
    write a story / poem / email, plan, rewrite; short paragraphs of everyday prose);
  * Python's own documentation: pydoc_data.topics (the language reference topics) and the
    docstrings of standard-library modules, classes and functions;
  * source code of small pure-Python standard-library functions (code-explanation tasks);
  * the license texts in /usr/share/common-licenses (Debian; skipped if absent).
Long prompts wrap a passage (up to ~900 tokens) in a summarise / answer-questions task.

The output depends on the Python version (3.11: its docs and sources) and the presence of
/usr/share/common-licenses; the shipped file was generated with Python 3.11.7 on Debian 12.
Needs the SmolLM2 tokenizer (jaxserve fetches/converts the model into its cache if missing).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import json
import random
import re
import statistics
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "jaxserve" / "bench" / "data" / "bench_prompts.jsonl"

# How many prompts of each kind.
COUNTS = {"question": 70, "task": 65, "rewrite": 25, "code": 40, "passage": 175}
# Which documentation a passage comes from (weights); a text long enough for the target.
PASSAGE_SOURCES = {"pydoc_data.topics": 0.45, "docstring": 0.35, "license": 0.2}
# Output-length range (tokens) by kind of task; uniform within it.
OUTPUT_RANGES = {"fact": (16, 96), "explain": (80, 224), "list": (64, 192), "create": (112, 256),
                 "rewrite": (48, 192), "code": (96, 256), "summary": (64, 192),
                 "passage_qa": (32, 176)}
MAX_PASSAGE_TOKENS = 880

# --- short questions, written for this file: (kind, question) ------------------------------
QUESTIONS = [
    ("fact", "What is the capital of Australia?"),
    ("fact", "How many bones are there in the adult human body?"),
    ("fact", "Who wrote the novel Pride and Prejudice?"),
    ("fact", "What is the boiling point of water at the top of Mount Everest?"),
    ("fact", "Which planet in our solar system has the most moons?"),
    ("fact", "What does the acronym HTTP stand for?"),
    ("fact", "In what year did the first human land on the Moon?"),
    ("fact", "What is the difference between weather and climate?"),
    ("fact", "How long does light from the Sun take to reach the Earth?"),
    ("fact", "What is the largest ocean on Earth?"),
    ("fact", "Why is the sky blue?"),
    ("fact", "What is the chemical formula of table salt?"),
    ("fact", "How many players are on a football team during a match?"),
    ("fact", "What language is spoken in Brazil?"),
    ("fact", "What is a prime number? Give two examples."),
    ("fact", "Who painted the Mona Lisa?"),
    ("fact", "What is the speed of sound in air at room temperature?"),
    ("fact", "Is a tomato a fruit or a vegetable?"),
    ("fact", "What is the tallest mountain in Africa?"),
    ("fact", "What does a thermometer measure?"),
    ("fact", "What is the main ingredient of guacamole?"),
    ("fact", "How many continents are there, and what are they called?"),
    ("fact", "What is the square root of 144?"),
    ("fact", "What year did the Berlin Wall fall?"),
    ("fact", "What is the freezing point of water in Fahrenheit?"),
    ("fact", "Which gas do plants absorb from the atmosphere?"),
    ("fact", "What is the plural of 'cactus'?"),
    ("fact", "What does RAM stand for in a computer?"),
    ("fact", "What is 15 percent of 240?"),
    ("fact", "Which organ pumps blood around the body?"),
    ("explain", "Why do we have leap years?"),
    ("explain", "How does a refrigerator keep food cold?"),
    ("explain", "Why do cats purr?"),
    ("explain", "How do airplanes stay in the air?"),
    ("explain", "What causes the seasons on Earth?"),
    ("explain", "How does a search engine decide which pages to show first?"),
    ("explain", "Why does ice float on water?"),
    ("explain", "What happens in the body when we fall asleep?"),
    ("explain", "How do noise-cancelling headphones work?"),
    ("explain", "Why is it important to back up your files, and what is a good way to do it?"),
    ("explain", "What is the difference between a virus and a bacterium?"),
    ("explain", "How does a credit score work?"),
    ("explain", "Why do some people get seasick while others do not?"),
    ("explain", "What is the difference between RAM and storage on a laptop?"),
    ("explain", "How does garbage collection work in Python?"),
    ("explain", "What is the difference between a list and a tuple in Python?"),
    ("explain", "Why is it hard to predict earthquakes?"),
    ("explain", "How do bees make honey?"),
    ("explain", "What is a mortgage and how does the interest on it work?"),
    ("explain", "Why do onions make people cry?"),
    ("explain", "What does it mean for an algorithm to run in O(n log n) time?"),
    ("explain", "How does a bicycle stay upright when it is moving?"),
    ("explain", "What is the greenhouse effect?"),
    ("explain", "Why do we dream?"),
    ("explain", "How does public transport make a city more efficient?"),
    ("list", "List five healthy breakfast ideas that take less than ten minutes to prepare."),
    ("list", "What are some good habits for staying focused while working from home?"),
    ("list", "Give me ten names for a friendly robot in a children's book."),
    ("list", "What should I pack for a three-day hiking trip in the mountains?"),
    ("list", "Suggest some ways to reduce plastic waste at home."),
    ("list", "What are the most common mistakes people make when learning a new language?"),
    ("list", "Name some classic novels that every teenager should read, with one sentence about each."),
    ("list", "What are the main causes of the First World War?"),
    ("list", "Give me a list of questions to ask at the end of a job interview."),
    ("list", "What are some fun things to do on a rainy weekend with kids?"),
    ("list", "List the planets of the solar system in order from the Sun, with one fact about each."),
    ("list", "What are the warning signs of burnout at work?"),
    ("list", "Suggest a weekly exercise routine for a beginner."),
    ("list", "What are good ways to save money on groceries?"),
    ("list", "Give me some tips for writing a clear and friendly email."),
    ("create", "Write a haiku about the first snow of winter."),
    ("create", "Tell me a bedtime story about a brave little turtle."),
    ("create", "Write a limerick about a cat who loves to cook."),
    ("create", "Write a short motivational speech for a team that just lost an important game."),
    ("create", "Describe a sunset over the ocean to someone who has never seen one."),
    ("create", "Write the opening paragraph of a mystery novel set in a small fishing village."),
    ("create", "Invent a new holiday and explain how people would celebrate it."),
    ("create", "Write a thank-you note to a teacher who helped me a lot this year."),
    ("create", "Write a product description for a reusable water bottle that keeps drinks cold for a day."),
    ("create", "Write a dialogue between a customer and a barista who is having a very strange morning."),
    ("create", "Write a short poem about a city waking up in the morning."),
    ("create", "Write a recipe for a simple vegetable soup, with ingredients and steps."),
    ("create", "Imagine you are a tour guide in ancient Rome. Describe what visitors would see."),
    ("create", "Write a short speech for a best friend's wedding."),
    ("create", "Write a fable that teaches the value of patience."),
]

# --- templated tasks: (kind, template, {slot: choices}) --------------------------------------
TASKS = [
    ("explain", "Explain {concept} to {audience}.", {
        "concept": ["photosynthesis", "compound interest", "recursion", "how vaccines work",
                    "inflation", "black holes", "supply and demand", "how the internet works",
                    "public-key cryptography", "plate tectonics", "how neural networks learn",
                    "the water cycle", "the theory of evolution", "how a bill becomes law",
                    "what a database index is", "the difference between weather and climate",
                    "how batteries store energy", "the placebo effect", "how GPS finds your location",
                    "why the Roman Empire declined"],
        "audience": ["a ten-year-old", "a high school student", "a busy executive in two minutes",
                     "someone who has never used a computer", "a curious grandparent",
                     "a first-year university student"]}),
    ("explain", "What are the pros and cons of {thing}?", {
        "thing": ["working from home", "electric cars", "nuclear power", "living in a big city",
                  "learning to code at school", "a four-day work week", "renting instead of buying a home",
                  "social media for teenagers", "open-plan offices", "studying abroad",
                  "using a standing desk", "self-driving cars"]}),
    ("explain", "Compare {a} and {b}. When would you choose one over the other?", {
        "a,b": [("Python", "JavaScript"), ("trains", "planes for travel across Europe"),
                ("tea", "coffee"), ("a laptop", "a desktop computer"), ("SQL databases", "NoSQL databases"),
                ("renting", "buying a car"), ("cats", "dogs as pets"), ("paper books", "e-readers"),
                ("running", "swimming for fitness"), ("TCP", "UDP"), ("solar power", "wind power"),
                ("a Roth IRA", "a traditional IRA")]}),
    ("list", "List {n} {things}.", {
        "n": ["five", "seven", "ten"],
        "things": ["tips for improving sleep", "ways to make a small apartment feel bigger",
                   "reasons to learn a second language", "ideas for a science fair project",
                   "questions to ask before adopting a dog", "easy vegetables to grow on a balcony",
                   "strategies for managing stress before an exam", "common cognitive biases with examples",
                   "ways to make meetings more productive", "famous inventions of the twentieth century",
                   "good practices for writing readable code", "books about the history of science"]}),
    ("create", "Write a short story about {character} who {situation}.", {
        "character": ["an old lighthouse keeper", "a young chef", "a lonely robot", "a retired astronaut",
                      "a girl who can talk to birds", "a clumsy wizard", "a taxi driver in Tokyo",
                      "a detective who is afraid of the dark", "a farmer", "a street musician"],
        "situation": ["finds a mysterious letter under the door", "gets lost in a forest at night",
                      "wins a competition by accident", "has to save the town from a flood",
                      "meets their future self", "discovers a hidden room in their house",
                      "must make a difficult promise", "loses their voice on the most important day"]}),
    ("create", "Write a poem about {topic} in the style of {style}.", {
        "topic": ["the sea", "a rainy Monday", "friendship", "an old tree", "the city at night",
                  "learning something new", "autumn leaves", "a cup of coffee"],
        "style": ["a sonnet", "a nursery rhyme", "free verse", "a ballad", "a haiku sequence"]}),
    ("create", "Write an email to {recipient} {purpose}.", {
        "recipient": ["my manager", "a landlord", "a customer", "my team", "a professor",
                      "a hotel", "an old friend"],
        "purpose": ["asking for a day off next Friday", "about a broken heating system",
                    "apologising for a late delivery", "announcing a new project kickoff meeting",
                    "asking for an extension on an assignment", "requesting a late check-out",
                    "suggesting we meet up next month"]}),
    ("list", "Give me a step-by-step plan to {goal}.", {
        "goal": ["learn to play the guitar in six months", "run a 10 km race", "start a vegetable garden",
                 "organise a birthday party for twenty people", "learn the basics of Python",
                 "prepare for a job interview", "declutter my home in one weekend",
                 "build an emergency fund", "write a short novel", "plan a two-week trip to Japan"]}),
    ("fact", "In one or two sentences, what is {term}?", {
        "term": ["a black hole", "machine learning", "the GDP of a country", "a sonnet", "an API",
                 "a vaccine", "a haiku", "an index fund", "the Pythagorean theorem", "a carbon footprint",
                 "a hash function", "a metaphor"]}),
]

# --- everyday prose for rewrite tasks (written for this file) --------------------------------
PARAGRAPHS = [
    "hi all, just a reminder that the office will be closed on monday for the public holiday. "
    "if you need anything urgent please contact sarah, she will be checking her email. also the "
    "kitchen fridge will be cleaned out on friday afternoon so take your stuff home before then "
    "or it will be thrown away. thanks and have a good long weekend",
    "Dear Mr. Patel, I am writing about the order I placed three weeks ago (order number 48213). "
    "The website said it would arrive within five working days, but I still have not received it, "
    "and the tracking page has not been updated since it left your warehouse. I have emailed your "
    "support team twice without a reply. Could you please tell me where my parcel is, or refund "
    "my money if it has been lost? Kind regards, Helen Morris",
    "Meeting notes, Tuesday: Anna presented the new website design, everyone liked the colours "
    "but the menu is confusing on phones. Tom said the launch date of the 14th is too early "
    "because the payment page is not tested. We agreed to move the launch to the 28th. Priya "
    "will talk to the designers about the menu. Tom will finish testing the payment page by "
    "next Friday. Anna will update the marketing plan with the new date.",
    "Our small bakery has been part of the neighbourhood for over twenty years. Every morning "
    "we bake bread, pastries and cakes using flour from a local mill and butter from farms "
    "nearby. We are open from seven in the morning until six in the evening, every day except "
    "Sunday, and we also take orders for birthday and wedding cakes.",
    "The new library opened last week after two years of construction. It has three floors, "
    "a children's area with a reading garden, forty computers that anyone can use for free, "
    "and quiet study rooms that can be booked online. Opening hours are longer than at the "
    "old library, and on Saturdays there will be free workshops for adults who want to improve "
    "their computer skills.",
    "I've been thinking about the trip and honestly I'm not sure the budget works. Flights alone "
    "are nearly six hundred each, and the hotel you picked is lovely but it's three hundred a "
    "night. Could we look at staying somewhere a bit cheaper for part of the week, or maybe go "
    "in October when prices drop? I really do want to go, I just don't want to be stressed "
    "about money the whole time.",
    "Thank you for applying for the position of junior data analyst. We received a very large "
    "number of applications and, after careful consideration, we have decided not to move "
    "forward with your application at this time. We were impressed by your enthusiasm and "
    "encourage you to apply for future openings that match your experience.",
    "The quarterly results were better than expected. Revenue grew by eight percent compared "
    "with the same period last year, mainly because of strong sales in the online shop. Costs "
    "rose as well, because we hired more staff for the warehouse and paid more for shipping. "
    "Profit was roughly flat. For the next quarter we plan to focus on reducing delivery costs.",
    "so basically the app keeps crashing whenever i try to upload a photo from my phone, it "
    "works fine on the laptop though. i tried reinstalling it twice and restarting the phone "
    "but nothing changed. its an older android phone if that matters. can someone help, i need "
    "to send these pictures to my insurance company by tomorrow",
    "Walking is one of the simplest forms of exercise. It needs no equipment, it can be done "
    "almost anywhere, and it is gentle on the joints. Studies suggest that a brisk thirty-minute "
    "walk on most days can improve heart health, lift mood and help with sleep. Walking with a "
    "friend or a dog can make the habit easier to keep.",
    "Hello team, great work on the release last week. A few customers have reported that the "
    "export button produces an empty file when the report has more than ten thousand rows. "
    "Could someone look into this before Thursday? Please also remember to fill in your hours "
    "for the month by Friday, finance needs them earlier than usual.",
    "The volunteer programme is looking for people who can give two hours a week to help at the "
    "community garden. No experience is needed. Tasks include watering, weeding, harvesting "
    "vegetables and showing visitors around. Volunteers get a share of the harvest and a free "
    "t-shirt. To sign up, leave your name and phone number at the front desk.",
]
REWRITE_TASKS = [
    ("rewrite", "Rewrite the following text so that it sounds more professional:\n\n{p}"),
    ("rewrite", "Proofread this text and correct any spelling, grammar and punctuation mistakes:\n\n{p}"),
    ("rewrite", "Make this text shorter without losing any important information:\n\n{p}"),
    ("rewrite", "{p}\n\nWrite a polite reply to the message above."),
    ("list", "Turn the following text into a clear bulleted list of the key points:\n\n{p}"),
    ("list", "{p}\n\nWhat action items or next steps follow from the text above? Who is responsible for each?"),
    ("rewrite", "Rewrite this in a friendly, casual tone suitable for a social media post:\n\n{p}"),
    ("fact", "What is the main purpose of the following message? Answer in one sentence.\n\n{p}"),
    ("rewrite", "Translate the following text into simple English that a beginner learner could understand:\n\n{p}"),
]

# --- passage tasks: (kind, template) --------------------------------------------------------
PASSAGE_TASKS = [
    ("summary", "Summarise the following passage in a few sentences.\n\n{p}"),
    ("summary", "Read this text and write a short summary for a busy reader:\n\n{p}"),
    ("summary", "{p}\n\nSummarise the text above in three bullet points."),
    ("summary", 'Give a one-paragraph summary of the following documentation.\n\n"""\n{p}\n"""'),
    ("summary", "TL;DR of this, please:\n\n{p}"),
    ("passage_qa", "Read the passage below and answer the question that follows.\n\nPassage:\n{p}\n\n"
                   "Question: What is the main point the passage makes?"),
    ("passage_qa", "{p}\n\nBased only on the text above, what are the key rules or conditions it describes?"),
    ("explain", "Here is an excerpt from some documentation:\n\n{p}\n\nExplain it in simple terms to "
                "someone who is new to programming."),
    ("passage_qa", "{p}\n\nWrite three quiz questions, with answers, that test understanding of this passage."),
    ("list", "Using the passage below, list the technical terms it uses and define each one briefly.\n\n{p}"),
    ("passage_qa", "{p}\n\nIs anything in the text above ambiguous or likely to confuse a reader? Explain why."),
    ("passage_qa", "Answer the question using the context.\n\nContext: {p}\n\nQuestion: What would "
                   "happen if someone ignored the advice or rules described here?"),
]
LICENSE_TASKS = [
    ("explain", "Here is part of a software license:\n\n{p}\n\nIn plain English, what does this "
                "section allow and what does it require?"),
    ("summary", "Summarise the obligations in this license text for a developer who wants to use "
                "the software in a commercial product:\n\n{p}"),
    ("passage_qa", "{p}\n\nAccording to the license text above, can I modify the software and "
                   "distribute my changes? Answer briefly and cite the relevant part."),
]
CODE_TASKS = [
    ("code", "Explain what this Python function does:\n\n```python\n{c}\n```"),
    ("code", "Review the following code and suggest improvements:\n\n```python\n{c}\n```"),
    ("code", "Write unit tests for this function:\n\n```python\n{c}\n```"),
    ("code", "{c}\n\nDescribe the inputs and outputs of the function above and give an example call."),
    ("code", "Rewrite this function with clearer variable names and comments:\n\n```python\n{c}\n```"),
]

DOC_MODULES = [
    "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "concurrent.futures",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib",
    "doctest", "email", "enum", "fractions", "functools", "gettext", "glob", "gzip", "hashlib",
    "heapq", "hmac", "html", "http.client", "http.server", "imaplib", "inspect", "io", "ipaddress",
    "itertools", "json", "logging", "mailbox", "math", "mimetypes", "multiprocessing", "operator",
    "optparse", "os", "pathlib", "pickle", "pprint", "queue", "random", "re", "sched", "secrets",
    "selectors", "shelve", "shlex", "shutil", "smtplib", "socket", "sqlite3", "statistics",
    "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "tokenize", "traceback", "turtle", "typing", "unittest", "urllib.parse", "uuid", "warnings",
    "weakref", "wave", "xml.dom.minidom", "zipfile", "zoneinfo",
]


def load_tokenizer():
    """The SmolLM2 tokenizer (tokenizers.Tokenizer) from jaxserve's converted checkpoint."""
    import tokenizers
    from jaxserve.config import load_config
    from jaxserve.checkpoint.sources import default_cache_dir, resolve_checkpoint
    config = load_config(ROOT / "configs" / "smollm2_135m.py")
    ckpt = resolve_checkpoint(config.source, default_cache_dir())
    return tokenizers.Tokenizer.from_file(str(ckpt / "tokenizer.json"))


def clean(text: str) -> str:
    """Dedent, strip trailing spaces and collapse runs of blank lines."""
    text = textwrap.dedent(text).strip("\n")
    text = "\n".join(line.rstrip() for line in text.splitlines())
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def english_ratio(text: str) -> float:
    """Share of characters that are ASCII letters or spaces (a crude prose detector)."""
    return sum(c.isascii() and (c.isalpha() or c == " ") for c in text) / max(1, len(text))


def doc_texts() -> list[tuple[str, str]]:
    """(source, text) of documentation prose: pydoc topics, stdlib docstrings, licenses."""
    import pydoc_data.topics
    out = [(f"pydoc_data.topics:{k}", clean(v)) for k, v in sorted(pydoc_data.topics.topics.items())]
    with contextlib.redirect_stdout(io.StringIO()):
        import this  # prints the Zen of Python (rot13-encoded in this.s)
    out.append(("this", "".join(this.d.get(c, c) for c in this.s)))
    for name in DOC_MODULES:
        mod = importlib.import_module(name)
        items = [(name, mod)] + [(f"{name}.{k}", v) for k, v in sorted(vars(mod).items())
                                 if not k.startswith("_") and (inspect.isclass(v) or inspect.isfunction(v))
                                 and getattr(v, "__module__", None) == name]
        for src, obj in items:
            doc = inspect.getdoc(obj) if obj is not mod else mod.__doc__
            if doc and len(doc.split()) >= 60 and english_ratio(doc) > 0.7:
                out.append((f"docstring:{src}", clean(doc)))
    lic = Path("/usr/share/common-licenses")
    if lic.is_dir():
        for f in sorted(lic.iterdir()):
            if f.is_file() and not f.is_symlink():
                out.append((f"license:{f.name}", clean(f.read_text(errors="replace"))))
    seen, uniq = set(), []
    for src, text in out:  # docstrings inherited / re-exported under several names
        if text not in seen:
            seen.add(text)
            uniq.append((src, text))
    return uniq


def code_snippets() -> list[tuple[str, str]]:
    """(source, code) of small pure-Python stdlib functions (8 to 30 lines)."""
    out = []
    for name in DOC_MODULES:
        mod = importlib.import_module(name)
        for k, v in sorted(vars(mod).items()):
            if inspect.isfunction(v) and v.__module__ == name and not k.startswith("_"):
                try:
                    src = clean(inspect.getsource(v))
                except (OSError, TypeError):
                    continue
                if 8 <= len(src.splitlines()) <= 30:
                    out.append((f"source:{name}.{k}", src))
    return out


def passage(text: str, target: int, rng: random.Random, count) -> str:
    """A contiguous run of paragraphs of `text` of at most ~`target` tokens."""
    paras = [p for p in text.split("\n\n") if p.strip()]
    start = rng.randrange(len(paras))
    # start earlier if the tail is too short to reach the target
    while start > 0 and count("\n\n".join(paras[start:])) < target:
        start -= 1
    chosen, n = [], 0
    for p in paras[start:]:
        k = count(p)
        if chosen and n + k > target:
            if n < 0.7 * target:  # fill up with the next paragraph's first sentences
                part = cut_sentences(p, target - n, count)
                if part:
                    chosen.append(part)
            break
        chosen.append(p)
        n += k
    text = "\n\n".join(chosen)
    if count(text) > target:  # one long paragraph: cut at a sentence end
        words = text.split(" ")
        while len(words) > 20 and count(" ".join(words)) > target:
            words = words[: int(len(words) * 0.9)]
        text = " ".join(words)
        cut = max(text.rfind(". "), text.rfind(".\n"))
        if cut > len(text) // 2:
            text = text[: cut + 1]
    return text


def cut_sentences(text: str, budget: int, count) -> str:
    """The longest run of whole sentences at the start of `text` within `budget` tokens."""
    sentences = re.split(r"(?<=[.!?])\s+", text)
    out = ""
    for s in sentences:
        longer = f"{out} {s}".strip()
        if count(longer) > budget:
            break
        out = longer
    return out


def build(seed: int) -> list[dict]:
    """All entries, shuffled with `seed`."""
    rng = random.Random(seed)
    tok = load_tokenizer()
    count = lambda s: len(tok.encode(s, add_special_tokens=False).ids)
    entries = []

    def add(kind: str, prompt: str, source: str) -> None:
        lo, hi = OUTPUT_RANGES[kind]
        entries.append({"prompt": prompt, "output_len": rng.randint(lo, hi),
                        "prompt_len": count(prompt), "source": source})

    for kind, q in rng.sample(QUESTIONS, min(COUNTS["question"], len(QUESTIONS))):
        add(kind, q, "handwritten:question")
    tasks, seen = [], set()
    while len(tasks) < COUNTS["task"]:
        kind, template, slots = rng.choice(TASKS)
        fill = {}
        for key, choices in slots.items():
            value = rng.choice(choices)
            fill |= dict(zip(key.split(","), value)) if "," in key else {key: value}
        prompt = template.format(**fill)
        if prompt not in seen:
            seen.add(prompt)
            tasks.append((kind, prompt))
    for kind, prompt in tasks:
        add(kind, prompt, "handwritten:template")
    pairs = [(t, p) for t in REWRITE_TASKS for p in PARAGRAPHS]
    for (kind, template), p in rng.sample(pairs, COUNTS["rewrite"]):
        add(kind, template.format(p=p), "handwritten:paragraph")
    for src, code in rng.sample(code_snippets(), COUNTS["code"]):
        kind, template = rng.choice(CODE_TASKS)
        add(kind, template.format(c=code), src)
    docs = doc_texts()
    lengths = {src: count(text) for src, text in docs}
    for _ in range(COUNTS["passage"]):
        # passage length: log-uniform between 60 and MAX_PASSAGE_TOKENS tokens
        target = int(round(80 * (MAX_PASSAGE_TOKENS / 80) ** rng.random()))
        kind = rng.choices(list(PASSAGE_SOURCES), weights=list(PASSAGE_SOURCES.values()))[0]
        pool = [(s, t) for s, t in docs if s.split(":")[0] == kind]
        candidates = [(s, t) for s, t in pool if lengths[s] >= target] or \
            [max(pool, key=lambda st: lengths[st[0]])]
        src, text = rng.choice(candidates)
        p = passage(text, target, rng, count)
        kind, template = rng.choice(LICENSE_TASKS if src.startswith("license:") else PASSAGE_TASKS)
        add(kind, template.format(p=p), src)
    rng.shuffle(entries)
    return entries


def main() -> None:
    """Write the file and print length statistics."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    entries = build(args.seed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for e in entries:
            f.write(json.dumps(e, ensure_ascii=False) + "\n")
    pl = sorted(e["prompt_len"] for e in entries)
    ol = [e["output_len"] for e in entries]
    print(f"{len(entries)} entries, {Path(args.out).stat().st_size / 1024:.0f} KiB -> {args.out}")
    print(f"prompt tokens: min {pl[0]} median {statistics.median(pl):.0f} mean "
          f"{statistics.mean(pl):.0f} p90 {pl[int(len(pl) * .9)]} max {pl[-1]}")
    print(f"output tokens: min {min(ol)} median {statistics.median(ol):.0f} mean "
          f"{statistics.mean(ol):.0f} max {max(ol)}")


if __name__ == "__main__":
    main()
