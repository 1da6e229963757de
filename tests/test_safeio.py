"""aotbuild/utils/safeio.py is the one reader and writer of outside files (docs/security.md): its refusals, and
an AST check that no other module opens, parses or renames files except an explicit allow-list."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aotbuild.utils import safeio

PACKAGE = Path(__file__).resolve().parent.parent / "aotbuild"

#: Attribute calls that open, read or write a file, whatever they are called on (Path, os, tarfile ...).
FILE_ATTRS = {"open", "fdopen", "read_text", "read_bytes", "write_text", "write_bytes"}
#: module.function calls that parse data or move files into place.
MODULE_CALLS = {("json", "load"), ("json", "loads"), ("tomllib", "load"), ("tomllib", "loads"), ("tomli", "load"),
                ("tomli", "loads"), ("os", "replace"), ("os", "rename"), ("shutil", "move"), ("pickle", "load"),
                ("pickle", "loads"), ("marshal", "loads")}

#: (module file, function) -> why it may open, parse or rename itself. "*": the whole module. Every
#: entry must still match a call (a stale entry fails the test), so the list stays short and true.
ALLOWED = {
    ("aotbuild/builder/child.py", "*"): "the child-process protocol: spec, phase, result and log files aotbuild writes "
                                "in its own private temp folder for its own child",
    ("aotbuild/builder/loader.py", "*"): "the serving child's protocol (spec, job and log files in aotbuild's private "
                                 "temp folder) and its stdout pipe",
    ("aotbuild/builder/build.py", "_build_group"): "the phase file of the child-process protocol (a private temp "
                                                   "folder)",
    ("aotbuild/builder/build.py", "_keep_log"): "copies the build child's own log next to the failure it explains",
    ("aotbuild/cli/doctor.py", "check_roundtrip"): "writes doctor's own recipe into its own temp folder",
    ("aotbuild/cli/commands.py", "_run"): "opens os.devnull",
    ("aotbuild/pipeline/images.py", "_load"): "Pillow decodes bytes safeio.read_bytes read, bounded (a BytesIO, no "
                                              "file); Pillow refuses decompression bombs itself",
    ("aotbuild/pipeline/textlen.py", "Pattern.sizes"): "parses the signature this process made of a live call's inputs "
                                              "(dispatch.signature), once per call: no file, no outside text",
    ("aotbuild/cache/locks.py", "_open"): "lock files: opened for flock only, their content never read or written",
    ("aotbuild/cache/locks.py", "is_unlocked"):
        "lock files: opened for flock only, their content never read or written",
    ("aotbuild/builtin/__init__.py", "ensure"): "publishes a built-in model folder it just created by one rename",
    ("aotbuild/pipeline/pipecall.py", "_pipeline_files"): "package data: the installed diffusers' own source files",
    ("aotbuild/pipeline/pipecall.py", "_signature_from_source"):
        "package data: the installed diffusers' own source files",
    ("aotbuild/cli/bench.py", "_cpu_model"): "the kernel's /proc/cpuinfo",
    ("aotbuild/targets/neuron.py", "NeuronTarget.hardware_kind"): "the kernel's /sys DMI product name",
    ("aotbuild/targets/inductor.py", "InductorTarget.install"): "the compiler's own files: hash-verified blobs "
                                                                 "copied into Inductor's cache folder",
    ("aotbuild/strategies/aot_compile.py", "AotCompile.install"): "the compiler's own files: a hash-verified "
                                                                   "blob handed to torch.compiler",
    ("aotbuild/remote/schemes.py", "_write_pack"): "tarfile over the file safeio.atomic_write opened",
    ("aotbuild/remote/schemes.py", "_read_pack"): "tarfile over a pack safeio.open_regular opened, hashed before",
}


def _raw_calls(path: Path) -> list[tuple[str, str, int]]:
    """(function qualname, call, line) of every file-opening, -parsing or -renaming call in ``path``.
    ``json.loads(json.dumps(...))`` (a round trip of data in memory) and calls on ``safeio`` are not."""
    found: list[tuple[str, str, int]] = []
    scope: list[str] = []

    class Visitor(ast.NodeVisitor):
        def _scoped(self, node: ast.AST) -> None:
            scope.append(node.name)  # type: ignore[attr-defined]
            self.generic_visit(node)
            scope.pop()

        visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

        def visit_Call(self, node: ast.Call) -> None:
            f, name = node.func, None
            if isinstance(f, ast.Name) and f.id == "open":
                name = "open"
            elif isinstance(f, ast.Attribute):
                base = f.value.id if isinstance(f.value, ast.Name) else "_"
                round_trip = (f.attr == "loads" and node.args and isinstance(node.args[0], ast.Call)
                              and isinstance(node.args[0].func, ast.Attribute) and node.args[0].func.attr == "dumps")
                if base == "safeio":
                    pass
                elif f.attr in FILE_ATTRS or ((base, f.attr) in MODULE_CALLS and not round_trip):
                    name = f"{base}.{f.attr}"
                elif base == "yaml" and any(w in f.attr.lower() for w in ("load", "compose", "parse", "scan")):
                    name = f"yaml.{f.attr}"
            if name:
                found.append((".".join(scope) or "<module>", name, node.lineno))
            self.generic_visit(node)

    Visitor().visit(ast.parse(path.read_text(encoding="utf-8")))
    return found


def test_only_safeio_opens_parses_or_renames_files_outside_the_allow_list():
    used: set[tuple[str, str]] = set()
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if rel == "aotbuild/utils/safeio.py":
            continue
        for function, call, line in _raw_calls(path):
            entry = next((k for k in ((rel, function), (rel, "*")) if k in ALLOWED), None)
            if entry is None:
                offenders.append(f"{rel}:{line} {function}: {call}(...)")
            else:
                used.add(entry)
    assert offenders == [], "read and write outside files through aotbuild.utils.safeio (or allow-list it, with why)"
    assert sorted(set(ALLOWED) - used) == []  # a stale entry: remove it


def test_the_check_sees_each_kind_of_raw_call(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import json, os, yaml\nfrom pathlib import Path\n"
                      "def f(p):\n    open(p)\n    Path(p).read_text()\n    json.loads(p)\n    yaml.safe_load(p)\n"
                      "    os.replace(p, p)\n    json.loads(json.dumps(p))\n    safeio.read_bytes(p, 1)\n")
    assert [c for _, c, _ in _raw_calls(source)] == ["open", "_.read_text", "json.loads", "yaml.safe_load",
                                                     "os.replace"]


# -- reading ----------------------------------------------------------------------------------

@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    with pytest.raises(safeio.NotRegularFile):
        safeio.read_bytes(fifo, 100)
    with pytest.raises(safeio.NotRegularFile):
        safeio.read_tail(fifo, 100)
    with pytest.raises(safeio.NotRegularFile):
        safeio.append_line(fifo, "x")


def test_a_folder_and_a_device_are_not_regular_files(tmp_path):
    with pytest.raises(safeio.NotRegularFile) as exc:
        safeio.read_bytes(tmp_path, 100)
    assert exc.value.is_dir
    if os.path.exists("/dev/zero"):  # a device would feed a reader forever
        with pytest.raises(safeio.NotRegularFile):
            safeio.read_bytes("/dev/zero", 100)


def test_the_size_cap(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 101)
    with pytest.raises(safeio.FileTooLarge) as exc:
        safeio.read_bytes(path, 100)
    assert exc.value.size == 101
    assert safeio.read_bytes(path, 101) == b"x" * 101
    path.write_bytes(b"".join(b"line %d\n" % i for i in range(1000)))
    tail = safeio.read_tail(path, 100, follow_symlinks=True)
    assert len(tail) <= 100 and tail.endswith(b"line 999\n") and tail.startswith(b"line ")


def test_each_caller_decides_what_a_symlink_out_means(tmp_path):
    folder, outside = tmp_path / "model", tmp_path / "secret"
    folder.mkdir()
    outside.write_text("{}")
    (folder / "link.json").symlink_to(outside)
    assert safeio.read_bytes(folder / "link.json", 100) == b"{}"  # a trusted key's link: the operator's choice
    with pytest.raises(safeio.LinkRefused):
        safeio.read_bytes(folder / "link.json", 100, within=folder)  # a model folder's link out of it
    with pytest.raises(safeio.LinkRefused):
        safeio.read_bytes(folder / "link.json", 100, follow_symlinks=False)  # a store's file is never a link
    (folder / "inside.json").write_text("{}")
    (folder / "link2.json").symlink_to(folder / "inside.json")
    assert safeio.read_json(folder / "link2.json", max_bytes=100, max_depth=2, within=folder) == {}


def test_json_depth_is_checked_before_parsing_and_nan_is_refused():
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(safeio.TooDeep) as exc:
        safeio.loads_json(deep, max_bytes=1 << 20, max_depth=32)
    assert exc.value.depth == 100_000
    assert safeio.loads_json('{"a": "[[[[[[", "b": [[1]]}', max_bytes=100, max_depth=3)["b"] == [[1]]
    for constant in ("NaN", "Infinity", "-Infinity"):
        with pytest.raises(safeio.BadData, match="not JSON"):
            safeio.loads_json(f'{{"x": {constant}}}', max_bytes=100, max_depth=3)
    with pytest.raises(safeio.BadData, match="more than the 10"):
        safeio.loads_json('{"x": "0123456789"}', max_bytes=10, max_depth=3)
    with pytest.raises(safeio.BadData, match="not UTF-8"):
        safeio.loads_json(b'{"x": "\xff"}', max_bytes=100, max_depth=3)


def test_json_depth_skips_escaped_quotes_and_is_linear_on_unterminated_strings():
    assert safeio.json_depth(r'["a\"[", [1]]') == 2  # an escaped quote does not end the string
    assert safeio.json_depth(r'["a\\", [1]]') == 2  # an escaped backslash does not escape the quote
    assert safeio.json_depth('["never closed [[[[') == 1
    # A quote followed by 200,000 escaped quotes never closes: a whole-string regular expression
    # backtracks from each of them (minutes here, hours at 1 MB). Run in a child with a hang guard, not a time limit.
    code = "from aotbuild.utils import safeio; print(safeio.json_depth('\"' + '\\\\\"' * 200_000))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)})
    assert proc.returncode == 0 and proc.stdout.strip() == "0", proc.stderr[-2000:]


def test_toml_and_yaml_depth_is_checked_before_parsing():
    with pytest.raises(safeio.TooDeep):
        safeio.loads_toml("a = " + "[" * 5000 + "]" * 5000, max_depth=64)
    assert safeio.loads_toml("[tool.aotbuild]\ncache = 'c'\n", max_depth=64) == {"tool": {"aotbuild": {"cache": "c"}}}
    with pytest.raises(safeio.TooDeep):
        safeio.loads_yaml("a: " + "[" * 5000 + "]" * 5000, max_nodes=100_000, max_depth=64, max_string=100)
    bomb = "a: &a [x, x]\n" + "".join(f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}]\n"
                                      for i in range(20))
    with pytest.raises(safeio.BadData, match="expands to more than"):
        safeio.loads_yaml(bomb, max_nodes=100_000, max_depth=64, max_string=100)


# -- writing ----------------------------------------------------------------------------------

def test_an_atomic_write_replaces_whole_or_not_at_all(tmp_path):
    target = tmp_path / "f.json"
    target.write_text("old")
    with safeio.atomic_write(target, mode=0o640) as w:
        w.file.write(b"new")
        assert target.read_text() == "old"  # readers see the old file until the rename
    assert target.read_text() == "new" and (target.stat().st_mode & 0o777) == 0o640
    with pytest.raises(RuntimeError), safeio.atomic_write(target) as w:
        w.file.write(b"half")
        raise RuntimeError("disk full")
    assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]  # no temp file left behind
    with safeio.atomic_write(target) as w:
        w.file.write(b"dropped")
        w.discard()
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


def test_place_and_write_new_leave_no_temp_and_never_overwrite(tmp_path):
    def failing(tmp: Path) -> None:
        tmp.write_bytes(b"part")
        raise OSError("copy failed")

    with pytest.raises(OSError, match="copy failed"):
        safeio.place(tmp_path / "dest", failing)
    assert list(tmp_path.iterdir()) == []
    safeio.place(tmp_path / "dest", lambda tmp: tmp.write_bytes(b"whole"))
    assert (tmp_path / "dest").read_bytes() == b"whole" and len(list(tmp_path.iterdir())) == 1
    safeio.write_new(tmp_path / "k.key", b"secret", mode=0o600)
    assert (tmp_path / "k.key").stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        safeio.write_new(tmp_path / "k.key", b"other")
    assert (tmp_path / "k.key").read_bytes() == b"secret"


def test_a_log_is_never_appended_through_a_symlink(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    (tmp_path / "log.jsonl").symlink_to(victim)
    with pytest.raises(safeio.LinkRefused):
        safeio.append_line(tmp_path / "log.jsonl", json.dumps({"x": 1}))
    assert victim.read_text() == "mine\n"
    safeio.append_line(tmp_path / "real.jsonl", "a")
    safeio.append_line(tmp_path / "real.jsonl", "b")
    assert (tmp_path / "real.jsonl").read_text() == "a\nb\n"


def test_safeio_imports_only_the_standard_library():
    tree = ast.parse((PACKAGE / "utils" / "safeio.py").read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names - set(sys.stdlib_module_names) - {"__future__"} <= {"yaml", "tomli"}  # imported when parsing
