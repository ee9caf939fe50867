"""A fork and a join: three ideas generated side by side from one shared prefix, then a select
of the best. Small on purpose: it shows the request graph's shapes (examples/pictures)."""

from __future__ import annotations

from flowlang import assistant, gen, program, select, system, user


@program
def brainstorm(s, topic: str, max_new_tokens: int = 24):
    s += system("You are a helpful assistant who answers briefly.")
    s += user(f"Give one short idea about {topic}.")
    branches = s.fork(3)
    for i, branch in enumerate(branches):
        branch += assistant(
            f"Idea {i + 1}:", gen("idea", max_new_tokens=max_new_tokens, temperature=0)
        )
    s.join(branches)
    s += user("Which idea is best?")
    with s.assistant():
        s += "The best is idea"
        s += select("best", choices=[" 1", " 2", " 3"])
