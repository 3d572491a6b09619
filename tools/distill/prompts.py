"""Prompt sets for distillation: a large varied training set built from templates and
topics, and a small held-out set written separately (no template, topic or task of it
occurs in training), on which acceptance is measured."""

import random

TOPICS = """photosynthesis; the water cycle; black holes; the French Revolution; machine learning;
climate change; the stock market; vaccines; the Roman Empire; volcanoes; the human heart;
electric cars; renewable energy; the internet; democracy; inflation; honey bees; coffee;
the Great Wall of China; plate tectonics; DNA; the moon landing; jazz music; chess;
the Olympic Games; recycling; sleep; meditation; time management; public speaking;
the printing press; antibiotics; rainforests; the ocean tides; earthquakes; gravity;
the solar system; Mars; dinosaurs; the Industrial Revolution; World War I; ancient Egypt;
the Renaissance; Shakespeare; the piano; photography; social media; cybersecurity;
blockchain; quantum computers; artificial intelligence; robots; 3D printing; nutrition;
vitamins; exercise; marathon running; yoga; gardening; composting; bread baking;
chocolate; tea; wine making; cheese; the immune system; the brain; memory; emotions;
friendship; leadership; teamwork; negotiation; budgeting; saving money; credit cards;
taxes; insurance; real estate; startups; marketing; customer service; remote work;
job interviews; writing a resume; learning a language; mathematics; prime numbers;
algebra; geometry; statistics; probability; calculus; the Pythagorean theorem;
electricity; magnets; light; sound; rainbows; clouds; snow; hurricanes; deserts;
glaciers; rivers; mountains; islands; coral reefs; whales; sharks; elephants; lions;
cats; dogs; birds migration; butterflies; ants; trees; flowers; mushrooms; bacteria;
viruses; the periodic table; water; oxygen; carbon; plastics; batteries; solar panels;
wind turbines; nuclear power; trains; airplanes; bicycles; ships; rockets; satellites;
GPS; smartphones; computers; operating systems; databases; cloud computing; open source
software; version control; the Python language; JavaScript; web browsers; email;
video games; movies; novels; poetry; painting; sculpture; architecture; museums;
libraries; schools; universities; homework; exams; children's education; parenting;
pets; cooking pasta; making soup; breakfast; vegetarian diets; street food; travel
planning; camping; hiking; beaches; city life; farming; fishing; weather forecasts;
maps; history of writing; ancient Greece; philosophy; ethics; happiness; kindness;
habits; motivation; stress; healthy aging; first aid; hospitals; doctors; dentists;
the post office; banks; money; trade; economics; supply and demand; unemployment;
elections; laws; human rights; the United Nations; volunteering; charity; holidays;
birthdays; weddings; music festivals; guitars; drums; orchestras; opera; dance;
football; basketball; tennis; swimming; the Tour de France; mountains climbing""".replace("\n", " ")

TEMPLATES = [
    "What is {t}?", "Explain {t} in simple terms.", "Can you tell me about {t}?",
    "Why is {t} important?", "How does {t} work?", "Give me three facts about {t}.",
    "Write a short paragraph about {t}.", "What are the pros and cons of {t}?",
    "Summarize the history of {t}.", "Explain {t} to a ten-year-old.",
    "What are common misconceptions about {t}?", "List five interesting things about {t}.",
    "Write a haiku about {t}.", "Write a short poem about {t}.",
    "Write a tweet about {t}.", "Describe {t} in one sentence.",
    "What should a beginner know about {t}?", "Give me tips related to {t}.",
    "Write a short essay introduction about {t}.", "What questions do people often ask about {t}?",
    "Compare {t} and {u}.", "How are {t} and {u} related?",
    "Write a short story that involves {t}.", "Write a dialogue between two friends about {t}.",
    "Create a quiz with three questions about {t}.", "What is the future of {t}?",
    "Write an outline for a presentation on {t}.", "What are the main ideas behind {t}?",
    "Give an example that illustrates {t}.", "Write a product description inspired by {t}.",
    "I am curious about {t}. Where should I start?", "Define {t} and give an example.",
    "Write a limerick about {t}.", "Tell me a fun fact about {t}.",
    "What would happen if {t} disappeared?", "Write a short news headline and summary about {t}.",
    "How has {t} changed over time?", "Teach me something about {t}.",
]

