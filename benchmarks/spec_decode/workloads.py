"""The three request sets of the speculative-decoding benchmark, written as conversation JSONL
(pagedllm/workload.py: one single-turn conversation per line), so `pagedllm bench serve` sends
them as chat messages through the model's chat template, as a user's client would.

    .venv/bin/python benchmarks/spec_decode/workloads.py OUT_DIR     # grounded, code, chat .jsonl

- grounded: a document in the prompt and a task whose answer quotes it (repeat a section word for
  word, list the definitions of some code with their signatures, turn a table into JSON);
- code: a Python file of 60-150 lines and a small edit (rename a function, add a docstring), the
  whole file to be returned;
- chat: stories, explanations, poems and advice with no source to copy.

The documents and code are this repository's own docs/ and pagedllm/ read at SOURCE_COMMIT with
`git show`, so the sets stay the same whatever the working tree holds, and no text is stored
twice. Every request is greedy (the client sends temperature 0), asks for MAX_TOKENS tokens and
ignores EOS: runs with and without speculation then produce the same number of tokens, and the
answers of grounded and code requests are longer than MAX_TOKENS anyway (a section, a file), so
the cap, not a made-up tail after EOS, ends them. Chat answers can end early; their tail after EOS
is then the model continuing on its own, which a drafter sees as plain text too.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCE_COMMIT = "eef40ac608208bc8fdc45192b215a1d67c8affbd"
NUM_REQUESTS = 32
"""Per workload; a run at C in flight sends the first N of them (run.py)."""
MAX_TOKENS = 256
"""Long enough that decode dominates each request, short enough for runs of minutes on 2 cores."""
MAX_DOCUMENT_CHARS = 4000
"""~1,000 tokens: a real document's size, and a prefill that stays below the decode's time."""
WORKLOADS = ("grounded", "code", "chat")


@dataclass(frozen=True)
class ChatRequest:
    """One line of a set: conversation JSONL with the answer's expected quote kept beside it."""

    conversation_id: int
    system: str
    turns: list[str]
    max_tokens: int
    ignore_eos: bool
    source: str
    """Which file (or none) the prompt is built from, for reading a result."""
    quote: str
    """Text of the prompt a faithful answer copies ("" for chat): what an n-gram drafter can find."""


def git_file(path: str, commit: str = SOURCE_COMMIT) -> str:
    """A file of this repository at `commit`; RuntimeError naming the fix where git lacks it."""
    done = subprocess.run(
        ["git", "show", f"{commit}:{path}"], cwd=REPO, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"git cannot read {path} at {commit[:12]} ({done.stderr.strip()}); the workloads are "
            "built from this repository's history: run from a full clone (git fetch --unshallow)"
        )
    return done.stdout


def git_files(prefix: str, suffix: str, commit: str = SOURCE_COMMIT) -> list[str]:
    names = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", commit, prefix], cwd=REPO, capture_output=True, text=True
    ).stdout.split()
    return sorted(n for n in names if n.endswith(suffix))


# ---- grounded ---------------------------------------------------------------------------------

GROUNDED_SYSTEM = "You are a precise assistant. Answer only from the text the user gives you."


def markdown_sections(text: str) -> list[tuple[str, str]]:
    """(title, section text with its heading) for every `## ` or `### ` section."""
    parts = re.split(r"(?m)^(?=#{2,3} )", text)
    return [(p.splitlines()[0].lstrip("# ").strip(), p.strip()) for p in parts if p.startswith("##")]


def _repeat_section(doc: str, sections: list[tuple[str, str]], i: int) -> tuple[str, str]:
    """The section with its neighbours as the document (those that fit in MAX_DOCUMENT_CHARS, the
    one after it first, so the section is not always last); the answer is the section itself.
    Every grounded and code prompt puts the text first and the task last: SmolLM2-135M follows
    the task (and copies) more often so than with the task first."""
    title, body = sections[i]
    parts = [body]
    for j in (i + 1, i - 1):
        if 0 <= j < len(sections) and len(sections[j][1]) + sum(map(len, parts)) <= MAX_DOCUMENT_CHARS:
            parts.insert(0 if j < i else len(parts), sections[j][1])
    task = f'Repeat the section titled "{title}" from the document above, word for word.'
    return f"{doc}:\n\n" + "\n\n".join(parts) + f"\n\n{task}", body


def _table_to_json(title: str, table: str) -> tuple[str, str]:
    task = (
        "Convert the table in the text above to a JSON list: one object per row, with the header's "
        "column names as keys and the cells copied exactly as values."
    )
    return f"Text ({title}):\n\n{table}\n{task}", table


def _list_definitions(path: str, code: str) -> tuple[str, str]:
    task = (
        "List every function, method and class defined in the code above, one per line, each with "
        "its full signature exactly as written (name, parameters, type hints, return type)."
    )
    code = code[:MAX_DOCUMENT_CHARS]
    defs = [line.strip() for line in code.splitlines() if re.match(r"\s*(async def|def|class) ", line)]
    return f"```python\n# {path}\n{code}\n```\n\n{task}", "\n".join(defs)


