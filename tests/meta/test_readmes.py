"""The READMEs and docs/ against the code, as CoreDNS's readme_test.go does for its plugins.

What is checked, for README.md, docs/*.md and every region_agent/<component>/README.md:

- every component folder has a README whose ``##`` sections are exactly SECTIONS, in order;
- every markdown link to a repository path resolves (and its ``#anchor`` names a heading), and
  every code span that names a repository path (``tests/fakes/kube_api.py``, ``geoip/source.py``,
  a bare ``probe.py``, ``region_agent.kube.watch``) names one that exists;
- the root README is at most 150 lines and starts with the two commands (set up and run the demo;
  set up and pass the tests);
- every ``region-agent ...`` command line shown (in code blocks and code spans) names real
  subcommands and options, and ``region-agent <subcommand> --help`` exits 0 for each;
- every example marked ``<!-- check-config -->`` (a settings file), ``<!-- check-zone -->`` (a
  zone file) or ``<!-- check-values -->`` (chart values: ``config`` is the settings file,
  ``zoneFile`` the zone file) just before its fenced block passes ``region-agent check-config``;
- every ``region_agent_*`` metric a component defines is named in its README's Metrics section,
  and every metric those sections list is defined;
- every settings field is named, with its environment variable, in the Settings section of the
  README of the component that owns it.

Examples are checked in a temporary directory: absolute paths in them (``/var/run/secrets/...``)
are moved under it, files named by a ``*_file`` setting are created there with a plausible
content, and the placeholder ``<base64>`` becomes a real base64 secret.
"""

from __future__ import annotations

import argparse
import ast
import base64
import contextlib
import functools
import os
import re
import shlex
import subprocess
import sys
import types
import typing
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from region_agent.app.settings import AgentSettings
from region_agent.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "region_agent"
SECTIONS = ("What it does", "Neighbours", "Settings", "Metrics", "How it is tested")
ROOT_README_MAX_LINES = 150
COMPONENTS = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *(PACKAGE / name / "README.md" for name in COMPONENTS)]
EXAMPLE_KINDS = ("check-config", "check-zone", "check-values")
SECRET = base64.b64encode(b"k" * 32).decode()
# Top-level settings fields whose owner is not app (the module that defines AgentSettings).
TOP_LEVEL_OWNERS = {"zone_file": "zonefile", "zone_file_poll_interval": "zonefile", "zone_file_settle": "zonefile",
                    "zone_file_max_bytes": "zonefile", "zone_file_allow_mass_removal": "zonefile",
                    "state_file": "state", "state_file_interval": "state"}


# --- reading markdown ------------------------------------------------------------------------

_FENCE = re.compile(r"^(\s*)(```|~~~)")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    info: str
    text: str
    marker: str | None  # the <!-- check-... --> just before it


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@functools.cache
def _lines(path: Path) -> tuple[str, ...]:
    return tuple(path.read_text(encoding="utf-8").splitlines())


def _blocks(path: Path) -> list[Block]:
    blocks: list[Block] = []
    lines = _lines(path)
    marker: str | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        found = re.fullmatch(r"\s*<!--\s*(check-[a-z]+)\s*-->\s*", line)
        if found:
            assert found.group(1) in EXAMPLE_KINDS, f"{_rel(path)}:{i + 1}: unknown marker {found.group(1)}"
            marker = found.group(1)
            i += 1
            continue
        fence = _FENCE.match(line)
        if fence:
            indent, token = fence.group(1), fence.group(2)
            info = line.strip()[3:].strip()
            body: list[str] = []
            start = i
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(token):
                body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
                i += 1
            blocks.append(Block(path, start + 1, info, "\n".join(body) + "\n", marker))
            marker = None
        elif line.strip():
            assert marker is None, f"{_rel(path)}:{i + 1}: <!-- {marker} --> must come just before a fenced block"
        i += 1
    assert marker is None, f"{_rel(path)}: <!-- {marker} --> at the end, with no block after it"
    return blocks


def _prose(path: Path) -> list[tuple[int, str]]:
    """The lines outside fenced blocks, numbered from 1."""
    out: list[tuple[int, str]] = []
    inside: str | None = None
    for number, line in enumerate(_lines(path), 1):
        fence = _FENCE.match(line)
        if fence:
            inside = None if inside == fence.group(2) else (inside or fence.group(2))
            continue
        if inside is None:
            out.append((number, line))
    return out