CODE_TASKS = """reverses a string; checks if a number is prime; computes the factorial of n;
returns the n-th Fibonacci number; sorts a list with bubble sort; finds the maximum in a list;
counts the vowels in a string; checks if a string is a palindrome; merges two sorted lists;
removes duplicates from a list; computes the average of a list of numbers; converts Celsius to
Fahrenheit; flattens a nested list; counts word frequencies in a text; finds the greatest common
divisor of two numbers; checks if two strings are anagrams; returns the sum of the digits of a
number; implements binary search; reads a file and counts its lines; capitalizes every word in a
sentence; computes the area of a circle; generates a random password; validates an email address;
transposes a matrix; finds the second largest number in a list; computes the power set of a set;
converts a decimal number to binary; returns the length of the longest word; implements a stack
class; implements a queue with two stacks; checks for balanced parentheses; rotates a list by k
positions; computes compound interest; finds common elements of two lists; splits a list into
chunks; returns the n smallest items; computes the median of a list; parses a CSV line;
counts the occurrences of a character; implements a simple calculator""".replace("\n", " ")

CODE_TEMPLATES = [
    "Write a Python function that {c}.", "Write a JavaScript function that {c}.",
    "How do I write code that {c}? Use Python.", "Show me a short program that {c}.",
    "Write a function that {c}, and explain how it works.", "Write a C function that {c}.",
]

LIST_TASKS = """the days of the week; the months of the year; the planets of the solar system;
the primary colors; the continents; five fruits that are red; ten animals that live in the sea;
the steps to make a cup of tea; the steps to change a tire; five healthy breakfast ideas;
ten common English verbs; the first ten prime numbers; five programming languages; the seven
wonders of the ancient world; five tips for studying; things to pack for a beach trip; ways to
save energy at home; five famous scientists; board games for a family night; ideas for a rainy
day; the steps to plant a tree; items needed for a picnic; the stages of the water cycle;
reasons to learn to cook; ways to stay hydrated; five classic novels; the noble gases; the
parts of a flower; the layers of the Earth; the bones in the human arm""".replace("\n", " ")

LIST_TEMPLATES = ["List {l}.", "Can you list {l}?", "Make a numbered list of {l}.", "Name {l}."]

CHAT = [
    "Hello! How are you today?", "Hi, who are you?", "Good morning!", "Can you help me?",
    "Thank you for your help.", "What can you do?", "Tell me a joke.", "I am feeling bored.",
    "What is your favorite color?", "Do you like music?", "I had a long day at work.",
    "Can you recommend a book?", "What should I cook for dinner tonight?", "I can't sleep.",
    "How do I make friends in a new city?", "Give me a motivational quote.",
    "What is the meaning of life?", "Can you write me a birthday message for my mom?",
    "Help me write an email to my boss asking for a day off.", "Translate 'good night' into French.",
    "What is 15 times 12?", "What is the square root of 144?", "Is it going to rain tomorrow?",
    "Write a thank-you note to a teacher.", "Suggest a name for my new puppy.",
]

# Written apart from the lists above: no held-out prompt is a training prompt, and most
# are phrased unlike any template (a few share a topic or a code template's opening).
HELD_OUT = [
    "What causes the seasons on Earth?",
    "Write a Python function that checks whether a year is a leap year.",
    "List the ingredients of a classic margherita pizza.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "How can I improve my handwriting?",
    "Explain what a neural network is to someone who has never programmed.",
    "Give me a weekly workout plan for a beginner.",
    "Why do cats purr?",
    "What is the difference between weather and climate?",
    "Write a polite message declining an invitation to a party.",
    "How do airplanes stay in the air?",
    "Suggest three hobbies for someone who likes being outdoors.",
    "Write a JavaScript function that returns the largest even number in an array.",
    "What are the benefits of reading every day?",
    "Describe the taste of a lemon to someone who has never had one.",
    "Plan a one-day trip to a museum with children.",
]


def _split(text: str) -> list[str]:
    return [item.strip() for item in text.split(";") if item.strip()]


def training_prompts(seed: int) -> list[str]:
    """Every prompt the generator can draw, in a seeded order (several thousand)."""
    rng = random.Random(seed)
    topics, codes, lists = _split(TOPICS), _split(CODE_TASKS), _split(LIST_TASKS)
    prompts = [tpl.format(t=t, u=rng.choice(topics)) for tpl in TEMPLATES for t in topics]
    prompts += [tpl.format(c=c) for tpl in CODE_TEMPLATES for c in codes]
    prompts += [tpl.format(l=l) for tpl in LIST_TEMPLATES for l in lists]
    prompts += CHAT * 4  # short chats recur in practice; sampling makes the answers differ
    held = {p.lower() for p in HELD_OUT}
    prompts = [p for p in prompts if p.lower() not in held]
    rng.shuffle(prompts)
    return prompts
