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
new table. Regenerated for FORMAT_VERSION 4 (manifests record what each graph depends on: issue 31,
aotbuild/pipeline/dependencies.py); every built-in recipe's keys computed by that command (issue 30).
aot-compile's regenerated when it dropped its ``compile.cpu_threads`` factor: its artifacts serve any
thread count (issue 36). ``auto``'s added when it became the default (issue 36): its factor
``target.strategy`` is ``auto`` and its compile settings hold no strategy's own factor; every other pin
unchanged. Regenerated for FORMAT_VERSION 5 (an AOT package's record names its constants and each prepacked
recipe the constant it makes: issue 53); nothing else changed.
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

pytestmark = pytest.mark.xdist_group("key-pins")  # one worker makes the built-in models this module shares

VARIANTS = [("jit-cache", "full"), ("jit-cache", "regional"), ("aot-package", "full"), ("aot-package", "regional"),
            ("aot-compile", "full"), ("aot-compile", "regional"), ("auto", "full"), ("auto", "regional")]
#: Every built-in recipe (test_every_built_in_recipe_is_pinned holds this list to recipes/tiny_*_cpu.yaml).
RECIPES = ["tiny_sd_cpu", "tiny_sdxl_cpu", "tiny_sd3_cpu", "tiny_flux_cpu", "tiny_pixart_cpu", "tiny_wan_cpu",
           "tiny_wan22_cpu", "tiny_qwenimage_cpu"]
#: Regional scope's block classes where the model declares no _repeated_blocks.
BLOCKS = {"tiny_sd3_cpu": ["JointTransformerBlock"], "tiny_pixart_cpu": ["BasicTransformerBlock"]}
#: The variants a recipe accepts, where not all: text_length is served by jit-cache (or auto, which takes
#: it) at full scope only, and the recipe refuses the others when it is read (issue 34).
ONLY = {"tiny_qwenimage_cpu": [("jit-cache", "full"), ("auto", "full")]}


