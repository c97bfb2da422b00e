"""The documentation checked against the code: docs/cli.md is what the command line generates today, every
`minigrpo ...` command in README.md and docs/ names a real command and only its real options, every Python
snippet compiles (and those that only define things run), and no figure the long README had was lost."""

import ast
import re
import shlex
from pathlib import Path

import pytest
import typer

from minigrpo.cli.app import app
from minigrpo.cli.reference import render

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
# a command as a shell runs it: at the start of a line, or after $(, &&, ; or |
SHELL_COMMAND = re.compile(r"(?:^|\$\(|&&|;|\|)\s*(minigrpo\s[^\n#`|;)&]*)", re.M)
INLINE_COMMAND = re.compile(r"`(minigrpo\s[^`]+)`")


def test_the_cli_reference_is_current():
    assert (ROOT / "docs" / "cli.md").read_text() == render(), \
        "docs/cli.md is stale: python -m minigrpo.cli.reference > docs/cli.md"


def documented_commands() -> list[tuple[str, str]]:
    """(page, command) for every command in a shell block or an inline code span."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for language, body in FENCE.findall(text):
            if language in ("", "bash", "sh", "shell", "console"):
                found += [(page.name, m.strip()) for m in SHELL_COMMAND.findall(body)]
        prose = FENCE.sub("", text)
        found += [(page.name, m.strip()) for m in INLINE_COMMAND.findall(prose)]
    return found


def options_of(command) -> set[str]:
    return {opt for p in command.params if p.param_type_name == "option" for opt in [*p.opts, *p.secondary_opts]} \
        | {"--help"}


def problems_with(line: str) -> list[str]:
    """What in one documented command the real command line does not have."""
    root = typer.main.get_command(app)
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # an unclosed quote in a prose fragment: check the words it has
        words = line.split()
    words = [w for w in words[1:] if w not in ("...", "…") and not re.fullmatch(r"[A-Z_]+|<[^>]*>", w)]
    if not words:
        return []
    command, rest = root, words
    while hasattr(command, "list_commands") and rest and not rest[0].startswith("-"):
        sub = command.get_command(None, rest[0])
        if sub is None:
            return [f"no command {rest[0]!r}"]
        command, rest = sub, rest[1:]
    if hasattr(command, "list_commands"):
        return []  # a group named on its own (`minigrpo bench ...`)
    train = root.get_command(None, "train")
    known, owner, out = options_of(command), command.name, []
    for word in rest:
        if word == "--":  # graduate: train's own flags follow
            known, owner = options_of(train), "train"
            continue
        flag = word.split("=", 1)[0]
        if flag.startswith("-") and not re.fullmatch(r"-\d.*", flag) and flag not in known:
            out.append(f"{owner} has no option {flag}")
    return out


def test_every_documented_command_exists_with_its_options():
    commands = documented_commands()
    assert len(commands) > 80  # the check reads the pages at all, and can fail:
    assert problems_with("minigrpo trian --steps 2") == ["no command 'trian'"]
    assert problems_with("minigrpo graduate --out x -- --task addition --no-such") == ["train has no option --no-such"]
    wrong = [f"{page}: `{line}`: {problem}" for page, line in commands for problem in problems_with(line)]
    assert not wrong, "\n".join(wrong)


def python_snippets() -> list[tuple[str, int, str]]:
    out = []
    for page in PAGES:
        for i, (language, body) in enumerate(FENCE.findall(page.read_text())):
            if language == "python":
                out.append((page.name, i, body))
    return out


@pytest.mark.parametrize("page, index, code", python_snippets(), ids=lambda v: str(v)[:24])
def test_every_python_snippet_compiles_and_definitions_run(page, index, code, tmp_path, monkeypatch):
    tree = compile(code, f"{page} snippet {index}", "exec", flags=ast.PyCF_ONLY_AST)
    compile(tree, f"{page} snippet {index}", "exec")
    defining = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    if all(isinstance(node, defining) or (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
           for node in tree.body):
        monkeypatch.chdir(tmp_path)  # cheap and offline: imports and definitions only
        exec(compile(tree, f"{page} snippet {index}", "exec"), {"__name__": "snippet"})


def test_no_figure_of_the_old_readme_was_lost():
    """tests/data/readme_figures.txt: every decimal figure and every timing the README held before it was cut to a
    page (taken with `grep -oE '[0-9]+\\.[0-9]+|[0-9][0-9,]* (s|ms|GB)\\b'` from it); each must still be in
    README.md or docs/."""
    everything = "\n".join(page.read_text() for page in PAGES)
    figures = (ROOT / "tests" / "data" / "readme_figures.txt").read_text().split("\n")
    missing = [f for f in figures if f and f not in everything]
    assert not missing, f"figures no longer documented: {missing[:20]}"


def test_the_design_map_names_every_module_once():
    """docs/design.md's layout is how a newcomer finds a file: every module of minigrpo/ and rewards/ is on it,
    once, and nothing on it is gone."""
    layout = (ROOT / "docs/design.md").read_text().split("## Layout", 1)[1].split("```")[1]
    listed = [line.split()[0] for line in layout.splitlines() if line.strip() and not line.startswith("#")]
    modules = {str(p.relative_to(ROOT)) for package in ("minigrpo", "rewards") for p in (ROOT / package).rglob("*.py")}
    assert sorted(p for p in listed if p.endswith(".py") and not p.startswith("scripts/")) == sorted(
        p for p in modules if not p.endswith("rewards/__init__.py")), set(listed) ^ modules
    assert all((ROOT / p.rstrip("/")).exists() for p in listed), [p for p in listed if not (ROOT / p.rstrip("/")).exists()]


OTHER_PROGRAMS = {"--durations"}  # pytest's, named in docs/speed.md


def test_every_flag_the_docs_name_alone_is_an_option_of_a_command():
    """A flag in prose (`--max-bad-steps`) names an option some command has; the renamed and guessed spellings the
    command line answers (`--lr`) are told as such. Flags inside a command line are test_every_documented_command's."""
    from minigrpo.cli.app import CALLED, RENAMED
    from minigrpo.cli.reference import commands

    known = {opt for _, command in commands(typer.main.get_command(app)) for p in command.params
             if p.param_type_name == "option" for opt in [*p.opts, *p.secondary_opts]}
    allowed = known | set(CALLED) | set(RENAMED) | OTHER_PROGRAMS | {"--help"}
    named = {(page.name, flag) for page in PAGES for span in re.findall(r"`(--[^`\s]+)", FENCE.sub("", page.read_text()))
             for flag in [span.split("=")[0].split("/")[0]]}
    assert not {(page, flag) for page, flag in named if flag not in allowed}
