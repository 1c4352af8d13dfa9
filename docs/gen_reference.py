"""Writes the reference pages that are generated, never edited by hand:

- ``docs/reference/options.md``: every command's options, from ``conf/`` (each key, its default and
  the comment beside it in the YAML, where the units are stated once);
- ``docs/reference/http-api.md``: the grasp service's HTTP API, from its own OpenAPI document;
- ``docs/reference/errors.md``: every error message a command can end with, from where it is raised.

    .venv/bin/python docs/gen_reference.py           # write them
    .venv/bin/python docs/gen_reference.py --check   # exit 1 if one is out of date (tests/test_docs.py)
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
OUT = ROOT / "docs" / "reference"

#: Each command and the config it composes (``[project.scripts]`` in pyproject.toml names the commands;
#: tests/test_docs.py checks that every one is here).
COMMANDS = {
    "sim2real-pipeline": ["pipeline"],
    "sim2real-render": ["render"],
    "sim2real-adapt": ["adapt"],
    "sim2real-translate": ["translate"],
    "sim2real-train-policy": ["train_policy"],
    "sim2real-train-base": ["base"],
    "sim2real-eval": ["eval"],
    "sim2real-finetune": ["finetune"],
    "sim2real-calibrate": ["calibrate_intrinsics", "calibrate_handeye", "calibrate_refine"],
    "sim2real-capture": ["capture"],
    "sim2real-serve": ["serve"],
    "sim2real-grasp-loop": ["grasp_loop"],
}
#: Folders of conf/ that are not option groups a user picks (Hydra's own, W&B sweep files).
NOT_GROUPS = {"hydra", "sweeps"}

_KEY = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z_][\w.]*)\s*:(?P<rest>.*)$")


def _comment_at(text: str) -> int:
    """Where a YAML line's remainder starts its comment (-1: none); a ``#`` inside quotes is not one."""
    quote = None
    for i, ch in enumerate(text):
        if ch in "'\"" and quote in (None, ch):
            quote = None if quote == ch else ch
        elif ch == "#" and quote is None and (i == 0 or text[i - 1].isspace()):
            return i
    return -1


def _split_comment(text: str) -> tuple[str, str]:
    """(value text, comment) of a YAML line's remainder."""
    i = _comment_at(text)
    return (text.strip(), "") if i < 0 else (text[:i].strip(), text[i + 1:].strip())


