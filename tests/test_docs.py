"""Docs that stay true: README.md and docs/*.md are checked against the code they describe.

- **Flags.** Every ``--flag`` written after a script's path (``python training/pretrain.py --x``,
  ``torchrun --nproc_per_node 2 training/pretrain.py --x``, ``accelerate launch ... training/pretrain.py``)
  is an option of that script's own argument parser; the flags before the script belong to the launcher
  and are checked against torchrun's or Accelerate's parser. A flag named alone in prose (`` `--blur_p` ``)
  must be an option of some script (or listed in ``FOREIGN_FLAGS``).
- **Paths.** Every relative markdown link (``[text](path#anchor)``, images too) resolves from the page's
  folder, anchors included; every repository path in backticks (``training/...``, ``results/...``) exists.
- **Runnable blocks.** A fenced block whose info string is ``python runnable`` runs, in a temporary folder,
  offline, after the ``TINY`` replacements below make it small (a tiny timm model, two steps).

Each checker is a function of the markdown text, so the tests at the bottom plant mistakes in a made-up
page and assert that each is reported.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import importlib.util
import inspect
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# hand-written experiment pages (the generated ones, e.g. results/ablation/README.md, are the scripts' output)
RESULT_PAGES = [ROOT / "results" / "bisect" / "README.md", ROOT / "results" / "pretrain_seeds" / "README.md",
                ROOT / "results" / "mocov3" / "README.md"]
PAGES = DOCS + [p for p in RESULT_PAGES if p.exists()]

SCRIPT = re.compile(r"(?<![\w./-])((?:training|benchmarks)/[\w/]+\.py)\b")
FLAG = re.compile(r"(?<![\w-])(--[A-Za-z][\w-]*)")
REPO_PATH = re.compile(r"^(?:training|benchmarks|results|docs|hf_contrast|tests|model_cards)/[\w./*-]*$")
LAUNCHERS = ("torchrun", "accelerate launch", "python -m torch.distributed.run")
# scripts that hand the flags they do not know on to another script
PASSES_FLAGS_TO = {"training/seeds.py": "training/pretrain.py"}
# flags of other programs, named in prose: flag -> whose
FOREIGN_FLAGS = {"--aug-plus": "facebookresearch/moco's main_moco.py", "--no-deps": "pip", "--target": "pip"}
# paths the docs name as a command's output, not committed
OUTPUT_PATHS = {"results/gpu", "results/gpu/", "results/gpu/smoke"}
# Runnable blocks are written at their real settings; the test runs them small.
TINY = {
    '"resnet18"': '"test_resnet"',
    "per_device_train_batch_size=256": "per_device_train_batch_size=8",
    "queue_size=2048": "queue_size=64",
    "num_train_epochs=40": "max_steps=2",
    "num_train_epochs=3": "max_steps=2",
}
NOT_TINY = ("resnet18", "resnet50", "vit_small", "num_train_epochs")


# ---------------------------------------------------------------------------------------------- markdown

FENCE = re.compile(r"^( {0,3})(```+|~~~+)[ \t]*([^\n`]*)\n(.*?)^\1\2[ \t]*$", re.M | re.S)


def fenced_blocks(text: str) -> list[tuple[str, str, int]]:
    """``(info string, code, line number)`` of every fenced code block."""
    return [(m.group(3).strip(), m.group(4), text.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(text)]


def prose(text: str) -> str:
    """The text with fenced blocks blanked out (line numbers kept)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def inline_spans(text: str) -> list[tuple[str, int]]:
    """``(content, line number)`` of every inline code span outside fenced blocks (a span may wrap a line)."""
    body = prose(text)
    return [(" ".join(m.group(2).split()), body.count("\n", 0, m.start()) + 1)
            for m in re.finditer(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", body, re.S)]


def command_lines(text: str) -> list[tuple[str, int]]:
    """Shell-like lines to look for script calls in: each line of each fenced block (``\\`` continuations
    joined) and each inline code span."""
    out = []
    for _, code, start in fenced_blocks(text):
        joined, first = "", None
        for i, line in enumerate(code.split("\n")):
            first = start + 1 + i if first is None else first
            if line.rstrip().endswith("\\"):
                joined += line.rstrip()[:-1] + " "
                continue
            out.append((joined + line, first))
            joined, first = "", None
    return out + inline_spans(text)


# ---------------------------------------------------------------------------------------------- flags

def script_calls(text: str) -> list[dict]:
    """Every call of a script: ``{"script", "flags", "launcher", "launcher_flags", "line"}``.

    A call runs from the script's path to the end of its command (``&&``, ``;``, ``|``, a ``#`` comment);
    flags before the path belong to a launcher when the command starts with one."""
    calls = []
    for line, number in command_lines(text):
        for command in re.split(r"&&|\|\||;|\|", re.sub(r"(^|\s)#.*", "", line)):
            found = list(SCRIPT.finditer(command))
            for i, m in enumerate(found):
                end = found[i + 1].start() if i + 1 < len(found) else len(command)
                before = command[:m.start()]
                launcher = next((name for name in LAUNCHERS if name in before), None)
                calls.append({
                    "script": m.group(1), "line": number, "launcher": launcher,
                    "flags": FLAG.findall(command[m.end():end]),
                    "launcher_flags": FLAG.findall(before.split(launcher, 1)[1]) if launcher else [],
                })
    return calls


def lone_flags(text: str) -> list[tuple[str, int]]:
    """Flags named in prose on their own: every flag of an inline span that starts with ``--flag``
    (`` `--blur_p P` ``, `` `--backbone B --backbone_kwargs J` ``)."""
    return [(flag, number) for span, number in inline_spans(text)
            if re.match(r"--[A-Za-z][\w-]*(?:[ =].*)?$", span) for flag in FLAG.findall(span)]


class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings}


def _load_script(path: Path):
    """Import a script as a module, with its folder on ``sys.path`` (scripts import their siblings)."""
    name = f"_docs_{path.parent.name}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    sys.path.insert(0, str(path.parent))  # script_options puts sys.path back
    spec.loader.exec_module(module)
    return module


def _parser_of(module, path: Path) -> argparse.ArgumentParser:
    """The parser the script parses its command line with: ``build_parser()`` where the script has one,
    else the parser ``main`` builds, caught when it starts parsing (nothing after that runs)."""
    if callable(getattr(module, "build_parser", None)):
        return module.build_parser()
    main = getattr(module, "main", None)
    if main is None:
        return argparse.ArgumentParser()  # takes no flags
    real, argv = argparse.ArgumentParser.parse_known_args, sys.argv

    def catch(self, *args, **kwargs):
        raise _Parsed(self)

    argparse.ArgumentParser.parse_known_args = catch
    sys.argv = [str(path)]
    try:
        main([]) if inspect.signature(main).parameters else main()
    except _Parsed as parsed:
        return parsed.parser
    finally:
        argparse.ArgumentParser.parse_known_args, sys.argv = real, argv
    raise RuntimeError(f"{path}: main() returned without parsing a command line")


@functools.cache
def script_options(script: str) -> frozenset[str] | None:
    """Every option string the script accepts (``None`` when there is no such script). Imported in this
    process (about 0.01 s a script once the package is imported); ``--help`` in a subprocess if that fails."""
    path = ROOT / script
    if not path.is_file():
        return None
    added, search_path = set(sys.modules), list(sys.path)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            options = _options(_parser_of(_load_script(path), path))
    except Exception:
        out = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=300,
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
        options = set(FLAG.findall(out))
        if not options:
            raise
    finally:  # forget the scripts imported as modules (not the libraries they pulled in) and their sys.path
        sys.path[:] = search_path
        for name in set(sys.modules) - added:
            file = getattr(sys.modules[name], "__file__", None) or ""
            if name.startswith("_docs_") or Path(file).parent in (ROOT / "training", ROOT / "benchmarks"):
                del sys.modules[name]
    if script in PASSES_FLAGS_TO:
        options |= script_options(PASSES_FLAGS_TO[script]) or set()
    return frozenset(options)


@functools.cache
def launcher_options(launcher: str) -> frozenset[str]:
    if launcher == "accelerate launch":
        from accelerate.commands.launch import launch_command_parser

        return frozenset(_options(launch_command_parser()))
    from torch.distributed.run import get_args_parser

    return frozenset(_options(get_args_parser()))


def all_script_options() -> set[str]:
    scripts = sorted(str(p.relative_to(ROOT)) for d in ("training", "benchmarks") for p in (ROOT / d).glob("*.py"))
    return set().union(*(script_options(s) or set() for s in scripts))


def flag_errors(text: str, options=script_options) -> list[str]:
    """What is wrong with the flags the text names; ``options(script)`` gives a script's option strings."""
    errors = []
    for call in script_calls(text):
        known = options(call["script"])
        if known is None:
            errors.append(f"line {call['line']}: {call['script']} does not exist")
            continue
        errors += [f"line {call['line']}: {call['script']} has no flag {flag}" for flag in call["flags"]
                   if flag not in known]
        if call["launcher"]:
            errors += [f"line {call['line']}: {call['launcher']} has no flag {flag}"
                       for flag in call["launcher_flags"] if flag not in launcher_options(call["launcher"])]
    lone = lone_flags(text)
    if lone:
        known = all_script_options() if options is script_options else set().union(
            *(options(s) or set() for s in {c["script"] for c in script_calls(text)}))
        errors += [f"line {n}: no script has a flag {flag}" for flag, n in lone
                   if flag not in known and flag not in FOREIGN_FLAGS]
    return errors


# ---------------------------------------------------------------------------------------------- paths

def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of the page's headings: lower case, punctuation dropped, spaces to hyphens, ``-1``,
    ``-2`` for repeats."""
    anchors, seen = set(), {}
    for m in re.finditer(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", prose(text), re.M):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))  # a link's text only
        slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def links(text: str) -> list[tuple[str, int]]:
    """``(target, line number)`` of every markdown link and image outside code."""
    body = re.sub(r"`[^`\n]*`", "", prose(text))
    return [(m.group(1), body.count("\n", 0, m.start()) + 1)
            for m in re.finditer(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", body)]


def path_errors(text: str, page: Path, root: Path = ROOT) -> list[str]:
    """Relative links (from ``page``'s folder) and backticked repository paths (from ``root``) that do not
    resolve."""
    errors = []
    for target, number in links(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            errors.append(f"line {number}: link {target} does not resolve ({path} is missing)")
        elif anchor and path.suffix == ".md":
            page_text = text if path == page else path.read_text()
            if anchor not in heading_anchors(page_text):
                errors.append(f"line {number}: link {target}: no heading #{anchor} in {path.name}")
    for span, number in inline_spans(text):
        for token in span.split():
            token = token.rstrip(".,:;)").split("::")[0]
            if not REPO_PATH.match(token) or token in OUTPUT_PATHS:
                continue
            if not (glob.glob(str(root / token)) if "*" in token else (root / token).exists()):
                errors.append(f"line {number}: path {token} does not exist")
    return errors


# ---------------------------------------------------------------------------------------------- runnable

def runnable_blocks(text: str) -> list[tuple[str, int]]:
    """``(code, line number)`` of the blocks marked ```` ```python runnable ````."""
    return [(code, line) for info, code, line in fenced_blocks(text) if info.split() == ["python", "runnable"]]


def tiny(code: str) -> str:
    for big, small in TINY.items():
        code = code.replace(big, small)
    return code


def run_block(code: str, workdir: Path, name: str = "<docs>") -> str | None:
    """Run one block (made tiny) in ``workdir``, in this process; ``None``, or the error it raised."""
    previous = os.getcwd()
    os.chdir(workdir)
    try:
        exec(compile(tiny(code), name, "exec"), {"__name__": "__docs__"})
    except BaseException as e:  # SystemExit too
        return f"{name}: {type(e).__name__}: {e}"
    finally:
        os.chdir(previous)
    return None


# ---------------------------------------------------------------------------------------------- the docs

def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_readme_is_a_front_page_with_the_ci_command():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 220
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in readme, f".ci/run runs {ci!r}, which README.md must give exactly"
    assert runnable_blocks(readme), "the README's API example is a ```python runnable block"


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_flags_exist_in_the_scripts_that_take_them(page):
    assert flag_errors(page.read_text()) == []


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_links_and_paths_resolve(page):
    assert path_errors(page.read_text(), page) == []


def test_docs_name_real_script_calls():  # the flag check above has something to check
    calls = [c for page in DOCS for c in script_calls(page.read_text())]
    assert len(calls) > 30 and {"training/pretrain.py", "training/plan.py", "benchmarks/gpu_check.py"} <= {
        c["script"] for c in calls}
    assert any(c["launcher"] == "torchrun" and c["launcher_flags"] for c in calls)


BLOCKS = [(page, code, line) for page in DOCS for code, line in runnable_blocks(page.read_text())]


@pytest.mark.parametrize("page,code,line", BLOCKS, ids=[f"{_id(p)}:{n}" for p, _, n in BLOCKS])
def test_runnable_blocks_run(page, code, line, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert not [w for w in NOT_TINY if w in tiny(code)], "a runnable block the TINY replacements do not shrink"
    assert run_block(code, tmp_path, f"{_id(page)}:{line}") is None


def test_every_tiny_replacement_is_used():  # a replacement no block needs any more would hide a renamed one
    codes = [code for _, code, _ in BLOCKS]
    assert [big for big in TINY if not any(big in c for c in codes)] == []


# ---------------------------------------------------------------------------------------------- planted mistakes

PLANTED = """# A page

Pretrain with `python training/pretrain.py --method simclr --temperature 0.1` or

```bash
torchrun --nproc_per_node 2 training/pretrain.py --per_device_train_batch_size 64 \\
    --queue_size 1024 --learning_rat 0.1   # a typo
accelerate launch --multi_gpu --num_processes 8 training/pretrain.py --use_cpu
python training/seeds.py --seeds 0 1 --blur_p 0.5 && python benchmarks/step_time.py --repeats 3
```

Set `--blur_p P`; see [the guide](docs/training.md#the-default-job) and [results](results/bisect/).
"""


def test_reading_the_parsers_leaves_no_trace():
    before_path, before_modules = list(sys.path), set(sys.modules)
    script_options.cache_clear()
    assert "--queue_size" in script_options("training/pretrain.py") and "--smoke" in script_options(
        "benchmarks/gpu_check.py")
    assert "--blur_p" in script_options("training/seeds.py")  # passed through to pretrain.py
    assert script_options("training/false_negative_report.py") == {"-h", "--help"}  # positional only
    assert sys.path == before_path
    assert not [m for m in set(sys.modules) - before_modules if m.startswith("_docs_") or m in ("pretrain", "seeds")]


def test_planted_unknown_flags_are_reported():
    assert flag_errors(PLANTED) == ["line 6: training/pretrain.py has no flag --learning_rat"]
    wrong = PLANTED.replace("--nproc_per_node", "--nprocs_per_node").replace("--repeats", "--rounds")
    wrong = wrong.replace("`--blur_p P`", "`--blurr_p P`").replace("seeds.py --seeds", "seeds.py --seed_list")
    assert sorted(flag_errors(wrong)) == sorted([
        "line 6: training/pretrain.py has no flag --learning_rat",
        "line 6: torchrun has no flag --nprocs_per_node",
        "line 9: training/seeds.py has no flag --seed_list",
        "line 9: benchmarks/step_time.py has no flag --rounds",
        "line 12: no script has a flag --blurr_p",
    ])
    assert flag_errors("`python training/pretrian.py --seed 1`") == ["line 1: training/pretrian.py does not exist"]


def test_calls_split_launcher_flags_from_the_script_flags():
    calls = script_calls(PLANTED)
    torchrun = next(c for c in calls if c["launcher"] == "torchrun")
    assert torchrun["launcher_flags"] == ["--nproc_per_node"]
    assert torchrun["flags"] == ["--per_device_train_batch_size", "--queue_size", "--learning_rat"]
    accelerate = next(c for c in calls if c["launcher"] == "accelerate launch")
    assert accelerate["launcher_flags"] == ["--multi_gpu", "--num_processes"] and accelerate["flags"] == ["--use_cpu"]
    assert [c["script"] for c in calls if c["line"] == 9] == ["training/seeds.py", "benchmarks/step_time.py"]


def test_planted_broken_links_and_paths_are_reported(tmp_path):
    page = ROOT / "README.md"  # links resolve from the repository root
    assert path_errors(PLANTED, page) == []
    broken = (PLANTED.replace("docs/training.md#the-default-job", "docs/training.md#no-such-heading")
              .replace("(results/bisect/)", "(results/bisekt/)")
              + "\nThe script `training/pretrian.py` and the table in `results/pretrain_seeds/summary.md`.\n")
    assert path_errors(broken, page) == [
        "line 12: link docs/training.md#no-such-heading: no heading #no-such-heading in training.md",
        f"line 12: link results/bisekt/ does not resolve ({ROOT / 'results' / 'bisekt'} is missing)",
        "line 14: path training/pretrian.py does not exist",
    ]


def test_heading_anchors_follow_github():
    text = "# Over three seeds: kNN and 1%, 10%\n## `--flag` and A/B\n## Repeat\n## Repeat\n"
    assert heading_anchors(text) == {"over-three-seeds-knn-and-1-10", "--flag-and-ab", "repeat", "repeat-1"}


def test_a_planted_failing_block_is_reported(tmp_path):
    good = "```python runnable\nimport json\nopen('x.json', 'w').write(json.dumps(1))\n```\n"
    bad = "Text.\n\n```python runnable\nx = 1\nassert x == 2, 'the doc is wrong'\n```\n\n```python\nnot run(\n```\n"
    (code, line), = runnable_blocks(good)
    assert run_block(code, tmp_path) is None and (tmp_path / "x.json").exists()  # ran in the folder given
    (code, line), = runnable_blocks(bad)  # the plain ```python block is not run
    assert line == 3 and run_block(code, tmp_path) == "<docs>: AssertionError: the doc is wrong"
    assert "ModuleNotFoundError" in run_block("import no_such_module_here\n", tmp_path)
