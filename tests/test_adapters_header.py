"""A LoRA file is a pull request's: every value aotbuild reads from its safetensors header is
type-checked before use, and a wrong one is refused in one line naming the file and the field (issue
32, item 5); so is an adapter path that cannot be a file name (a NUL, a newline, a name too long)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from aotbuild.errors import RecipeError, UsageError
from aotbuild.features import lora as adapters

TENSOR = {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 128]}
NAME = "unet.a.lora_A.weight"


def write(path: Path, header: dict, data: bytes = b"\0" * 128) -> Path:
    raw = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize("header,field,says", [
    ({NAME: TENSOR, "__metadata__": {"lora_adapter_metadata": 1}}, "__metadata__.'lora_adapter_metadata'",
     "expected text, got 1 (int)"),
    ({NAME: TENSOR, "__metadata__": ["format"]}, "'__metadata__'", "expected a mapping of text to text"),
    ({NAME: {**TENSOR, "dtype": 5}}, f"'{NAME}'.dtype", "got 5 (int)"),
    ({NAME: {**TENSOR, "dtype": "F32\n::error::x\x1b[31m"}}, f"'{NAME}'.dtype", "got 'F32\\n::error::x\\x1b[31m'"),
    ({NAME: {k: v for k, v in TENSOR.items() if k != "dtype"}}, f"'{NAME}'.dtype", "got None"),
    ({NAME: {**TENSOR, "shape": "48"}}, f"'{NAME}'.shape", "got '48' (str)"),
    ({NAME: {**TENSOR, "shape": [4.0, 8]}}, f"'{NAME}'.shape", "got [4.0, 8] (list)"),
    ({NAME: {**TENSOR, "shape": [True, 8]}}, f"'{NAME}'.shape", "got [True, 8] (list)"),
    ({NAME: {**TENSOR, "shape": [-4, 8]}}, f"'{NAME}'.shape", "got [-4, 8]"),
    ({NAME: {**TENSOR, "shape": [2 ** 70, 0]}}, f"'{NAME}'.shape", "a list of at most 8 sizes"),
    ({NAME: {**TENSOR, "shape": [1] * 9}}, f"'{NAME}'.shape", "a list of at most 8 sizes"),
    ({NAME: {**TENSOR, "data_offsets": "0,128"}}, f"'{NAME}'.data_offsets", "got '0,128' (str)"),
    ({NAME: {**TENSOR, "data_offsets": [0, 64, 128]}}, f"'{NAME}'.data_offsets", "got [0, 64, 128]"),
    ({NAME: {**TENSOR, "data_offsets": [64, 0]}}, f"'{NAME}'.data_offsets", "got [64, 0]"),
    ({NAME: {**TENSOR, "data_offsets": [0, 2 ** 64]}}, f"'{NAME}'.data_offsets", "begin <= end"),
    ({NAME: [4, 8]}, f"'{NAME}'", "expected a mapping with dtype, shape and data_offsets, got [4, 8] (list)"),
])
def test_a_header_value_of_the_wrong_type_is_refused_naming_the_file_and_field(tmp_path, header, field, says):
    path = write(tmp_path / "l.safetensors", header)
    with pytest.raises(UsageError) as info:
        adapters.read(path)
    message = str(info.value)
    assert message.startswith(f"{path}: safetensors header field {field}: expected "), message
    assert says in message and "\n" not in message and "\x1b" not in message, message


def test_a_module_path_that_is_no_torch_name_is_refused_before_it_becomes_a_key_factor(tmp_path):
    path = write(tmp_path / "l.safetensors", {"unet.a\x1b]0;x\x07 b.lora_A.weight": TENSOR})
    with pytest.raises(UsageError, match=r"tensor 'unet\.a\\x1b\]0;x\\x07 b\.lora_A\.weight': its module path is "
                                         r"not a torch module's name"):
        adapters.read(path)


def test_a_well_formed_header_with_metadata_is_read(tmp_path):
    header = {NAME: TENSOR, "unet.a.lora_B.weight": {"dtype": "BF16", "shape": [8, 4], "data_offsets": [128, 192]},
              "__metadata__": {"format": "pt", "lora_adapter_metadata": "{\"r\": 4}"}}
    found = adapters.read(write(tmp_path / "l.safetensors", header, b"\0" * 192))
    assert found.rank == 4 and found.modules == {"unet": {"a"}}


@pytest.fixture
def repo(tmp_path) -> Path:
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    return tmp_path


def _recipe(repo: Path, path: str, weight_name: str | None = None):
    from aotbuild.recipe.rules import parse_recipe

    adapter = {"path": path, "adapter_name": "a", **({"weight_name": weight_name} if weight_name else {})}
    return parse_recipe({"model": "builtin:tiny-sd", "shapes": [{"height": 64, "width": 64}],
                         "lora": {"rank": 4, "adapters": [adapter]}}, str(repo / "r.yaml"))


@pytest.mark.parametrize("path,weight_name,key,says", [
    ("x" * 300, None, "lora.adapters[0].path", "cannot be used as a path (File name too long)"),
    ("./" + "x" * 300 + ".safetensors", None, "lora.adapters[0].path", "cannot be used as a path"),
    ("org/lora\0x", None, "lora.adapters[0].path", "a path or Hub id holds no control characters"),
    ("org/lora\n::error::x", None, "lora.adapters[0].path", "a path or Hub id holds no control characters"),
    ("org/lora", "a\0.safetensors", "lora.adapters[0].weight_name", "adapters are .safetensors files"),
])
def test_an_adapter_path_that_cannot_be_a_file_is_a_recipe_error(repo, path, weight_name, key, says):
    recipe = _recipe(repo, path, weight_name)
    with pytest.raises(RecipeError) as info:
        adapters.resolve(recipe, recipe.lora.adapters[0])
    assert info.value.key == key and says in info.value.message, str(info.value)
    assert "\n" not in str(info.value) and "\0" not in str(info.value)


def test_plan_refuses_a_hostile_header_in_one_line(cache, tmp_path):
    from tests.conftest import invoke_cli

    repo = tmp_path / "repo"
    write(repo / "loras" / "l" / adapters.DEFAULT_WEIGHT_NAME, {NAME: TENSOR, "__metadata__": {"alpha": [1]}})
    (repo / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (repo / "r.yaml").write_text("model: {id: builtin:tiny-sd, dtype: float32}\nshapes: [{height: 64, width: 64}]\n"
                                 "lora: {rank: 8, adapters: [{path: loras/l, adapter_name: l}]}\n")
    proc = invoke_cli("plan", "--cache", str(cache), str(repo / "r.yaml"))
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and "safetensors header field __metadata__.'alpha': expected text, got [1]" \
        in proc.stderr, proc.stderr


def test_a_header_naming_more_target_modules_than_the_bound_is_refused_naming_the_file(tmp_path, monkeypatch):
    """Found in review: a header's module paths become target_modules, a key factor, bounded only by the
    header's 64 MiB: 300 distinct names (an 'all linear' adapter of a large model has tens)."""
    tensor = {"dtype": "F32", "shape": [1, 1]}
    header = {f"unet.m{i}.lora_A.weight": {**tensor, "data_offsets": [4 * i, 4 * i + 4]} for i in range(300)}
    path = write(tmp_path / "l.safetensors", header, b"\0" * 1200)
    with pytest.raises(UsageError) as info:
        adapters.read(path)
    assert str(info.value) == (f"{path}: component 'unet''s module paths: 300 target modules: at most 256 (raise it "
                               f"with AOTBUILD_MAX_LORA_TARGETS)"), str(info.value)
    monkeypatch.setenv("AOTBUILD_MAX_LORA_TARGETS", "300")
    assert len(adapters.read(path).targets("unet")) == 300  # the operator's choice


def test_a_recipes_lora_target_modules_are_bounded(repo, monkeypatch):
    from aotbuild.recipe.rules import parse_recipe

    data = {"model": "builtin:tiny-sd", "shapes": [{"height": 64, "width": 64}],
            "lora": {"rank": 4, "target_modules": [f"m{i}" for i in range(257)],
                     "adapters": [{"path": "org/lora", "adapter_name": "a"}]}}
    with pytest.raises(RecipeError) as info:
        parse_recipe(data, str(repo / "r.yaml"))
    assert info.value.key == "lora.target_modules" and info.value.message == \
        "257 target modules: at most 256 (raise it with AOTBUILD_MAX_LORA_TARGETS)", info.value