def yaml_comments(path: Path) -> tuple[dict[str, str], list[str]]:
    """``{dotted key: the comment beside it}`` of a config file, and its header comment lines.

    A comment-only line whose ``#`` stands in the same column as the comment above it
    continues that comment (the configs wrap long comments so).
    """
    comments: dict[str, str] = {}
    header: list[str] = []
    stack: list[tuple[int, str]] = []
    last_key, last_col, in_header = None, -1, True
    above: list[str] = []  # comment lines standing alone right above the next key
    for line in path.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if in_header and stripped.startswith("#"):
            header.append(stripped.lstrip("#").strip())
            continue
        if stripped and not stripped.startswith("#"):
            in_header = False
        if not stripped:
            above, last_key = [], None
            continue
        if stripped.startswith("#"):
            if last_key is not None and line.index("#") == last_col:
                comments[last_key] = f"{comments[last_key]} {stripped.lstrip('#').strip()}".strip()
            else:
                above.append(stripped.lstrip("#").strip())
                last_key = None
            continue
        m = _KEY.match(line)
        if not m or stripped.startswith("-"):
            last_key, above = None, []
            continue
        indent = len(m["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = ".".join([k for _, k in stack] + [m["key"]])
        stack.append((indent, m["key"]))
        _value, comment = _split_comment(m["rest"])
        if comment:
            comments[key] = comment
            last_key, last_col = key, m.start("rest") + _comment_at(m["rest"])
        else:
            last_key = None
        if above:
            comments[key] = " ".join([*above, comments.get(key, "")]).strip()
            above = []
    return comments, header


_SECTION = object()  # _flat's value for a mapping whose keys follow


def _flat(node, prefix: str = "") -> list[tuple[str, object]]:
    if isinstance(node, dict):
        out = []
        for k, v in node.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict) and v:
                out.append((key, _SECTION))  # a section: its comment, then its keys
                out.extend(_flat(v, key))
            else:
                out.append((key, v))
        return out
    return [(prefix, node)]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _value(v: object) -> str:
    if v is None:
        return "`null`"
    if isinstance(v, str):
        return f"`{v}`" if v else "`''`"
    return f"`{json.dumps(v)}`"


def option_table(path: Path) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """(the table's lines, the defaults list as (group, choice), the header comment) of a config file."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    comments, header = yaml_comments(path)
    defaults = []
    for entry in data.pop("defaults", []) or []:
        if isinstance(entry, dict):
            defaults.extend((str(k), str(v)) for k, v in entry.items())
    data.pop("hydra", None)
    rows = ["| option | default | what it is |", "|---|---|---|"]
    for key, v in _flat(data):
        shown = "(section)" if v is _SECTION else _value(v)
        rows.append(f"| `{key}` | {_cell(shown)} | {_cell(comments.get(key, ''))} |")
    return (rows if len(rows) > 2 else []), defaults, header


def _groups() -> dict[str, list[str]]:
    """``{group: its options}``: the folders of conf/ (nested ones as ``a/b``)."""
    out: dict[str, list[str]] = {}
    for f in sorted(CONF.rglob("*.yaml")):
        rel = f.relative_to(CONF)
        if len(rel.parts) > 1 and rel.parts[0] not in NOT_GROUPS:
            out.setdefault("/".join(rel.parts[:-1]), []).append(f.stem)
    return out


def options_page() -> str:
    groups = _groups()
    lines = ["# Command options", "",
             "Generated by `docs/gen_reference.py` from `conf/`: edit the YAML files, never this page. "
             "Each command composes its config with Hydra; give an option as `key=value` on the command "
             "line (`sim2real-pipeline budget=small seed=3`), a group's option as `group=name`. Units are "
             "stated in each option's comment, once, in `conf/`.", ""]
    for command, names in COMMANDS.items():
        lines += [f"## `{command}`", ""]
        for name in names:
            rows, defaults, header = option_table(CONF / f"{name}.yaml")
            if len(names) > 1:
                lines += [f"### `{name.split('_', 1)[1]}`", ""]
            lines += [f"From `conf/{name}.yaml`.", ""]
            if header:
                lines += ["```text", *header, "```", ""]
            picked = [(g, c) for g, c in defaults if g != "_self_" and not g.startswith("override")]
            if picked:
                lines += ["Groups (choose with `group=option`): " + "; ".join(
                    f"`{g}={c}`" + (f" (options: {', '.join(groups.get(g.split('@')[0], []))})"
                                    if groups.get(g.split('@')[0]) else "")
                    for g, c in picked) + ".", ""]
            lines += rows + [""]
    lines += ["## Config groups", "",
              "What each option of a group sets. A group's keys sit under the group's name in the "
              "command's config (`policy.lr`), unless the file says `# @package _global_`.", ""]
    for group, choices in groups.items():
        for choice in choices:
            path = CONF / group / f"{choice}.yaml"
            rows, _defaults, header = option_table(path)
            lines += [f"### `{group}={choice}`", "", f"From `conf/{group}/{choice}.yaml`.", ""]
            if header:
                lines += ["```text", *header, "```", ""]
            lines += (rows or ["(no options of its own)"]) + [""]
    return "\n".join(lines).rstrip() + "\n"


# ------------------------------------------------------------------ HTTP API
def openapi_spec() -> dict:
    """The service's OpenAPI document, from an app built on a test artifact (no network, no GPU)."""
    from perception.core.testing import make_test_artifact
    from perception.robot.service import create_app

    with tempfile.TemporaryDirectory() as tmp:
        art = make_test_artifact(Path(tmp) / "artifact")
        return create_app(art, background_load=True).openapi()


def _schema(schema: dict, components: dict) -> str:
    ref = schema.get("$ref")
    if ref:
        name = ref.rsplit("/", 1)[-1]
        return f"[`{name}`](#{name.lower()})" if name in components else f"`{name}`"
    if "anyOf" in schema:
        return " or ".join(_schema(s, components) for s in schema["anyOf"])
    if schema.get("type") == "array":
        return f"array of {_schema(schema.get('items', {}), components)}"
    return f"`{schema.get('type', 'object')}`"


def http_api_page(spec: dict) -> str:
    components = spec.get("components", {}).get("schemas", {})
    info = spec.get("info", {})
    lines = ["# HTTP API of `sim2real-serve`", "",
             "Generated by `docs/gen_reference.py` from the service's own OpenAPI document (a running "
             "service serves it at `/openapi.json`, and as one page at `/docs`).", "",
             f"{info.get('description', '')}", "",
             "With a token set (`token=` or `SIM2REAL_TOKEN`), every endpoint but `/healthz` and the docs "
             "needs `Authorization: Bearer TOKEN`.", ""]
    for path, methods in spec.get("paths", {}).items():
        for method, op in methods.items():
            lines += [f"## `{method.upper()} {path}`", ""]
            for key in ("summary", "description"):
                if op.get(key):
                    lines += [op[key].strip(), ""]
            params = op.get("parameters", [])
            if params:
                lines += ["| parameter | in | type | description |", "|---|---|---|---|"]
                for p in params:
                    lines.append(f"| `{p.get('name')}` | {p.get('in')} | {_schema(p.get('schema', {}), components)} | "
                                 f"{_cell(p.get('description', ''))} |")
                lines.append("")
            body = op.get("requestBody", {}).get("content", {})
            if body:
                lines += ["Request body: " + ", ".join(
                    f"`{ct}`" + (f" ({_schema(c['schema'], components)})" if c.get("schema") else "")
                    for ct, c in body.items()), ""]
            responses = op.get("responses", {})
            if responses:
                lines += ["| answer | meaning | body |", "|---|---|---|"]
                for code, r in responses.items():
                    content = r.get("content", {})
                    shown = ", ".join(_schema(c.get("schema", {}), components) for c in content.values()
                                      if c.get("schema"))
                    lines.append(f"| `{code}` | {_cell(r.get('description', ''))} | {shown} |")
                lines.append("")
    if components:
        lines += ["## Schemas", ""]
        for name, s in components.items():
            lines += [f"### {name}", ""]
            if s.get("description"):
                lines += [_cell(s["description"]), ""]
            props = s.get("properties", {})
            if props:
                required = set(s.get("required", []))
                lines += ["| field | type | required | description |", "|---|---|---|---|"]
                for k, v in props.items():
                    lines.append(f"| `{k}` | {_schema(v, components)} | {'yes' if k in required else ''} | "
                                 f"{_cell(v.get('description', v.get('title', '')))} |")
                lines.append("")
    return "\n".join(lines).rstrip() + "\n"


# ------------------------------------------------------------------ errors
#: The packages whose errors reach a user (benchmarks and tests aside).
ERROR_PACKAGES = ("conf", "perception", "sim_render", "adaptation", "policies")
#: Calls whose first argument is a message a command prints and exits on.
_MESSAGE_CALLS = {"fail", "CliError"}


def _template(node: ast.expr) -> str | None:
    """A message's text with each ``{...}`` part shown as ``…``; None when it is not a literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "…" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        a, b = _template(node.left), _template(node.right)
        return None if a is None or b is None else a + b
    return None


def _with_function(tree: ast.AST):
    """Every node with the name of the function (or class) it stands in, outermost first."""
    def walk(node, where):
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{where}.{child.name}" if where else child.name
            yield child, inner
            yield from walk(child, inner)
    yield from walk(tree, "")


def error_messages() -> list[tuple[str, str, str, str]]:
    """``(file, function, error type, message)`` for every error raised with a literal message."""
    found = []
    for package in ERROR_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node, where in _with_function(tree):
                call, kind = None, None
                if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                    call = node.exc
                    func = call.func
                    kind = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) \
                        else None
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _MESSAGE_CALLS:
                    call, kind = node, node.func.id
                if call is None or not kind or not call.args:
                    continue
                if kind.startswith("_") or not (kind.endswith("Error") or kind in _MESSAGE_CALLS
                                                or kind.endswith("Exception")):
                    continue
                text = _template(call.args[0])
                if text is None or len(text.replace("…", "").strip()) < 8:
                    continue
                found.append((str(path.relative_to(ROOT)), where or "(module)", kind, " ".join(text.split())))
    return found


#: What to do about each error, by ``FILE:ErrorType`` or ``ErrorType`` (docs/remedies.yaml).
REMEDIES = ROOT / "docs" / "remedies.yaml"
#: A remedy that marks a check of the code's own invariants.
INTERNAL = "internal"
INTERNAL_TEXT = ("none for a user: a check of the code's own invariants that no input should reach; report it "
                 "with the command and its log")
#: Words with which a message says what to do itself: the value it must take, what it needs, the
#: options known, a command to run.
_SAYS_WHAT_TO_DO = re.compile(
    r"\b(must|should|expects?|expected|needs?|needed|requires?|required|use|set|give|pass|run|rerun|export|render|"
    r"install|choose|pick|remove|delete|copy|send|write|train|recalibrate|calibrate|measure|record|capture|known|"
    r"at least|at most|within|instead|only|allowed|supported|try|point|lower|raise|wait|restart|report|"
    r"open the|unplugged)\b", re.I)


def remedies() -> dict[str, str]:
    """docs/remedies.yaml: what to do, by ``FILE:ErrorType`` or ``ErrorType``."""
    import yaml  # lazy: PyYAML (Hydra's dependency) only where the pages are generated

    data = yaml.safe_load(REMEDIES.read_text(encoding="utf-8")) or {}
    return {str(k): " ".join(str(v).split()) for k, v in data.items()}


def what_to_do(path: str, kind: str, text: str, known: dict[str, str]) -> str | None:
    """What a user does about a message: its remedy in docs/remedies.yaml (by file and type, then
    by type), else "as the message says" where the message says it; None when neither."""
    remedy = known.get(f"{path}:{kind}") or known.get(kind)
    says = _SAYS_WHAT_TO_DO.search(text) is not None
    if remedy == INTERNAL:  # the file's other messages of that type may still be a user's to mend
        return "as the message says" if says else INTERNAL_TEXT
    if remedy:
        return remedy
    return "as the message says" if says else None


def without_remedy() -> list[tuple[str, str, str, str]]:
    """The messages that neither say what to do nor have a remedy in docs/remedies.yaml."""
    known = remedies()
    return [m for m in error_messages() if what_to_do(m[0], m[2], m[3], known) is None]


def errors_page() -> str:
    lines = ["# Error messages", "",
             "Generated by `docs/gen_reference.py` from every place in the source that raises an error with "
             "a written message (`…` stands for the part filled in at run time). A command ends on one of "
             "these with `PROG: error: MESSAGE` and exit code 2 (a bad option, file or input), or exit 1 "
             "(a failure while it ran). Each message names what was wrong. What to do: each file's section "
             "says it once for each kind of error (from `docs/remedies.yaml`), and a message that says it "
             "itself is marked \"as the message says\". The [troubleshooting page](../guide/troubleshooting.md) "
             "explains the ones met most. Search this page for the words of your message.", ""]
    known = remedies()
    by_file: dict[str, list[tuple[str, str, str, str]]] = {}
    for path, where, kind, text in error_messages():
        remedy = what_to_do(path, kind, text, known) or "(no remedy written: docs/remedies.yaml)"
        by_file.setdefault(path, []).append((where, kind, text, remedy))
    for path, items in by_file.items():
        # A remedy shared by several messages is said once, above the file's messages.
        shared = {kind: remedy for _w, kind, _t, remedy in items
                  if remedy not in ("as the message says", INTERNAL_TEXT) and not remedy.startswith("(no remedy")}
        lines += [f"## `{path}`", ""]
        if shared:
            lines += ["| error | what to do |", "|---|---|"]
            lines += [f"| `{kind}` | {_cell(remedy)} |" for kind, remedy in shared.items()]
            lines.append("")
        lines += ["| raised in | error | message | what to do |", "|---|---|---|---|"]
        for where, kind, text, remedy in items:
            said = (f"see `{kind}` above" if kind in shared and shared[kind] == remedy
                    else "internal: report it" if remedy == INTERNAL_TEXT else remedy)
            lines.append(f"| `{where}` | `{kind}` | {_cell(text)} | {_cell(said)} |")
        lines.append("")
    lines += [f"\"internal: report it\": {INTERNAL_TEXT}."]
    return "\n".join(lines).rstrip() + "\n"


def pages() -> dict[Path, str]:
    return {OUT / "options.md": options_page(), OUT / "http-api.md": http_api_page(openapi_spec()),
            OUT / "errors.md": errors_page()}


def scripts() -> list[str]:
    """The commands pyproject.toml installs."""
    return sorted(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a generated page is out of date; write nothing")
    args = ap.parse_args(argv)
    stale = []
    for path, text in pages().items():
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    if stale:
        print(f"out of date: {', '.join(stale)}; run: python docs/gen_reference.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
