"""One rule for the Python API (issue 55, item 1): ``plan``, ``build``, ``push``, ``pull`` and ``sign``
take a recipe file or folder (str or os.PathLike), a dict, a Recipe, or a list or tuple of them (push
and sign: entry keys too), and a bare str is one item: ``aotbuild.push("recipes/x.yaml", remote)``
iterated the string and scanned the file system from ``/``. ``load_compiled`` takes one recipe and
refuses a folder or a list by name. All of it is ``recipe/rules.recipe_items`` (and ``as_recipe``)."""

from __future__ import annotations

import shutil

import pytest
import yaml

import aotbuild
from aotbuild import RecipeError, UsageError
from aotbuild.cache.signing import keygen
from tests.conftest import TINY_DICT


class Where:
    """An os.PathLike that is not a pathlib.Path (a library's own path type)."""

    def __init__(self, path):
        self.path = str(path)

    def __fspath__(self) -> str:
        return self.path


@pytest.fixture
def place(cache, tmp_path, fake_compiles):
    folder = tmp_path / "recipes"
    folder.mkdir()
    file = folder / "tiny.yaml"
    file.write_text(yaml.safe_dump(TINY_DICT))
    other = tmp_path / "other"
    shutil.copytree(cache / "models", other / "models")
    (tmp_path / "remote").mkdir()
    return {"file": file, "folder": folder, "cache": cache, "other": other, "remote": f"file://{tmp_path / 'remote'}",
            "key": keygen(tmp_path / "keys" / "ci")[0]}


def _forms(place) -> dict[str, object]:
    file = place["file"]
    return {"str": str(file), "PathLike": Where(file), "folder": str(place["folder"]),
            "folder PathLike": Where(place["folder"]), "dict": dict(TINY_DICT), "Recipe": aotbuild.load_recipe(file),
            "list": [str(file)], "tuple": (Where(file),)}


def test_each_function_takes_one_recipe_a_folder_or_a_list_of_them_in_every_form(place):
    cache, other, remote = place["cache"], place["other"], place["remote"]
    [key] = [j.key for j in aotbuild.plan(TINY_DICT, cache=cache)]
    for form, recipes in _forms(place).items():
        assert [j.key for j in aotbuild.plan(recipes, cache=cache)] == [key], form
        assert [r.job.key for r in aotbuild.build(recipes, cache=cache).results] == [key], form
        pushed = aotbuild.push(recipes, remote, cache=cache)
        assert pushed.result.sent + pushed.result.present == [key] and not pushed.skipped, form
        assert [(i.job.key, i.status in ("pulled", "cached")) for i in aotbuild.pull(recipes, remote, cache=other)] \
            == [(key, True)], form
        assert aotbuild.sign(recipes, place["key"], cache=cache) in ([key], []), form
    # push and sign take entry keys too: a bare key is one item, as is a list of one
    for keys in (key[:12], [key[:12]], (key,)):
        pushed = aotbuild.push(keys, remote, cache=cache)
        assert pushed.result.present == [key] and not pushed.skipped, keys
        assert aotbuild.sign(keys, place["key"], cache=cache) == [], keys  # signed above


def test_what_is_not_a_recipe_is_refused_naming_the_function(place):
    for call, name in ((lambda x: aotbuild.plan(x, cache=place["cache"]), "plan"),
                       (lambda x: aotbuild.build(x, cache=place["cache"]), "build"),
                       (lambda x: aotbuild.push(x, place["remote"], cache=place["cache"]), "push"),
                       (lambda x: aotbuild.pull(x, place["remote"], cache=place["cache"]), "pull"),
                       (lambda x: aotbuild.sign(x, place["key"], cache=place["cache"]), "sign")):
        for bad in (42, {str(place["file"])}, [[str(place["file"])]], iter([str(place["file"])]), b"recipes"):
            with pytest.raises(UsageError, match=rf"^{name}\(\) takes .*or a list or tuple of them; got "):
                call(bad)


def test_load_compiled_takes_one_recipe_and_refuses_a_folder_or_a_list_by_name(place, tmp_path):
    for many in ([str(place["file"])], (place["file"],)):
        with pytest.raises(UsageError, match=r"load_compiled\(\) takes one recipe .*not a (list|tuple)"):
            aotbuild.load_compiled(many, cache=place["cache"])
    for folder in (str(place["folder"]), Where(place["folder"])):
        with pytest.raises(UsageError, match=rf"load_compiled\(\) takes one recipe file, and {place['folder']} is a "
                                             r"folder: name one of its \.yaml files"):
            aotbuild.load_compiled(folder, cache=place["cache"])
    # an os.PathLike is read as the file it names (this model folder is missing: the recipe's own error)
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump({**TINY_DICT, "model": {"id": str(tmp_path / "nowhere")}}))
    with pytest.raises(RecipeError, match=rf"^{broken}: model\.id: no such folder"):
        aotbuild.load_compiled(Where(broken), cache=place["cache"])
