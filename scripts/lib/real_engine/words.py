"""The word list shared by the tiny model's tokenizer (make_model.py) and the client (drive.py).

Every word is one token of the generated vocabulary, so a prompt of N words is about N prompt
tokens: token counts in the report read like word counts. The words are pronounceable
pseudo-words built from syllables in a fixed order, so the list is the same on every machine.
"""

CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"


def words(count=600):
    """`count` distinct lowercase pseudo-words of two or three syllables, in a fixed order."""
    syllables = [c + v for c in CONSONANTS for v in VOWELS]
    n = len(syllables)
    out = []
    for i in range(n * n):
        a, b = syllables[i % n], syllables[(i // n + 7 * i) % n]
        w = a + b + (syllables[(3 * i + 11) % n] if i % 3 == 2 else "")
        if w not in out:
            out.append(w)
        if len(out) == count:
            break
    return out
