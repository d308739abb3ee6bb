"""training/dialogue.py: the plays' speeches become User/Assistant conversations, in the chat template's form."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))

from dialogue import conversations, speeches
from tinyloop.server.protocol import ChatMessage
from tinyloop.server.template import render_chat

PLAY = """HAMLET.
Good morrow, friend.
How fares the king?

HORATIO.
Well, my lord,
and asks for you.

HAMLET.
Then I will go.

HAMLET.
Alone, I mean.

FIRST CLOWN.
Here lies the water; good.
"""


def test_speeches_join_their_lines_under_each_heading():
    assert speeches(PLAY) == [
        ("HAMLET", "Good morrow, friend. How fares the king?"),
        ("HORATIO", "Well, my lord, and asks for you."),
        ("HAMLET", "Then I will go."),
        ("HAMLET", "Alone, I mean."),
        ("FIRST CLOWN", "Here lies the water; good."),
    ]


def test_conversations_alternate_and_end_with_an_answer_in_the_templates_form():
    convos = list(conversations(PLAY, max_words=60, rng=random.Random(0)))
    assert convos[0].startswith("User: Good morrow, friend. How fares the king?\nAssistant: Well, my lord")
    for c in convos:
        lines = c.split("\n")
        assert [line.split(":")[0] for line in lines] == ["User", "Assistant"] * (len(lines) // 2)
    # The server writes a one-question chat as the training data's prefix, so the model continues it as trained.
    first = convos[0].split("\nAssistant:")[0]
    assert render_chat([ChatMessage(role="user", content=first[len("User: ") :])]) == first + "\nAssistant:"
    # A speaker answering themself is no exchange; an answer over the word limit is skipped.
    assert all("Then I will go.\nAssistant: Alone" not in c for c in convos)
    assert list(conversations(PLAY, max_words=4, rng=random.Random(0))) == [
        "User: Well, my lord, and asks for you.\nAssistant: Then I will go."
    ]


def test_conversations_are_what_the_default_models_template_writes():
    """Every exchange but the last ends at end-of-text inside the conversation (the last one's comes from the
    passage separator), exactly as training/chat_template.jinja closes every assistant turn."""
    from tinyloop.server.template import file_template

    source = (Path(__file__).resolve().parents[1] / "training" / "chat_template.jinja").read_text(encoding="utf-8")
    template = file_template(source, "", "<|endoftext|>")
    longer = PLAY + "\nHORATIO.\nWhere, my lord?\n\nMARCELLUS.\nTo the platform.\n"
    convos = list(conversations(longer, max_words=60, rng=random.Random(3)))
    assert any("<|endoftext|>\nUser: " in c for c in convos)  # some conversation has several exchanges
    for c in convos:
        messages = []
        for exchange in c.split("<|endoftext|>\n"):
            user, assistant = exchange.split("\nAssistant: ")
            messages += [
                ChatMessage(role="user", content=user.removeprefix("User: ")),
                ChatMessage(role="assistant", content=assistant),
            ]
        assert template.render(messages, None) == c + "<|endoftext|>\nAssistant:"
