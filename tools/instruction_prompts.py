"""Instruction prompts of many kinds, as people write to a chat assistant.

    python -m tools.instruction_prompts [--n 20] [--seed 0]

`build(n, seed)` returns `n` distinct prompts as {"prompt": str, "kind": str}, the kinds in
(almost) equal numbers, deterministic for a seed. Each prompt is composed at random from
hand-written parts held in this file: lists of topics, concepts, objects, people and roles,
places and short facts; sentence templates per kind; small code snippets in Python,
JavaScript, SQL, shell and C; short paragraphs to summarise or rewrite. Phrasing,
politeness, length and spelling vary (greetings, thanks, occasional informal spelling).

Kinds:
    question      everyday questions (how-to, is it safe, why, what does X mean, trivia)
    advice        cooking, health, travel, study, work, money, relationships, pets, gardening
    explain       a science / history / technology / economics concept, simply, for a
                  child, in N sentences
    brainstorm    lists and ideas ("give me 5 ideas for ...")
    message       emails and messages: formal, casual, apology, request, thank-you
    creative      stories, poems, dialogues and lyrics with given characters, setting, style
    summarize     summary of a paragraph given in the prompt
    rewrite       rewrite a given paragraph: shorter, more formal, simpler, as bullet points
    code          write a function, explain a snippet, find the bug, convert between languages
    sql           an SQL query for a described table
    math          arithmetic and logic word problems, numbers drawn at random
    compare       X vs Y
    classify      sentiment of a review, topic of a headline, intent, spam; extraction of
                  names, dates and places from a sentence
    foreign       questions and requests written in French, Spanish, German, Italian,
                  Portuguese
    translate     translate an English sentence into one of those languages, or back
    plan          multi-step instructions: plan a trip, a week, a project

Everything here was written for this file; no outside text is used. It is a training
source for tools/train_draft_head.py, distinct from tools/make_bench_prompts.py (the
benchmark's generator: Python documentation, standard-library code, licence texts), so
that a draft head trained on both sees ordinary chat too. Standard library only; no
model, no network.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import string

# --- people, places, shared slots ---------------------------------------------------------

NAMES = [
    "Amina", "Ben", "Carlos", "Daria", "Elif", "Farid", "Grace", "Hiro", "Ingrid", "Jamal",
    "Keiko", "Liam", "Maya", "Nikos", "Olga", "Pedro", "Quinn", "Rosa", "Sanjay", "Tomás",
    "Uma", "Viktor", "Wen", "Ximena", "Yusuf", "Zoe", "Aiden", "Beatriz", "Chloé", "Dmitri",
    "Esther", "Felix", "Gita", "Hannah", "Ivan", "Jana", "Kofi", "Lucia", "Mateo", "Noor",
]

ROLES = [
    "a nurse who works night shifts", "a first-year university student", "a retired teacher",
    "a single parent of two", "a junior software developer", "a small-business owner",
    "a high-school student", "a freelance graphic designer", "a stay-at-home dad",
    "a delivery driver", "a PhD student in biology", "a bakery owner", "a new manager",
    "a personal trainer", "a farmer", "a librarian", "a musician who teaches on the side",
    "an accountant", "a waiter", "a warehouse worker", "an exchange student", "a pensioner",
    "a line cook", "a car mechanic", "a primary-school teacher", "a data analyst",
    "a physiotherapist", "a bus driver", "a social worker", "a student nurse",
    "a call-centre agent", "a night-shift security guard", "an architect", "a hairdresser",
    "a postdoc who just moved abroad", "a part-time cashier", "a travelling salesperson",
    "a new dad", "a mum of three", "a 60-year-old who just started running",
    "a remote worker", "a volunteer firefighter",
]

PLACES = [
    "Lisbon", "Kyoto", "Iceland", "Marrakech", "the Scottish Highlands", "Vancouver",
    "Buenos Aires", "Cape Town", "Hanoi", "Prague", "the Amalfi Coast", "Seoul",
    "Mexico City", "New Zealand's South Island", "Istanbul", "Copenhagen", "Crete", "Montreal",
    "Peru", "Vienna", "Bali", "the Dolomites", "Edinburgh", "Singapore", "Chicago", "Sicily",
    "Budapest", "the Norwegian fjords", "Tasmania", "Jordan", "Barcelona", "Krakow", "Oaxaca",
    "Sri Lanka", "the Swiss Alps", "Berlin", "Porto", "Cartagena", "Kerala", "Tallinn",
    "Quebec City", "Nairobi", "Ljubljana", "Yellowstone", "Hokkaido", "Tuscany",
]

CITIES = [
    "Lyon", "Osaka", "Toronto", "Manchester", "Rotterdam", "Valencia", "Gdansk", "Lagos",
    "Melbourne", "Bogotá", "Leipzig", "Bologna", "Curitiba", "Dublin", "Helsinki", "Austin",
    "Marseille", "Busan", "Wellington", "Antwerp", "Seville", "Zurich", "Pune", "Accra",
]

COMPANIES = [
    "Northwind Ltd", "Blue Harbor Foods", "Keller & Sons", "Solaris Energy", "Pinecrest Clinic",
    "Orbit Logistics", "Maple Street Bakery", "Vantage Studios", "Greenfield Bank",
    "Atlas Robotics", "Riverbend Books", "Copperleaf Design", "Sunny Acres Farm",
]

MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]

# --- everyday questions -------------------------------------------------------------------

HOWTO = [
    "remove a coffee stain from a white shirt", "get rid of fruit flies in the kitchen",
    "boil an egg so the yolk stays runny", "fold a fitted sheet",
    "unclog a bathroom sink without chemicals", "clean a cast-iron pan",
    "keep a cut avocado from turning brown", "take a screenshot on a Windows laptop",
    "fix a flat bicycle tyre", "descale a kettle", "tie a tie",
    "defrost chicken quickly and safely", "sharpen a kitchen knife",
    "stop my glasses from fogging up in winter", "make my phone battery last longer",
    "wash a wool sweater without shrinking it", "translate text from a photo on my phone",
    "set up a shared family calendar", "reheat pizza so it stays crispy", "get a splinter out",
    "clean the inside of a microwave", "hang a heavy mirror on a plaster wall",
    "back up the photos on my phone", "fall asleep faster", "remember people's names",
    "stop hiccups", "peel garlic quickly", "keep my cat off the kitchen counter",
    "iron a shirt properly", "cook rice in a normal pot", "fix a squeaky door",
    "get candle wax off a tablecloth", "keep bread fresh for longer",
    "check whether an egg is still good", "jump-start a car", "measure my ring size at home",
    "set a table for a formal dinner", "reduce the echo in a room",
    "clean white sneakers", "pack a suitcase so my clothes don't wrinkle",
    "open a jar lid that is stuck", "find a good dentist in a new city",
    "block spam calls on my phone", "get rid of the smell in my running shoes",
]

SAFE = [
    "eat rice that was left out overnight", "charge my phone overnight",
    "refreeze meat that has been thawed", "swim right after eating",
    "drink water from a garden hose", "use my laptop while it's charging",
    "eat a potato that has turned a bit green", "give my dog a small piece of cheese",
    "run every single day", "wash raw chicken before cooking it",
    "put a metal spoon in the microwave", "use an old phone charger with a new phone",
    "sleep with wet hair", "let a toddler use a tablet every day",
    "drive a few kilometres after the fuel light comes on", "keep batteries in the fridge",
    "wear contact lenses in the shower", "reuse plastic water bottles",
    "eat yoghurt after its best-before date", "store tomatoes in the fridge",
    "leave the heating on low all day", "go to the gym with a cold",
    "feed bread to ducks", "use the same sponge for dishes for a month",
]

CHORES = [
    "wash my bed sheets", "replace my toothbrush", "water a snake plant",
    "change my car's oil", "clean the fridge", "replace the filter in my vacuum cleaner",
    "get my eyes tested", "change my passwords", "descale the coffee machine",
    "bathe my dog", "wash my pillows", "clean my keyboard", "replace my running shoes",
    "defrost the freezer", "back up my computer", "test my smoke alarm",
    "trim my cat's claws", "clean the oven", "wash my jeans", "check my tyre pressure",
]

PHRASES = [
    "break the ice", "the elephant in the room", "once in a blue moon",
    "bite off more than you can chew", "a blessing in disguise", "let the cat out of the bag",
    "under the weather", "cut corners", "hit the sack", "the ball is in your court",
    "burn the midnight oil", "spill the beans", "call it a day", "skating on thin ice",
    "cost an arm and a leg", "a piece of cake", "beat around the bush",
    "jump on the bandwagon", "when pigs fly", "miss the boat", "touch base",
    "low-hanging fruit", "circle back", "FOMO", "a red herring", "in a nutshell",
]

DURATIONS = [
    "get used to a new time zone", "learn to touch type", "bake a potato in the oven",
    "walk 10 kilometres", "grow tomatoes from seed", "renew a passport", "get over a cold",
    "become fluent in Spanish", "digest a big meal", "charge an electric car at home",
    "read a 300-page book", "hard-boil an egg", "learn the rules of chess",
    "break in new leather boots", "let bread dough rise", "train a puppy to sit",
    "paint a small bedroom", "fly from London to New York",
    "see results from going to the gym", "cook pasta al dente",
]

WHY_QUESTIONS = [
    "Why does bread go stale?", "Why do my ears pop on a plane?",
    "Why do cut apples turn brown?", "Why do cats knead blankets?",
    "Why does the shower curtain move towards me when I shower?", "Why do we get goosebumps?",
    "Why is yawning contagious?", "Why do my fingers get wrinkly in the bath?",
    "Why does the Moon look bigger near the horizon?", "Why do dogs tilt their heads?",
    "Why does time seem to go faster as we get older?",
    "Why do some people sneeze when they look at bright light?",
    "Why is the sea salty when rivers aren't?",
    "Why do mosquitoes bite some people more than others?",
    "Why do some trees keep their leaves in winter?", "Why do we have different blood types?",
    "Why does metal feel colder than wood at the same temperature?",
    "Why do I get a headache when I'm hungry?", "Why do planes fly so high?",
    "Why do zebras have stripes?", "Why does my voice sound strange on recordings?",
    "Why do we get hiccups?", "Why does blowing on hot soup cool it down?",
    "Why is the number 13 considered unlucky?", "Why do clocks go clockwise?",
    "Why are flamingos pink?", "Why does popcorn pop?", "Why do we feel sleepy after lunch?",
    "Why do old books smell the way they do?", "Why does my cat bring me dead mice?",
]

TRIVIA = [
    "How far is the Moon from Earth?", "Which country has the most time zones?",
    "How many hearts does an octopus have?", "What's the longest river in Europe?",
    "Who invented the telephone?", "How many languages are spoken in India?",
    "What is the smallest country in the world?", "How hot is the surface of the Sun?",
    "When was the first email sent?", "How many strings does a cello have?",
    "What is the fastest land animal?", "How old is the universe?",
    "Who was the first woman to win a Nobel Prize?", "What is the hardest natural material?",
    "How deep is the deepest part of the ocean?", "How many teeth does an adult have?",
    "What is the capital of Canada?", "Which planet has the longest day?",
    "How many kilometres are there in a mile?", "Who wrote One Hundred Years of Solitude?",
    "What do giant pandas eat?", "What is the national animal of Scotland?",
    "How long is a marathon?", "What is the largest desert in the world?",
    "When did the Second World War end?", "What's the chemical symbol for gold?",
    "Which blood type can be given to anyone?", "How many minutes are there in a week?",
    "What is the most common element in the universe?", "Where are the Galápagos Islands?",
    "Who composed The Four Seasons?", "How tall is the Eiffel Tower?",
    "What is the largest organ of the human body?", "Which metal is liquid at room temperature?",
]

QUESTION_TEMPLATES = [
    "How do I {howto}?", "What's the easiest way to {howto}?",
    "Does anyone know how to {howto}? Asking for real.", "Best way to {howto}?",
    "Is it safe to {safe}?", "Is it actually bad to {safe}, or is that a myth?",
    "How often should I {chore}?", "What does \"{phrase}\" mean?",
    "Someone at work said \"{phrase}\" today. What does that mean?",
    "How long does it take to {duration}?", "Roughly how long would it take me to {duration}?",
    "{why}", "Random question: {why}", "My kid asked me this and I had no idea: {why}",
    "{trivia}", "Quick trivia question: {trivia}", "{trivia} Just a short answer, please.",
]

# --- advice ---------------------------------------------------------------------------------

ADVICE_GOALS = [
    # cooking
    "make crispy roast potatoes", "cook for one person without wasting food",
    "get better at using spices", "meal-prep lunches for the whole week",
    "bake bread without a bread machine", "make a cheap dinner that still impresses guests",
    # health
    "drink more water during the day", "build a habit of stretching every morning",
    "sleep better when I work shifts", "start running as a complete beginner",
    "cut down on sugar", "stay healthy on a long-haul flight",
    # travel
    "travel with only a carry-on bag", "avoid jet lag", "find cheap flights",
    "stay safe travelling alone", "survive a long train ride with a toddler",
    # study
    "remember what I read", "study for exams without cramming",
    "stay motivated while writing a thesis", "learn vocabulary in a new language",
    "take better notes in lectures",
    # work
    "ask for a raise", "say no to extra work politely", "run a short and useful meeting",
    "give feedback to a colleague without offending them",
    "prepare for my first performance review", "switch careers at 35",
    # money
    "make a monthly budget and stick to it", "pay off a credit card faster",
    "start investing with a small amount of money", "save for a house deposit",
    "split bills fairly with a partner who earns more",
    # relationships
    "make friends as an adult", "deal with a friend who always cancels plans",
    "keep a long-distance relationship going",
    "talk to my parents about a difficult decision", "sort out arguments with my flatmate",
    "support a friend who is grieving",
    # pets
    "introduce a new cat to my older cat", "stop my puppy from biting",
    "keep an indoor cat entertained", "travel by car with a nervous dog",
    "stop my dog pulling on the lead",
    # gardening
    "grow herbs on a windowsill", "keep tomato plants healthy",
    "get rid of aphids without chemicals", "start composting in a small flat",
    "plan a garden that attracts bees", "save a dying houseplant",
]

ADVICE_SITUATIONS = [
    "I always burn the garlic when I make pasta sauce", "My homemade bread never rises properly",
    "I get really tired every afternoon around 3 pm",
    "I've started getting back pain from sitting at my desk",
    "My flight got cancelled and the airline won't answer the phone",
    "I'm going abroad for the first time next month and I'm nervous",
    "I have three exams next week and I haven't started revising",
    "I keep getting distracted by my phone when I study",
    "My manager keeps giving me urgent tasks at 5 pm on Fridays",
    "I was offered a job with higher pay but a much longer commute",
    "A coworker keeps taking credit for my work in meetings",
    "I spend far too much money on takeaway food",
    "I have some savings and no idea what to do with them",
    "I lent a friend money and they haven't paid me back",
    "My best friend is moving to another country",
    "My partner and I keep arguing about household chores",
    "I've been feeling left out of my friend group lately",
    "My cat has started scratching the sofa",
    "My dog barks at everyone who walks past the window",
    "We're adopting a rescue dog next week",
    "The leaves on my fiddle-leaf fig are turning brown", "Slugs are eating all my lettuce",
    "I've just moved into a flat with a tiny balcony and want to grow something",
    "I'm starting university in a city where I don't know anyone",
    "I have a job interview tomorrow and I'm really anxious",
    "My teenage son spends all day playing video games",
    "I want to go back to studying but I work full time", "My neighbours are loud every night",
    "I've been invited to a wedding where I'll only know the bride",
    "I'm hosting my in-laws for the first time this weekend",
    "I have to give a speech at my sister's wedding",
    "My houseplants keep dying even though I water them",
    "My landlord wants to raise the rent by 15 percent",
    "I have too many subscriptions and can't keep track of them",
    "I'm vegetarian and my family keeps cooking meat for me",
    "I have a two-hour gap between classes every day",
    "My elderly mother lives alone and refuses any help",
    "I'm retiring next year and I'm worried about being bored",
    "I just got my first credit card", "My kids refuse to eat vegetables",
    "I'm training for a 5K but my knees hurt after runs",
    "I freeze up whenever I have to speak in meetings",
    "My small business has more work than I can handle alone",
    "I want to travel for a month but I can only afford a little",
    "I'm learning Spanish but I can't understand native speakers",
]

ADVICE_TEMPLATES = [
    "{situation}. What should I do?", "I'm {role}. {situation}. Any advice?",
    "How can I {goal}?", "What are your best tips to {goal}?",
    "Can you give me some advice? {situation}.",
    "{situation}, and honestly I'm not sure what to do. Could you give me a few practical "
    "suggestions?",
    "I'm {role} and I'd like to {goal}. Where do I start?",
    "Any tips on how to {goal} on a budget?",
    "What mistakes should people avoid when they try to {goal}?",
    "{situation}. How should I handle it?",
    "What would you recommend for {role} who wants to {goal}?",
    "I need advice. {situation}. I've already tried the obvious things. What else could work?",
]

# --- explain a concept ----------------------------------------------------------------------

SCIENCE = [
    "photosynthesis", "how magnets work", "why the Moon has phases", "what DNA does",
    "how vaccines train the immune system", "the difference between mass and weight",
    "what atoms are made of", "how rainbows form", "why metals conduct electricity",
    "how tides work", "entropy", "how the heart pumps blood",
    "why leaves change colour in autumn", "how earthquakes happen", "what a light-year is",
    "how sound travels", "gravity", "how our eyes see colour", "why salt melts ice",
    "how a volcano erupts", "what antibiotics do", "how clouds form",
    "what a chemical reaction is", "how fish breathe underwater", "how a rocket reaches orbit",
    "what causes lightning", "how bees communicate", "what an ecosystem is",
    "how fossils form", "genetic mutations", "how the kidneys clean the blood", "dark matter",
    "how a lens focuses light", "radioactive half-life", "why stars twinkle",
    "how plants move water up to their leaves", "the ozone layer", "how a compass works",
    "what sleep does for the brain", "how muscles get stronger",
]

HISTORY = [
    "why the Great Wall of China was built", "the Industrial Revolution",
    "how the printing press changed Europe", "the causes of the French Revolution",
    "the Silk Road", "how the ancient Egyptians built the pyramids", "the Cold War",
    "why the Titanic sank", "the Renaissance", "who the Vikings were", "the Magna Carta",
    "how democracy worked in ancient Athens", "the fall of the Berlin Wall",
    "the Apollo programme", "the invention of writing in Mesopotamia", "feudalism",
    "the abolition of slavery in the United States", "the Age of Exploration",
    "the Meiji Restoration in Japan", "the League of Nations", "the Black Death",
    "why the Romans built so many roads", "how the Inca Empire was organised",
    "the history of the Olympic Games", "the women's suffrage movement",
    "the partition of India", "the Marshall Plan", "the Aztec city of Tenochtitlan",
    "the Ottoman Empire", "how the Suez Canal was built", "the history of the bicycle",
    "why the Library of Alexandria is famous", "the end of apartheid in South Africa",
    "the Protestant Reformation", "the Mongol Empire", "the Great Depression",
    "the first transatlantic telegraph cable", "the history of vaccination",
    "the founding of the United Nations", "the Hundred Years' War",
]

TECHNOLOGY = [
    "how Wi-Fi works", "cloud computing", "how a CPU runs a program", "blockchain",
    "how an email gets delivered", "machine learning", "how touchscreens detect a finger",
    "what an operating system does", "how websites store passwords safely", "what a VPN is",
    "how 3D printers work", "open-source software", "how a QR code stores information",
    "how solar panels make electricity", "what an API is", "how video streaming works",
    "what a compiler does", "how Bluetooth pairing works", "large language models",
    "two-factor authentication", "how electric motors work", "DNS",
    "the difference between an SSD and a hard drive", "how your phone uses GPS satellites",
    "encryption", "how a microwave oven heats food", "pixels and screen resolution",
    "how a search engine indexes the web", "version control", "browser cookies",
    "how lithium-ion batteries charge", "the Internet of Things", "facial recognition",
    "what a firewall does", "how barcodes are read", "what RAM is for",
    "image compression", "smart contracts", "how fibre-optic cables carry data",
    "virtual machines",
]

ECONOMICS = [
    "inflation", "what interest rates do", "how the stock market works", "recessions",
    "opportunity cost", "how taxes pay for public services", "what a central bank does",
    "supply and demand", "what GDP measures", "why exchange rates change", "monopolies",
    "diminishing returns", "how insurance works", "a budget deficit",
    "comparative advantage", "how credit card companies make money", "bonds",
    "how unemployment is measured", "minimum wage laws", "tariffs",
    "the difference between saving and investing", "diversification", "crowdfunding",
    "economies of scale", "how a cooperative works", "pensions",
    "why prices are higher at airports", "externalities", "how banks create money",
    "the gig economy", "the tragedy of the commons", "a trade deficit",
    "how auctions set prices", "compound interest", "index funds",
    "why some countries are richer than others", "subsidies", "rent control",
    "behavioural economics", "price elasticity",
]

EXPLAIN_TEMPLATES = [
    "Explain {concept} in simple terms.", "Can you explain {concept} to a {age}-year-old?",
    "Explain {concept} in {sentences} sentences.",
    "I never really understood {concept}. Could you break it down for me?",
    "ELI5: {concept}",
    "Explain {concept} as if I were a complete beginner, using an everyday analogy.",
    "Give me a short explanation of {concept}, followed by one real-world example.",
    "My daughter asked me about {concept} and I didn't know what to say. How would you "
    "explain it to a child?",
    "Write a paragraph about {concept} for a high-school textbook.",
    "In no more than {words} words, explain {concept}.",
    "Teach me about {concept}. Start with the basics, then go one level deeper.",
    "I have a test tomorrow. What do I need to know about {concept}?",
]

# --- lists and brainstorming -----------------------------------------------------------------

IDEA_TOPICS = [
    "a birthday party for a seven-year-old", "a team-building activity that isn't awkward",
    "a name for a coffee shop", "a name for a podcast about gardening",
    "a rainy Sunday afternoon", "a cheap date night", "a school science project about water",
    "a YouTube channel about cooking on a budget", "a gift for my dad who has everything",
    "a blog post about remote work", "a fundraiser for a local animal shelter",
    "healthy lunches I can take to work", "a costume that costs under 20 dollars",
    "a small garden on a balcony", "a short film with only two actors", "a board game night",
    "a community event in a small town", "making a long commute less boring",
    "using up leftover rice", "decorating a student room", "a first date that isn't dinner",
    "a relaxed stag party", "staying active in winter",
    "a mobile app that helps people recycle", "a newsletter for my neighbourhood",
    "a side hustle I could start with little money", "a theme for a wedding",
    "a retirement party for a colleague", "a 30-minute lesson on fractions",
    "icebreaker questions for a new team", "a family reunion",
    "a tabletop role-playing campaign", "a weekend project with my teenager",
    "a slogan for a bike repair shop", "vegetarian dinners my kids will actually eat",
    "a surprise for our anniversary", "a small business selling handmade candles",
    "a reading challenge for the year", "outdoor games for a summer camp",
    "making a boring office nicer", "a new club at my school",
    "posts for an Instagram account about houseplants", "a charity run", "a pub quiz night",
]

LIST_TOPICS = [
    "foods high in iron", "famous women scientists and what they discovered",
    "board games for two players", "English idioms about time",
    "countries that border Germany", "words that rhyme with 'light'",
    "fruits that are in season in autumn", "habits of productive people",
    "signs that a houseplant is overwatered", "questions to ask a landlord before renting",
    "classic films from the 1950s", "mistakes new drivers make",
    "things to check before buying a used car", "animals that live in the Arctic",
    "messages for a coworker's birthday card", "ways to reuse glass jars",
    "stretches for people who sit all day", "books for someone who wants to start reading again",
    "cheap hobbies to try this year", "podcasts topics for teenagers",
    "things to do in a city when it's raining", "snacks that don't need a fridge",
    "soft skills employers look for", "questions to ask my grandparents about their lives",
    "ways to cut my electricity bill", "essential tools for a first home",
    "famous bridges around the world", "songs about the sea",
    "warning signs of a phishing email", "ways to make a small kitchen work better",
]

BRAINSTORM_TEMPLATES = [
    "Give me {n} ideas for {idea}.", "Brainstorm {n} ideas for {idea}.",
    "I need ideas for {idea}. Can you list {n}?",
    "List {n} creative ideas for {idea}, with one sentence each.",
    "What are some good ideas for {idea}?",
    "Help me brainstorm {idea}. Give me at least {n} options.",
    "Suggest {n} ideas for {idea}, from cheapest to most expensive.",
    "Can you come up with {n} unusual ideas for {idea}?", "{n} ideas for {idea}, go!",
    "List {n} {listing}.", "Can you give me a list of {listing}?",
    "What are {n} {listing}? A short bullet list is fine.",
    "Make a numbered list of {n} {listing}, with a short note on each.",
]

NUMBERS_SMALL = ["3", "5", "five", "7", "ten", "10", "six", "four", "8", "a few"]

# --- emails and messages --------------------------------------------------------------------

# Who a formal message goes to, by setting: recipients and what one writes to them about.
MESSAGE_GROUPS = {
    "work": {
        "recipient": ["my manager", "my team at work", "my former boss", "the HR department",
                      "my coworkers", "a new colleague", "a client who has not paid an invoice",
                      "a supplier", "a potential investor", "the organiser of a conference",
                      "the hiring manager at a bookshop", "the editor of a magazine"],
        "purpose": ["to move our meeting to next week", "to follow up on a job application",
                    "to propose a new format for weekly meetings",
                    "to announce that I'm leaving the company",
                    "to confirm the details of an event",
                    "to introduce myself as the new project lead",
                    "to invite them to a product demo", "to ask for feedback on my presentation",
                    "to explain why the report will be two days late",
                    "to request time off for a family event", "to thank them after an interview",
                    "to share the notes from yesterday's meeting",
                    "to ask for a reference letter", "to negotiate a higher salary"],
        "mistake": ["missing an important meeting", "sending the wrong file",
                    "being rude during a discussion", "a delayed order",
                    "double-booking the meeting room", "not replying for two weeks",
                    "a billing error on their account", "cancelling at the last minute"],
        "request": ["for an extension on the deadline", "to review my draft by Friday",
                    "for permission to work from home on Mondays",
                    "for a meeting to discuss my project", "to send back the signed contract",
                    "to share the slides from their talk"],
    },
    "home": {
        "recipient": ["my landlord", "my building's management company", "my neighbour",
                      "the city council", "the residents' association"],
        "purpose": ["about a noise problem in the building",
                    "to ask whether my deposit will be returned",
                    "to report a broken streetlight", "about a leak in the bathroom ceiling",
                    "to ask whether I may paint the living room",
                    "about rubbish left in the shared hallway",
                    "to ask for a quote for painting two rooms"],
        "mistake": ["paying the rent late", "the noise from my party last weekend",
                    "blocking the driveway", "forgetting to pass on their post"],
        "request": ["to fix the heating before winter", "for permission to get a cat",
                    "to repair the broken intercom", "for a copy of the tenancy agreement"],
    },
    "customer": {
        "recipient": ["my gym", "my bank", "an airline's customer service", "my doctor's surgery",
                      "my internet provider", "a hotel I stayed at last month", "an online shop"],
        "purpose": ["to cancel my membership", "to ask for a payment plan",
                    "to complain about a charge I don't recognise", "to ask for a refund",
                    "about a problem that still hasn't been fixed after two weeks",
                    "to change the address on my account", "to ask for a copy of my contract"],
        "mistake": ["missing my appointment", "cancelling my booking at the last minute",
                    "being rude on the phone yesterday"],
        "request": ["for a refund", "to close my account", "to send me a receipt",
                    "to pause my membership for two months", "for a copy of my records"],
    },
    "school": {
        "recipient": ["my child's teacher", "the school principal", "my son's football coach",
                      "a professor I'd like to work with", "my thesis supervisor",
                      "the university admissions office"],
        "purpose": ["to explain that my daughter will miss school on Friday",
                    "to ask about the homework policy", "to ask about internship opportunities",
                    "to ask for a meeting about my son's progress",
                    "to ask whether I could join their research group",
                    "to ask about the application deadline"],
        "mistake": ["missing the parents' evening", "handing in my essay late",
                    "forgetting to sign the permission slip", "missing our meeting"],
        "request": ["for an extension on my essay", "for a letter of recommendation",
                    "for more information about the course fees",
                    "for feedback on my first chapter"],
    },
}

FRIENDS = [
    "my best friend", "my sister", "my roommate", "an old school friend", "my cousin",
    "my brother", "a friend I haven't seen in years", "my group chat", "my gym buddy",
    "my neighbour",
]

CASUAL_PURPOSES = [
    "to say I'll be 20 minutes late", "inviting them to a barbecue on Saturday",
    "asking if they want to see a film this weekend", "to congratulate them on their new job",
    "asking to borrow their camping tent", "to wish them a happy birthday",
    "to check how they're doing after their operation",
    "to remind them, nicely, that they owe me 20 euros",
    "to cancel our plans without sounding rude", "to say thanks for dinner last night",
    "asking for their lasagne recipe", "to plan a surprise for a friend's birthday",
]

KINDNESSES = [
    "helping me move house", "a great year of mentoring", "covering my shift",
    "the birthday present", "their hospitality during my visit", "writing me a reference",
    "fixing my bike", "a thoughtful gift for the baby", "supporting our charity event",
    "their patience during a hard month",
]

INVITATIONS = [
    "Hey! Want to come to my cousin's engagement party on the 12th? It's going to be huge",
    "Would you be able to give a talk at our meetup next month?",
    "We're organising a hike on Sunday at 6am, you in?",
    "Can you help me paint my flat this weekend?",
    "Would you like to join the committee for the summer fair?",
    "Fancy a weekend in the mountains with the whole gang?",
]

MESSAGE_TEMPLATES = [
    "Write a formal email to {recipient} {purpose}.",
    "Can you write a short, casual text to {friend} {casual}?",
    "Help me write an apology message to {recipient} for {mistake}.",
    "Draft a polite email asking {recipient} {request}.",
    "Write a thank-you note to {friend} for {kindness}.",
    "I need to email {recipient} {purpose}. Keep it professional but warm.",
    "Write a WhatsApp message to {friend} {casual}. Make it a bit funny.",
    "Compose an email from {name} to {recipient} {purpose}. Sign it as {name}.",
    "write a msg to {friend} {casual}, nothing too long",
    "Reply politely, declining this invitation: \"{invitation}\"",
    "Write a short apology email to {recipient}. The reason: {mistake}. Offer a solution.",
    "Could you help me word a request to {recipient} {request}? I don't want to sound pushy.",
    "Write a thank-you card message to {helper} for {kindness}.",
]

# --- stories and poems ----------------------------------------------------------------------

CHARACTERS = [
    "a retired circus acrobat", "a shy dragon", "a girl who collects lost keys",
    "a grumpy cat named Pepper", "an astronaut on her last mission",
    "a boy who can't tell a lie", "a robot gardener", "a ghost who is afraid of people",
    "an elderly beekeeper", "twin sisters who run a bakery", "a detective who only works at night",
    "a young inventor in 1890s Vienna", "a talking umbrella", "a squirrel planning a heist",
    "a bus driver who sees the same stranger every day", "a knight who hates fighting",
    "a teenager who finds a time-travel app", "a librarian with a secret", "a lonely snowman",
    "a pirate who gets seasick", "a penguin who wants to fly",
    "a chef who has lost her sense of taste", "an alien tourist", "a village postman",
    "a lost hiker", "a violin teacher", "two rival food-truck owners",
    "a kid who befriends a storm cloud", "a museum night guard",
    "a witch who runs a repair shop", "a fox who learns to read", "a newly elected mayor",
    "an old sailor and his parrot", "a mapmaker", "a clockmaker's apprentice",
    "a dog waiting at a train station", "a princess who prefers engineering",
    "a nervous first-time babysitter", "a lighthouse keeper's daughter",
]

SETTINGS = [
    "in a small village in the mountains", "on a spaceship headed to Mars",
    "in a city where it never stops raining", "at a night market in Taipei",
    "in a library that only appears at midnight", "on a sinking ship", "in a desert oasis",
    "in a snowed-in mountain hut", "at a school for young magicians",
    "on the last day of summer", "in an abandoned amusement park", "under the sea",
    "in a busy hospital on New Year's Eve", "in a floating city",
    "on a long train journey across Siberia", "in a small bookshop in Paris",
    "during a power cut in New York", "on an island with no adults",
    "in a world where dreams are for sale", "in a medieval market town", "in the year 3000",
    "on a farm during a drought", "inside a video game",
    "at a wedding where everything goes wrong", "in a quiet suburban street",
    "on a mountain road at night", "in a jungle research station",
    "in a kingdom ruled by cats", "in a laundrette at 2 am", "at a seaside hotel in winter",
]

PLOTS = [
    "finds a map drawn on a napkin", "has to return a lost wallet",
    "wakes up with a strange new talent", "must win a baking contest",
    "discovers that the neighbours are spies", "learns a secret about their grandmother",
    "has one day to make a new friend", "gets stuck in a lift with a famous singer",
    "tries to keep a promise that seems impossible", "finds a door that wasn't there yesterday",
    "receives a letter from the future", "accidentally becomes famous",
    "has to cross a river without a bridge", "is mistaken for a king",
    "teaches a class for the first time", "loses the key to the city",
    "hears a song nobody else can hear", "plants a seed that grows overnight",
    "starts a band", "runs away to join a travelling theatre",
]

TONES = ["funny", "bittersweet", "spooky", "heartwarming", "suspenseful", "whimsical",
         "melancholic", "hopeful", "dramatic", "light-hearted"]

POEM_FORMS = ["a haiku", "a sonnet", "a limerick", "a free-verse poem", "a rhyming poem",
              "a short ballad", "an acrostic poem", "a villanelle", "a poem in four stanzas",
              "a pair of haiku"]

POEM_TOPICS = [
    "a train station at dawn", "my grandmother's kitchen", "the first day of spring",
    "a broken umbrella", "missing someone far away", "a city after rain",
    "the sound of the ocean at night", "a lost glove", "Monday mornings",
    "the smell of fresh bread", "a fox in the snow", "growing older", "a stray dog",
    "the moon over a car park", "learning to ride a bike", "a forgotten birthday",
    "a thunderstorm", "a quiet library", "coffee with an old friend",
    "the last leaf on a tree", "moving to a new country", "a lighthouse",
    "a garden in July", "a long flight", "friendship across distance",
    "the stars in the desert", "a child's drawing", "the end of exams", "a bicycle ride",
    "home", "a cat watching birds", "an empty stadium", "a river in the fog",
    "a summer night", "an old pair of boots",
]

STYLES = ["Emily Dickinson", "a children's picture book", "a sea shanty", "Shakespeare",
          "a rap verse", "a nursery rhyme", "a country song", "Dr. Seuss",
          "a nature documentary narrator", "Edgar Allan Poe", "a 1920s newspaper"]

GENRES = ["mystery", "science-fiction", "fantasy", "romance", "horror", "pirate adventure",
          "comedy", "historical", "thriller", "fairy-tale"]

CREATIVE_TEMPLATES = [
    "Write a short story about {character} {setting}.",
    "Write a {length} story in which {character} {plot}. The tone should be {tone}.",
    "Write a poem about {poem_topic}.", "Write {form} about {poem_topic}.",
    "Can you write {form} about {poem_topic} in the style of {style}?",
    "Tell me a bedtime story about {character} who {plot}.",
    "Write the opening scene of a {genre} story set {setting}.",
    "Write a dialogue between {character} and {character2} {setting}.",
    "Write song lyrics about {poem_topic}, with a chorus.",
    "Write a {tone} story (under {words} words) about {character} {setting}, told in the "
    "first person.",
    "I'm writing a {genre} novel. My main character is {character}. Write a scene where they "
    "{plot}.",
    "write me {form} about {poem_topic} pls",
]

STORY_LENGTHS = ["short", "very short", "one-page", "200-word", "500-word", "three-paragraph"]

# --- paragraphs to summarise or rewrite (written for this file) --------------------------------

PARAGRAPHS = [
    "At its meeting on Thursday, the town council voted to turn the car park behind the old "
    "cinema into a small public park. The project will cost about 400,000 euros, most of which "
    "will come from a regional grant. Work is expected to begin in the spring and last around "
    "eight months. Some shop owners worry that losing the parking spaces will hurt their "
    "business, so the council has promised to add a new bus stop nearby and to review the plan "
    "after one year.",
    "Octopuses are among the most intelligent invertebrates. They can solve simple puzzles, "
    "open jars to reach food and even recognise individual people. Each of their eight arms "
    "contains a large number of nerve cells, which lets the arms react to touch and taste with "
    "some independence from the brain. Most octopuses live only one or two years, which makes "
    "their ability to learn quickly all the more surprising.",
    "Brightway Home is recalling its 1.7-litre electric kettle, model BK-200, sold between "
    "January and June. In a small number of units the lid can open while the water is boiling, "
    "which may cause burns. Customers should stop using the kettle immediately and return it "
    "to any store for a full refund, even without a receipt. No other Brightway products are "
    "affected.",
    "ok so today was kind of a mess. missed the bus, got to work late, and then the printer "
    "died right before my presentation so i had to show everything on my laptop to like "
    "twelve people crowded around it. the weird thing is the meeting actually went well?? my "
    "boss said the ideas were good and wants a full plan by next month. so i guess it was a "
    "good day in disguise",
    "A small study asked two groups of students to prepare for the same exam. One group "
    "studied for three hours the night before, while the other studied for thirty minutes a "
    "day over six days. Both groups spent the same total time, but the second group scored "
    "noticeably higher and remembered more of the material a month later. The researchers say "
    "the results support the idea that spacing out practice helps long-term memory.",
    "Bright two-bedroom flat on the third floor of a quiet building, ten minutes' walk from "
    "the central station. The kitchen was renovated last year and comes with a dishwasher and "
    "a new fridge. There is a small balcony facing the garden, a shared bike room and a "
    "laundry in the basement. Rent is 1,150 per month plus bills; pets are allowed after "
    "discussion with the owner. Available from the first of next month.",
    "We are a growing bicycle repair shop looking for a part-time mechanic to join our team "
    "of four. You will service bikes, talk to customers about repairs and help keep the "
    "workshop tidy. Experience with electric bikes is a plus, but we are happy to train the "
    "right person. The job is twenty hours a week, including every other Saturday. Please "
    "send a short message about yourself and your experience.",
    "The Silk Road was not a single road but a network of trade routes that linked China with "
    "Central Asia, the Middle East and Europe. Merchants rarely travelled the whole distance; "
    "instead, goods passed from trader to trader along the way. Besides silk, the routes "
    "carried spices, glass, paper and horses, as well as ideas, religions and diseases. For "
    "more than a thousand years they shaped the cultures of the regions they connected.",
    "From next Tuesday, the city museum will stay open every Thursday until nine in the "
    "evening. The late openings will include short guided tours of the new textile gallery, "
    "live music in the courtyard and a small café serving drinks and snacks. Entry after six "
    "o'clock will be free for students and anyone under eighteen. The museum hopes the change "
    "will attract people who cannot visit during working hours.",
    "Thanks for getting in touch. It sounds like your router is restarting because it is "
    "overheating. Please move it away from the radiator and make sure nothing is covering the "
    "vents on top. If the problem continues after a day, hold the reset button for ten seconds "
    "to restore the factory settings, then set up your Wi-Fi name and password again. If that "
    "doesn't help, reply to this message and we will send you a replacement.",
    "The novel follows a retired ferry captain who agrees to carry one last group of "
    "passengers across a northern lake. The first half is slow, full of long descriptions of "
    "weather and water, and some readers may give up before things get going. Those who keep "
    "reading are rewarded: the final chapters are tense, moving and beautifully written. It is "
    "not a perfect book, but its ending will stay with me for a long time.",
    "The home side came back from two goals down to draw 2-2 in a rainy match on Saturday. "
    "The visitors controlled the first hour and scored twice from set pieces, but a change of "
    "formation after the break gave the home team more space on the wings. A header in the "
    "71st minute and a late penalty rescued a point. The coach praised the players' spirit but "
    "admitted that the defence still needs work.",
    "Starting in March, members will need to book classes through the app at least two hours "
    "in advance. Anyone who books a place and does not show up three times in one month will "
    "not be able to book for a week. We are making this change because popular classes fill "
    "up quickly and many reserved places go unused. Drop-in use of the weights room and the "
    "pool will not change.",
    "A yellow warning for strong winds is in place for the coast from Friday evening until "
    "Saturday noon. Gusts of up to 90 kilometres per hour are possible, especially on exposed "
    "hills and bridges. Ferries may be delayed or cancelled, and people are advised to secure "
    "garden furniture and avoid walking along the sea front. Conditions should improve by "
    "Saturday afternoon.",
    "Coffee is thought to have first been drunk in Yemen in the fifteenth century, where it "
    "helped people stay awake during night-time prayers. From there it spread to Cairo, "
    "Istanbul and, by the seventeenth century, to Europe, where coffee houses became popular "
    "places to read newspapers, do business and argue about politics. Today it is one of the "
    "most widely traded farm products in the world.",
    "hey neighbours! we're having a little get-together in the courtyard on saturday from "
    "4pm, bring something to drink or a snack if u want but no pressure. kids and dogs "
    "welcome. there will be music but we'll turn it down by 10, promise. if the noise might "
    "bother you just knock on flat 3B and let us know",
    "In this project we tested whether simple text-message reminders could help patients "
    "remember to take their blood pressure medication. Two hundred adults were split into two "
    "groups; one received a short daily reminder and the other did not. After three months, "
    "the reminder group missed fewer doses on average and said they felt more in control of "
    "their treatment. The effect was largest among patients over sixty-five.",
    "To reduce costs, the company will no longer pay for taxi rides shorter than five "
    "kilometres, except late at night or when an employee is carrying heavy equipment. Staff "
    "are encouraged to use public transport or the shared company bikes instead. Receipts for "
    "all other travel must now be submitted within thirty days. These rules apply from the "
    "first of next month.",
    "We arrived in the little harbour town just after sunset, tired and hungry after nine "
    "hours on the road. The only restaurant still open was a tiny place with four tables and "
    "no menu; the owner simply brought us whatever she had cooked that day. It turned out to "
    "be the best fish soup I have ever eaten. The next morning we woke to the sound of fishing "
    "boats and decided to stay two more nights.",
    "Dear parents, the class trip to the science centre will take place on the 14th. Children "
    "should arrive by 8:15 and bring a packed lunch, a water bottle and a rain jacket. The bus "
    "will return at about 4 pm. The cost is 12 euros per child; if this is a problem for your "
    "family, please speak to the class teacher in confidence. Permission slips must be "
    "returned by Friday.",
    "Community gardens are spreading in many cities as people look for ways to grow food in "
    "small spaces. Besides fresh vegetables, they give neighbours a place to meet, children a "
    "chance to learn where food comes from, and older residents a reason to stay active. Some "
    "research links access to green space with lower stress. The main challenges are finding "
    "land and keeping volunteers involved over several seasons.",
    "I ordered a large pizza at 7 and it came at quarter to nine, cold, and with mushrooms even "
    "though I specifically asked for no mushrooms. When I called the shop the guy on the phone "
    "just said they were busy and hung up. I've ordered from you pretty much every week for "
    "two years and this is the first time I'm actually annoyed. I'd like a refund or at least "
    "a voucher.",
    "A password manager is an app that keeps all your passwords in an encrypted vault, "
    "protected by one strong master password. Because you only need to remember that one, you "
    "can use long, random and different passwords for every website. Most password managers "
    "can also fill in login forms and warn you when a site you use has been part of a data "
    "breach. The main risk is forgetting the master password, so keep a copy somewhere safe.",
    "Notes from Monday's planning call: the client wants the first version of the app in six "
    "weeks instead of eight. Marco thinks this is possible if we drop offline mode for now. "
    "Leila will ask the client whether that is acceptable. Design needs the final icons by "
    "Wednesday. We meet again on Thursday to confirm the new timeline and decide who will "
    "handle testing.",
    "Teenagers often struggle to fall asleep early, and it isn't only because of their "
    "phones. During puberty the body clock shifts, so feeling sleepy naturally happens later "
    "in the evening. Early school start times then cut their sleep short. Some schools that "
    "moved the start of the day later have reported better attendance and fewer students "
    "nodding off in class.",
]

AUDIENCES = [
    "a busy manager", "a ten-year-old", "someone who is learning English", "my grandmother",
    "a group of teenagers", "someone with no background in the subject", "a newspaper reader",
    "a social media post", "a colleague who missed the meeting",
]

SUMMARY_TEMPLATES = [
    "Summarise this in one sentence:\n\n{p}",
    "Can you give me a short summary of the following?\n\n{p}",
    "{p}\n\nSummarize the paragraph above in {n} bullet points.",
    "tldr?\n\n{p}", "Summarize this for {audience}:\n\n{p}",
    "What are the key points of this text?\n\n\"{p}\"",
    "Write a headline and a one-line summary for this:\n\n{p}",
    "{p}\n\nSum that up in under {words} words, please.",
    "Please condense this into two sentences.\n\n{p}",
    "Read this and tell me the main idea in plain words:\n{p}",
    "Here's something I was sent. What's the gist?\n\n{p}",
]

REWRITE_TEMPLATES = [
    "Rewrite this paragraph to be shorter:\n\n{p}", "Make this more formal:\n\n{p}",
    "Rewrite the following in simpler language for a {age}-year-old:\n\n{p}",
    "Turn this into bullet points:\n\n{p}",
    "Rewrite this text in a warmer, friendlier tone:\n\n{p}",
    "Can you rewrite this so it sounds more confident?\n\n{p}",
    "{p}\n\nRewrite the text above as a short post of under 280 characters.",
    "Paraphrase this paragraph without changing its meaning:\n\n{p}",
    "Fix the grammar and make this read better:\n\n{p}",
    "Rewrite this for {audience}:\n\n{p}",
    "Cut this down to about half its length, keeping the key facts:\n\n{p}",
    "{p}\n\nCan you make the text above sound less formal?",
]

# --- code ------------------------------------------------------------------------------------

FENCE = {"Python": "python", "JavaScript": "javascript", "C": "c", "SQL": "sql", "Bash": "bash"}

SNIPPETS = [
    ("Python", '''def word_counts(text):
    counts = {}
    for word in text.lower().split():
        counts[word] = counts.get(word, 0) + 1
    return counts'''),
    ("Python", '''def chunks(items, size):
    return [items[i:i + size] for i in range(0, len(items), size)]'''),
    ("Python", '''def is_palindrome(s):
    cleaned = [c.lower() for c in s if c.isalnum()]
    return cleaned == cleaned[::-1]'''),
    ("Python", '''def moving_average(values, window):
    result = []
    for i in range(len(values) - window + 1):
        result.append(sum(values[i:i + window]) / window)
    return result'''),
    ("Python", '''def flatten(nested):
    out = []
    for item in nested:
        if isinstance(item, list):
            out.extend(flatten(item))
        else:
            out.append(item)
    return out'''),
    ("Python", '''def gcd(a, b):
    while b:
        a, b = b, a % b
    return a'''),
    ("Python", '''from collections import Counter

def top_words(path, k=10):
    with open(path, encoding="utf-8") as f:
        words = f.read().lower().split()
    return Counter(words).most_common(k)'''),
    ("Python", '''class Stack:
    def __init__(self):
        self._items = []

    def push(self, item):
        self._items.append(item)

    def pop(self):
        if not self._items:
            raise IndexError("pop from empty stack")
        return self._items.pop()'''),
    ("Python", '''def group_by_length(words):
    groups = {}
    for w in words:
        groups.setdefault(len(w), []).append(w)
    return dict(sorted(groups.items()))'''),
    ("Python", '''def merge_sorted(a, b):
    i = j = 0
    out = []
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out + a[i:] + b[j:]'''),
    ("JavaScript", '''function debounce(fn, delay) {
  let timer = null;
  return function (...args) {
    clearTimeout(timer);
    timer = setTimeout(() => fn.apply(this, args), delay);
  };
}'''),
    ("JavaScript", '''const unique = (arr) => [...new Set(arr)];'''),
    ("JavaScript", '''function capitalizeWords(sentence) {
  return sentence
    .split(" ")
    .map((w) => w.charAt(0).toUpperCase() + w.slice(1))
    .join(" ");
}'''),
    ("JavaScript", '''async function fetchJson(url) {
  const response = await fetch(url);
  if (!response.ok) {
    throw new Error(`Request failed: ${response.status}`);
  }
  return response.json();
}'''),
    ("JavaScript", '''function countBy(items, keyFn) {
  return items.reduce((acc, item) => {
    const key = keyFn(item);
    acc[key] = (acc[key] || 0) + 1;
    return acc;
  }, {});
}'''),
    ("JavaScript", '''function range(start, end, step = 1) {
  const out = [];
  for (let i = start; i < end; i += step) out.push(i);
  return out;
}'''),
    ("C", '''int sum_array(const int *a, int n) {
    int total = 0;
    for (int i = 0; i < n; i++)
        total += a[i];
    return total;
}'''),
    ("C", '''void reverse(char *s) {
    size_t n = strlen(s);
    for (size_t i = 0; i < n / 2; i++) {
        char t = s[i];
        s[i] = s[n - 1 - i];
        s[n - 1 - i] = t;
    }
}'''),
    ("C", '''int is_prime(int n) {
    if (n < 2) return 0;
    for (int d = 2; d * d <= n; d++)
        if (n % d == 0) return 0;
    return 1;
}'''),
    ("C", '''unsigned count_bits(unsigned x) {
    unsigned c = 0;
    while (x) {
        x &= x - 1;
        c++;
    }
    return c;
}'''),
    ("C", '''int max_index(const double *v, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[best]) best = i;
    return best;
}'''),
    ("SQL", '''SELECT department, AVG(salary) AS avg_salary
FROM employees
GROUP BY department
HAVING COUNT(*) > 5
ORDER BY avg_salary DESC;'''),
    ("SQL", '''SELECT c.name, COUNT(o.id) AS orders
FROM customers c
LEFT JOIN orders o ON o.customer_id = c.id
GROUP BY c.name;'''),
    ("SQL", '''UPDATE products SET price = price * 1.1 WHERE category = 'books';'''),
    ("SQL", '''SELECT title, rating FROM films
WHERE release_year BETWEEN 1990 AND 1999 AND rating >= 8
ORDER BY rating DESC
LIMIT 10;'''),
    ("Bash", '''find . -name "*.log" -mtime +7 -delete'''),
    ("Bash", '''du -sh * | sort -h | tail -n 5'''),
    ("Bash", '''for f in *.jpg; do
  mv "$f" "$(date +%Y%m%d)_$f"
done'''),
    ("Bash", '''grep -rn "TODO" src/ | wc -l'''),
    ("Bash", '''tar -czf "backup_$(date +%F).tar.gz" ~/Documents'''),
    ("Bash", '''ps aux --sort=-%mem | head -n 6'''),
    ("Bash", '''cut -d, -f2 data.csv | sort | uniq -c | sort -rn | head'''),
]

# (language, code with one bug, what goes wrong)
BUGGY = [
    ("Python", '''def last_n(items, n):
    return items[len(items) - n - 1:]''', "it returns one item too many"),
    ("Python", '''def add_item(item, basket=[]):
    basket.append(item)
    return basket''', "items from earlier calls keep showing up in new baskets"),
    ("Python", '''def remove_negatives(nums):
    for x in nums:
        if x < 0:
            nums.remove(x)
    return nums''', "some negative numbers are still in the list afterwards"),
    ("Python", '''def is_admin(role):
    return role is "admin"''', "it sometimes returns False even when the role is admin"),
    ("Python", '''def find_max(nums):
    if len(nums) == 1:
        return nums[0]
    rest = find_max(nums[1:])
    if nums[0] > rest:
        return nums[0]''', "it returns None for some lists"),
    ("Python", '''def sum_to(n):
    """Return 1 + 2 + ... + n."""
    total = 0
    for i in range(n):
        total += i
    return total''', "sum_to(3) gives 3 instead of 6"),
    ("Python", '''def count_matching(path, word):
    count = 0
    for line in open(path):
        if line == word:
            count += 1
    return count''', "it always returns 0"),
    ("JavaScript", '''for (var i = 0; i < 3; i++) {
  setTimeout(() => console.log(i), 100);
}''', "it prints 3 three times instead of 0, 1, 2"),
    ("JavaScript", '''const scores = [10, 9, 100, 25];
scores.sort();
console.log("Highest:", scores[scores.length - 1]);''', "it says the highest score is 9"),
    ("JavaScript", '''async function getUserName(id) {
  const res = fetch(`/api/users/${id}`);
  const data = await res.json();
  return data.name;
}''', "I get 'res.json is not a function'"),
    ("C", '''int total(int a[], int n) {
    int s = 0;
    for (int i = 0; i <= n; i++)
        s += a[i];
    return s;
}''', "the sum is sometimes a random large number"),
    ("C", '''char *greeting(const char *name) {
    char buf[64];
    snprintf(buf, sizeof buf, "Hello, %s!", name);
    return buf;
}''', "the caller prints garbage characters"),
    ("C", '''double percent(int part, int whole) {
    return part / whole * 100;
}''', "percent(1, 4) returns 0 instead of 25"),
    ("SQL", '''SELECT department, COUNT(*)
FROM employees
WHERE COUNT(*) > 10
GROUP BY department;''', "the database complains about an aggregate in WHERE"),
    ("SQL", '''SELECT name FROM customers WHERE email = NULL;''',
     "it returns no rows even though some customers have no email"),
    ("Bash", '''for f in $(ls *.txt); do
  wc -l $f
done''', "it breaks on file names with spaces"),
    ("Bash", '''if [ $count > 10 ]; then
  echo "too many"
fi''', "it creates a file called 10 instead of comparing"),
]

CODE_TASKS = [
    "checks whether a string is a palindrome", "returns the n-th Fibonacci number",
    "counts the words in a text file", "merges two sorted lists",
    "removes duplicates from a list while keeping the order",
    "converts Celsius to Fahrenheit", "does a rough check that an email address is valid",
    "flattens a nested list", "finds the most common element in a list",
    "reverses the order of words in a sentence", "checks whether two strings are anagrams",
    "computes the median of a list of numbers", "parses a date like 2024-03-15",
    "generates a random password of a given length",
    "reads a CSV file and adds up one column", "returns all prime numbers below n",
    "capitalises the first letter of every word", "computes the greatest common divisor",
    "splits a list into chunks of size k", "converts a number to Roman numerals",
    "checks whether the brackets in a string are balanced",
    "finds the longest word in a sentence", "counts the vowels in a string",
    "rotates an array by k positions", "does a binary search on a sorted array",
    "groups words by their first letter", "converts a decimal number to binary",
    "checks whether a year is a leap year", "computes n factorial without recursion",
    "returns the intersection of two lists",
    "shortens a string to n characters and adds an ellipsis",
    "formats a number of seconds as HH:MM:SS", "finds the second largest number in a list",
    "removes all whitespace from a string", "checks whether a number is a power of two",
    "keeps a running average of a stream of numbers",
    "sorts a list of records by a given field",
    "computes the Levenshtein distance between two strings",
    "retries another function up to three times if it fails", "transposes a matrix",
    "checks whether a Sudoku row is valid", "counts how often each character appears",
]

SHELL_TASKS = [
    "renames every .jpeg file in a folder to .jpg", "lists the 10 largest files in my home folder",
    "counts how many times each IP address appears in access.log",
    "backs up a folder into a zip file with today's date in the name",
    "checks every minute whether a website is up",
    "deletes all node_modules folders under the current one",
    "prints the lines containing 'error' in all log files from today",
    "shows which process is using port 8080", "warns me when the disk is more than 90% full",
    "converts all .wav files in a folder to .mp3 with ffmpeg",
]

CODE_LANGS = ["Python", "Python", "Python", "JavaScript", "JavaScript", "C", "Java", "Go",
              "Rust", "TypeScript", "C++", "Ruby"]
TARGET_LANGS = ["Python", "JavaScript", "C", "Java", "Go", "Rust", "TypeScript", "C++"]

WRITE_TEMPLATES = [
    "Write a {lang} function that {task}.",
    "Can you write {lang} code that {task}? Please add comments.",
    "I need a {lang} function which {task}. Include a couple of test cases.",
    "How would I write a function in {lang} that {task}?",
    "Write a {lang} function that {task}, and explain its time complexity.",
    "write me a quick {lang} snippet that {task}",
    "Implement a function in {lang} that {task}. Don't use any external libraries.",
    "Show me the cleanest way in {lang} to write a function that {task}.",
]
SHELL_TEMPLATES = [
    "Write a bash script that {task}.", "Give me a shell one-liner that {task}.",
    "How can I make a cron-friendly shell script that {task}?",
]
EXPLAIN_CODE_TEMPLATES = [
    "What does this {lang} code do?\n\n{block}",
    "Explain this {lang} snippet line by line:\n\n{block}",
    "Can you walk me through this code? I'm new to {lang}.\n\n{block}",
    "{block}\n\nWhat is the purpose of the code above?",
    "I found this in our codebase. What is it for, and is there anything risky about it?"
    "\n\n{block}",
    "Explain the following {lang} code to a beginner:\n\n{block}",
    "{block}\n\nCan you add comments to this explaining each step?",
    "Is this {lang} code correct and efficient? Explain what it does.\n\n{block}",
]
DEBUG_TEMPLATES = [
    "This {lang} code has a bug. Can you find it and fix it?\n\n{block}",
    "Why doesn't this work?\n\n{block}",
    "My {lang} code isn't working: {symptom}. What's wrong?\n\n{block}",
    "Find the bug:\n\n{block}",
    "{block}\n\nThere's something wrong with the code above. What is it?",
    "I've been staring at this for an hour. {symptom}. Where's the mistake?\n\n{block}",
    "Review this {lang} snippet and point out any bugs:\n\n{block}",
    "{block}\n\nProblem: {symptom}. Please explain the cause and give a fixed version.",
]
CONVERT_TEMPLATES = [
    "Convert this {lang} code to {target}:\n\n{block}",
    "Can you rewrite this in {target}?\n\n{block}", "How would this look in {target}?\n\n{block}",
    "Translate the following {lang} snippet into idiomatic {target}.\n\n{block}",
    "Port this to {target}, keeping the same behaviour:\n\n{block}",
    "I know {lang} but not {target}. Rewrite this in {target} and explain the differences.\n\n"
    "{block}",
]

# (table description, things to query)
SQL_TABLES = [
    ("employees(id, name, department, salary, hire_date, manager_id)", [
        "the names of employees hired in the last year", "the highest salary in each department",
        "employees who earn more than their manager",
        "the number of employees per department, largest first",
        "the average salary of people hired before 2015"]),
    ("orders(id, customer_id, order_date, total) and customers(id, name, country)", [
        "the total amount spent by each customer", "customers who have never placed an order",
        "the five countries with the most orders", "the month with the most revenue in 2023",
        "customers whose first order was in the last 30 days"]),
    ("books(id, title, author, year, genre, price)", [
        "all books by authors whose name starts with M", "the cheapest book in each genre",
        "how many books were published in each decade",
        "the average price of science-fiction books", "titles that appear more than once"]),
    ("students(id, name, class) and grades(student_id, subject, score)", [
        "each student's average score", "the best student in every subject",
        "students who scored below 50 in at least two subjects",
        "the class with the highest average maths score"]),
    ("rides(id, driver_id, start_time, end_time, distance_km, fare)", [
        "the total fare per driver per day", "the longest ride of every driver",
        "the average fare per kilometre for each hour of the day",
        "drivers who had no rides last week"]),
    ("products(id, name, category, price, stock)", [
        "products that are out of stock", "the three most expensive products in each category",
        "the total value of the stock in each category",
        "categories where the average price is above 50"]),
    ("page_views(user_id, url, viewed_at)", [
        "the ten most visited pages yesterday", "the number of unique visitors per day",
        "users who viewed more than 100 pages in a single day",
        "the first page each user ever visited"]),
    ("flights(id, origin, destination, departure, arrival, price)", [
        "the cheapest flight from London to Madrid", "the number of flights on each route",
        "routes whose average price is above 300", "flights that take longer than five hours"]),
    ("loans(book_id, member_id, loaned_on, returned_on) and members(id, name, joined_on)", [
        "loans that are more than 14 days old and not returned yet",
        "the most borrowed book this year", "members who have borrowed more than ten books",
        "members who joined this year but never borrowed anything"]),
]
SQL_DIALECTS = ["PostgreSQL", "MySQL", "SQLite", "standard SQL"]
SQL_TEMPLATES = [
    "Write an SQL query to find {q}. The table is {t}.",
    "Given a table {t}, how do I get {q}?", "I have {t}. Need a query for {q}.",
    "SQL question: with the table {t}, show {q}.",
    "Using {dialect}, write a query that returns {q} from {t}.",
    "Can you help me with a SQL query? My schema is {t} and I want {q}.",
    "{dialect} query please: {q}. Schema: {t}",
    "Write a query for {q} (schema: {t}) and explain each clause.",
    "Tables: {t}.\nTask: {q}.\nWrite the SQL.",
]

# --- math and logic ---------------------------------------------------------------------------

# (template, {field: (low, high) or (low, high, step)}); {name}, {name2}, {name3} are people
MATH_TEMPLATES = [
    ("{name} has {a} stickers and gives {b} of them to {name2}. How many stickers does {name} "
     "have left?", {"a": (20, 90), "b": (2, 19)}),
    ("A train travels {a} km in {b} hours. What is its average speed?",
     {"a": (120, 900), "b": (2, 9)}),
    ("A jacket costs ${a} and is on sale for {p}% off. What is the sale price?",
     {"a": (30, 250), "p": (10, 60, 5)}),
    ("{name} saves ${a} every week. How many weeks will it take to save ${c}?",
     {"a": (15, 80), "c": (500, 3000, 50)}),
    ("A rectangular garden is {a} m long and {b} m wide. What are its area and perimeter?",
     {"a": (5, 40), "b": (3, 25)}),
    ("What is {p}% of {c}?", {"p": (5, 95, 5), "c": (40, 2000, 10)}),
    ("Solve for x: {a}x + {b} = {c}.", {"a": (2, 12), "b": (1, 30), "c": (31, 150)}),
    ("A recipe for {a} people needs {b} grams of flour. How much flour do I need for {c} people?",
     {"a": (2, 6), "b": (150, 600, 25), "c": (7, 20)}),
    ("{name} is {a} years old and {name2} is {b} years older. How old will they be together "
     "in {c} years?", {"a": (6, 40), "b": (2, 15), "c": (3, 20)}),
    ("Three friends share a restaurant bill of ${c}. One pays ${a} and another pays ${b}. How "
     "much does the third pay?", {"c": (90, 240), "a": (20, 44), "b": (20, 44)}),
    ("If {a} workers can paint a house in {b} days, how long would {c} workers take at the "
     "same rate?", {"a": (2, 8), "b": (6, 30), "c": (3, 12)}),
    ("The average of {k} test scores is {a}. After one more test with a score of {b}, what is "
     "the new average?", {"k": (3, 9), "a": (60, 85), "b": (50, 100)}),
    ("A car uses {b} litres of fuel per 100 km. How much fuel does it need for a {c} km trip?",
     {"b": (4, 12), "c": (80, 1200, 10)}),
    ("I put ${c} in a savings account at {p}% interest per year, compounded annually. How much "
     "will I have after {k} years?", {"c": (500, 20000, 500), "p": (1, 7), "k": (2, 15)}),
    ("A bag holds {a} red marbles and {b} blue marbles. If I take one at random, what is the "
     "probability that it is blue?", {"a": (2, 15), "b": (2, 15)}),
    ("How many hours and minutes are there in {c} minutes?", {"c": (75, 1500)}),
    ("{name} reads {a} pages a day. The book has {c} pages. How many days will it take to "
     "finish it?", {"a": (8, 45), "c": (150, 900)}),
    ("Pens come in packs of {a} for ${b}. How many packs do I need for {c} pens, and what do "
     "they cost?", {"a": (3, 12), "b": (2, 9), "c": (20, 100)}),
    ("My phone plan costs ${a} a month plus ${b} for every GB over the limit. Last month I "
     "went {k} GB over. What was my bill?", {"a": (10, 45), "b": (2, 8), "k": (1, 9)}),
    ("If today is {weekday}, what day of the week will it be in {c} days?", {"c": (10, 400)}),
    ("A tank holds {c} litres. It fills at {a} litres per minute but leaks {b} litres per "
     "minute. How long does it take to fill from empty?",
     {"c": (200, 2000, 50), "a": (12, 40), "b": (1, 10)}),
    ("Is {c} a prime number? Explain how you checked.", {"c": (50, 500)}),
    ("What is {a} × {b}? Show the steps.", {"a": (12, 99), "b": (12, 999)}),
    ("Convert {c} degrees Fahrenheit to Celsius.", {"c": (-10, 110)}),
    ("A pizza is cut into {a} equal slices. {name} eats {b} and {name2} eats {k}. What "
     "fraction of the pizza is left?", {"a": (8, 12), "b": (1, 3), "k": (1, 3)}),
    ("Two trains leave stations {c} km apart at the same time, heading towards each other at "
     "{a} km/h and {b} km/h. After how long do they meet?",
     {"c": (100, 600, 10), "a": (60, 140), "b": (60, 140)}),
    ("There are {a} people at a party and everyone shakes hands with everyone else once. How "
     "many handshakes are there?", {"a": (4, 30)}),
    ("Which is larger: {p}% of {c}, or {c}% of {p}?", {"p": (5, 95, 5), "c": (10, 90, 10)}),
    ("A drawer has {b} black socks and {w} white socks. How many socks must I take out in the "
     "dark to be sure of a matching pair?", {"b": (3, 12), "w": (3, 12)}),
    ("{name} is older than {name2}, and {name3} is younger than {name2}. Who is the oldest, "
     "and who is the youngest?", {}),
    ("{name}, {name2} and {name3} each have a different pet: a cat, a dog or a parrot. {name} "
     "is allergic to fur and {name2} doesn't like birds. Who has which pet?", {}),
    ("{name} finishes a race ahead of {name2} but behind {name3}. {name4} finishes last. In "
     "what order did the four finish?", {}),
]
MATH_PREFIXES = ["", "", "", "Solve this: ", "Math problem: ",
                 "Can you help me with this question? ", "Homework help: "]
MATH_SUFFIXES = ["", "", "", " Show your working.", " Explain step by step.",
                 " Just give me the final answer.", " Please explain it simply, it's for my son."]

# --- comparisons ------------------------------------------------------------------------------

COMPARE_PAIRS = [
    ("an iPhone", "an Android phone"), ("stocks", "bonds"), ("running", "cycling"),
    ("Spanish", "French for an English speaker"), ("a gas hob", "an induction hob"),
    ("yoga", "pilates"), ("public school", "private school"), ("Zoom", "Microsoft Teams"),
    ("React", "Vue"), ("PostgreSQL", "MySQL"), ("Linux", "Windows for programming"),
    ("a credit card", "a debit card"), ("freelancing", "a full-time job"),
    ("white rice", "brown rice"), ("butter", "olive oil for cooking"),
    ("a hybrid car", "a fully electric car"), ("a holiday flat", "a hotel"),
    ("the Roman Republic", "the Roman Empire"), ("mitosis", "meiosis"),
    ("baking soda", "baking powder"), ("git merge", "git rebase"), ("HTTP", "HTTPS"),
    ("LED bulbs", "halogen bulbs"), ("a PhD", "going straight into industry"),
    ("living alone", "living with flatmates"), ("walking", "running for losing weight"),
    ("the Nile", "the Amazon"), ("Mars", "Venus"), ("classical music", "jazz"),
    ("tennis", "badminton"), ("Tokyo", "Osaka for a first visit"),
    ("a laptop", "a tablet for a student"), ("inflation", "deflation"),
    ("oil paint", "acrylic paint"), ("espresso", "filter coffee"),
    ("the violin", "the piano for an adult beginner"), ("Excel", "Google Sheets"),
    ("crocodiles", "alligators"), ("a marathon", "a triathlon"),
    ("frozen vegetables", "fresh vegetables"), ("owning a car", "car sharing in a city"),
    ("Impressionism", "Expressionism"), ("static typing", "dynamic typing"),
    ("a monarchy", "a republic"), ("a fixed-rate mortgage", "a variable-rate mortgage"),
    ("guitar", "ukulele"), ("meditation", "journaling"), ("a wiki", "a shared drive"),
    ("term life insurance", "whole life insurance"), ("cotton", "linen"),
]

COMPARE_TEMPLATES = [
    "What's the difference between {a} and {b}?", "{a} or {b}? Which would you pick and why?",
    "Compare {a} and {b} in a short table.",
    "Can you compare {a} vs {b} for me? I'm trying to decide.",
    "{a} vs {b}: pros and cons of each.", "Is {a} better than {b}?",
    "Compare {a} with {b}. Which is better for what?",
    "Give me three ways {a} and {b} are similar and three ways they differ.",
    "I can't decide between {a} and {b}. Help me choose.",
    "Explain the main differences between {a} and {b} in {sentences} sentences.",
]

# --- classification and extraction ------------------------------------------------------------

REVIEW_ITEMS = [
    "these headphones", "this blender", "the hotel", "this restaurant", "these running shoes",
    "this phone case", "the online course", "this vacuum cleaner", "the hostel", "this novel",
    "the coffee machine", "this backpack", "the yoga mat", "the delivery service",
    "this board game", "the dentist's office", "the rental car", "this laptop stand",
    "the museum tour", "this kettle",
]
REVIEW_OPENINGS = [
    "Bought {item} last month.", "Tried {item} on a friend's recommendation.",
    "Review of {item}:", "We used {item} for our family trip.", "My honest take on {item}.",
    "Got {item} as a gift.",
]
REVIEW_GOOD = [
    "Honestly one of the best purchases I've made this year.",
    "Works exactly as described and the price was fair.",
    "Customer service replied within an hour and sorted everything out.",
    "I'd happily recommend it to friends.", "The quality feels solid and it looks great.",
    "Staff were friendly and nothing was too much trouble.", "Exceeded my expectations!",
]
REVIEW_BAD = [
    "It stopped working after two weeks.", "Way too expensive for what you get.",
    "The instructions were confusing and a part was missing.",
    "I asked for a refund and nobody answered.", "Would not buy again.",
    "It was dirty and smelled strange.", "Took three weeks to arrive and came damaged.",
]
REVIEW_MEH = [
    "It does the job, nothing special.", "Average, about what you'd expect for the price.",
    "Some things were good, some weren't.", "Not bad, not great.",
]

EVENT_SENTENCES = [
    "On {date}, {name} met {name2} in {city} to discuss the new budget.",
    "{name} flew from {city} to {city2} on {date} for a family wedding.",
    "The contract between {company} and {company2} was signed by {name} in {city} on {date}.",
    "{name} and {name2} will present their results at the conference in {city} on {date}.",
    "After leaving {city} on {date}, {name} spent three weeks travelling with {name2}.",
    "Please tell {name} that the meeting with {name2} has moved from {date} to {date2}.",
    "{company} announced on {date} that {name} will open its new office in {city}.",
    "Dr {name2} will see {name} at the {city} clinic on {date} at 10:30.",
]

HEADLINES = [
    "Local team wins regional final after dramatic penalty shootout",
    "Central bank keeps interest rates unchanged for third month in a row",
    "Scientists map the genome of a rare desert frog",
    "Parliament debates new rules on short-term holiday rentals",
    "Streaming service confirms second season of hit detective series",
    "Start-up raises funding to build cheaper heat pumps",
    "Marathon record falls on a cold morning in the capital",
    "New telescope images reveal a galaxy forming stars at record speed",
    "Supermarket chain to close 40 stores as online sales grow",
    "Mayor promises free bus travel for under-18s from next year",
    "Veteran actor returns to the stage after a ten-year break",
    "Study finds city trees lower summer temperatures by several degrees",
    "Tennis star pulls out of tournament with a wrist injury",
    "Electric scooter company fined over battery safety",
    "Opposition party chooses new leader after close vote",
    "Music festival sells out in record time despite higher prices",
    "Researchers test a vaccine for a common childhood virus",
    "Car maker recalls 80,000 vehicles over brake fault",
]

CUSTOMER_MESSAGES = [
    "I was charged twice for my subscription this month.",
    "The app logs me out every time I switch to another screen.",
    "How do I close my account permanently?", "Do you ship to Norway?",
    "My invoice shows the wrong company address.",
    "I can't reset my password, the email never arrives.",
    "What are your opening hours on public holidays?",
    "Please cancel my order, I bought the wrong size.",
    "The video keeps freezing after two minutes.", "Can I change the date on my booking?",
    "Why did my monthly price go up?", "Is there a student discount?",
]

SMS_MESSAGES = [
    "Congratulations! You have won a 500 dollar gift card. Click the link now to claim it "
    "before midnight!!",
    "Hi, your dentist appointment is confirmed for Tuesday at 10:30. Reply C to cancel.",
    "URGENT: your bank account has been locked. Verify your details at the link below.",
    "Hey it's Sam, I'm outside, can you open the door?",
    "Your parcel could not be delivered. Pay a 1.99 fee to rebook delivery: see link.",
    "Reminder: the school is closed on Friday for teacher training.",
    "You've been selected for a free cruise! Call now, limited places.",
    "Your verification code is 482913. Don't share it with anyone.",
    "Mum says dinner is at 7, don't be late",
    "Earn 300 a day working from home, no experience needed, reply YES",
]

CLASSIFY_TEMPLATES = {
    "sentiment": [
        "What is the sentiment of this review: positive, negative or mixed?\n\n\"{text}\"",
        "Classify this customer review as positive, negative or neutral.\n\n{text}",
        "Is this review happy or unhappy? {text}",
        "Rate the sentiment of this review from 1 (very negative) to 5 (very positive) and "
        "explain briefly.\n\n{text}",
    ],
    "extract": [
        "Extract all names of people, dates and places from this sentence: {text}",
        "From the text below, list every person, date and place as JSON.\n\n{text}",
        "Who, when and where? \"{text}\"",
        "Find the named entities in this sentence and label each as PERSON, DATE, LOCATION or "
        "ORGANIZATION:\n{text}",
    ],
    "topic": [
        "Which category does this headline belong to: politics, sports, science, business or "
        "entertainment?\n\n\"{text}\"",
        "Classify this news headline by topic and give a one-word answer: {text}",
        "Headline: {text}\nWhat section of a newspaper would this go in?",
    ],
    "intent": [
        "Classify the intent of this customer message (billing, technical problem, "
        "cancellation, general question): \"{text}\"",
        "A customer wrote: \"{text}\" Which support team should handle this, and why?",
        "Label the intent of this message in one or two words: {text}",
    ],
    "spam": [
        "Is this text message spam? Answer yes or no, then explain.\n\n{text}",
        "Spam or not spam? \"{text}\"",
        "Should I trust this message? \"{text}\"",
    ],
}

# --- other languages ---------------------------------------------------------------------------

# Per language: templates with slots, the slots' values, greetings and closings, and
# sentences to translate into English. All written for this file.
FOREIGN = {
    "French": {
        "templates": [
            "Peux-tu m'expliquer {sujet} simplement ?",
            "Explique-moi {sujet} comme si j'avais dix ans.",
            "Donne-moi {n} idées pour {activite}.", "Écris un petit poème sur {theme}.",
            "Comment est-ce que je peux {objectif} ?",
            "Quels sont les avantages et les inconvénients {chose} ?",
            "Écris un e-mail {destinataire} pour {but}.",
            "J'ai besoin d'un conseil : {situation}. Qu'est-ce que tu me conseilles ?",
            "Raconte-moi une courte histoire avec {personnage} {lieu}.",
            "Fais-moi un plan pour {projet} en {duree}.",
        ],
        "slots": {
            "sujet": ["la photosynthèse", "l'inflation", "le fonctionnement d'internet",
                      "la Révolution française", "les trous noirs", "le cycle de l'eau",
                      "l'intelligence artificielle", "le système immunitaire",
                      "les taux d'intérêt", "la tectonique des plaques", "la blockchain",
                      "le réchauffement climatique"],
            "n": ["trois", "cinq", "sept", "dix"],
            "activite": ["un anniversaire d'enfant", "un week-end pluvieux",
                         "un dîner entre amis", "apprendre l'anglais plus vite",
                         "économiser de l'argent", "occuper des enfants pendant les vacances",
                         "un cadeau pour ma grand-mère", "décorer un petit appartement",
                         "rester actif en hiver", "le nom de ma boulangerie"],
            "theme": ["la mer", "l'automne", "une vieille maison", "la pluie sur Paris",
                      "l'amitié", "un chat paresseux", "le premier jour d'école",
                      "le silence de la montagne"],
            "objectif": ["mieux dormir", "apprendre à coder", "arrêter de procrastiner",
                         "manger plus sainement", "parler en public sans stress",
                         "trouver un appartement à Lyon", "améliorer mon CV",
                         "garder mes plantes en vie"],
            "chose": ["du télétravail", "de la voiture électrique",
                      "des réseaux sociaux pour les ados", "de la vie à la campagne",
                      "de l'énergie nucléaire", "de la semaine de quatre jours",
                      "d'une année d'études à l'étranger"],
            "destinataire": ["à mon propriétaire", "à ma directrice", "à un client mécontent",
                             "à mon professeur", "à la mairie", "à un ancien collègue"],
            "but": ["demander un délai supplémentaire", "signaler une fuite d'eau",
                    "m'excuser de mon retard", "remercier pour l'aide reçue",
                    "demander un rendez-vous", "annuler une réservation"],
            "situation": ["mon colocataire ne fait jamais la vaisselle",
                          "je n'arrive pas à me concentrer quand je révise",
                          "mon chien aboie quand je pars",
                          "j'ai du mal à me faire des amis dans une nouvelle ville",
                          "je dépense trop d'argent en livraisons de repas",
                          "mon chef me donne trop de travail"],
            "personnage": ["un boulanger", "une petite fille curieuse", "un robot solitaire",
                           "un vieux pêcheur", "une détective", "un chat qui parle"],
            "lieu": ["dans une gare abandonnée", "sur une île déserte", "à Marseille en 1920",
                     "dans une forêt enchantée", "sur une station spatiale"],
            "projet": ["apprendre l'espagnol", "courir un semi-marathon", "préparer un examen",
                       "organiser un déménagement", "lancer un petit blog"],
            "duree": ["trois mois", "six semaines", "un an", "quinze jours"],
        },
        "greetings": ["Bonjour ! ", "Salut ! ", "Bonsoir. "],
        "closings": [" Merci !", " Merci d'avance.", " Sois bref, s'il te plaît."],
        "sentences": ["Où se trouve la boulangerie la plus proche ?",
                      "Nous partons en vacances en Bretagne la semaine prochaine.",
                      "J'ai oublié mon parapluie dans le train.",
                      "Pourriez-vous parler un peu plus lentement ?",
                      "Le musée est fermé le mardi.",
                      "Ma sœur travaille dans un hôpital à Toulouse.",
                      "Il fait trop chaud pour courir aujourd'hui.",
                      "Est-ce que je peux payer par carte ?"],
        "to_english": ["Traduis en anglais : {s}", "Comment dit-on ça en anglais : « {s} » ?"],
    },
    "Spanish": {
        "templates": [
            "¿Puedes explicarme {tema} de forma sencilla?",
            "Explícame {tema} como si tuviera diez años.",
            "Dame {n} ideas para {actividad}.", "Escribe un poema corto sobre {motivo}.",
            "¿Cómo puedo {objetivo}?", "¿Cuáles son las ventajas y desventajas {cosa}?",
            "Escribe un correo {destinatario} para {proposito}.",
            "Necesito un consejo: {situacion}. ¿Qué me recomiendas?",
            "Cuéntame una historia corta sobre {personaje} {lugar}.",
            "Hazme un plan para {proyecto} en {plazo}.",
        ],
        "slots": {
            "tema": ["la fotosíntesis", "la inflación", "cómo funciona internet",
                     "la Revolución Industrial", "los agujeros negros", "el ciclo del agua",
                     "la inteligencia artificial", "el sistema inmunitario",
                     "los tipos de interés", "la energía solar", "la teoría de la relatividad",
                     "el cambio climático"],
            "n": ["tres", "cinco", "siete", "diez"],
            "actividad": ["una fiesta de cumpleaños infantil", "un fin de semana lluvioso",
                          "una cena con amigos", "ahorrar dinero cada mes",
                          "aprender inglés más rápido", "un regalo para mi abuelo",
                          "decorar un piso pequeño", "mantenerme activo en invierno",
                          "el nombre de mi panadería", "entretener a los niños en vacaciones"],
            "motivo": ["el mar", "el otoño", "una casa vieja", "la lluvia en Madrid",
                       "la amistad", "un gato perezoso", "el primer día de trabajo",
                       "las montañas al amanecer"],
            "objetivo": ["dormir mejor", "aprender a programar", "dejar de procrastinar",
                         "comer más sano", "hablar en público sin nervios",
                         "mejorar mi currículum", "cuidar mejor mis plantas",
                         "ahorrar para un viaje"],
            "cosa": ["del teletrabajo", "de los coches eléctricos",
                     "de las redes sociales para adolescentes", "de vivir en el campo",
                     "de la semana laboral de cuatro días", "de estudiar en el extranjero",
                     "de alquilar en vez de comprar"],
            "destinatario": ["a mi casero", "a mi jefa", "a un cliente enfadado",
                             "a mi profesor", "al ayuntamiento",
                             "a un antiguo compañero de trabajo"],
            "proposito": ["pedir más tiempo para entregar un informe",
                          "avisar de una fuga de agua", "disculparme por llegar tarde",
                          "dar las gracias por su ayuda", "pedir una cita",
                          "cancelar una reserva"],
            "situacion": ["mi compañero de piso nunca lava los platos",
                          "no consigo concentrarme cuando estudio",
                          "mi perro ladra cuando me voy de casa",
                          "me cuesta hacer amigos en una ciudad nueva",
                          "gasto demasiado en comida a domicilio",
                          "mi jefe me da demasiado trabajo"],
            "personaje": ["un panadero", "una niña muy curiosa", "un robot solitario",
                          "un viejo pescador", "una detective", "un gato que habla"],
            "lugar": ["en una estación abandonada", "en una isla desierta",
                      "en Sevilla en 1920", "en un bosque encantado",
                      "en una estación espacial"],
            "proyecto": ["aprender francés", "correr una media maratón", "preparar un examen",
                         "organizar una mudanza", "lanzar un pequeño blog"],
            "plazo": ["tres meses", "seis semanas", "un año", "quince días"],
        },
        "greetings": ["Hola. ", "¡Hola! ", "Buenas. "],
        "closings": [" Gracias.", " ¡Muchas gracias!", " Por favor, sé breve."],
        "sentences": ["¿Dónde está la parada de autobús más cercana?",
                      "Mañana vamos a visitar a mis abuelos en el pueblo.",
                      "No me gusta nada el frío de enero.",
                      "¿Podrías ayudarme a mover este sofá?",
                      "El restaurante estaba lleno, así que cenamos en casa.",
                      "Mi hermana trabaja en un hospital de Valencia.",
                      "Se me olvidó la contraseña del correo.",
                      "Este verano quiero aprender a nadar."],
        "to_english": ["Traduce al inglés: {s}", "¿Cómo se dice esto en inglés? «{s}»"],
    },
    "German": {
        "templates": [
            "Kannst du mir {thema} einfach erklären?",
            "Erkläre mir {thema} so, dass es ein Zehnjähriger versteht.",
            "Gib mir {n} Ideen für {aktivitaet}.", "Schreib ein kurzes Gedicht über {motiv}.",
            "Wie kann ich {ziel}?", "Was sind die Vor- und Nachteile {sache}?",
            "Schreib eine E-Mail {empfaenger}, um {zweck}.",
            "Ich brauche einen Rat: {situation}. Was würdest du mir empfehlen?",
            "Erzähl mir eine kurze Geschichte über {figur} {ort}.",
            "Erstelle mir einen Plan: Ich möchte in {zeitraum} {vorhaben}.",
        ],
        "slots": {
            "thema": ["die Photosynthese", "die Inflation", "die Funktionsweise des Internets",
                      "die Industrielle Revolution", "Schwarze Löcher", "den Wasserkreislauf",
                      "künstliche Intelligenz", "das Immunsystem", "Zinsen",
                      "die Relativitätstheorie", "den Klimawandel", "die Gewaltenteilung"],
            "n": ["drei", "fünf", "sieben", "zehn"],
            "aktivitaet": ["einen Kindergeburtstag", "ein verregnetes Wochenende",
                           "einen Abend mit Freunden", "ein Geschenk für meinen Opa",
                           "einen Namen für mein Café", "die Sommerferien mit Kindern",
                           "ein Teamevent im Büro", "gesunde Mittagessen fürs Büro",
                           "ein Schulprojekt über Energie"],
            "motiv": ["das Meer", "den Herbst", "ein altes Haus", "den Regen in Berlin",
                      "die Freundschaft", "eine faule Katze", "den ersten Arbeitstag",
                      "die Berge im Morgengrauen"],
            "ziel": ["besser schlafen", "programmieren lernen", "gesünder essen",
                     "ohne Lampenfieber vor Publikum sprechen", "meinen Lebenslauf verbessern",
                     "meine Zimmerpflanzen am Leben halten", "für eine Reise sparen",
                     "mich beim Lernen besser konzentrieren"],
            "sache": ["des Homeoffice", "von Elektroautos",
                      "von sozialen Medien für Jugendliche", "des Lebens auf dem Land",
                      "einer Vier-Tage-Woche", "eines Auslandssemesters",
                      "einer Mietwohnung im Vergleich zum Eigentum"],
            "empfaenger": ["an meinen Vermieter", "an meine Chefin",
                           "an einen verärgerten Kunden", "an meinen Professor",
                           "an die Stadtverwaltung", "an einen ehemaligen Kollegen"],
            "zweck": ["nach einer Fristverlängerung zu fragen", "einen Wasserschaden zu melden",
                      "mich für meine Verspätung zu entschuldigen",
                      "mich für die Hilfe zu bedanken", "einen Termin zu vereinbaren",
                      "eine Reservierung zu stornieren"],
            "situation": ["mein Mitbewohner spült nie ab",
                          "ich kann mich beim Lernen nicht konzentrieren",
                          "mein Hund bellt, wenn ich das Haus verlasse",
                          "es fällt mir schwer, in einer neuen Stadt Freunde zu finden",
                          "ich gebe zu viel Geld für Essenslieferungen aus",
                          "mein Chef gibt mir zu viel Arbeit"],
            "figur": ["einen Bäcker", "ein neugieriges Mädchen", "einen einsamen Roboter",
                      "einen alten Fischer", "eine Detektivin", "eine sprechende Katze"],
            "ort": ["in einem verlassenen Bahnhof", "auf einer einsamen Insel",
                    "in Hamburg im Jahr 1920", "in einem verzauberten Wald",
                    "auf einer Raumstation"],
            "zeitraum": ["drei Monaten", "sechs Wochen", "einem Jahr", "zwei Wochen"],
            "vorhaben": ["Spanisch lernen", "einen Halbmarathon laufen",
                         "eine wichtige Prüfung bestehen", "einen Umzug organisieren",
                         "einen kleinen Blog starten"],
        },
        "greetings": ["Hallo! ", "Hi! ", "Guten Tag. "],
        "closings": [" Danke!", " Vielen Dank im Voraus.", " Bitte kurz halten."],
        "sentences": ["Wo ist hier die nächste Apotheke?",
                      "Wir fahren am Wochenende an die Ostsee.",
                      "Ich habe meinen Schlüssel im Büro vergessen.",
                      "Kannst du mir bitte das Salz geben?",
                      "Der Zug hatte wieder zwanzig Minuten Verspätung.",
                      "Meine Tochter lernt seit einem Jahr Geige.",
                      "Das Wetter soll morgen besser werden.",
                      "Ich hätte gern einen Kaffee mit Milch."],
        "to_english": ["Übersetze ins Englische: {s}", "Was heißt „{s}“ auf Englisch?"],
    },
    "Italian": {
        "templates": [
            "Puoi spiegarmi {tema} in modo semplice?",
            "Spiegami {tema} come se avessi dieci anni.",
            "Dammi {n} idee per {attivita}.", "Scrivi una breve poesia {soggetto}.",
            "Come posso {obiettivo}?", "Quali sono i vantaggi e gli svantaggi {cosa}?",
            "Scrivi un'email {destinatario} per {scopo}.",
            "Ho bisogno di un consiglio: {situazione}. Cosa mi suggerisci?",
            "Raccontami una breve storia su {personaggio} {luogo}.",
            "Fammi un piano per {progetto} in {periodo}.",
        ],
        "slots": {
            "tema": ["la fotosintesi", "l'inflazione", "come funziona internet",
                     "la Rivoluzione industriale", "i buchi neri", "il ciclo dell'acqua",
                     "l'intelligenza artificiale", "il sistema immunitario",
                     "i tassi di interesse", "l'energia solare", "il Rinascimento",
                     "il cambiamento climatico"],
            "n": ["tre", "cinque", "sette", "dieci"],
            "attivita": ["una festa di compleanno per bambini", "un weekend di pioggia",
                         "una cena tra amici", "risparmiare ogni mese",
                         "un regalo per mia nonna", "arredare un monolocale",
                         "il nome della mia gelateria", "tenere occupati i bambini in vacanza",
                         "restare in forma in inverno"],
            "soggetto": ["sul mare", "sull'autunno", "su una vecchia casa",
                         "sulla pioggia a Roma", "sull'amicizia", "su un gatto pigro",
                         "sul primo giorno di lavoro", "sulle montagne all'alba"],
            "obiettivo": ["dormire meglio", "imparare a programmare",
                          "smettere di rimandare tutto", "mangiare in modo più sano",
                          "parlare in pubblico senza ansia", "migliorare il mio curriculum",
                          "tenere in vita le mie piante", "risparmiare per un viaggio"],
            "cosa": ["del lavoro da casa", "delle auto elettriche",
                     "dei social network per gli adolescenti", "della vita in campagna",
                     "della settimana lavorativa di quattro giorni", "di studiare all'estero",
                     "di affittare invece di comprare casa"],
            "destinatario": ["al mio padrone di casa", "alla mia responsabile",
                             "a un cliente arrabbiato", "al mio professore", "al comune",
                             "a un ex collega"],
            "scopo": ["chiedere una proroga", "segnalare una perdita d'acqua",
                      "scusarmi per il ritardo", "ringraziare per l'aiuto",
                      "fissare un appuntamento", "annullare una prenotazione"],
            "situazione": ["il mio coinquilino non lava mai i piatti",
                           "non riesco a concentrarmi quando studio",
                           "il mio cane abbaia quando esco di casa",
                           "faccio fatica a farmi degli amici in una nuova città",
                           "spendo troppo per il cibo a domicilio",
                           "il mio capo mi dà troppo lavoro"],
            "personaggio": ["un panettiere", "una bambina curiosa", "un robot solitario",
                            "un vecchio pescatore", "una detective", "un gatto parlante"],
            "luogo": ["in una stazione abbandonata", "su un'isola deserta",
                      "a Napoli nel 1920", "in un bosco incantato",
                      "su una stazione spaziale"],
            "progetto": ["imparare il tedesco", "correre una mezza maratona",
                         "prepararmi a un esame", "organizzare un trasloco",
                         "aprire un piccolo blog"],
            "periodo": ["tre mesi", "sei settimane", "un anno", "due settimane"],
        },
        "greetings": ["Ciao! ", "Buongiorno. ", "Salve! "],
        "closings": [" Grazie!", " Grazie mille.", " Per favore, sii breve."],
        "sentences": ["Scusi, a che ora parte l'ultimo treno per Firenze?",
                      "Domani sera andiamo a cena dai miei genitori.",
                      "Ho perso il portafoglio sull'autobus.",
                      "Questa è la pizza più buona che abbia mai mangiato.",
                      "Il negozio è chiuso la domenica pomeriggio.",
                      "Mio fratello vive a Torino da cinque anni.",
                      "Potresti parlare più lentamente, per favore?",
                      "Stasera piove, quindi restiamo a casa."],
        "to_english": ["Traduci in inglese: {s}", "Come si dice in inglese \"{s}\"?"],
    },
    "Portuguese": {
        "templates": [
            "Você pode me explicar {tema} de um jeito simples?",
            "Explique {tema} como se eu tivesse dez anos.",
            "Me dê {n} ideias para {atividade}.", "Escreva um poema curto sobre {assunto}.",
            "Como posso {objetivo}?", "Quais são as vantagens e desvantagens {coisa}?",
            "Escreva um e-mail {destinatario} {finalidade}.",
            "Preciso de um conselho: {situacao}. O que você sugere?",
            "Conte uma história curta sobre {personagem} {lugar}.",
            "Faça um plano para {projeto} em {prazo}.",
        ],
        "slots": {
            "tema": ["a fotossíntese", "a inflação", "como a internet funciona",
                     "a Revolução Industrial", "os buracos negros", "o ciclo da água",
                     "a inteligência artificial", "o sistema imunológico", "os juros compostos",
                     "a energia solar", "as placas tectônicas", "as mudanças climáticas"],
            "n": ["três", "cinco", "sete", "dez"],
            "atividade": ["uma festa de aniversário infantil", "um fim de semana chuvoso",
                          "um jantar com amigos", "economizar dinheiro todo mês",
                          "um presente para minha avó", "decorar um apartamento pequeno",
                          "o nome da minha cafeteria", "distrair as crianças nas férias",
                          "me manter ativo no inverno"],
            "assunto": ["o mar", "o outono", "uma casa antiga", "a chuva em São Paulo",
                        "a amizade", "um gato preguiçoso", "o primeiro dia de trabalho",
                        "as montanhas ao amanhecer"],
            "objetivo": ["dormir melhor", "aprender a programar", "parar de procrastinar",
                         "comer de forma mais saudável", "falar em público sem nervosismo",
                         "melhorar meu currículo", "cuidar melhor das minhas plantas",
                         "economizar para uma viagem"],
            "coisa": ["do trabalho remoto", "dos carros elétricos",
                      "das redes sociais para adolescentes", "de morar no campo",
                      "da semana de quatro dias", "de estudar no exterior",
                      "de alugar em vez de comprar"],
            "destinatario": ["ao meu senhorio", "à minha chefe", "a um cliente irritado",
                             "ao meu professor", "à prefeitura", "a um antigo colega"],
            "finalidade": ["pedindo mais prazo para um relatório",
                           "avisando sobre um vazamento de água", "pedindo desculpas pelo atraso",
                           "agradecendo a ajuda", "marcando uma reunião",
                           "cancelando uma reserva"],
            "situacao": ["meu colega de quarto nunca lava a louça",
                         "não consigo me concentrar quando estudo",
                         "meu cachorro late quando saio de casa",
                         "tenho dificuldade de fazer amigos numa cidade nova",
                         "gasto dinheiro demais com delivery", "meu chefe me dá trabalho demais"],
            "personagem": ["um padeiro", "uma menina curiosa", "um robô solitário",
                           "um velho pescador", "uma detetive", "um gato falante"],
            "lugar": ["numa estação abandonada", "numa ilha deserta", "em Lisboa em 1920",
                      "numa floresta encantada", "numa estação espacial"],
            "projeto": ["aprender inglês", "correr uma meia maratona",
                        "me preparar para uma prova", "organizar uma mudança",
                        "começar um pequeno blog"],
            "prazo": ["três meses", "seis semanas", "um ano", "quinze dias"],
        },
        "greetings": ["Olá! ", "Oi! ", "Bom dia. "],
        "closings": [" Obrigado!", " Muito obrigada.", " Seja breve, por favor."],
        "sentences": ["Onde fica a farmácia mais próxima?",
                      "Amanhã vamos à praia com os meus primos.",
                      "Esqueci o guarda-chuva no restaurante.",
                      "Você pode me ajudar a carregar essas caixas?",
                      "O ônibus estava lotado hoje de manhã.",
                      "Minha irmã estuda medicina em Coimbra.",
                      "Quanto custa uma passagem para o Porto?",
                      "Acho que vai chover à tarde."],
        "to_english": ["Traduza para o inglês: {s}", "Como se diz isso em inglês: \"{s}\"?"],
    },
}

ENGLISH_SENTENCES = [
    "Where is the nearest train station?",
    "I would like to book a table for four people at eight o'clock.",
    "Could you speak a little more slowly, please?",
    "My flight has been cancelled and I need a hotel for tonight.",
    "How much does this jacket cost?", "We are looking forward to meeting you next week.",
    "I'm allergic to peanuts.", "The meeting has been moved to Thursday afternoon.",
    "Can I pay by card?", "It was really nice to meet you.",
    "Please send me the documents by Friday.", "I've lost my passport.",
    "What time does the museum close?", "My brother lives in a small town near the coast.",
    "Thank you for your help, I really appreciate it.", "Is breakfast included in the price?",
    "I don't understand, can you repeat that?", "The children are playing in the garden.",
    "We need to buy bread, milk and eggs.", "Turn left at the second traffic light.",
    "I have been learning this language for two years.",
    "The weather is going to be sunny all weekend.",
    "Could you recommend a good restaurant nearby?",
    "Sorry I'm late, the bus didn't come.", "My phone battery is almost dead.",
    "Happy birthday! I hope all your wishes come true.", "This soup is too salty.",
    "The train to the airport leaves every fifteen minutes.",
    "Do you have this shirt in a larger size?", "I work as a nurse at the city hospital.",
    "Let's meet in front of the cinema at seven.",
    "The package should arrive within three working days.",
    "I would like to open a bank account.",
    "Please keep the door closed, the cat likes to escape.",
    "How long does it take to get to the city centre?", "We've run out of coffee again.",
    "She reads a book every week.", "The heating in my room isn't working.",
    "Can you help me carry these boxes?", "Our office is on the fifth floor.",
    "The exhibition is free on Sundays.", "He wants to become a vet when he grows up.",
    "What do you usually eat for breakfast?",
]

TRANSLATE_TEMPLATES = [
    "Translate to {lang}: {s}", "Translate the following sentence into {lang}:\n\n{s}",
    "How do you say \"{s}\" in {lang}?", "Can you translate this into {lang} for me? \"{s}\"",
    "What's \"{s}\" in {lang}?", "{lang} please: {s}",
    "Please translate into {lang}, keeping it polite: {s}",
    "Translate into {lang}, then explain any tricky words: {s}",
    "I'm travelling soon. How would I say this in {lang}: \"{s}\"",
]
FROM_TEMPLATES = [
    "Translate into English: {s}", "What does \"{s}\" mean in English?",
    "Can you translate this {lang} sentence? {s}",
    "My {lang} friend sent me this: \"{s}\" What does it say?",
]

# --- multi-step plans --------------------------------------------------------------------------

TRAVELLERS = [
    "my partner and me", "a family with two young kids", "a group of four students",
    "a solo traveller", "my elderly parents", "three friends who love hiking",
    "a couple on their honeymoon", "someone who uses a wheelchair", "a teenager and a parent",
    "two colleagues with one free day after a conference",
]
BUDGETS = ["tight", "moderate", "generous", "backpacker"]
WEEKLY_PLANS = ["meal", "workout", "study", "cleaning", "reading", "budget"]
CONSTRAINTS = [
    "work 9 to 5 on weekdays", "have two kids and a part-time job",
    "study in the mornings and work in the evenings", "only have 30 minutes free a day",
    "work night shifts three days a week", "commute an hour each way",
]
WEEK_ACTIVITIES = ["exercise", "learning Spanish", "seeing friends", "a side project",
                   "cooking proper meals", "reading", "playing music"]
PROJECTS = [
    "the launch of a small online shop", "a school fundraiser", "a kitchen renovation",
    "a team away-day for 12 people", "moving into a new flat", "a community clean-up day",
    "moving our website to a new host", "a surprise 50th birthday party",
    "a mobile app prototype during a hackathon weekend", "writing my thesis",
    "a neighbourhood book swap", "a wedding with 80 guests",
]
BIG_GOALS = [
    "run my first half marathon", "learn enough Italian for a holiday",
    "get a job as a data analyst", "save 5,000 dollars", "read 30 books",
    "learn to draw portraits", "build a simple personal website", "pass my driving test",
    "learn to swim properly", "write and self-publish a short ebook",
]
PERIODS = ["three months", "six months", "a year", "eight weeks", "90 days"]
EVENTS = ["a garden party", "a children's birthday party", "a Friday dinner party",
          "a baby shower", "a farewell party for a colleague", "a board game evening",
          "a picnic in the park"]

PLAN_TEMPLATES = [
    "Plan a {days}-day trip to {place} for {travellers} on a {budget} budget.",
    "Make a day-by-day itinerary for {days} days in {place}, for {travellers}.",
    "Can you make me a weekly {weekly} plan? I {constraint}.",
    "Help me plan {project}. Break it into steps with rough deadlines.",
    "I want to {big_goal} in {period}. Create a step-by-step plan with milestones.",
    "Create a schedule for my week: I {constraint}, and I want time for {activity}.",
    "Plan {event} for {guests} people. Include a timeline, a shopping list and a budget.",
    "First explain {concept} in two or three sentences, then give two everyday examples, and "
    "finally write one quiz question about it.",
    "First ask me three questions about my situation, then suggest a plan to {goal}.",
    "I'm moving to {place} next month. Make me a checklist of what to do, in order.",
    "We're going to {place} for {days} days. Plan each day, suggest where to eat, and list "
    "what to pack.",
    "Break {project} into tasks, say who should do what in a team of {team}, and estimate "
    "the time for each task.",
]

# --- slot pools shared by the English templates ------------------------------------------------

POOLS = {
    "howto": HOWTO, "safe": SAFE, "chore": CHORES, "phrase": PHRASES, "duration": DURATIONS,
    "why": WHY_QUESTIONS, "trivia": TRIVIA,
    "situation": ADVICE_SITUATIONS, "goal": ADVICE_GOALS, "role": ROLES,
    "concept": SCIENCE + HISTORY + TECHNOLOGY + ECONOMICS,
    "age": [str(a) for a in range(5, 13)],
    "sentences": ["two", "three", "3", "four", "five", "5"],
    "words": ["50", "80", "100", "150", "200"],
    "idea": IDEA_TOPICS, "listing": LIST_TOPICS, "n": NUMBERS_SMALL,
    "friend": FRIENDS, "casual": CASUAL_PURPOSES,
    "kindness": KINDNESSES, "invitation": INVITATIONS, "name": NAMES,
    "helper": ["my neighbour", "my colleague", "my aunt", "our babysitter", "my mentor",
               "my old maths teacher", "the volunteers at the food bank", "my flatmate",
               "my son's football coach", "the nurses on the ward"],
    "character": CHARACTERS, "character2": CHARACTERS, "setting": SETTINGS, "plot": PLOTS,
    "tone": TONES, "form": POEM_FORMS, "poem_topic": POEM_TOPICS, "style": STYLES,
    "genre": GENRES, "length": STORY_LENGTHS, "audience": AUDIENCES,
    "place": PLACES, "travellers": TRAVELLERS, "budget": BUDGETS,
    "days": [str(d) for d in range(2, 15)], "weekly": WEEKLY_PLANS,
    "constraint": CONSTRAINTS, "activity": WEEK_ACTIVITIES, "project": PROJECTS,
    "big_goal": BIG_GOALS, "period": PERIODS, "event": EVENTS,
    "guests": [str(g) for g in range(6, 41)], "team": ["three", "four", "five", "six"],
    "dialect": SQL_DIALECTS, "weekday": WEEKDAYS,
}

# --- phrasing variation ---------------------------------------------------------------------

GREETINGS = ["Hi! ", "Hello. ", "Hey! ", "Hi there. ", "Good morning! ",
             "I need some help. ", "Hello again. "]
CLOSINGS = [" Thanks!", " Thank you.", " Thanks in advance!", " I appreciate it.", " Cheers.",
            " Thanks a lot!", " ty"]
# Chat abbreviations (pattern, replacement), each applied with some probability.
ABBREVIATIONS = [
    (r"\byou\b", "u"), (r"\byour\b", "ur"), (r"\bplease\b", "pls"), (r"\bthanks\b", "thx"),
    (r"\bbecause\b", "bc"), (r"\bI'm\b", "im"), (r"\bdon't\b", "dont"), (r"\bcan't\b", "cant"),
    (r"\bwhat's\b", "whats"), (r"\bdoesn't\b", "doesnt"), (r"\bwant to\b", "wanna"),
    (r"\bgoing to\b", "gonna"), (r"\bpeople\b", "ppl"), (r"\bsomething\b", "smth"),
    (r"\btomorrow\b", "tmrw"), (r"\breally\b", "rly"),
]
# Common misspellings, rarer: at most one occurrence each.
MISSPELLINGS = [
    (r"\bdefinitely\b", "definately"), (r"\bseparate\b", "seperate"),
    (r"\breceive\b", "recieve"), (r"\bthe\b", "teh"), (r"\bwhich\b", "wich"),
    (r"\bbecause\b", "becuase"), (r"\bwould\b", "woudl"), (r"\bexplain\b", "explian"),
]
# Kinds whose prompts get greetings, closings and informal spelling.
DRESSED_KINDS = {"question", "advice", "explain", "brainstorm", "message", "creative",
                 "summarize", "rewrite", "code", "sql", "math", "compare", "classify", "plan"}
# Kinds whose one-line prompts may be written informally.
CASUAL_KINDS = {"question", "advice", "explain", "brainstorm", "message", "creative",
                "compare", "plan", "math"}

_FORMATTER = string.Formatter()


def _fill(rng: random.Random, template: str, pools: dict = POOLS, **fixed) -> str:
    """`template` with each {slot} not in `fixed` drawn from `pools` (one draw per slot)."""
    values = dict(fixed)
    for _, field, _, _ in _FORMATTER.parse(template):
        if field and field not in values:
            values[field] = rng.choice(pools[field])
    return template.format(**values)


def _informal(rng: random.Random, text: str) -> str:
    """`text` as typed quickly: lower case, chat abbreviations, a dropped final mark."""
    text = text.lower() if rng.random() < 0.5 else text[0].lower() + text[1:]
    for pattern, repl in ABBREVIATIONS:
        if rng.random() < 0.4:
            text = re.sub(pattern, repl, text, flags=re.IGNORECASE)
    for pattern, repl in MISSPELLINGS:
        if rng.random() < 0.15:
            text = re.sub(pattern, repl, text, count=1, flags=re.IGNORECASE)
    if text[-1] == "?" and rng.random() < 0.2:
        text += "?"
    elif text[-1] in ".?" and rng.random() < 0.5:
        text = text[:-1]
    return text


def _dress(rng: random.Random, kind: str, text: str) -> str:
    """Vary the phrasing around a prompt: informal spelling, a greeting, a closing."""
    one_line = "\n" not in text
    if kind in CASUAL_KINDS and one_line and rng.random() < 0.15:
        return _informal(rng, text)
    if rng.random() < 0.15 and len(text.split("\n", 1)[0]) <= 100:
        text = rng.choice(GREETINGS + (["Quick question: "] if text.endswith("?") else [])) + text
    if rng.random() < 0.15:
        closing = rng.choice(CLOSINGS)
        if one_line and (text[-1].isalnum() or text[-1] == ")"):
            text += "."
        text += closing if one_line else "\n\n" + closing.strip()
    return text


# --- one generator per kind ----------------------------------------------------------------------

def _question(rng):
    return _fill(rng, rng.choice(QUESTION_TEMPLATES))


def _advice(rng):
    return _fill(rng, rng.choice(ADVICE_TEMPLATES))


def _explain(rng):
    return _fill(rng, rng.choice(EXPLAIN_TEMPLATES))


def _brainstorm(rng):
    text = _fill(rng, rng.choice(BRAINSTORM_TEMPLATES))
    return text[0].upper() + text[1:]


def _message(rng):
    group = MESSAGE_GROUPS[rng.choice(list(MESSAGE_GROUPS))]
    return _fill(rng, rng.choice(MESSAGE_TEMPLATES), {**POOLS, **group})


def _creative(rng):
    character, character2 = rng.sample(CHARACTERS, 2)
    return _fill(rng, rng.choice(CREATIVE_TEMPLATES), character=character, character2=character2,
                 words=rng.choice(["100", "150", "200", "300"]))


def _summarize(rng):
    return _fill(rng, rng.choice(SUMMARY_TEMPLATES), p=rng.choice(PARAGRAPHS),
                 n=rng.choice(["2", "3", "three", "4", "five"]))


def _rewrite(rng):
    return _fill(rng, rng.choice(REWRITE_TEMPLATES), p=rng.choice(PARAGRAPHS))


def _block(rng, lang: str, code: str) -> str:
    """A snippet as pasted into a chat: usually a fenced Markdown code block."""
    if rng.random() < 0.2:
        return code
    return f"```{FENCE[lang]}\n{code}\n```"


def _code(rng):
    task = rng.choice(["write", "write", "explain", "debug", "convert"])
    if task == "write":
        if rng.random() < 0.15:
            return _fill(rng, rng.choice(SHELL_TEMPLATES), task=rng.choice(SHELL_TASKS))
        return _fill(rng, rng.choice(WRITE_TEMPLATES), lang=rng.choice(CODE_LANGS),
                     task=rng.choice(CODE_TASKS))
    if task == "explain":
        lang, code = rng.choice(SNIPPETS)
        return _fill(rng, rng.choice(EXPLAIN_CODE_TEMPLATES), lang=lang,
                     block=_block(rng, lang, code))
    if task == "debug":
        lang, code, symptom = rng.choice(BUGGY)
        return _fill(rng, rng.choice(DEBUG_TEMPLATES), lang=lang, symptom=symptom,
                     block=_block(rng, lang, code))
    lang, code = rng.choice([s for s in SNIPPETS if s[0] in ("Python", "JavaScript", "C")])
    target = rng.choice([t for t in TARGET_LANGS if t != lang])
    return _fill(rng, rng.choice(CONVERT_TEMPLATES), lang=lang, target=target,
                 block=_block(rng, lang, code))


def _sql(rng):
    table, queries = rng.choice(SQL_TABLES)
    return _fill(rng, rng.choice(SQL_TEMPLATES), t=table, q=rng.choice(queries))


def _math(rng):
    template, ranges = rng.choice(MATH_TEMPLATES)
    values = {k: rng.randrange(r[0], r[1] + 1, r[2] if len(r) > 2 else 1)
              for k, r in ranges.items()}
    name, name2, name3, name4 = rng.sample(NAMES, 4)
    text = _fill(rng, template, name=name, name2=name2, name3=name3, name4=name4, **values)
    return rng.choice(MATH_PREFIXES) + text + rng.choice(MATH_SUFFIXES)


def _compare(rng):
    a, b = rng.choice(COMPARE_PAIRS)
    if rng.random() < 0.5 and " for " not in b:
        a, b = b, a
    text = _fill(rng, rng.choice(COMPARE_TEMPLATES), a=a, b=b)
    return text[0].upper() + text[1:]


def _date(rng) -> str:
    """A date in one of the ways people write them."""
    day, month, year = rng.randint(1, 28), rng.randint(1, 12), rng.randint(2019, 2027)
    return rng.choice([f"{day} {MONTHS[month - 1]} {year}", f"{MONTHS[month - 1]} {day}, {year}",
                       f"{year}-{month:02d}-{day:02d}", f"{MONTHS[month - 1]} {day}"])


def _review(rng) -> str:
    """A short product or service review: positive, negative or mixed."""
    opening = rng.choice(REVIEW_OPENINGS).format(item=rng.choice(REVIEW_ITEMS))
    mood = rng.choice(["good", "bad", "mixed", "meh"])
    if mood == "good":
        body = rng.sample(REVIEW_GOOD, 2)
    elif mood == "bad":
        body = rng.sample(REVIEW_BAD, 2)
    elif mood == "mixed":
        bad = rng.choice(REVIEW_BAD)
        body = [rng.choice(REVIEW_GOOD), "But " + (bad if bad.startswith("I ") else bad[0].lower()
                                                   + bad[1:])]
    else:
        body = [rng.choice(REVIEW_MEH)]
    return " ".join([opening, *body])


def _classify(rng):
    task = rng.choice(list(CLASSIFY_TEMPLATES))
    if task == "sentiment":
        text = _review(rng)
    elif task == "extract":
        name, name2 = rng.sample(NAMES, 2)
        city, city2 = rng.sample(CITIES, 2)
        company, company2 = rng.sample(COMPANIES, 2)
        text = _fill(rng, rng.choice(EVENT_SENTENCES), name=name, name2=name2, city=city,
                     city2=city2, company=company, company2=company2, date=_date(rng),
                     date2=_date(rng))
    else:
        text = rng.choice({"topic": HEADLINES, "intent": CUSTOMER_MESSAGES,
                           "spam": SMS_MESSAGES}[task])
    return rng.choice(CLASSIFY_TEMPLATES[task]).format(text=text)


def _foreign(rng):
    lang = FOREIGN[rng.choice(list(FOREIGN))]
    text = _fill(rng, rng.choice(lang["templates"]), lang["slots"])
    if rng.random() < 0.25:
        text = rng.choice(lang["greetings"]) + text
    if rng.random() < 0.25:
        text += rng.choice(lang["closings"])
    return text


def _translate(rng):
    name = rng.choice(list(FOREIGN))
    if rng.random() < 0.7:
        return _fill(rng, rng.choice(TRANSLATE_TEMPLATES), lang=name,
                     s=rng.choice(ENGLISH_SENTENCES))
    lang = FOREIGN[name]
    s = rng.choice(lang["sentences"])
    if rng.random() < 0.5:
        return rng.choice(lang["to_english"]).format(s=s)
    return _fill(rng, rng.choice(FROM_TEMPLATES), lang=name, s=s)


def _plan(rng):
    return _fill(rng, rng.choice(PLAN_TEMPLATES))


KINDS = {
    "question": _question, "advice": _advice, "explain": _explain, "brainstorm": _brainstorm,
    "message": _message, "creative": _creative, "summarize": _summarize, "rewrite": _rewrite,
    "code": _code, "sql": _sql, "math": _math, "compare": _compare, "classify": _classify,
    "foreign": _foreign, "translate": _translate, "plan": _plan,
}

_MAX_TRIES = 200    # draws of one kind in a row that give only prompts already taken


def make(rng: random.Random, kind: str) -> str:
    """One prompt of `kind` (a key of KINDS), drawn with `rng`."""
    text = KINDS[kind](rng)
    return _dress(rng, kind, text) if kind in DRESSED_KINDS else text


def build(n: int, seed: int) -> list[dict]:
    """`n` distinct instruction prompts, {"prompt": str, "kind": str}, deterministic for `seed`.

    Kinds take turns in a shuffled order each round, so their counts differ by at most one;
    a kind that keeps producing prompts already taken drops out. Raises ValueError when
    fewer than `n` distinct prompts can be made.
    """
    rng = random.Random(seed)
    active = list(KINDS)
    out: list[dict] = []
    seen: set[str] = set()
    while len(out) < n:
        if not active:
            raise ValueError(f"could only make {len(out)} distinct prompts, not {n}")
        order = list(active)
        rng.shuffle(order)
        for kind in order:
            if len(out) == n:
                break
            for _ in range(_MAX_TRIES):
                prompt = make(rng, kind)
                if prompt not in seen:
                    seen.add(prompt)
                    out.append({"prompt": prompt, "kind": kind})
                    break
            else:
                active.remove(kind)
    return out


def main(argv=None) -> int:
    """Print `build(--n, --seed)`, one JSON object per line."""
    parser = argparse.ArgumentParser(description="Print instruction prompts as JSON lines.")
    parser.add_argument("--n", type=int, default=20, help="number of prompts")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    args = parser.parse_args(argv)
    for entry in build(args.n, args.seed):
        print(json.dumps(entry, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
