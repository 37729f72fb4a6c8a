"""A reward for tests/integration/test_dapo_ranks.py: 1 when the response's first character's code is a multiple
of 4 (about a quarter of a random tiny model's responses), else 0, so a group of 4 is all 0 about a third of the
time: some groups are dropped, and a step often needs a second round."""


def first_character_reward(responses: list[str]) -> list[float]:
    return [1.0 if response and ord(response[0]) % 4 == 0 else 0.0 for response in responses]
