"""Keys of every built-in recipe, pinned: a refactor must not change what a key is.

Each recipe under recipes/ that uses a built-in model is planned under every strategy and scope it
allows; every job's factors, with the environment (``env``: torch, diffusers, python versions) and
the device fingerprint (``device``) and the build host's thread count replaced by fixed values, are
hashed, and the hashes must equal the pins below. So every other factor (model, component config,
compile settings, shape, warmup, format) is held constant across commits.

The component configs come from the built-in models that this diffusers version saves, so the pins
hold for the diffusers release they were written with (PINNED_WITH); another release skips the test.
A change that means to change keys (a new factor, FORMAT_VERSION) regenerates them on purpose:
``python tests/test_key_pins.py`` prints the new table.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXED_ENV = {"torch": "pinned", "torch_build": "pinned", "diffusers": "pinned", "transformers": "pinned",
             "python": "3.x"}
FIXED_DEVICE = {"device_kind": "cpu", "machine": "pinned", "cpu_isa": "pinned"}
PINNED_WITH = "0.42.1"

VARIANTS = [("jit-cache", "full"), ("jit-cache", "regional"), ("aot-package", "full"), ("aot-package", "regional"),
            ("aot-compile", "full"), ("aot-compile", "regional")]
RECIPES = ["tiny_sd_cpu", "tiny_sdxl_cpu", "tiny_sd3_cpu", "tiny_flux_cpu"]


def _pinned_key(factors: dict) -> str:
    from aotbuild.keys import key_of

    fixed = {**factors, "env": FIXED_ENV, "device": FIXED_DEVICE}
    if "cpu_threads" in fixed["compile"]:
        fixed["compile"] = {**fixed["compile"], "cpu_threads": 2}
    return key_of(fixed)


def compute(cache_root: Path) -> dict[str, list[str]]:
    import yaml

    from aotbuild import plan

    out: dict[str, list[str]] = {}
    for name in RECIPES:
        path = REPO / "recipes" / f"{name}.yaml"
        for strategy, scope in VARIANTS:
            data = yaml.safe_load(path.read_text())
            data["strategy"] = strategy
            data.setdefault("compile", {})["scope"] = scope
            if scope == "regional" and name == "tiny_sd3_cpu":
                data["compile"]["blocks"] = ["JointTransformerBlock"]
            jobs = plan([data], cache_root)
            assert all(j.key for j in jobs), [j.reason for j in jobs]
            out[f"{name}/{strategy}/{scope}"] = [_pinned_key(j.factors) for j in
                                                 sorted(jobs, key=lambda j: (j.component, str(j.shape)))]
    return out


PINS = {
    'tiny_sd_cpu/jit-cache/full': [
        'd25ecaef028017f4be291d9d83b297ed771e6bb316f395c5d02995c1176732f7',
        '586ee863c057fd183647cc48480d42f6d9f7e9e1153efc91afa96a239f5d0774',
    ],
    'tiny_sd_cpu/jit-cache/regional': [
        'b90bbe29d7c4bf986979b2febe18c5d35bc5ffce36e224240a28f47297d47c4c',
        'f051223b6f21eb8fc757411e9c0b28d3ff9a487f5c3a197bcf8504e13e487c7f',
    ],
    'tiny_sd_cpu/aot-package/full': [
        '1b2ccbf1b16d7c3759d21160476e1b0c9581021cfa0a4c30615373ff92694323',
        'f678e90a3c3017a058e399bd3172196b1c1a4ab0d646b760907d4a233075ac18',
    ],
    'tiny_sd_cpu/aot-package/regional': [
        '3c54ce1671a7241066a57351f617135593126393caf71ff5ca32ff44ac9697a0',
        'b213f66a373d0aac295007b58a0a528e3cdf01267b9725576a89cc0610fc4125',
    ],
    'tiny_sd_cpu/aot-compile/full': [
        'fde0ecbb5b2a2ceb8e2618dacc961c837be44c56bee59656f02e267b4f06d099',
        '60f0ac3ac742f27958c6e3fe37686dd07f0e2ce19bb42c841366e9a3b573062a',
    ],
    'tiny_sd_cpu/aot-compile/regional': [
        'd863d5cabd56a293f22fa93044d367b27bb7a707cb6149bcad091152a2b5e023',
        'fbb5dc7bbdb68abd01c66e9e55a1a8f4bcc06dcf436775a39dede4e6142da63c',
    ],
    'tiny_sdxl_cpu/jit-cache/full': [
        '5e584fce291f4ac7ad387cfa74e67aea64f9f11044dfead157601fe670dba401',
    ],
    'tiny_sdxl_cpu/jit-cache/regional': [
        '61b9bc59d556f6211b42653a175b7fc13693469ab438d813a7c5e8a96d58443a',
    ],
    'tiny_sdxl_cpu/aot-package/full': [
        '311069b9c7a7a4db6caf4dd53ac9f116307eeafdbcb57d52ab78e228b6729392',
    ],
    'tiny_sdxl_cpu/aot-package/regional': [
        '763828195887cb7c22d97ddca3e6a4c3befb99bf13739d4cfd0f32818e28e8ba',
    ],
    'tiny_sdxl_cpu/aot-compile/full': [
        '1dd28fe23058fb2770f8ec124240589a1b57575ee099bf47c3967aee3517992e',
    ],
    'tiny_sdxl_cpu/aot-compile/regional': [
        '3ae8052c8d27e0c7836a6f8aa48bba67fa1e0eb2a003535897e0e7cd0affd771',
    ],
    'tiny_sd3_cpu/jit-cache/full': [
        '332eb8731b3c5425c1ecfca8e3ba084209aa9aec98af2cf77d3c487cf76302d2',
    ],
    'tiny_sd3_cpu/jit-cache/regional': [
        '5b2b540020f7188e0e34fedd56315251712d5033934a9524657d7d624e161f29',
    ],
    'tiny_sd3_cpu/aot-package/full': [
        '18ffb915c3dc159ff0c67e382e30173026704812d9b1f3927e98126d9005754a',
    ],
    'tiny_sd3_cpu/aot-package/regional': [
        'bc854447501bd3cc76dd7e294a8f26b4aa7242448dc3cb9280a6dc0433270af7',
    ],
    'tiny_sd3_cpu/aot-compile/full': [
        '1679680d1ca9a1b5924b1c62d81bed25087eb1fa2fd9b45c8cd97a228b0dab6f',
    ],
    'tiny_sd3_cpu/aot-compile/regional': [
        '2b5bbd6d5894c4157e2d72bd818850cfe11334147e2d264e70004ba68afc17ff',
    ],
    'tiny_flux_cpu/jit-cache/full': [
        '1fe14f092a386b6ba668e39278c027c853fbaea85df9b29ba328d48b437809e6',
    ],
    'tiny_flux_cpu/jit-cache/regional': [
        'cb1ce4472b3410691471396a20b6bebf5a84f8543273d0afea982fc668571749',
    ],
    'tiny_flux_cpu/aot-package/full': [
        '5264d3e122398ae8d5417c6fffb3c26173a837b11033617247adb5af7feff325',
    ],
    'tiny_flux_cpu/aot-package/regional': [
        '11a1763fa9a99b7073319cb1d6a728ed9f4f99dd6fa0ddfeee4f1a258983f5ea',
    ],
    'tiny_flux_cpu/aot-compile/full': [
        '326e54cd90d8b3f5f6aee5e78ff225cb46bfe4dd3178a9ee1380c122eda715df',
    ],
    'tiny_flux_cpu/aot-compile/regional': [
        '48049bda3aa50d70e5bef4d4ab5ec8b84913bf840687a95ec13e7349c56e9d3b',
    ],
}


@pytest.fixture(scope="module")
def builtins_cache(tmp_path_factory) -> Path:
    from aotbuild import builtin

    root = tmp_path_factory.mktemp("pins")
    for name in builtin.BUILTINS:
        builtin.ensure(f"builtin:{name}", root / "models")
    return root


def test_keys_of_builtin_recipes_are_pinned(builtins_cache):
    from importlib.metadata import version

    if version("diffusers") != PINNED_WITH:
        pytest.skip(f"pins were written with diffusers {PINNED_WITH}; this is {version('diffusers')}")
    assert compute(builtins_cache) == PINS


if __name__ == "__main__":  # regenerate: python tests/test_key_pins.py
    import tempfile

    sys.path.insert(0, str(REPO))
    from aotbuild import builtin

    with tempfile.TemporaryDirectory() as tmp:
        for model in builtin.BUILTINS:
            builtin.ensure(f"builtin:{model}", Path(tmp) / "models")
        print("PINS = {")
        for label, keys in compute(Path(tmp)).items():
            print(f"    {label!r}: [\n" + "".join(f"        {k!r},\n" for k in keys) + "    ],")
        print("}")
