"""The programs SGLang's RadixAttention paper measured, as SGLang's repository writes them,
run on flowlang with only the import changed (`import flowlang.sglang as sgl`).

Each `@sgl.function` below follows SGLang's `benchmark/<name>/bench_sglang.py` (and
`benchmark/generative_agents/agent_functions.py`) of github.com/sgl-project/sglang
(Apache-2.0): the same prompt structure, gen/select names (including "air port code"),
max_tokens, stops, regexes, choices, forks and joins, roles and var scopes. Only the programs
are kept; SGLang's harness (argparse, dataset files, dump_state_text, select_sglang_backend)
is not. Where two benches define the same names (the two trees of thought, the two JSON
decoders), each program is built inside a function of its own, as SGLang's benches build some of
theirs inside `main()`.

The datasets (MMLU, HellaSwag, GSM-8K, HotpotQA traces, generative agents' call log, Wikipedia
city pages, essays, the llama2 paper, SGLang's line files) are not here: each program has a
seeded synthetic-input builder with the same shapes (k shots per subject, 20 shots and 4
endings, 5 shots and "Question"/"Answer", traces of thoughts/actions/observations, persona
memories, documents of a few thousand tokens, a body of lines split in 4, ...).
`PROGRAMS[name].make_args(num, scale)` returns the run_batch argument list: `num` instances
(the bench's default is `default_num`), `scale` multiplies the lengths of the texts (1.0: about
the bench's dataset lengths; tests use ~0.05). `run(spec, num, scale, backend)` runs one as
SGLang's bench runs it (run_batch with the bench's keywords; generative agents' calls one by
one with `.run(**kwargs).sync()`).
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import flowlang.sglang as sgl
from flowlang.sglang.lang.ir import REGEX_FLOAT, REGEX_INT, REGEX_STR

# ------------------------------------------------------------------------------------------
# synthetic text (seeded: the same seed, the same text)

WORDS = (
    "the of and a to in is was for on that with as by at from his her an were are which this "
    "be had it not or have its first one their new after also who they two has been other "
    "time city people year years during world state river school war music film party game "
    "team season house center church village company group system family water north south "
    "east west early later known built small large main national local public major common "
    "several between under since while where through against around among within without "
    "population station market bridge island harbor valley mountain forest garden library "
    "museum theater railway airport university college hospital council museum festival "
    "history culture economy industry trade farming energy transport science medicine art "
    "government election court law tax bank money price cost value number record report "
    "student teacher doctor worker farmer writer painter singer player leader member officer "
    "morning evening winter summer spring autumn rain snow wind storm light stone wood iron "
    "gold silver glass paper bread coffee tea wine fish horse bird tree flower road street "
    "walk run build open close carry write read study teach learn grow change move follow "
    "begin finish become remain include describe produce receive support develop increase"
).split()
NAMES = (
    "Isabella Klaus Maria Sam Jane Tom Abigail Carlos Hailey Rajiv Latoya Francisco Yuriko "
    "Arthur Ryan Eddy Mei John Wolfgang Giorgio Adam Jennifer Tamara Carmen Ayesha"
).split()
SURNAMES = (
    "Rodriguez Mueller Lopez Moore Anderson Watson Chen Gomez Chen Lin Williams Morris Moreno "
    "Yamamoto Burton Park Lin Lin Schulz Rossi Smith Moore Taylor Ortiz Khan"
).split()
CITIES = (
    "Lisbon Oslo Kyoto Lima Accra Perth Quito Dhaka Hanoi Riga Tunis Porto Bergen Osaka Cusco "
    "Cairo Delhi Dakar Seville Krakow Vilnius Tallinn Utrecht Leeds Hobart Nagoya Izmir"
).split()


def _rng(*key: Any) -> random.Random:
    return random.Random("|".join(map(str, key)))  # a str seed is stable across runs


def sentence(rng: random.Random, low: int = 8, high: int = 18) -> str:
    words = rng.choices(WORDS, k=rng.randint(low, high))
    return " ".join(words).capitalize() + "."


def paragraph(rng: random.Random, num_words: int) -> str:
    """About `num_words` words of sentences (at least one)."""
    out, count = [], 0
    while count < max(1, num_words):
        out.append(sentence(rng))
        count += len(out[-1].split())
    return " ".join(out)


def words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(low, high)))


def person(rng: random.Random) -> str:
    return rng.choice(NAMES) + " " + rng.choice(SURNAMES)


def _n(base: float, scale: float, least: int = 1) -> int:
    return max(least, round(base * scale))


# ------------------------------------------------------------------------------------------
# mmlu (benchmark/mmlu/bench_sglang.py): 5-shot per subject, max_new_tokens=1

SUBJECTS = [
    "abstract_algebra", "anatomy", "astronomy", "business_ethics", "clinical_knowledge",
    "college_biology", "college_chemistry", "college_computer_science", "college_mathematics",
    "college_medicine", "college_physics", "computer_security", "conceptual_physics",
    "econometrics", "electrical_engineering", "elementary_mathematics", "formal_logic",
    "global_facts", "high_school_biology", "high_school_chemistry", "high_school_geography",
    "high_school_macroeconomics", "high_school_physics", "high_school_psychology",
    "human_aging", "international_law", "jurisprudence", "logical_fallacies",
    "machine_learning", "management", "marketing", "medical_genetics", "miscellaneous",
    "moral_disputes", "nutrition", "philosophy", "prehistory", "professional_accounting",
    "professional_law", "professional_medicine", "public_relations", "security_studies",
    "sociology", "us_foreign_policy", "virology", "world_religions",
]  # fmt: skip
choices = ["A", "B", "C", "D"]
MMLU_QUESTIONS_PER_SUBJECT = 10


def format_subject(subject):
    l = subject.split("_")  # noqa: E741 - SGLang's code
    s = ""
    for entry in l:
        s += " " + entry
    return s


def format_example(df, idx, include_answer=True):
    """SGLang's format_example; `df` is a list of rows [question, A, B, C, D, answer]."""
    prompt = df[idx][0]
    k = len(df[idx]) - 2
    for j in range(k):
        prompt += "\n{}. {}".format(choices[j], df[idx][j + 1])  # noqa: UP032
    prompt += "\nAnswer:"
    if include_answer:
        prompt += " {}\n\n".format(df[idx][k + 1])  # noqa: UP032
    return prompt


def gen_prompt(train_df, subject, k=-1):
    prompt = "The following are multiple choice questions (with answers) about{}.\n\n".format(  # noqa: UP032, E501
        format_subject(subject)
    )
    if k == -1:
        k = len(train_df)
    for i in range(k):
        prompt += format_example(train_df, i)
    return prompt


def _mmlu_row(subject: str, split: str, i: int, scale: float) -> list[str]:
    rng = _rng("mmlu", subject, split, i)
    question = paragraph(rng, _n(40, scale, 4)).rstrip(".") + "?"
    options = [words(rng, 1, _n(8, scale)) for _ in choices]
    return [question, *options, rng.choice(choices)]