def grounded_requests(num_requests: int = NUM_REQUESTS) -> list[ChatRequest]:
    """A third each: repeat a section, a table to JSON, list code's definitions (in turn)."""
    prose = [
        (doc, sections, i)
        for doc in ("docs/architecture.md", "docs/tuning.md", "docs/scaling.md", "docs/kv_quantization.md")
        for sections in [markdown_sections(git_file(doc))]
        for i, (_, body) in enumerate(sections)
        if 800 <= len(body) <= MAX_DOCUMENT_CHARS
    ]
    # docs/benchmarks.md as it stood at SOURCE_COMMIT (its figures are now in docs/benchmarks/).
    tables = [
        (title, block)
        for title, body in markdown_sections(git_file("docs/benchmarks.md"))
        for block in re.findall(r"(?m)(?:^\|.*\|\n){4,}", body + "\n")
        if 400 <= len(block) <= MAX_DOCUMENT_CHARS
    ]
    code = [p for p in git_files("pagedllm/", ".py") if 150 < git_file(p).count("\n") <= 300]
    makers = [
        lambda k: ("repeat", *prose[k % len(prose)]),
        lambda k: ("table", *tables[k % len(tables)]),
        lambda k: ("defs", code[k % len(code)]),
    ]
    requests = []
    for n in range(num_requests):
        kind, *what = makers[n % 3](n // 3 * 5)  # a stride of 5: sources from all over each list
        if kind == "repeat":
            doc, sections, i = what
            prompt, quote = _repeat_section(doc, sections, i)
        elif kind == "table":
            prompt, quote = _table_to_json(*what)
            doc = "docs/benchmarks.md"
        else:
            doc = what[0]
            prompt, quote = _list_definitions(doc, git_file(doc))
        requests.append(ChatRequest(n, GROUNDED_SYSTEM, [prompt], MAX_TOKENS, True, doc, quote))
    return requests


# ---- code edit --------------------------------------------------------------------------------

CODE_SYSTEM = "You are a careful programmer. Reply with the complete edited file in one ```python block."


def _functions(code: str) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def _edit(code: str, kind: str) -> str:
    """A small edit of one function the file defines, named so the answer is the file again."""
    functions = sorted(_functions(code), key=lambda f: f.lineno)
    if kind == "rename":
        named = [f for f in functions if not f.name.startswith("__")] or functions
        old = named[len(named) // 2].name
        return f"Rename the function `{old}` to `{old}_v2` everywhere in this file, calls included."
    bare = [f for f in functions if ast.get_docstring(f) is None] or functions
    return f"Add a one-line docstring to `{bare[len(bare) // 2].name}` that says what it does."


def code_requests(num_requests: int = NUM_REQUESTS) -> list[ChatRequest]:
    """Files of 60-150 lines with at least two functions, each asked for a rename and a docstring."""
    files = [
        (p, code)
        for p in git_files("pagedllm/", ".py")
        if 60 <= (code := git_file(p)).count("\n") <= 150 and len(_functions(code)) >= 2
    ]
    requests = []
    for n in range(num_requests):
        path, code = files[(n // 2 * 7) % len(files)]  # a stride of 7 spreads them over the package
        instruction = _edit(code, "rename" if n % 2 == 0 else "docstring")
        # the file first, the task last: SmolLM2-135M copies the file more often in this order
        prompt = f"```python\n# {path}\n{code}```\n\n{instruction} Return the whole file."
        requests.append(ChatRequest(n, CODE_SYSTEM, [prompt], MAX_TOKENS, True, path, code))
    return requests


# ---- open-ended chat --------------------------------------------------------------------------

CHAT_SYSTEM = "You are a friendly, imaginative assistant."
CHAT_FORMS = (
    "Write a short story about {}.",
    "Explain {} to a curious twelve-year-old, with an example.",
    "Write a poem about {}.",
    "I want to get better at {}. Give me a plan for the next month.",
)
CHAT_TOPICS = (
    "a lighthouse keeper who finds a message in a bottle",
    "why the sky is blue",
    "the first day of spring in a small mountain village",
    "cooking dinner for friends on a tight budget",
    "a robot that learns to paint",
    "how vaccines train the immune system",
    "an old dog and the boy who grew up with it",
    "public speaking",
    "a city where it always rains",
    "how airplanes stay in the air",
    "a friendship between a fox and a crow",
    "drawing portraits",
    "the night before a long journey",
    "how a bill becomes a law",
    "a baker who can taste people's memories",
    "running a first marathon",
)


def chat_requests(num_requests: int = NUM_REQUESTS) -> list[ChatRequest]:
    """Every topic in turn, the forms rotating, so no two requests share a prompt."""
    requests = []
    for n in range(num_requests):
        form = CHAT_FORMS[(n + n // len(CHAT_TOPICS)) % len(CHAT_FORMS)]
        prompt = form.format(CHAT_TOPICS[n % len(CHAT_TOPICS)])
        requests.append(ChatRequest(n, CHAT_SYSTEM, [prompt], MAX_TOKENS, True, "", ""))
    return requests


BUILDERS = {"grounded": grounded_requests, "code": code_requests, "chat": chat_requests}


def write_workload(name: str, out_dir: Path, max_tokens: int = MAX_TOKENS) -> Path:
    """OUT_DIR/NAME.jsonl, readable by `pagedllm bench serve --workload` (extra keys ignored);
    `max_tokens` other than MAX_TOKENS only for quick checks of the runner."""
    path = out_dir / f"{name}.jsonl"
    out_dir.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for request in BUILDERS[name]():
            row = asdict(request) | {"max_tokens": max_tokens}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    args = parser.parse_args()
    for name in args.workloads:
        print(write_workload(name, args.out_dir))


if __name__ == "__main__":
    main()