def _headings(path: Path) -> list[tuple[int, str]]:
    found = []
    for _, line in _prose(path):
        heading = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if heading:
            found.append((len(heading.group(1)), heading.group(2)))
    return found


def _slugs(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file."""
    seen: dict[str, int] = {}
    slugs = set()
    for _, title in _headings(path):
        slug = re.sub(r"[^\w\- ]", "", title.lower().replace("`", "")).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        slugs.add(slug if count == 0 else f"{slug}-{count}")
    return slugs


def _section(path: Path, title: str) -> str:
    """The text of one ``##`` section, its code blocks included."""
    text, keep = [], False
    inside: str | None = None
    for line in _lines(path):
        fence = _FENCE.match(line)
        if fence:
            inside = None if inside == fence.group(2) else (inside or fence.group(2))
        elif inside is None and line.startswith("## "):
            keep = line[3:].strip() == title
            continue
        if keep:
            text.append(line)
    return "\n".join(text)


def _code_spans(path: Path) -> Iterator[tuple[int, str]]:
    for number, line in _prose(path):
        for span in re.findall(r"`([^`\n]+)`", line):
            yield number, span


# --- the fixed sections, the root README's length ---------------------------------------------

@pytest.mark.parametrize("component", COMPONENTS)
def test_every_component_has_a_readme_with_the_fixed_sections(component: str) -> None:
    readme = PACKAGE / component / "README.md"
    assert readme.is_file(), f"region_agent/{component}/ has no README.md"
    titles = [title for level, title in _headings(readme) if level == 2]
    assert tuple(titles) == SECTIONS, f"{_rel(readme)}: ## sections {titles}, expected {list(SECTIONS)} in order"
    assert _headings(readme)[0] == (1, component), f"{_rel(readme)} must start with '# {component}'"


def test_the_root_readme_is_short() -> None:
    count = len(_lines(ROOT / "README.md"))
    assert count <= ROOT_README_MAX_LINES, f"README.md has {count} lines; at most {ROOT_README_MAX_LINES}"


def test_the_root_readme_starts_with_the_two_commands() -> None:
    first, second = (block.text.strip() for block in _blocks(ROOT / "README.md")[:2])
    assert first == "bash scripts/setup.sh && .venv/bin/region-agent demo"
    assert second == "bash scripts/test.sh"


# --- links and paths --------------------------------------------------------------------------

def _links() -> list[tuple[Path, int, str]]:
    found: list[tuple[Path, int, str]] = []
    for path in DOCS:
        for number, line in _prose(path):
            outside_code = re.sub(r"`[^`]*`", "", line)
            found.extend((path, number, target)
                         for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", outside_code))
    return found


def test_every_link_to_a_repository_path_resolves() -> None:
    broken = []
    for path, number, target in _links():
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        where = f"{_rel(path)}:{number}: {target}"
        if not resolved.exists() or not resolved.is_relative_to(ROOT):
            broken.append(f"{where} (no such path)")
        elif anchor and resolved.suffix == ".md" and anchor not in _slugs(resolved):
            broken.append(f"{where} (no heading #{anchor} in {_rel(resolved)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


@functools.cache
def _repo_basenames() -> frozenset[str]:
    names: set[str] = set()
    for base in ("region_agent", "tests", "bench", "scripts", "container", "helm", "deploy", "docs"):
        names.update(p.name for p in (ROOT / base).rglob("*") if "__pycache__" not in p.parts)
    return frozenset(names)


def _path_problem(readme: Path, span: str) -> str | None:
    """Why a code span that names a repository path names none, or None (also for spans that are no path)."""
    token = span.strip().rstrip(":,.")
    if re.fullmatch(r"region_agent(\.\w+)+", token):
        parts = token.split(".")
        for end in range(len(parts), 1, -1):
            base = ROOT.joinpath(*parts[:end])
            if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
                return None
        return "no such module"
    if re.search(r"[\s$<>{}*=:@]", token) or token.startswith(("/", "~", ".", "-", "http")):
        return None
    if "/" not in token:
        if token.endswith(".py") and token not in _repo_basenames():
            return "no file of that name in the repository"
        return None
    first = token.split("/", 1)[0]
    for base in (ROOT, PACKAGE, readme.parent):
        if (base / first).exists():
            return None if (base / token).exists() else f"no {token} under {_rel(base) if base != ROOT else '.'}"
    return None  # not a repository path (serving.knative.dev/v1, ...)


def test_every_path_named_in_a_code_span_exists() -> None:
    missing = [f"{_rel(path)}:{number}: `{span}`: {problem}"
               for path in DOCS for number, span in _code_spans(path)
               if (problem := _path_problem(path, span)) is not None]
    assert not missing, "stale paths:\n" + "\n".join(missing)


# --- documented commands ----------------------------------------------------------------------

_COMMAND = re.compile(r"(?:^\s*(?:\$\s+)?|\$\(|&&\s*|\|\|?\s*|;\s*)(?:[\w./-]*/)?region-agent(?=\s|$)([^\n]*)")


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def _command_lines() -> list[tuple[str, str]]:
    """(where, the words after ``region-agent``) for every command line the docs show."""
    found: list[tuple[str, str]] = []

    def scan(where: str, text: str) -> None:
        for match in _COMMAND.finditer(text):
            rest = re.split(r"\s#|\s\||&&|;|\)|\s>|`", match.group(1))[0]
            found.append((where, rest))

    for path in DOCS:
        for block in _blocks(path):
            joined = re.sub(r"\\\n\s*", " ", block.text)
            for offset, line in enumerate(joined.splitlines(), 1):
                scan(f"{_rel(path)}:{block.line + offset}", line)
        for number, span in _code_spans(path):
            scan(f"{_rel(path)}:{number}", span)
    return found


def _parse_command(words: str) -> tuple[tuple[str, ...], list[str]]:
    """The subcommand path and the options of one documented command line."""
    try:
        tokens = shlex.split(words)
    except ValueError:
        tokens = words.split()
    tokens = [t.strip("[]") for t in tokens if t.strip("[]")]
    parser, path = build_parser(), []
    while tokens and tokens[0] in _subcommands(parser):
        path.append(tokens[0])
        parser = _subcommands(parser)[tokens.pop(0)]
    if tokens and not path and not tokens[0].startswith("-"):
        raise ValueError(f"{tokens[0]!r} is not a region-agent subcommand")
    options = [t.split("=", 1)[0] for t in tokens if t.startswith("-")]
    return tuple(path), options


def _documented_commands() -> dict[tuple[str, ...], str]:
    """Each subcommand path shown, with the first place it is shown."""
    commands: dict[tuple[str, ...], str] = {}
    for where, words in _command_lines():
        with contextlib.suppress(ValueError):
            commands.setdefault(_parse_command(words)[0], where)
    return commands


def test_documented_command_lines_name_real_subcommands_and_options() -> None:
    problems = []
    for where, words in _command_lines():
        try:
            path, options = _parse_command(words)
        except ValueError as exc:
            problems.append(f"{where}: region-agent {words.strip()}: {exc}")
            continue
        parser, known = build_parser(), set()
        known |= _options(parser)
        for name in path:
            parser = _subcommands(parser)[name]
            known |= _options(parser)
        unknown = [option for option in options if option not in known]
        if unknown:
            problems.append(f"{where}: region-agent {' '.join(path)}: no option {', '.join(unknown)}")
    assert not problems, "\n".join(problems)
    # The docs show the commands an operator needs; losing them all would pass the rest silently.
    assert {("run",), ("demo",), ("check-config",), ("zone",), ("keys", "install")} <= set(_documented_commands())


@pytest.mark.parametrize("path", sorted(_documented_commands()), ids=lambda p: " ".join(p) or "(none)")
def test_help_of_every_documented_subcommand_exits_0(path: tuple[str, ...], capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    with pytest.raises(SystemExit) as done:
        main([*path, "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: region-agent {' '.join(path)}".rstrip())


def test_the_console_script_runs() -> None:
    done = subprocess.run([*_region_agent(), "--help"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    for name in _subcommands(build_parser()):
        assert name in done.stdout


# --- examples through region-agent check-config -----------------------------------------------

def _region_agent() -> list[str]:
    script = Path(sys.executable).with_name("region-agent")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "region_agent"]


def _examples() -> list[Block]:
    return [block for path in DOCS for block in _blocks(path) if block.marker is not None]


def _file_content(key: str) -> str:
    if key.endswith("token_file"):
        return "t0ken\n"
    if key == "keyring_file":
        return f'{{"primary": "{SECRET}", "keys": ["{SECRET}"]}}\n'
    if key == "tsig_keys_file":
        return f"file-key: {{algorithm: hmac-sha256, secret: {SECRET}}}\n"  # not a name the example has inline
    return ""


def _localise(node: Any, tmp: Path, key: str = "") -> Any:
    """Absolute paths moved under ``tmp``; files named by ``*_file`` settings created there."""
    if isinstance(node, dict):
        return {k: _localise(v, tmp, str(k)) for k, v in node.items()}
    if isinstance(node, list):
        return [_localise(v, tmp, key) for v in node]
    if isinstance(node, str) and node.startswith("/"):
        moved = tmp / node.lstrip("/")
        if key.endswith("_file") and not moved.exists():
            moved.parent.mkdir(parents=True, exist_ok=True)
            moved.write_text(_file_content(key))
        return str(moved)
    return node


DEMO_ZONE = (PACKAGE / "demo" / "zone.yaml").read_text()


def _prepare(block: Block, tmp: Path) -> list[str]:
    """Write the example's files under ``tmp``; the check-config arguments that check them."""
    text = block.text.replace("<base64>", SECRET)
    if block.marker == "check-zone":
        (tmp / "zone.yaml").write_text(text)
        return ["--zone-file", str(tmp / "zone.yaml")]
    data = yaml.safe_load(text)
    assert isinstance(data, dict), "the example is not a YAML mapping"
    if block.marker == "check-values":
        config = data.get("config")
        assert isinstance(config, dict), "chart values without a config mapping"
        if isinstance(data.get("zoneFile"), str):
            (tmp / "zone.yaml").write_text(data["zoneFile"])
    else:
        config = data
    if isinstance(config.get("zone_file"), str) and not (tmp / config["zone_file"]).exists():
        (tmp / config["zone_file"]).write_text(DEMO_ZONE)  # a settings example naming a zone file
    (tmp / "agent.yaml").write_text(yaml.safe_dump(_localise(config, tmp)))
    return ["--config", str(tmp / "agent.yaml")]


def _check_config(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REGION_AGENT_")}
    return subprocess.run([*_region_agent(), "check-config", *args], capture_output=True, text=True, env=env,
                          timeout=120, check=False)


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str] | str]:
    """Every example through check-config at once (the runs are processes; two at a time)."""
    jobs: dict[str, list[str]] = {}
    results: dict[str, subprocess.CompletedProcess[str] | str] = {}
    for block in _examples():
        name = f"{_rel(block.path)}:{block.line}"
        try:
            jobs[name] = _prepare(block, tmp_path_factory.mktemp("example"))
        except (AssertionError, yaml.YAMLError) as exc:
            results[name] = f"can not be prepared: {exc}"
    jobs["region_agent/demo/agent.yaml"] = ["--config", str(PACKAGE / "demo" / "agent.yaml")]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results.update(zip(jobs, pool.map(_check_config, jobs.values()), strict=True))
    return results


def test_examples_are_marked() -> None:
    kinds = {block.marker for block in _examples()}
    assert kinds == set(EXAMPLE_KINDS), f"markers found: {sorted(k or '' for k in kinds)}"


@pytest.mark.parametrize("example", [*(f"{_rel(b.path)}:{b.line}" for b in _examples()),
                                     "region_agent/demo/agent.yaml"])
def test_every_marked_example_passes_check_config(example: str,
                                                  checked: dict[str, subprocess.CompletedProcess[str] | str]) -> None:
    result = checked[example]
    assert not isinstance(result, str), f"{example}: {result}"
    assert result.returncode == 0, f"{example}: region-agent check-config exit {result.returncode}:\n{result.stderr}"


# --- metrics ----------------------------------------------------------------------------------

def _loop_names(loop: ast.For, constants: dict[str, ast.expr]) -> tuple[str, list[str]] | None:
    """The loop variable and the strings it takes, for ``for name[, ...] in <literal or constant>``."""
    target = loop.target.elts[0] if isinstance(loop.target, ast.Tuple) else loop.target
    source = constants.get(loop.iter.id) if isinstance(loop.iter, ast.Name) else loop.iter
    if not isinstance(target, ast.Name) or not isinstance(source, ast.Tuple | ast.List):
        return None
    values = []
    for element in source.elts:
        first = element.elts[0] if isinstance(element, ast.Tuple) and element.elts else element
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            values.append(first.value)
    return target.id, values


def _metrics_in(source: str) -> set[str]:
    """The region_agent_* metric names one module defines: literals, ``prefix + "name"``, f-strings in loops."""
    tree = ast.parse(source)
    names = set(re.findall(r"[\"'](region_agent_[a-z0-9_]*[a-z0-9])[\"']", source))
    prefixes = {node.targets[0].id: node.value.value for node in ast.walk(tree)
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                and node.value.value.startswith("region_agent_")}
    constants = {node.targets[0].id: node.value for node in tree.body
                 if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)}
    for node in ast.walk(tree):
        if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and isinstance(node.left, ast.Name)
                and node.left.id in prefixes and isinstance(node.right, ast.Constant)):
            names.add(prefixes[node.left.id] + str(node.right.value))
        if isinstance(node, ast.For) and (loop := _loop_names(node, constants)) is not None:
            variable, values = loop
            for inner in ast.walk(node):
                if (isinstance(inner, ast.JoinedStr) and len(inner.values) == 2
                        and isinstance(inner.values[0], ast.Constant)
                        and str(inner.values[0].value).startswith("region_agent_")
                        and isinstance(inner.values[1], ast.FormattedValue)
                        and isinstance(inner.values[1].value, ast.Name) and inner.values[1].value.id == variable):
                    names.update(str(inner.values[0].value) + value for value in values)
    return names


@functools.cache
def _defined_metrics() -> dict[str, set[str]]:
    """component → the metric names its modules define."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        component = path.relative_to(PACKAGE).parts[0]
        found.setdefault(component, set()).update(_metrics_in(path.read_text(encoding="utf-8")))
    return found


def _named(name: str, text: str) -> bool:
    return re.search(rf"(?<![a-z0-9_]){re.escape(name)}(_total)?(?![a-z0-9_])", text) is not None


def test_the_metric_scan_finds_what_the_agent_registers() -> None:
    every = set().union(*_defined_metrics().values())
    assert {"region_agent_dns_responses", "region_agent_usage_open_sessions", "region_agent_gossip_probes",
            "region_agent_task_running", "region_agent_kube_events_total"} <= every


@pytest.mark.parametrize("component", COMPONENTS)
def test_every_metric_is_in_its_components_readme(component: str) -> None:
    readme = PACKAGE / component / "README.md"
    text = _section(readme, "Metrics")
    missing = sorted(name for name in _defined_metrics().get(component, set()) if not _named(name, text))
    assert not missing, f"{_rel(readme)} ## Metrics does not name: {', '.join(missing)}"


@pytest.mark.parametrize("component", COMPONENTS)
def test_every_metric_a_readme_lists_is_defined(component: str) -> None:
    readme = PACKAGE / component / "README.md"
    every = set().union(*_defined_metrics().values())
    listed = re.findall(r"^\|\s*`(region_agent_[a-z0-9_]+)`", _section(readme, "Metrics"), flags=re.M)
    unknown = [name for name in listed
               if not any(re.sub(suffix + "$", "", name) in every for suffix in ("", "_total", "_bucket"))]
    assert not unknown, f"{_rel(readme)} lists metrics no code defines: {', '.join(unknown)}"


# --- settings ---------------------------------------------------------------------------------

def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                return arg
    return None


def _settings_fields(model: type[BaseModel] = AgentSettings, path: tuple[str, ...] = ()
                     ) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(owning component, field path) for every leaf field of the agent's settings."""
    for name, field in model.model_fields.items():
        sub = _model_of(field.annotation)
        if sub is not None:
            yield from _settings_fields(sub, (*path, name))
            continue
        owner = model.__module__.split(".")[1]
        if model is AgentSettings:
            owner = TOP_LEVEL_OWNERS.get(name, owner)
        yield owner, (*path, name)


def test_the_settings_walk_covers_every_group() -> None:
    owners = {owner for owner, _ in _settings_fields()}
    assert {"app", "checks", "cluster", "globaldns", "gossip", "health", "kube", "state", "usage",
            "zonefile"} <= owners


@pytest.mark.parametrize("component", COMPONENTS)
def test_every_setting_is_in_its_owners_readme_with_its_environment_variable(component: str) -> None:
    readme = PACKAGE / component / "README.md"
    text = _section(readme, "Settings")
    missing = []
    for owner, path in _settings_fields():
        if owner != component:
            continue
        env = "REGION_AGENT_" + "__".join(part.upper() for part in path)
        if not re.search(rf"`(?:[a-z_]+\.)*{re.escape(path[-1])}`", text) or env not in text:
            missing.append(f"{'.'.join(path)} ({env})")
    assert not missing, f"{_rel(readme)} ## Settings does not name: {', '.join(missing)}"