def mmlu_args(num: int, scale: float = 1.0) -> list[dict]:
    """`num` questions, 10 per subject (subjects in order), each with its subject's 5-shot
    examples (dev rows) in front, as SGLang's bench builds them (`ntrain` 5)."""
    arguments = []
    for n in range(num):
        subject = SUBJECTS[(n // MMLU_QUESTIONS_PER_SUBJECT) % len(SUBJECTS)]
        dev_df = [_mmlu_row(subject, "dev", i, scale) for i in range(5)]
        test_df = [_mmlu_row(subject, "test", n % MMLU_QUESTIONS_PER_SUBJECT, scale)]
        few_shot_examples = gen_prompt(dev_df, subject, 5)
        arguments.append(
            {"examples": few_shot_examples, "question": format_example(test_df, 0, False)}
        )
    return arguments


@sgl.function
def few_shot_mmlu(s, examples, question):
    s += examples + question + sgl.gen("answer")


# ------------------------------------------------------------------------------------------
# hellaswag (benchmark/hellaswag/bench_sglang.py): 20 shots, select among 4 endings

HELLASWAG_SHOTS = 20


def hellaswag_line(i: int) -> dict:
    rng = _rng("hellaswag", i)
    return {
        "activity_label": words(rng, 1, 3).capitalize(),
        "ctx": paragraph(rng, 30),
        "endings": [sentence(rng, 6, 16).lower() for _ in range(4)],
        "label": rng.randrange(4),
    }


def get_one_example(lines, i, include_answer):
    ret = lines[i]["activity_label"] + ": " + lines[i]["ctx"] + " "
    if include_answer:
        ret += lines[i]["endings"][lines[i]["label"]]
    return ret


def get_few_shot_examples(lines, k):
    ret = ""
    for i in range(k):
        ret += get_one_example(lines, i, True) + "\n\n"
    return ret


def _hellaswag():
    lines = [hellaswag_line(i) for i in range(HELLASWAG_SHOTS)]
    few_shot_examples = get_few_shot_examples(lines, HELLASWAG_SHOTS)

    @sgl.function
    def few_shot_hellaswag(s, question, choices):
        s += few_shot_examples + question
        s += sgl.select("answer", choices=choices)

    return few_shot_hellaswag


few_shot_hellaswag = _hellaswag()


def hellaswag_args(num: int, scale: float = 1.0) -> list[dict]:
    """As SGLang's bench: the questions are lines[:num] of the set the 20 shots come from
    (`scale` does not change HellaSwag's lengths: its contexts are short)."""
    lines = [hellaswag_line(i) for i in range(num)]
    return [{"question": get_one_example(lines, i, False), "choices": lines[i]["endings"]}
            for i in range(num)]  # fmt: skip


# ------------------------------------------------------------------------------------------
# gsm8k (benchmark/gsm8k/bench_sglang.py): 5 shots, max_tokens=512, stop="Question"...

GSM8K_SHOTS = 5


def gsm8k_line(i: int, scale: float = 1.0) -> dict:
    rng = _rng("gsm8k", i)
    name = rng.choice(NAMES)
    a, b, c = rng.randint(2, 60), rng.randint(2, 60), rng.randint(2, 9)
    question = (
        f"{name} has {a} {rng.choice(WORDS)} and buys {b} more. "
        + paragraph(rng, _n(25, scale, 3))
        + f" If {name} then shares them among {c} friends, how many does each friend get?"
    )
    steps = [
        f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} in all.",
        paragraph(rng, _n(20, scale, 3)),
        f"Each friend gets {a + b} / {c} = <<{a + b}/{c}={(a + b) // c}>>{(a + b) // c}.",
    ]
    return {"question": question, "answer": "\n".join(steps) + f"\n#### {(a + b) // c}"}


def gsm8k_get_one_example(lines, i, include_answer):
    ret = "Question: " + lines[i]["question"] + "\nAnswer:"
    if include_answer:
        ret += " " + lines[i]["answer"]
    return ret


def gsm8k_get_few_shot_examples(lines, k):
    ret = ""
    for i in range(k):
        ret += gsm8k_get_one_example(lines, i, True) + "\n\n"
    return ret


def _gsm8k():
    lines = [gsm8k_line(i) for i in range(GSM8K_SHOTS)]
    few_shot_examples = gsm8k_get_few_shot_examples(lines, GSM8K_SHOTS)

    # fmt: off
    @sgl.function
    def few_shot_gsm8k(s, question):
        s += few_shot_examples + question
        s += sgl.gen(
            "answer", max_tokens=512, stop=["Question", "Assistant:", "<|separator|>"]
        )

    # fmt: on
    return few_shot_gsm8k


few_shot_gsm8k = _gsm8k()


def gsm8k_args(num: int, scale: float = 1.0) -> list[dict]:
    """lines[:num] of the set the 5 shots come from, as SGLang's bench takes them."""
    lines = [gsm8k_line(i, scale if i >= GSM8K_SHOTS else 1.0) for i in range(num)]
    return [{"question": gsm8k_get_one_example(lines, i, False)} for i in range(num)]


# ------------------------------------------------------------------------------------------
# tree_of_thought_v0 (benchmark/tree_of_thought_v0/bench_sglang.py): 3 x 3 x 3 forks


def _tree_of_thought_v0():
    # Use a low temp to make the results more deterministic and the comparison more fair.
    temp = 0.3

    def propose_plan(s, question, num_branches):
        s += sgl.user(
            """Please generate a high-level plan for solving the following question. As the first step, just say what method and idea you will use to solve the question. You can reorganize the information in the question. Do not do the actual calculation. Keep your response concise and within 80 words. Question: """  # noqa: E501
            + question
        )
        forks = s.fork(num_branches)
        forks += sgl.assistant(sgl.gen("plan", max_tokens=256, temperature=temp))
        return forks

    def execute_plan(s, num_branches):
        s += sgl.user(
            """The plan looks good! Now, use real numbers and do the calculation. Please solve the question step-by-step according to the high-level plan. Give me the final answer. Make your response short."""  # noqa: E501
        )
        forks = s.fork(num_branches)
        forks += sgl.assistant(sgl.gen("answer", max_tokens=256, temperature=temp))
        return forks

    def reflect_solution(s, num_branches):
        s += sgl.user(
            """Okay. Now you evaluate your own solution and give it a score on a scale of 1 to 5. Please do rigorous check of the correctness."""  # noqa: E501
        )
        forks = s.fork(num_branches)
        forks += sgl.assistant(sgl.gen("score", max_tokens=256, temperature=temp))
        return forks

    @sgl.function
    def tree_search(s, question, num_branches):
        forks_to_join = []

        plan_forks = propose_plan(s, question, num_branches)
        forks_to_join.append(plan_forks)

        sol_states = []
        for plan in plan_forks:
            forks = execute_plan(plan, num_branches)
            forks_to_join.append(forks)
            sol_states.extend(forks)

        for sol in sol_states:
            forks = reflect_solution(sol, num_branches)
            forks_to_join.append(forks)

        for f in reversed(forks_to_join):
            f.join()

    return tree_search


tree_search_v0 = _tree_of_thought_v0()


def tree_of_thought_args(num: int, scale: float = 1.0, num_branches: int = 3) -> list[dict]:
    """GSM-8K questions (the bench reads test.jsonl), `num_branches` per level."""
    return [{"question": gsm8k_line(1000 + i, scale)["question"], "num_branches": num_branches}
            for i in range(num)]  # fmt: skip


# ------------------------------------------------------------------------------------------
# tree_of_thought_deep (benchmark/tree_of_thought_deep/bench_sglang.py): 2 x 2 x 2 x 2 forks


def _tree_of_thought_deep():
    # Use a low temp to make the results more deterministic and the comparison more fair.
    temp = 0.001

    def propose_plan(s, question, num_branches):
        s += sgl.user(
            """Please generate a high-level plan for solving the following question. As the first step, just say what method and idea you will use to solve the question. You can reorganize the information in the question. Do not do the actual calculation. Keep your response concise and within 80 words. Question: """  # noqa: E501
            + question
        )
        forks = s.fork(num_branches)
        forks += sgl.assistant(sgl.gen("plan", max_tokens=256, temperature=temp))
        return forks

    def execute_plan(s, num_branches):
        s += sgl.user(
            """The plan looks good! Now, use real numbers and do the calculation. Please solve the question step-by-step according to the high-level plan. Give me the final answer. Make your response short."""  # noqa: E501
        )
        forks = s.fork(num_branches)
        forks += sgl.assistant(sgl.gen("answer", max_tokens=256, temperature=temp))
        return forks

    def reflect_solution(s, num_branches):
        s += sgl.user(
            """Okay. Now, evaluate your own solution and give it a score on a scale of 1 to 5. Please do rigorous check of the correctness."""  # noqa: E501
        )
        forks = s.fork(num_branches)
        forks += sgl.assistant(sgl.gen("score", max_tokens=256, temperature=temp))
        return forks

    def get_final_answer(s, num_branches):
        s += sgl.user(
            """Based on your reflection, do you change your mind? Now, give me the final answer after careful consideration."""  # noqa: E501
        )
        forks = s.fork(num_branches)
        forks += sgl.assistant(sgl.gen("final_answer", max_tokens=256, temperature=temp))
        return forks

    @sgl.function
    def tree_search(s, question, num_branches):
        plan_forks = propose_plan(s, question, num_branches)

        sol_states = []
        for plan in plan_forks:
            forks = execute_plan(plan, num_branches)
            sol_states.extend(forks)

        ref_states = []
        for sol in sol_states:
            forks = reflect_solution(sol, num_branches)
            ref_states.extend(forks)

        solutions = []
        for sol in ref_states:
            forks = get_final_answer(sol, num_branches)
            solutions.append(forks)
        solutions = [[s.text() for s in forks] for forks in solutions]

        return solutions

    return tree_search


tree_search_deep = _tree_of_thought_deep()


# ------------------------------------------------------------------------------------------
# react (benchmark/react/bench_sglang.py): a replayed ReAct trace, a fork(1) per thought

REACT_PREAMBLE = """Solve a question answering task with interleaving Thought, Action, Observation steps. Thought can reason about the current situation, and Action can be three types: 
(1) Search[entity], which searches the exact entity on Wikipedia and returns the first paragraph if it exists. If not, it will return some similar entities to search.
(2) Lookup[keyword], which returns the next sentence containing keyword in the current passage.
(3) Finish[answer], which returns the answer and finishes the task.
Here are some examples.
Question: What is the elevation range for the area that the eastern sector of the Colorado orogeny extends into?
Thought 1: I need to search Colorado orogeny, find the area that the eastern sector of the Colorado orogeny extends into, then find the elevation range of the area.
Action 1: Search[Colorado orogeny]
Observation 1: The Colorado orogeny was an episode of mountain building (an orogeny) in Colorado and surrounding areas.
Thought 2: It does not mention the eastern sector. So I need to look up eastern sector.
Action 2: Lookup[eastern sector]
Observation 2: (Result 1 / 1) The eastern sector extends into the High Plains and is called the Central Plains orogeny.
Thought 3: The eastern sector of Colorado orogeny extends into the High Plains. So I need to search High Plains and find its elevation range.
Action 3: Search[High Plains]
Observation 3: High Plains refers to one of two distinct land regions:
Thought 4: I need to instead search High Plains (United States).
Action 4: Search[High Plains (United States)]
Observation 4: The High Plains are a subregion of the Great Plains. From east to west, the High Plains rise in elevation from around 1,800 to 7,000 ft (550 to 2,130 m).[3]
Thought 5: High Plains rise in elevation from around 1,800 to 7,000 ft, so the answer is 1,800 to 7,000 ft.
Action 5: Finish[1,800 to 7,000 ft]
Question: Musician and satirist Allie Goertz wrote a song about the "The Simpsons" character Milhouse, who Matt Groening named after who?
Thought 1: The question simplifies to "The Simpsons" character Milhouse is named after who. I only need to search Milhouse and find who it is named after.
Action 1: Search[Milhouse]
Observation 1: Milhouse Mussolini Van Houten is a recurring character in the Fox animated television series The Simpsons voiced by Pamela Hayden and created by Matt Groening.
Thought 2: The paragraph does not tell who Milhouse is named after, maybe I can look up "named after".
Action 2: Lookup[named after]
Observation 2: (Result 1 / 1) Milhouse was named after U.S. president Richard Nixon, whose middle name was Milhous. 
Thought 3: Milhouse was named after U.S. president Richard Nixon, so the answer is Richard Nixon.
Action 3: Finish[Richard Nixon]
Question: Which documentary is about Finnish rock groups, Adam Clayton Powell or The Saimaa Gesture?
Thought 1: I need to search Adam Clayton Powell and The Saimaa Gesture, and find which documentary is about Finnish rock groups.
Action 1: Search[Adam Clayton Powell]
Observation 1: Could not find [Adam Clayton Powell]. Similar: ['Adam Clayton Powell III', 'Seventh Avenue (Manhattan)', 'Adam Clayton Powell Jr. State Office Building', 'Isabel Washington Powell', 'Adam Powell', 'Adam Clayton Powell (film)', 'Giancarlo Esposito'].
Thought 2: To find the documentary, I can search Adam Clayton Powell (film).
Action 2: Search[Adam Clayton Powell (film)]
Observation 2: Adam Clayton Powell is a 1989 American documentary film directed by Richard Kilberg.
The film is about the rise and fall of influential African-American politician Adam Clayton Powell Jr.[3][4] It was later aired as part of the PBS series The American Experience.
Thought 3: Adam Clayton Powell (film) is a documentary about an African-American politician, not Finnish rock groups. So the documentary about Finnish rock groups must instead be The Saimaa Gesture.
Action 3: Finish[The Saimaa Gesture]
Question: What profession does Nicholas Ray and Elia Kazan have in common?
Thought 1: I need to search Nicholas Ray and Elia Kazan, find their professions, then find the profession they have in common.
Action 1: Search[Nicholas Ray]
Observation 1: Nicholas Ray (born Raymond Nicholas Kienzle Jr., August 7, 1911 – June 16, 1979) was an American film director, screenwriter, and actor best known for the 1955 film Rebel Without a Cause.
Thought 2: Professions of Nicholas Ray are director, screenwriter, and actor. I need to search Elia Kazan next and find his professions.
Action 2: Search[Elia Kazan]
Observation 2: Elia Kazan was an American film and theatre director, producer, screenwriter and actor.
Thought 3: Professions of Elia Kazan are director, producer, screenwriter, and actor. So profession Nicholas Ray and Elia Kazan have in common is director, screenwriter, and actor.
Action 3: Finish[director, screenwriter, actor]
Question: Which magazine was started first Arthur's Magazine or First for Women?
Thought 1: I need to search Arthur's Magazine and First for Women, and find which was started first.
Action 1: Search[Arthur's Magazine]
Observation 1: Arthur's Magazine (1844-1846) was an American literary periodical published in Philadelphia in the 19th century. 
Thought 2: Arthur's Magazine was started in 1844. I need to search First for Women next.
Action 2: Search[First for Women]
Observation 2: First for Women is a woman's magazine published by Bauer Media Group in the USA.[1] The magazine was started in 1989. 
Thought 3: First for Women was started in 1989. 1844 (Arthur's Magazine) < 1989 (First for Women), so Arthur's Magazine was started first.
Action 3: Finish[Arthur's Magazine]
Question: Were Pavel Urysohn and Leonid Levin known for the same type of work?
Thought 1: I need to search Pavel Urysohn and Leonid Levin, find their types of work, then find if they are the same.
Action 1: Search[Pavel Urysohn]
Observation 1: Pavel Samuilovich Urysohn (February 3, 1898 â August 17, 1924) was a Soviet mathematician who is best known for his contributions in dimension theory.
Thought 2: Pavel Urysohn is a mathematician. I need to search Leonid Levin next and find its type of work.
Action 2: Search[Leonid Levin]
Observation 2: Leonid Anatolievich Levin is a Soviet-American mathematician and computer scientist. 
Thought 3: Leonid Levin is a mathematician and computer scientist. So Pavel Urysohn and Leonid Levin have the same type of work. 
Action 3: Finish[yes]
"""  # noqa: E501, W291 - SGLang's prompt, its trailing spaces included


@sgl.function
def webthink(s, question, triplets):
    s += REACT_PREAMBLE + question
    for i in range(1, len(triplets) + 2):
        s += "Thought " + str(i) + ":"
        # NOTE: This is an implementation for replaying a given trace for benchmark purposes. It is not an actual ReAct agent implementation.  # noqa: E501
        ss = s.fork(1)
        ss[0] += sgl.gen(name="thought_action", max_tokens=200, stop="Observation")
        ss.join()
        # to verify the correctness of output, this should be collected
        # print(ss[0]["thought_action"])
        if i > len(triplets):
            break
        s += (triplets[i - 1]["thought"] + "\nAction " + str(i) + ":" +
              triplets[i - 1]["action"] + "\nObservation " + str(i) + ":" +
              triplets[i - 1]["observation"] + "\n")  # fmt: skip


def react_args(num: int, scale: float = 1.0) -> list[dict]:
    """HotpotQA questions with a recorded trace of 2-5 (thought, action, observation) steps,
    observations of a Wikipedia paragraph's length."""
    arguments = []
    for n in range(num):
        rng = _rng("react", n)
        question = f"Question: {paragraph(rng, 12).rstrip('.')}?\n"
        triplets = []
        steps = rng.randint(2, 5)
        for i in range(steps):
            entity = " ".join(rng.choices(WORDS, k=2)).title()
            last = i == steps - 1
            triplets.append({
                "thought": " " + paragraph(rng, _n(25, scale, 3)),
                "action": f" Finish[{entity}]" if last else f" Search[{entity}]",
                "observation": " " + ("Episode finished, reward = 1" if last
                                      else paragraph(rng, _n(60, scale, 4))),
            })  # fmt: skip
        arguments.append({"question": question, "triplets": triplets})
    return arguments


# ------------------------------------------------------------------------------------------
# generative_agents (benchmark/generative_agents/agent_functions.py): the five agent functions
# with ~70% of the LLM calls, called one by one with `.run(**arg)`


@sgl.function
def poignancy_event(s, persona_name, persona_iss, event):
    s += "Here is a brief description of " + persona_name + ".\n"
    s += persona_iss + "\n"
    s += "On the scale of 1 to 10, where 1 is purely mundane (e.g., brushing teeth, making bed) and 10 is extremely poignant (e.g., a break up, college acceptance), rate the likely poignancy of the following event for"  # noqa: E501
    s += persona_name + ".\n\n"
    s += "Event: " + event
    s += "Rate (return a number between 1 to 10):"
    s += sgl.gen(name="Rate", max_tokens=2)


@sgl.function
def generate_event_triple(s, persona_name, action):
    s += """Task: Turn the input into (subject, predicate, object).
Input: Sam Johnson is eating breakfast. 
Output: (Dolores Murphy, eat, breakfast) 
--- 
Input: Joon Park is brewing coffee.
Output: (Joon Park, brew, coffee)
---
Input: Jane Cook is sleeping. 
Output: (Jane Cook, is, sleep)
---
Input: Michael Bernstein is writing email on a computer. 
Output: (Michael Bernstein, write, email)
---
Input: Percy Liang is teaching students in a classroom. 
Output: (Percy Liang, teach, students)
---
Input: Merrie Morris is running on a treadmill. 
Output: (Merrie Morris, run, treadmill)
---"""  # noqa: W291 - SGLang's prompt, its trailing spaces included
    s += persona_name + "is" + action + ".\n"
    s += "(" + persona_name + ","
    s += sgl.gen(name="Triple", max_tokens=20, stop=")")


@sgl.function
def generate_pronunciatio(s, action):
    s += "Convert an action description to an emoji (important: use two or less emojis).\n"
    s += "Action description: " + action + ".\n"
    s += "Emoji:" + sgl.gen(name="Emoji", max_tokens=6)


@sgl.function
def action_location_sector(
    s,
    persona_name,
    living_sector,
    living_sector_areas,
    current_sector,
    current_sector_areas,
    daily_plan,
    sector_options,
    current_action,
    next_action,
):
    s += """Task -- choose an appropriate area  from the area options for a task at hand. 
Sam Kim lives in {Sam Kim's house} that has Sam Kim's room, bathroom, kitchen.
Sam Kim is currently in {Sam Kim's house} that has Sam Kim's room, bathroom, kitchen. 
Area options: {Sam Kim's house, The Rose and Crown Pub, Hobbs Cafe, Oak Hill College, Johnson Park, Harvey Oak Supply Store, The Willows Market and Pharmacy}.
* Stay in the current area if the activity can be done there. Only go out if the activity needs to take place in another place.
* Must be one of the "Area options," verbatim.
For taking a walk, Sam Kim should go to the following area: {Johnson Park}
---
Jane Anderson lives in {Oak Hill College Student Dormatory} that has Jane Anderson's room.
Jane Anderson is currently in {Oak Hill College} that has a classroom, library
Area options: {Oak Hill College Student Dormatory, The Rose and Crown Pub, Hobbs Cafe, Oak Hill College, Johnson Park, Harvey Oak Supply Store, The Willows Market and Pharmacy}. 
* Stay in the current area if the activity can be done there. Only go out if the activity needs to take place in another place.
* Must be one of the "Area options," verbatim.
For eating dinner, Jane Anderson should go to the following area: {Hobbs Cafe}
---"""  # noqa: E501, W291 - SGLang's prompt, its trailing spaces included
    s += (persona_name + " lives in " + living_sector + " that has " +
          living_sector_areas + ".\n")  # fmt: skip
    s += (persona_name + " is currently in " + current_sector + " that has " +
          current_sector_areas + ".\n")  # fmt: skip
    s += daily_plan + ".\n"
    s += "Area options: " + sector_options + ".\n"
    s += """* Stay in the current area if the activity can be done there. Only go out if the activity needs to take place in another place.
* Must be one of the "Area options," verbatim.\n"""  # noqa: E501
    s += (persona_name + " is " + current_action + ". For " + next_action +
          ", " + persona_name + " should go to the following area: {")  # fmt: skip
    s += sgl.gen(name="Location", max_tokens=10, stop="}")


@sgl.function
def action_location_object(s, persona_name, target_sector, target_sector_areas,
                           current_action, next_action):  # fmt: skip
    s += """
Jane Anderson is in kitchen in Jane Anderson's house.
Jane Anderson is going to Jane Anderson's house that has the following areas: {kitchen,  bedroom, bathroom}
Stay in the current area if the activity can be done there. Never go into other people's rooms unless necessary.
For cooking, Jane Anderson should go to the following area in Jane Anderson's house:
Answer: {kitchen}
---
Tom Watson is in common room in Tom Watson's apartment. 
Tom Watson is going to Hobbs Cafe that has the following areas: {cafe}
Stay in the current area if the activity can be done there. Never go into other people's rooms unless necessary.
For getting coffee, Tom Watson should go to the following area in Hobbs Cafe:
Answer: {cafe}
---"""  # noqa: E501, W291 - SGLang's prompt, its trailing spaces included
    s += (persona_name + " is going to " + target_sector +
          " that has the following areas: {" + target_sector_areas + "}\n")  # fmt: skip
    s += """* Stay in the current area if the activity can be done there. 
* NEVER go into other people's rooms unless necessary."""  # noqa: W291
    s += (persona_name + " is " + current_action + ". For " + next_action +
          ", " + persona_name + "should go to the following area in " +
          target_sector)  # fmt: skip
    s += " (MUST pick one of {" + target_sector_areas + "}):\n"
    s += "Answer: {" + sgl.gen(name="Area", max_tokens=5, stop="}")


AGENT_FUNCTIONS = {
    "poignancy_event": poignancy_event,
    "generate_event_triple": generate_event_triple,
    "generate_pronunciatio": generate_pronunciatio,
    "action_location_sector": action_location_sector,
    "action_location_object": action_location_object,
}
SECTORS = {
    "Hobbs Cafe": "cafe, kitchen, counter",
    "Oak Hill College": "classroom, library, common room",
    "Johnson Park": "park garden, lake, playground",
    "The Rose and Crown Pub": "pub, bar counter, kitchen",
    "Harvey Oak Supply Store": "supply store, storage",
    "The Willows Market and Pharmacy": "store, pharmacy counter",
}
AGENT_PERSONAS = 3  # the calls cycle over this many agents (each with its own memories)


def _persona(p: int, scale: float) -> dict:
    rng = _rng("persona", p)
    name = NAMES[p % len(NAMES)] + " " + SURNAMES[p % len(SURNAMES)]
    home = f"{name}'s apartment"
    return {
        "persona_name": name,
        "persona_iss": (  # the identity stable set: who the agent is, its memories and plans
            f"Name: {name}\nAge: {rng.randint(20, 70)}\nInnate traits: {words(rng, 3, 3)}\n"
            f"Learned traits: {paragraph(rng, _n(60, scale, 5))}\n"
            f"Currently: {paragraph(rng, _n(60, scale, 5))}\n"
            f"Lifestyle: {paragraph(rng, _n(40, scale, 5))}\n"
            f"Daily plan requirement: {paragraph(rng, _n(40, scale, 5))}"
        ),
        "home": home,
        "home_areas": f"{name}'s room, bathroom, kitchen",
        "daily_plan": f"In general, {name} " + paragraph(rng, _n(50, scale, 5)).lower(),
    }


def generative_agents_args(num: int, scale: float = 1.0) -> list[dict]:
    """`num` agent calls, as SGLang's agent_calls.jsonl lines: {function name: its kwargs},
    the five functions in turn, for AGENT_PERSONAS agents in turn."""
    personas = [_persona(p, scale) for p in range(AGENT_PERSONAS)]
    options = "{" + ", ".join(["{home}", *SECTORS]) + "}"
    calls = []
    for n in range(num):
        rng = _rng("agent-call", n)
        persona = personas[n % AGENT_PERSONAS]
        name = persona["persona_name"]
        action, next_action = words(rng, 3, 6), words(rng, 3, 6)
        target = rng.choice(list(SECTORS))
        kind = list(AGENT_FUNCTIONS)[(n // AGENT_PERSONAS) % len(AGENT_FUNCTIONS)]
        if kind == "poignancy_event":
            kwargs = {"persona_name": name, "persona_iss": persona["persona_iss"],
                      "event": f"{name} is {action}"}  # fmt: skip
        elif kind == "generate_event_triple":
            kwargs = {"persona_name": name, "action": action}
        elif kind == "generate_pronunciatio":
            kwargs = {"action": action}
        elif kind == "action_location_sector":
            kwargs = {
                "persona_name": name,
                "living_sector": "{" + persona["home"] + "}",
                "living_sector_areas": persona["home_areas"],
                "current_sector": "{" + persona["home"] + "}",
                "current_sector_areas": persona["home_areas"],
                "daily_plan": persona["daily_plan"],
                "sector_options": options.replace("{home}", persona["home"]),
                "current_action": action,
                "next_action": next_action,
            }
        else:
            kwargs = {"persona_name": name, "target_sector": target,
                      "target_sector_areas": SECTORS[target], "current_action": action,
                      "next_action": next_action}  # fmt: skip
        calls.append({kind: kwargs})
    return calls


# ------------------------------------------------------------------------------------------
# json_decode_regex (benchmark/json_decode_regex/bench_sglang.py): regex gens in a var scope

REGEX_LIST = r"\[(" + REGEX_STR + ", )*" + REGEX_STR + r"\]"


def _json_decode_regex():
    # fmt: off
    @sgl.function
    def json_warm_up(s):
        s += "The information about Hogwarts is in the following JSON format.\n"
        with s.var_scope("json_output"):
            s += "{\n"
            s += '  "name": ' + sgl.gen("name", max_tokens=8, regex=REGEX_STR + ",") + "\n"
            s += '  "country": ' + sgl.gen("country", max_tokens=8, regex=REGEX_STR + ",") + "\n"
            s += '  "latitude": ' + sgl.gen("latitude", max_tokens=8, regex=REGEX_FLOAT + ",") + "\n"  # noqa: E501
            s += '  "population": ' + sgl.gen("population", max_tokens=8, regex=REGEX_INT + ",") + "\n"  # noqa: E501
            s += '  "top 3 landmarks": ' + sgl.gen( "landmarks", max_tokens=24, regex=REGEX_LIST) + "\n"  # noqa: E501
            s += "}\n"
        print(f'The warmp up json result is:\n{s["json_output"]}')
    # fmt: on

    # fmt: off
    @sgl.function
    def json_decode(s, document):
        s += "Please extract the information of a city from the following wikipedia page.\n"
        s += "Page begin.\n" + document + "Page end.\n"
        s += "Here is the name, country, and symbol of the city in JSON format.\n"
        with s.var_scope("json_output"):
            s += "{\n"
            s += '  "name": ' + sgl.gen("name", max_tokens=8, regex=REGEX_STR + ",") + "\n"
            s += '  "country": ' + sgl.gen("country", max_tokens=8, regex=REGEX_STR + ",") + "\n"
            s += '  "latitude": ' + sgl.gen("latitude", max_tokens=8, regex=REGEX_FLOAT + ",") + "\n"  # noqa: E501
            s += '  "population": ' + sgl.gen("population", max_tokens=8, regex=REGEX_INT + ",") + "\n"  # noqa: E501
            s += '  "top 3 landmarks": ' + sgl.gen( "landmarks", max_tokens=24, regex=REGEX_LIST) + "\n"  # noqa: E501
            s += "}\n"
    # fmt: on

    return json_warm_up, json_decode


json_warm_up, json_decode_regex = _json_decode_regex()


def city_page(i: int, num_words: int) -> str:
    """A Wikipedia-like page about a city: a lead, then sections (no dataset here)."""
    rng = _rng("city", i)
    city = CITIES[i % len(CITIES)]
    out = [f"{city} is a city in {rng.choice(WORDS).title()}. " + paragraph(rng, 40)]
    sections = ["History", "Geography", "Climate", "Demographics", "Economy", "Culture",
                "Transport", "Education", "Sport", "Landmarks"]  # fmt: skip
    count = len(out[0].split())
    while count < num_words:
        head = sections[len(out) % len(sections)]
        body = paragraph(rng, 80)
        out.append(f"== {head} ==\n{body}")
        count += len(body.split()) + 2
    return "\n".join(out) + "\n"


def json_decode_regex_args(num: int, scale: float = 1.0) -> list[dict]:
    """City pages of ~1,500 words at scale 1 (SGLang's questions.jsonl: Wikipedia pages)."""
    return [{"document": city_page(i, _n(1500, scale, 20))} for i in range(num)]


# ------------------------------------------------------------------------------------------
# json_jump_forward (benchmark/json_jump_forward/bench_sglang.py, mode "character"): one
# regex of a whole JSON object, the constant parts jumped over

# there are some FSM bugs with json regex converted from pydantic model
# here use a string regex instead
# regex_string = build_regex_from_object(HarryPoterRole)
character_regex = (
    r"""\{\n"""
    + r"""    "name": "[\w\d\s]{1,16}",\n"""
    + r"""    "house": "(Gryffindor|Slytherin|Ravenclaw|Hufflepuff)",\n"""
    + r"""    "blood status": "(Pure-blood|Half-blood|Muggle-born)",\n"""
    + r"""    "occupation": "(student|teacher|auror|ministry of magic|death eater|order of the phoenix)",\n"""  # noqa: E501
    + r"""    "wand": \{\n"""
    + r"""        "wood": "[\w\d\s]{1,16}",\n"""
    + r"""        "core": "[\w\d\s]{1,16}",\n"""
    + r"""        "length": [0-9]{1,2}\.[0-9]{0,2}\n"""
    + r"""    \},\n"""
    + r"""    "alive": "(Alive|Deceased)",\n"""
    + r"""    "patronus": "[\w\d\s]{1,16}",\n"""
    + r"""    "bogart": "[\w\d\s]{1,16}"\n"""
    + r"""\}"""
)


# fmt: off
@sgl.function
def character_gen(s, name):
    s += name + " is a character in Harry Potter. Please fill in the following information about this character.\n"  # noqa: E501
    s += sgl.gen("json_output", max_tokens=256, regex=character_regex)
# fmt: on


def json_jump_forward_args(num: int, scale: float = 1.0) -> list[dict]:
    """Character names, one a line as in SGLang's dataset.txt (`scale` has no effect)."""
    return [{"name": person(_rng("character", i))} for i in range(num)]


# ------------------------------------------------------------------------------------------
# multi_turn_chat (benchmark/multi_turn_chat/bench_sglang.py + data_gen.py): 4 turns of
# 256-512 random characters, 4-8 new tokens each, ignore_eos


@sgl.function
def multi_turns(s, qas):
    for qa in qas:
        s += qa["prompt"]
        s += sgl.gen(max_tokens=qa["new_tokens"], ignore_eos=True)


def multi_turn_chat_args(
    num: int, scale: float = 1.0, turns: int = 4, long: bool = False
) -> list[dict]:
    """SGLang's data_gen.gen_arguments: `turns` turns of a 256-512 long prompt of random
    letters and digits (data_gen grows it to that many tokens; here: that many characters,
    about half as many tokens) and 4-8 new tokens (256-512 with `long`)."""
    rng = _rng("multi_turn_chat")
    cha_set = string.ascii_letters + string.digits
    min_len_a, max_len_a = (256, 512) if long else (4, 8)
    multi_qas = [{"qas": []} for _ in range(num)]
    for i in range(num):
        qas = multi_qas[i]["qas"]
        for _ in range(turns):
            prompt_len = rng.randint(_n(256, scale), _n(512, scale))
            new_tokens = rng.randint(min_len_a, max_len_a)
            qas.append({"prompt": "".join(rng.choices(cha_set, k=prompt_len)),
                        "new_tokens": new_tokens})  # fmt: skip
    return multi_qas


# ------------------------------------------------------------------------------------------
# llm_judge (benchmark/llm_judge/bench_sglang.py): fork(6) judgements, then a score

system_prompt = "Please serve as an impartial judge and rigorously evaluate the quality of the following article. Apply the most stringent standards possible, showing no leniency."  # noqa: E501

dimension_prompts = [
    "Content: This refers to the essences of the essay. The substance should be well researched, accurate, relevant to the topic and should show a thorough understanding of the subject. The essay should also reflect a clear goal or purpose.",  # noqa: E501
    "Organization and Structure: An essay needs to be properly structured with a clear introduction, body, and conclusion. The essay should flow naturally, with one paragraph leading seamlessly into the next.",  # noqa: E501
    "Argument and Analysis: The argument made in the essay should be logical, coherent and clearly articulated. Each point made should be backed up by solid evidence and thorough analysis.",  # noqa: E501
    "Clarity and Precision: The essay should be written in a clear and concise manner. The points made should be easily understood by the reader. The language used should also be precise and unambiguous.",  # noqa: E501
    "Grammar and Punctuation: Proper use of grammar and punctuation is vital in an academic essay. Errors in grammar and punctuation not only distract the reader but can also negatively impact the meaning and interpretation of the content.",  # noqa: E501
    "Referencing and Citation: An essay should contain proper citations and references for all sources used. This not only prevents accusations of plagiarism but also gives credit to the authors of the works that have contributed to the essay. The citation should adhere to a specific format as required by the academic institution or specified by the professor.",  # noqa: E501
]


# fmt: off
@sgl.function
def multi_dimension_judge(s, article):
    s += system_prompt
    s += "\n```\n" + article + "\n```\n\n"

    forks = s.fork(len(dimension_prompts))
    for i in range(len(dimension_prompts)):
        forks[i] += (
            "USER: Please judge the quality based on the following metric. "
            + dimension_prompts[i]
            + " Please provide a single-paragraph judgement. "
            + "Focus on the provided metric and do not say other things. "
            'End your judgement paragraph with the word "END"\nJUDGE:'
        )
        forks[i] += sgl.gen("judgement", max_tokens=256, stop="END")
    forks.join()

    s += "I will judge the quality based on the following metrics.\n"
    for i in range(len(dimension_prompts)):
        s += (
            dimension_prompts[i].split(":")[0]
            + ": "
            + forks[i]["judgement"].strip()
            + "\n"
        )

    s += "In summary, on a scale of 1 to 10, I would give the article a score of"
    s += sgl.gen("score", max_tokens=2)
# fmt: on


def llm_judge_args(num: int, scale: float = 1.0) -> list[dict]:
    """Essays of ~600 words at scale 1 (SGLang's articles.jsonl), a title and paragraphs."""
    arguments = []
    for i in range(num):
        rng = _rng("article", i)
        body = [paragraph(rng, _n(120, scale, 5)) for _ in range(5)]
        arguments.append({"article": words(rng, 3, 7).title() + "\n\n" + "\n\n".join(body)})
    return arguments


# ------------------------------------------------------------------------------------------
# tip_suggestion (benchmark/tip_suggestion/bench_sglang.py): 5 tips, each expanded by a
# nested call of another function

number = 5


# fmt: off
@sgl.function
def expand_tip(s, topic, tip):
    s += (
"""Please expand a tip for a topic into a detailed paragraph.

Topic: staying healthy
Tip: Regular Exercise
Paragraph: Incorporate physical activity into your daily routine. This doesn't necessarily mean intense gym workouts; it can be as simple as walking, cycling, or yoga. Regular exercise helps in maintaining a healthy weight, improves cardiovascular health, boosts mental health, and can enhance cognitive function, which is crucial for fields that require intense intellectual engagement.

Topic: building a campfire
Tip: Choose the Right Location
Paragraph: Always build your campfire in a safe spot. This means selecting a location that's away from trees, bushes, and other flammable materials. Ideally, use a fire ring if available. If you're building a fire pit, it should be on bare soil or on a bed of stones, not on grass or near roots which can catch fire underground. Make sure the area above is clear of low-hanging branches.

Topic: writing a blog post
Tip: structure your content effectively
Paragraph: A well-structured post is easier to read and more enjoyable. Start with an engaging introduction that hooks the reader and clearly states the purpose of your post. Use headings and subheadings to break up the text and guide readers through your content. Bullet points and numbered lists can make information more digestible. Ensure each paragraph flows logically into the next, and conclude with a summary or call-to-action that encourages reader engagement.

Topic: """ + topic + "\nTip: " + tip + "\nParagraph:")  # noqa: E501
    s += sgl.gen("paragraph", max_tokens=128, stop=["\n\n"], temperature=0)


@sgl.function
def suggest_tips(s, topic):
    s += "Please act as a helpful assistant. Your job is to provide users with useful tips on a specific topic.\n"  # noqa: E501
    s += "USER: Give some tips for " + topic + ".\n"
    s += ("ASSISTANT: Okay. Here are " + str(number) + " concise tips, each under 8 words:\n")

    paragraphs = []
    for i in range(1, 1 + number):
        s += f"{i}." + sgl.gen(f"tip_{i}", max_tokens=24, stop=[".", "\n"]) + ".\n"
        paragraphs.append(expand_tip(topic=topic, tip=s[f"tip_{i}"]))

    for i in range(1, 1 + number):
        s += f"Tip {i}:" + paragraphs[i-1]["paragraph"] + "\n"
# fmt: on


def tip_suggestion_args(num: int, scale: float = 1.0) -> list[dict]:
    """Topics of a few words (SGLang's topic.jsonl; `scale` has no effect)."""
    return [{"topic": words(_rng("topic", i), 2, 5)} for i in range(num)]


# ------------------------------------------------------------------------------------------
# multi_document_qa (benchmark/multi_document_qa/bench_sglang.py): fork per document,
# joined with concate_and_append


@sgl.function
def multi_document_qa(s, docs, question):
    s += sgl.user_begin()
    s += "Pleaes answer a question according to given documents.\n"
    s += "Question:" + question + "Documents begin.\n"

    forks = s.fork(len(docs))
    forks += lambda i: docs[i]
    forks.join("concate_and_append")

    s += "\nDocuments end."
    s += (
        "\n\nBased on the above documents, please answer this question:\n"
        + question
        + "\nAnswer in three words or fewer."
    )
    s += sgl.user_end()
    s += sgl.assistant(sgl.gen("answer", max_tokens=16))


def multi_document_qa_args(num: int, scale: float = 1.0) -> list[dict]:
    """The first 10 documents (sections of a paper, ~400 words each at scale 1) for every
    question, as SGLang's bench takes `l["documents"][:10]`."""
    docs = []
    for d in range(10):
        rng = _rng("document", d)
        docs.append(f"Document {d + 1}. " + paragraph(rng, _n(400, scale, 10)) + "\n")
    questions = [paragraph(_rng("doc-question", i), 10).rstrip(".") + "?" for i in range(num)]
    return [{"docs": docs, "question": q} for q in questions]


# ------------------------------------------------------------------------------------------
# long_json_decode (benchmark/long_json_decode/bench_sglang.py): a ~10k-token page, 4 gens


def _long_json_decode():
    # fmt: off
    @sgl.function
    def json_decode(s, document):
        s += "Please extract the information of a city from the following wikipedia page.\n"
        s += "Page begin.\n" + document + "Page end.\n"
        s += "Here is the name, country, and symbol of the city in JSON format.\n"
        s += "{\n"
        s += '  "name": "' + sgl.gen("name", max_tokens=8, stop='"') + '",\n'
        s += '  "country": "' + sgl.gen("country", max_tokens=8, stop='"') + '",\n'
        s += (
            '  "air port code": "'
            + sgl.gen("air port code", max_tokens=8, stop='"')
            + '",\n'
        )
        s += (
            '  "top 3 landmarks": "'
            + sgl.gen("landmarks", max_tokens=24, stop='"')
            + '",\n'
        )
        s += "}\n"

    # fmt: on
    return json_decode


long_json_decode = _long_json_decode()


def long_json_decode_args(num: int, scale: float = 1.0) -> list[dict]:
    """City pages cut at ~10,000 Llama tokens in SGLang's build_dataset.py: ~7,000 words at
    scale 1 (five cities, repeated past five as the bench reads questions.jsonl's lines)."""
    return [{"document": city_page(500 + i % 5, _n(7000, scale, 20))} for i in range(num)]


# ------------------------------------------------------------------------------------------
# line_retrieval (benchmark/line_retrieval/bench_sglang.py): a body of lines in 4 forks with
# position offsets, joined with concate_and_append, then a question about one line


@sgl.function
def line_retrieval(s, prefix, suffix, body_0, body_1, body_2, body_3):
    s += prefix + "\n"

    contexts = [body_0, body_1, body_2, body_3]
    position_ids_offset = [i * 1000 for i in range(len(contexts))]
    forks = s.fork(len(contexts), position_ids_offset)
    forks += lambda i: contexts[i] + "\n"
    forks.join(mode="concate_and_append")

    s += "\n" + suffix
    s += sgl.gen("answer", max_tokens=16)


LINE_PREFIX = "Here is a list of lines, each with its corresponding REGISTER_CONTENT value. Please memorize them. Be prepared to provide the REGISTER_CONTENT value for a specific line index when I ask."  # noqa: E501
LINE_SUFFIX = "The list has ended. Please give the final REGISTER_CONTENT value for a specific line after resovling the redirections and references. For example, the REGISTER_CONTENT of Line __idx0__ is __val0__. The REGISTER_CONTENT of Line __idx1__ is __val1__. The REGISTER_CONTENT of Line __idx2__ is __val2__. The REGISTER_CONTENT of Line ??? is"  # noqa: E501


def line_retrieval_args(num: int, scale: float = 1.0) -> list[dict]:
    """SGLang's gen_data.py lines (no redirects), `src_index` 600 at scale 1 (the README's run:
    a body of 601 lines), `num` queries of lines before it (`num_hoops` 1)."""
    rng = _rng("lines")
    src_index = _n(600, scale, 8)
    indices, values, lines = [], [], []
    while len(lines) < src_index + 1:
        index = "-".join(rng.choices(WORDS, k=2))
        if index in indices:
            continue
        value = f"{rng.randint(0, 999998):06}"
        indices.append(index)
        values.append(value)
        lines.append(f"Line {index}: The REGISTER_CONTENT is {value}.")
    suffix = LINE_SUFFIX
    for k, i in enumerate((5, 1, 2)):
        suffix = suffix.replace(f"__idx{k}__", indices[i]).replace(f"__val{k}__", values[i])
    body = lines[: src_index + 1]
    body_part_len = len(body) // 4
    arguments = []
    for j in range(num):
        dst_index = min(int(src_index * j / max(1, num)), src_index - 1)
        arguments.append({
            "prefix": LINE_PREFIX,
            "body_0": "\n".join(body[:body_part_len]),
            "body_1": "\n".join(body[body_part_len: 2 * body_part_len]),
            "body_2": "\n".join(body[2 * body_part_len: 3 * body_part_len]),
            "body_3": "\n".join(body[3 * body_part_len:]),
            "suffix": suffix.replace("???", indices[dst_index]),
        })  # fmt: skip
    return arguments


# ------------------------------------------------------------------------------------------
# the registry


@dataclass(frozen=True)
class Spec:
    """One program of SGLang's benchmark/ and how its bench runs it.

    mode "batch": `function.run_batch(make_args(num, scale), **run_kwargs)`;
    mode "calls": make_args gives SGLang's call log, [{function name: kwargs}], each run with
    `functions[name].run(**kwargs)` then `.sync()`, one after another (generative agents).
    `exact`: prefill computed should equal the prompt report's lower bound (every prompt is
    known before its siblings run, and the cache holds them all); `why` says why not.
    """

    name: str
    source: str  # the file of sgl-project/sglang it follows
    function: Any
    make_args: Callable[[int, float], list]
    run_kwargs: dict[str, Any]
    default_num: int  # the bench's default number of instances
    exact: bool = True
    why: str = ""
    mode: str = "batch"
    functions: dict[str, Any] = field(default_factory=dict)
    warm_up: Any = None  # run once before the measured batch (json_decode_regex)
    nested: bool = False  # calls other functions on the default backend (set it)
    sampled: bool = False  # a gen samples at temperature > 0: outputs may differ run to run


def _spec(name: str, function: Any, make_args: Callable, **kwargs: Any) -> Spec:
    kwargs.setdefault("run_kwargs", {"temperature": 0})
    kwargs.setdefault("source", f"benchmark/{name}/bench_sglang.py")
    return Spec(name=name, function=function, make_args=make_args, **kwargs)


def _tot(num_branches: int) -> Callable[[int, float], list]:
    return lambda num, scale=1.0: tree_of_thought_args(num, scale, num_branches)


PROGRAMS: dict[str, Spec] = {
    spec.name: spec
    for spec in [
        _spec("mmlu", few_shot_mmlu, mmlu_args, default_num=1400,
              run_kwargs={"temperature": 0, "max_new_tokens": 1}),
        _spec("hellaswag", few_shot_hellaswag, hellaswag_args, default_num=200),
        _spec("gsm8k", few_shot_gsm8k, gsm8k_args, default_num=200),
        _spec("tree_of_thought_v0", tree_search_v0, _tot(3), default_num=200, sampled=True,
              exact=False, why="a branch's prompt holds its parent's sampled reply, whose last "
              "token has no KV yet; and the joins in reverse order wait for every level"),
        _spec("tree_of_thought_deep", tree_search_deep, _tot(2), default_num=200,
              sampled=True, exact=False, why="as tree_of_thought_v0, one level deeper"),
        _spec("react", webthink, react_args, default_num=10),
        _spec("generative_agents", None, generative_agents_args, default_num=10,
              mode="calls", functions=AGENT_FUNCTIONS, run_kwargs={}, sampled=True,
              source="benchmark/generative_agents/agent_functions.py"),
        _spec("json_decode_regex", json_decode_regex, json_decode_regex_args, default_num=20,
              warm_up=json_warm_up),
        _spec("json_jump_forward", character_gen, json_jump_forward_args, default_num=50),
        _spec("multi_turn_chat", multi_turns, multi_turn_chat_args, default_num=20),
        _spec("llm_judge", multi_dimension_judge, llm_judge_args, default_num=20,
              exact=False, why="the summary prompt holds each judgement .strip()-ped and "
              "re-tokenized after the article, text no request computed KV for"),
        _spec("tip_suggestion", suggest_tips, tip_suggestion_args, default_num=100,
              nested=True, exact=False, why="the summary appends each nested call's "
              "paragraph as new text"),
        _spec("multi_document_qa", multi_document_qa, multi_document_qa_args, default_num=100),
        _spec("long_json_decode", long_json_decode, long_json_decode_args, default_num=10),
        _spec("line_retrieval", line_retrieval, line_retrieval_args, default_num=10),
    ]
}  # fmt: skip


def run(
    spec: Spec,
    num: int,
    scale: float = 1.0,
    backend: Any = None,
    warm_up: bool = True,
    greedy: bool = True,
) -> list:
    """Run `spec` as SGLang's bench does; the states (one per instance, or per call).

    `greedy` adds temperature=0 to the run's keywords where the bench leaves run()'s default
    (generative agents' `func.run(**arg)`: temperature 1.0); a gen that sets its own
    temperature keeps it (the trees of thought)."""
    run_kwargs = {**spec.run_kwargs, **({"temperature": 0} if greedy else {})}
    if warm_up and spec.warm_up is not None:
        spec.warm_up.run(backend=backend, **run_kwargs).sync()
    arguments = spec.make_args(num, scale)
    if spec.mode == "calls":
        states = []
        for a in arguments:
            # only a single key in the dict
            for func, arg in a.items():
                result = spec.functions[func].run(**arg, backend=backend, **run_kwargs)
            result.sync()
            states.append(result)
        return states
    return spec.function.run_batch(arguments, backend=backend, **run_kwargs)


def outputs(states: list) -> list:
    """What each instance produced: its text, every variable, and the return value if any."""
    out = []
    for state in states:
        error = state.error()
        if error is not None:
            raise error
        value = state.ret_value
        out.append({
            "text": state.text(),
            "variables": state.variables(),
            **({} if value is None else {"ret": value}),
        })  # fmt: skip
    return out