def variants(name: str) -> list[tuple[str, str]]:
    return [v for v in VARIANTS if v in ONLY.get(name, VARIANTS)]


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
        for strategy, scope in variants(name):
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
        'd445b58436c088f546494c220521e374b3348d107acfd1de5572b92db49460c2',
        '4efbe3c0c45fdbb61770b7792714245717c7d4c6bed14c5c538337a631e5868f',
    ],
    'tiny_sd_cpu/jit-cache/regional': [
        'a1e840730ed1106e70a53ec523bb0ad7eb76eb78fbd90e629203f4449463d3c2',
        'e617035216e5df4264ebbb9ef0092bcd96774f85f08eb146ce15afc9cce50a36',
    ],
    'tiny_sd_cpu/aot-package/full': [
        'be516c340d29b3a31471bfe5c3eda64198567349a4ce14fd0d89622a53a8cb57',
        'bcb322808c9d461ada9a709ad69219dbc7f6f23de625994dbe70d4542c1bd0f8',
    ],
    'tiny_sd_cpu/aot-package/regional': [
        '95ec568aa4991e738a5495647e787cfa770dd3c21b332e736a7b0b678a9a5ec7',
        '2c975a096678808fb54c3fbd37c7702164fa83831452a02ba35d6bfb41d2fcc8',
    ],
    'tiny_sd_cpu/aot-compile/full': [
        '23595a05bf2a9b57ac13bc1fef9962133460b4bd8d2b79b5b1694f1e1536b3f9',
        'd1540ca0fee35800a133c54fe57d2ce9d9e52afb361b38f66047db8fb96c1c53',
    ],
    'tiny_sd_cpu/aot-compile/regional': [
        'e9ea297715b03478638c7fa3365110bc14607fc803b2ea678d95f112fdc3033b',
        '9fb7ad2b3f4a85d36db45fbf8fd5dd385db68e2692c18cd2598fb7682afd4635',
    ],
    'tiny_sd_cpu/auto/full': [
        'e997081fadf2bbf737bbd044604a34dc08f3202c6caab137af3462cc353b40e9',
        '06583bd32a417994a1a4df910833196648bf1bbe60789cc8184b22da8b71e351',
    ],
    'tiny_sd_cpu/auto/regional': [
        '79cabfcfa95741405ad1295184d6a438461077219fe734b17f734f1b6cf06825',
        'a109dc397ac9e82d57a1ca452acd62dfb1113a53b1e63d605be7699db9499bad',
    ],
    'tiny_sdxl_cpu/jit-cache/full': [
        'c7a5140a0d5b3f0c6963bb09b2997223bc706fd6f5a30f076a9ac968394f1d7d',
    ],
    'tiny_sdxl_cpu/jit-cache/regional': [
        '1a6f0d3865b7cef2befb2e4e203edbc3a6cd23aea1f22d3cde614e81b320329c',
    ],
    'tiny_sdxl_cpu/aot-package/full': [
        'a6f7a81452b6aea15f9677e58e9ccb4e90ee6b46beed41a140d461e229fe86c0',
    ],
    'tiny_sdxl_cpu/aot-package/regional': [
        '78480e13733693b8f8de56cac25337b2af92dd26087927a79fd50842b13d1024',
    ],
    'tiny_sdxl_cpu/aot-compile/full': [
        '6121e71d184ba0e8d22702dc00d952928adeab14f02024d6b279f7e385d87f86',
    ],
    'tiny_sdxl_cpu/aot-compile/regional': [
        '5a1d7431bf9c0c060fb3885e37709164395efd1188224a28bdc81f34180086db',
    ],
    'tiny_sdxl_cpu/auto/full': [
        '7638af7ac10b72a2939238753e73f53b3f23a97dcecae9c7b4226f8e4def8ec9',
    ],
    'tiny_sdxl_cpu/auto/regional': [
        '5b10a32b8146f390417529fa1fc5fb282157de9179723fe0dbe9759004de4220',
    ],
    'tiny_sd3_cpu/jit-cache/full': [
        '73e91bc47c6f08d4c25a19fadc631b740f5472d35f82f454a7ca9f0b7a219667',
    ],
    'tiny_sd3_cpu/jit-cache/regional': [
        'baf25d3fa44a66b159735d8e0bb17eda692c9923922b4bc6f52353a45d1ebd56',
    ],
    'tiny_sd3_cpu/aot-package/full': [
        '9c241ca14d0dbfd8b682e109b0ef80269798ac0a3a50cd3bd5a535dc9cfd490f',
    ],
    'tiny_sd3_cpu/aot-package/regional': [
        '39f9bdfe8e14724b1e094852318042435259170f8d62088d950153d49a8be8fa',
    ],
    'tiny_sd3_cpu/aot-compile/full': [
        'a2cf5765142af6d6a61647d0a9c48844c18dfedba30fdb9a636e9fd04ec12e2b',
    ],
    'tiny_sd3_cpu/aot-compile/regional': [
        'f59d36da735cc590244c391353165b0ecc4104cedbe473f2d38077b8ad418b65',
    ],
    'tiny_sd3_cpu/auto/full': [
        '2c866bef603866f19ce7dbbcd3298085a8a15a05d4ea8bedfa966e394acaa1ec',
    ],
    'tiny_sd3_cpu/auto/regional': [
        '8174dd293034ec8365b4d93d309289519cb37852cd2b8b235ddd48f020656bbe',
    ],
    'tiny_flux_cpu/jit-cache/full': [
        'ff3fe6df4c2e972d69335de6a3afe55802886d4d3affc3fbd5a94288cc62a1dd',
    ],
    'tiny_flux_cpu/jit-cache/regional': [
        '03e05cd89e92436ef079c8f150ea8679f7f45f0d5961ad298050e21829fc4062',
    ],
    'tiny_flux_cpu/aot-package/full': [
        'efddc0434ee938cb85bf8d67693f51fad277b27a5a3ad35171eb133c38ee8b62',
    ],
    'tiny_flux_cpu/aot-package/regional': [
        'b694264c84e1ac080dd89e75e89864b5e28f945592bd6f8ce09748b7d1426a62',
    ],
    'tiny_flux_cpu/aot-compile/full': [
        'da6a84e4526a13be3ff7cfe87c3bc37b80695169ca73dfcc321ac412266aa899',
    ],
    'tiny_flux_cpu/aot-compile/regional': [
        'c5e3c1adafe18d916bd6ab361317e81d152cf8121d1128904f3b060455beff27',
    ],
    'tiny_flux_cpu/auto/full': [
        '3e5188cd25e1bf9b3122bf0e1706f5ecd43cfc3ef36c70187797f188bc49ed1f',
    ],
    'tiny_flux_cpu/auto/regional': [
        'f2f83d76946bef974e3ecc2db0d223e2034e84ae0e34af0de011827ffcd705c5',
    ],
    'tiny_pixart_cpu/jit-cache/full': [
        'f40fd5d971848346f63e996c43167355b801e3549a46276b1a7b49437d0f1000',
    ],
    'tiny_pixart_cpu/jit-cache/regional': [
        '798576d7dc919c505621f7db92bdadabd7b57e9d0565cd1bd0f6a8db0a389054',
    ],
    'tiny_pixart_cpu/aot-package/full': [
        '592d1f52dee8bba46167318b8479f23455b16fc52a15bb92eeb14fe010ce491f',
    ],
    'tiny_pixart_cpu/aot-package/regional': [
        'f9f5ad2d28c8052c4dbd44086607a2b355714a7bc14f8de11d3bd28ebedc5583',
    ],
    'tiny_pixart_cpu/aot-compile/full': [
        'ec0a1871506bcecdf02f345b893f6f55d68f5413ac9bfbba4f65d7edf723121b',
    ],
    'tiny_pixart_cpu/aot-compile/regional': [
        '39daff4ff0045d96bb13b89e943b4b67448b87688aa698f652de8fbb356d5daf',
    ],
    'tiny_pixart_cpu/auto/full': [
        'da905344711a8cda0aebf268600e1adcd5f1e854003a6a3f9f3dcca5bcdfdbd5',
    ],
    'tiny_pixart_cpu/auto/regional': [
        'b140960cc6b1e3895889b0020cbb268af32cbf60a99537457c0844fe7dbb663e',
    ],
    'tiny_wan_cpu/jit-cache/full': [
        'a770e9922a4cc35d8e27bd3d1ce117b1c67671674d12a01fbb8e31f1b79cd6a0',
    ],
    'tiny_wan_cpu/jit-cache/regional': [
        '2033146e1afa9b620f5533acdbcd4ad5bc504acc7090a4a135a80629f02d5fc3',
    ],
    'tiny_wan_cpu/aot-package/full': [
        'ce6f937c5cb5288d281d3f685937b95772cc81eea06525543f1a72f8092bceaa',
    ],
    'tiny_wan_cpu/aot-package/regional': [
        '398bef6642ed8bd170bc2fb606846827830a0c0b840cceb01493f0273cea62d1',
    ],
    'tiny_wan_cpu/aot-compile/full': [
        'd2911d15b40c5db4831914499ad55fdce847f6d34e25803ca98b6c1e997b79ec',
    ],
    'tiny_wan_cpu/aot-compile/regional': [
        '56fbabef378735daba4f7e2b3c1b1fcecdb6733f808ffe91e54b7d68c71f62a1',
    ],
    'tiny_wan_cpu/auto/full': [
        '7c2a68c6f2cce9c1f5d6c674620e3d4e212c1e3d786d06c2e9f3c88a10f9fa47',
    ],
    'tiny_wan_cpu/auto/regional': [
        '4269ebdba3a77e929ebf382c266d96c5658701224e53bb05360d94beb65c185e',
    ],
    'tiny_wan22_cpu/jit-cache/full': [
        'f8e1adcf2f66503f3b9991bc0ba3b22048329a13da5017831613e76d6afae43e',
        '390ce3a0b6d44c7ee06cbf1ed9c439f7fd1d15eb66b33252a62c3e2b6d7d5a91',
    ],
    'tiny_wan22_cpu/jit-cache/regional': [
        '5955ee0dcdc17b7de9655f87bb4493fb0c26ac8a52a65c1685be8bf0d1fa5b9e',
        'fe11a091e9edfd6b2a02a534b66cc9394d87ad8687a9bf451a4ea30f1e784e33',
    ],
    'tiny_wan22_cpu/aot-package/full': [
        '976da6f6b617de3b8bbddcbae2c231b588362a4cb478f6d8a2f3fd0aebbfac2b',
        'dabf2d694f3358991942e449a1e902169253b77ffaf3fa6be10e2624a1f17fa9',
    ],
    'tiny_wan22_cpu/aot-package/regional': [
        'f68df4abdc0f3aa98263bc5a2aaad349f66996be34773d2b2de6dd09a398a011',
        '71ab79786a0221b2074f33edb798a5433a5f3ebc6f8b8a4f65783b1ed007fa93',
    ],
    'tiny_wan22_cpu/aot-compile/full': [
        'ca6ceac2d42ea025c11de778b198b82c173d14fe6d56767ae67e9a67a5ef8370',
        '6d768e7adfee1344967e1988bf8a21db11ff1828c821f21daee0621d952d4018',
    ],
    'tiny_wan22_cpu/aot-compile/regional': [
        'dcd857366daf17e268f6b158e46fa8ce6fba7b43d522193304ecac3642b9de1c',
        'bd0b55aeb743c5fa96c5e1f7bb89d4a7cf71af29c299ea9ee70a88d830848776',
    ],
    'tiny_wan22_cpu/auto/full': [
        '8f3e0e07a2b822878b72186b9c3b18265051449ef63c83823dba47de2ad4a860',
        '26d4f52875ac4b789e9a79065389778328653eb60d813d2f69d0720bca051b25',
    ],
    'tiny_wan22_cpu/auto/regional': [
        'db453f8c9562ddec0ae312dfe4a83093041baea50f5de8c7ebf8ccd3ccd9a8f4',
        '925e37e2d8b33f3b1b750fa10d063b598c64f2e93f827eb7f76b77a59f177cb4',
    ],
    'tiny_qwenimage_cpu/jit-cache/full': [
        'd47eb6da51a68a127bf3e6ceb9ec34f61af6c8ba2ef09e915221a08da565bf2e',
    ],
    'tiny_qwenimage_cpu/auto/full': [
        '58fa0cf3c0a38da648f67efb23b72942b8695cc542b996d93acd0706fe890584',
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
    assert sorted(PINS) == sorted(f"{name}/{s}/{scope}" for name in RECIPES for s, scope in variants(name))


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
