"""Keys of every built-in recipe, pinned: a refactor must not change what a key is.

Each recipe under recipes/ that uses a built-in model is planned under every strategy and scope it
allows; every job's factors, with the environment (``env``: torch, diffusers, python versions) and
the device fingerprint (``device``) and the build host's thread count replaced by fixed values, are
hashed, and the hashes must equal the pins below. So every other factor (model, component config,
compile settings, shape, warmup, format) is held constant across commits.

The component configs come from the built-in models that the installed diffusers saves, so the pins
hold for the versions of .ci/constraints.txt, which CI installs (.ci/run, the README's test command).
With other versions installed the test skips, naming the constraints file; under CI (``CI=true``) it
fails instead, so a CI run never passes without checking keys. A change that means to change keys (a
new factor, FORMAT_VERSION) regenerates them on purpose: ``python tests/test_key_pins.py`` prints the
new table. Regenerated for FORMAT_VERSION 3 (manifests record the component's structure); the three
video and PixArt recipes were added with their keys computed by that command (issue 30).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXED_ENV = {"torch": "pinned", "torch_build": "pinned", "diffusers": "pinned", "transformers": "pinned",
             "python": "3.x"}
FIXED_DEVICE = {"device_kind": "cpu", "machine": "pinned", "cpu_isa": "pinned"}
CONSTRAINTS = REPO / ".ci" / "constraints.txt"

VARIANTS = [("jit-cache", "full"), ("jit-cache", "regional"), ("aot-package", "full"), ("aot-package", "regional"),
            ("aot-compile", "full"), ("aot-compile", "regional")]
#: Every built-in recipe (test_every_built_in_recipe_is_pinned holds this list to recipes/tiny_*_cpu.yaml).
RECIPES = ["tiny_sd_cpu", "tiny_sdxl_cpu", "tiny_sd3_cpu", "tiny_flux_cpu", "tiny_pixart_cpu", "tiny_wan_cpu",
           "tiny_wan22_cpu"]
#: Regional scope's block classes where the model declares no _repeated_blocks.
BLOCKS = {"tiny_sd3_cpu": ["JointTransformerBlock"], "tiny_pixart_cpu": ["BasicTransformerBlock"]}


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
            if scope == "regional" and name in BLOCKS:
                data["compile"]["blocks"] = BLOCKS[name]
            jobs = plan([data], cache_root)
            assert all(j.key for j in jobs), [j.reason for j in jobs]
            out[f"{name}/{strategy}/{scope}"] = [_pinned_key(j.factors) for j in
                                                 sorted(jobs, key=lambda j: (j.component, str(j.shape)))]
    return out


PINS = {
    'tiny_sd_cpu/jit-cache/full': [
        '8a20dd73c68a23dbc1c4b8a46512edf71744c701fb5eed6d5d592c90ae797d3f',
        '05374ddc1f9cd50b5b3036f06bbb9fae90c409f15ae490d39f6a3477878efd92',
    ],
    'tiny_sd_cpu/jit-cache/regional': [
        'a2bf465463439ef3c3a7672b977736bf109aec4795f3f8aaf0b5f7ef6c55ec9c',
        'e55adc26c85eda95698c0c57d0e89dccb911a6f87989cb57a3cae29a501ee9bb',
    ],
    'tiny_sd_cpu/aot-package/full': [
        '9f2c99a68b47ed59f7ca0ce9cf1a74b0691ec5fa4bb0d17c517384b01d7bdb1f',
        '7ce647f7c69337ec51d0960e6f52de1c079686882580804b0f6f23e06e1055c6',
    ],
    'tiny_sd_cpu/aot-package/regional': [
        'ba71a1de3e69d1d753505c5058ebd2134c1770d6baa0c9f6bd1f9473e6334bd4',
        '8da240ae826f6f1538a30d63febb4c3c94107204fa0201b984bad765023b9ef9',
    ],
    'tiny_sd_cpu/aot-compile/full': [
        '732239a4e543abdb1a0e01c606c6675156ee46837fe656a2b5205ad0613cb31c',
        '6b0c8838a51b346517305c1f34808e03b0beb65536fefe13a46ca72db189f029',
    ],
    'tiny_sd_cpu/aot-compile/regional': [
        '0962396c70707e20ca48b99b142ebce09b53227483c2587c617b8c1ca82b977e',
        'd0007bc1f56d06c6d0a3a28f2d9ae111b4d7b461a5f2c33fcc35f4ed193f49a5',
    ],
    'tiny_sdxl_cpu/jit-cache/full': [
        '327abe35a4d0079314ca0ff2f82294f35c2b4f0244dbd8e78aa69c9aad416d6d',
    ],
    'tiny_sdxl_cpu/jit-cache/regional': [
        'bc4aca9c7b69e35a0413bf4ff7320ecbc69ac9bccb603e12906bb39a6a8ef796',
    ],
    'tiny_sdxl_cpu/aot-package/full': [
        '9a96cbb909a35b33445ef059737793d5d6373bd26f00471fcaede14904498365',
    ],
    'tiny_sdxl_cpu/aot-package/regional': [
        '2147735479a35ced98252e0cbf2bb71552614af5d4a2e34b4cbe53ea09ee6eca',
    ],
    'tiny_sdxl_cpu/aot-compile/full': [
        '887b915ee75ffee1b9d103e61d02a6d6de2c3b7c36a184111bf6da23a0ed9664',
    ],
    'tiny_sdxl_cpu/aot-compile/regional': [
        '30ac8bbeaadd4cdbcec4c223d9c1dabc31e4732934165b975fc8df65a333a8f5',
    ],
    'tiny_sd3_cpu/jit-cache/full': [
        '36c892139f87444e41d1799333c5056f8bcba9f4582b283d99c13df938249150',
    ],
    'tiny_sd3_cpu/jit-cache/regional': [
        '793c10ec58cb5f687a83811ea2d74c2f38d7d5504002716152a77f19393e90a0',
    ],
    'tiny_sd3_cpu/aot-package/full': [
        '7bfa2178625a80e5a7e218f9414686f78d22f3b3934691cef12ecff988b5534f',
    ],
    'tiny_sd3_cpu/aot-package/regional': [
        '40fefb478fe019e7e4d52b32561368a4cca6ebb083767d0374044e2a9f65e8c1',
    ],
    'tiny_sd3_cpu/aot-compile/full': [
        'eea21ddb3ab199b29ab03000196a3da4c0d0456da1567f0b94a172e6238a9600',
    ],
    'tiny_sd3_cpu/aot-compile/regional': [
        '3fd6c2bc5f9f20116816c0f62c98502b1396facb56b20ababe58e74703534be6',
    ],
    'tiny_flux_cpu/jit-cache/full': [
        '6d455b8949417b9d0c306c80054d3cff49df2fe163cdca12732fa43fcf4e2247',
    ],
    'tiny_flux_cpu/jit-cache/regional': [
        '7579cddcd7daa7ddc4f29a9f52d18ef3dbe567b3aa0187bb337a9a7228e3b2a8',
    ],
    'tiny_flux_cpu/aot-package/full': [
        'c2f64b224a01dcc7c446d0d9cc9136861212e889561a1afceeabcc9ceed2ecdd',
    ],
    'tiny_flux_cpu/aot-package/regional': [
        '38ec94b3fd5bdbc36e28068f01c7f5df8d148da924c3efaca8188c56a3e403b8',
    ],
    'tiny_flux_cpu/aot-compile/full': [
        '246f58c35a48245799941184bf51e3437123d77920ddea5122a1d43d7b073a22',
    ],
    'tiny_flux_cpu/aot-compile/regional': [
        '402aa80dd2f6e96102ba259a2166125249dc7ea0a38208c9017eb939f47ed0fb',
    ],
    'tiny_pixart_cpu/jit-cache/full': [
        '5387e504b0ccce469b4b22c1a8391a15fe72d39f2005f4f932b9fd0c92894b30',
    ],
    'tiny_pixart_cpu/jit-cache/regional': [
        '2cb365929aa16c4c4745fac5f9fb883dff2354bb4fda77f41daf4d4419840b07',
    ],
    'tiny_pixart_cpu/aot-package/full': [
        'eb17f0ebc464e4260c8a21fc6c48d44de1cc67b9ab4d007e0a4674bafc087871',
    ],
    'tiny_pixart_cpu/aot-package/regional': [
        '9cb38061d595abc5f89141625157ebacf330c9359f744b01bc4797e364e04317',
    ],
    'tiny_pixart_cpu/aot-compile/full': [
        'd476d1a56427ec8644f77a3d11476a6786f908f9cb87dcb328df42646d58c9c0',
    ],
    'tiny_pixart_cpu/aot-compile/regional': [
        '529c81c45a922c8ca7a37cd5e1d9739924bb8535e4602f32c42c9f7ad473c228',
    ],
    'tiny_wan_cpu/jit-cache/full': [
        '62fbe100b64616055a01c3d95cdb9929f43c242969293dcc2405abd648b883cb',
    ],
    'tiny_wan_cpu/jit-cache/regional': [
        '3cd9df7c04ab6f3074bd49cfbe08eab09c0303656544af204c8422dd10196389',
    ],
    'tiny_wan_cpu/aot-package/full': [
        '1df3582963b622b1953cc89c2e5cca3d0334caa9903fa110503cbc4939fd04cb',
    ],
    'tiny_wan_cpu/aot-package/regional': [
        'ec767306bb0fdb5010b6d2fae86730b988b993b589af17e90b67023627d726d4',
    ],
    'tiny_wan_cpu/aot-compile/full': [
        '2713843b3c5380f792e91ad9a242729df1f063feff740d17ddd4d254245ded8d',
    ],
    'tiny_wan_cpu/aot-compile/regional': [
        '66618236e63bd94d5f1e279dd2f6609d7a43fd98c2d92f5ffc2f8e81cdbd0c42',
    ],
    'tiny_wan22_cpu/jit-cache/full': [
        'a588d7d4d89ba66f989e63f518ce30fff172dab31400b7ca806d31c4ac496256',
        'b93904cdc1d59c32fb66d61fcebbbeb6c1ece0f9d78f5442d5a06d87aa8f77ff',
    ],
    'tiny_wan22_cpu/jit-cache/regional': [
        '01060413f862e3aa3d4cb3ea15394ef78dd3898987aa32781b9e956abab648db',
        'd55190df8247aa68b8aa01afdf504dea4de69a7435ab6d6b4c5b44136ec35197',
    ],
    'tiny_wan22_cpu/aot-package/full': [
        'ec9baa708596aebe5fa9c1b006a61aa98fa3d620fe7325ae9ac7272ebeed3466',
        '2b79313d129c4015141466825166ee76559d18296c04365852c8aa6e72a07cff',
    ],
    'tiny_wan22_cpu/aot-package/regional': [
        'd5ccf113d847a94196e04c301d3524106bb9af8b9c38195f4d80829f61501638',
        '6ad2feb64b79c374ffb7c64c87b53aae3fb87045963668d1e155330ec2777905',
    ],
    'tiny_wan22_cpu/aot-compile/full': [
        '772281be6528c3e4316225f4112e39c4ab886aec794f4a5a15669aab6172051a',
        'bd85afdeff3b5b2dc0e61b4c028918a4d707f0c94fd72eb27b2275d8c2f12238',
    ],
    'tiny_wan22_cpu/aot-compile/regional': [
        'c4eed7365544211bc517d1c60dc0dca383ade3eb0f27b578dad4ba5806c0f0de',
        '83a5296eebefc320aa13a841223d82fb4108555b690c3abf461a70f941b96b43',
    ],
}


@pytest.fixture(scope="module")
def builtins_cache(tmp_path_factory) -> Path:
    from aotbuild import builtin

    root = tmp_path_factory.mktemp("pins")
    for name in builtin.BUILTINS:
        builtin.ensure(f"builtin:{name}", root / "models")
    return root


def constrained_versions() -> dict[str, str]:
    """``name==version`` lines of .ci/constraints.txt, names as pip normalizes them."""
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[re.sub(r"[-_.]+", "-", name.strip().lower())] = version.strip()
    return pins


def version_mismatches() -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name, wanted in constrained_versions().items():
        try:
            here = version(name)
        except PackageNotFoundError:
            here = "not installed"
        if here != wanted:
            out.append(f"{name} {here} (constraints: {wanted})")
    return out


def test_the_constraints_pin_the_key_pins_libraries():
    assert set(constrained_versions()) == {"diffusers", "transformers", "peft", "torchao", "huggingface-hub"}
    assert all(re.fullmatch(r"[0-9][0-9A-Za-z.+]*", v) for v in constrained_versions().values())


def test_every_built_in_recipe_is_pinned():
    assert sorted(RECIPES) == sorted(p.stem for p in (REPO / "recipes").glob("tiny_*_cpu.yaml"))
    assert sorted(PINS) == sorted(f"{name}/{s}/{scope}" for name in RECIPES for s, scope in VARIANTS)


def test_keys_of_builtin_recipes_are_pinned(builtins_cache):
    mismatches = version_mismatches()
    if mismatches:
        why = (f"the key pins hold for the versions of {CONSTRAINTS.relative_to(REPO)}; installed: "
               f"{', '.join(mismatches)} (pip install -e '.[test]' -c {CONSTRAINTS.relative_to(REPO)})")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI must check the key pins: {why}")
        pytest.skip(why)
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
