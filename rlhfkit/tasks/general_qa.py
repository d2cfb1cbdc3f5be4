"""A small general-knowledge capability set: short questions with one plain, correct answer each.

The demo measures the alignment tax on it (`evaluation.capability`): how much worse each aligned policy predicts these
answers than the SFT model does, in nats per token. Written for rlhfkit; nothing in it comes from the demo's task.
"""

from __future__ import annotations

QA = [
    ('What is the capital of France?', 'The capital of France is Paris.'),
    ('How many days are there in a week?', 'There are seven days in a week.'),
    ('What do bees make?', 'Bees make honey and beeswax.'),
    ('What is the boiling point of water at sea level?', 'Water boils at 100 degrees Celsius at sea level.'),
    ('Which planet is known as the Red Planet?', 'Mars is known as the Red Planet.'),
    ('What is two plus three?', 'Two plus three is five.'),
    ('What colour is the sky on a clear day?', 'On a clear day the sky is blue.'),
    ('How many legs does a spider have?', 'A spider has eight legs.'),
    ('What is the largest ocean on Earth?', 'The Pacific Ocean is the largest ocean on Earth.'),
    ('What gas do plants take in from the air?', 'Plants take in carbon dioxide from the air.'),
    ('Who wrote Romeo and Juliet?', 'William Shakespeare wrote Romeo and Juliet.'),
    ('What is the opposite of hot?', 'The opposite of hot is cold.'),
    ('How many months are there in a year?', 'There are twelve months in a year.'),
    ('What is frozen water called?', 'Frozen water is called ice.'),
    ('What is the chemical symbol for gold?', 'The chemical symbol for gold is Au.'),
    ('Which animal is known as the king of the jungle?', 'The lion is often called the king of the jungle.'),
    ('What is ten minus four?', 'Ten minus four is six.'),
    ('What language is spoken in Spain?', 'Spanish is the main language spoken in Spain.'),
    ('What do you call a baby cat?', 'A baby cat is called a kitten.'),
    ('How many hours are in a day?', 'There are twenty-four hours in a day.'),
    ('What is the closest star to Earth?', 'The Sun is the closest star to Earth.'),
    ('Write a short greeting.', 'Hello! I hope you are having a good day.'),
    ('Name a primary colour.', 'Red is a primary colour.'),
    ('What is the plural of mouse?', 'The plural of mouse is mice.'),
]


def records(system_prompt: str | None = None) -> list[dict]:
    """The set as SFT records: chat messages (a system turn first when `system_prompt` is given)."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [{"messages": system + [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in QA]
