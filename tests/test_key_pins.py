"""Keys of every built-in recipe, pinned: a refactor must not change what a key is.

Each recipe under recipes/ that uses a built-in model is planned under every strategy and scope it allows;
every job's factors, with the environment (``env``: torch, diffusers, python versions) and the device
fingerprint (``device``) and the build host's thread count replaced by fixed values, are hashed, and the
hashes must equal the pins below. So every other factor (model, component config, compile settings, shape,
warmup, format) is held constant across commits.

The component configs come from the built-in models that the installed diffusers saves, so the pins hold for
the versions of .ci/constraints.txt, which CI installs (.ci/run, the README's test command). With other
versions installed the test skips, naming the constraints file; under CI (``CI=true``) it fails instead, so a
CI run never passes without checking keys, except in CI's newest job (``AOTBUILD_CI_JOB=newest``, set by
``.ci/run --newest``), where it skips naming each version that moved. A change that means to change keys (a
new factor, FORMAT_VERSION) regenerates them on purpose: ``python tests/test_key_pins.py`` prints the new
table. Regenerated for FORMAT_VERSION 4 (manifests record what each graph depends on: issue 31,
aotbuild/pipeline/dependencies.py); every built-in recipe's keys computed by that command (issue 30).
aot-compile's regenerated when it dropped its ``compile.cpu_threads`` factor: its artifacts serve any thread count
(issue 36). ``auto``'s added when it became the default (issue 36): its factor ``target.strategy`` is ``auto``
and its compile settings hold no strategy's own factor; every other pin unchanged.
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
        'df532807b47849258b5b0502202daa445f4b01a76d14e15ec6bcdc5e9b123786',
        'a90fcb4756cbf4f4da370502423514c4c3d8e9fe81ce1ec91286920032e0bd2f',
    ],
    'tiny_sd_cpu/jit-cache/regional': [
        '9a48395f19584d090f88d05c68d9cbbc561f9e2597774b856b84292aa21b66d0',
        '2128096b4026ea07453b2edb94e5a06f42eaedb900566c0eae1326a8f4819bfc',
    ],
    'tiny_sd_cpu/aot-package/full': [
        'b9e97f7e98bce029314c551558f49c2602b8b7e7da47ece584eb10e19320fddd',
        '30e44c86be045857ae51aa8fea0a2b8be0022368834c64ad230f74965cefd607',
    ],
    'tiny_sd_cpu/aot-package/regional': [
        'c621a4bfd55ba90a3010327f7df96e0e8203e0402f10f263c077a054a425df81',
        '4b63368da3a7a31c3cb5e774637919a8c43e6d99d5a6f70c62abcc817a53104b',
    ],
    'tiny_sd_cpu/aot-compile/full': [
        'a5318eed180467211556a732769271750f93e6356ccbf2d73b199803aeb099bf',
        '8932358720d106c2672b37fbd71c03ff52efa065edc2e492134481762c995b05',
    ],
    'tiny_sd_cpu/aot-compile/regional': [
        '42e685120122d8375c40d040749010fdc43148d30811fe735d2efc6c805dbfb3',
        'ba18b78b6556cf0cf8d895cfe2dd2638961ffa750941aeb1d37c3a3b696179f9',
    ],
    'tiny_sd_cpu/auto/full': [
        'de21d540a022d90a06df67f6fa5630726099657e4b2bc69c6d1a8f2b99ead588',
        'a67d42bc3a07b7356c76a56cad584b0724bef6c51b7d32e66f5487b1cdc7c37c',
    ],
    'tiny_sd_cpu/auto/regional': [
        '3204952dadceb08ca51a54a9d493f1d41bc0b02a9d82c4e41d0729e827423c5f',
        'b50a001e825acfac30fb4a84fcb1d61d7c8c7ab50ba6ae7ef139eaeca5d1871f',
    ],
    'tiny_sdxl_cpu/jit-cache/full': [
        '71cca74925625414a4b746d4f17c679ec2e84cfcaf8c89278a76069d624c6674',
    ],
    'tiny_sdxl_cpu/jit-cache/regional': [
        'd8694a2b7b619de9c5b071e80ef7e9dd0cab74f5bf74bb4e6ff41a46047b74de',
    ],
    'tiny_sdxl_cpu/aot-package/full': [
        '5c32dfcc40114931ca3918048000ca0043fa901a01acea4d3059fe572fecd06a',
    ],
    'tiny_sdxl_cpu/aot-package/regional': [
        '01ac484ab83159a856b93fe448a2c812c5e0ec1fac2305c06a0966ca9b2d9a1c',
    ],
    'tiny_sdxl_cpu/aot-compile/full': [
        '661a6244d619b0a1b5a73bf31edaf8617bd59d50e5bd94c0646140a4051c2a2a',
    ],
    'tiny_sdxl_cpu/aot-compile/regional': [
        '02704cd4d7f26f88b08c742c84fedd62d837e5b88447c2ef795b5376fdec383e',
    ],
    'tiny_sdxl_cpu/auto/full': [
        '290e55bea04ebe0cf3559fc05ae818cd5978535027507db98a25523d1f0f7884',
    ],
    'tiny_sdxl_cpu/auto/regional': [
        '5fab206bea1f073d56fa2584d43c7634544b7c362a7ec8208a5fe56542da3c54',
    ],
    'tiny_sd3_cpu/jit-cache/full': [
        'e0406de54910348333f9db776f56c495ae782cc5b8bd5225ad7a987f45f91385',
    ],
    'tiny_sd3_cpu/jit-cache/regional': [
        '419c1ed2397b0abd7841bf931ae0ef535ad4e744a83e6c59f66b271e519b696a',
    ],
    'tiny_sd3_cpu/aot-package/full': [
        'fdcf878406fcb7d8ba5903e28d07ca9be3a09dafbc345d2e17b922ea8e525f36',
    ],
    'tiny_sd3_cpu/aot-package/regional': [
        '5162b06fffaa9db203d536b0440c07981299014cc9135235e8ea98ff294503da',
    ],
    'tiny_sd3_cpu/aot-compile/full': [
        '4394a2c9ff01524339c555fa10d39b70cdb11c1b718d6aaa724a9351311612e3',
    ],
    'tiny_sd3_cpu/aot-compile/regional': [
        '77856d54ca7d2dfc0ec024d271ad35b06f4695edd1e8cd5233623c5543574e3f',
    ],
    'tiny_sd3_cpu/auto/full': [
        '927d3fb869a6727786d649d76825ea4f5e6d7647d1e24f321ffcbf7ae0602c0e',
    ],
    'tiny_sd3_cpu/auto/regional': [
        '6be190d310d298bd64486dddfb3fc1b51dd7765d0aa1778ad558eb616c8836ea',
    ],
    'tiny_flux_cpu/jit-cache/full': [
        'c4886d73b5222e6b57c3e245c82d06bf8a4132f6dfd4cd2d5a66100c964879e6',
    ],
    'tiny_flux_cpu/jit-cache/regional': [
        '35a99ffee77718b74c0292b621c963249c818971aefeb805e0758dcd611af306',
    ],
    'tiny_flux_cpu/aot-package/full': [
        'c08758c9135ae10f647c65a2451f9159f25d978612f76933600bdcb53ea7dd4c',
    ],
    'tiny_flux_cpu/aot-package/regional': [
        'a67741d4264f7bb9e3b6386bec04f445deab2a7e7ed44b9643c08f92fc03aa71',
    ],
    'tiny_flux_cpu/aot-compile/full': [
        '205b228be015c97bf704287748db29f000fee174ea69500d1b00a28d8aeaf13c',
    ],
    'tiny_flux_cpu/aot-compile/regional': [
        '6e68a85fc22a6b155da8739255fc54802886e570a52f235835d423ed77351850',
    ],
    'tiny_flux_cpu/auto/full': [
        '37826bab79480afd2b12abea4f7cc32536d5d47acffa5c787589dc8aa8dfe483',
    ],
    'tiny_flux_cpu/auto/regional': [
        '083ccc3fdc0c417eb726682329a25cfdd352aa27ae5210e937a307dcfe53c506',
    ],
    'tiny_pixart_cpu/jit-cache/full': [
        '6a2142a671c133be2493a3c0fd52fe72731744829bfe8d9fdb803e62d7bf024e',
    ],
    'tiny_pixart_cpu/jit-cache/regional': [
        'ecb546d3945c30243e60acb60610396c63362fa9c32e7df4991f2d747cff6801',
    ],
    'tiny_pixart_cpu/aot-package/full': [
        '2ba527fbcfcf39da447f3e0701e22ad7133725676a50397c8168742cb450e075',
    ],
    'tiny_pixart_cpu/aot-package/regional': [
        '0a7e0e9d12762c2b26baf28cee037ebafbe1578b8d23fd32550a46204fecfa43',
    ],
    'tiny_pixart_cpu/aot-compile/full': [
        '052cf6ffd4887efd9cb1c3106ea6229dfca006244bd2d705858b33063ce3f8b2',
    ],
    'tiny_pixart_cpu/aot-compile/regional': [
        '7eb558eb0b85cc04b7758a765c95dc0ffc9fbcfc44373b2e9371b585a82b1ce3',
    ],
    'tiny_pixart_cpu/auto/full': [
        '80e30205388caee13ec2a539c58edfee5cf14fc322b825abcfdde6b03f637a63',
    ],
    'tiny_pixart_cpu/auto/regional': [
        'e4d8d6a40287328546417dbfddd43caa7b5ceaf4cd33c76eec4dd62e60198b0d',
    ],
    'tiny_wan_cpu/jit-cache/full': [
        '9dcbc72b666e51f177696b2c1ea7ae015c162930b9fd982ae5ed7e351e486387',
    ],
    'tiny_wan_cpu/jit-cache/regional': [
        'e326f9618057dc89d900470b7f2f13d5332584913bd32401ab5111580f0606cc',
    ],
    'tiny_wan_cpu/aot-package/full': [
        '690c8802819703cf0272fee9c0fa963479d827d6e497f56e430c6fabe61b80ad',
    ],
    'tiny_wan_cpu/aot-package/regional': [
        '1eb61da30c713da92aa91efaebf7a6d5e18ea7d51d086a90b80314f1ce0c67ac',
    ],
    'tiny_wan_cpu/aot-compile/full': [
        '1835a2d038bf99d0a5670ac100920c010f07cd0413bd34e89baeca26af8d43dc',
    ],
    'tiny_wan_cpu/aot-compile/regional': [
        'f0927ded7483a149f8843589b200fe2891b5a051a0dd34229bcc43a5b2277de3',
    ],
    'tiny_wan_cpu/auto/full': [
        '84a3b836cb43fbc663f4452e12103225df5064fd911c6e3c0143a429cc48394a',
    ],
    'tiny_wan_cpu/auto/regional': [
        '98c6ca99c9e0f09ddd2e9b8fe98e364529362b6597416e32dc693ae4da49c75a',
    ],
    'tiny_wan22_cpu/jit-cache/full': [
        '13ce94bffdf16e2de207cfd515e5d8e19d7281f93ce1c76edca358aba8108905',
        'cf685ae2f415a6ba5004080144fa7a05f6d7da5d39353ecca76ec000ce4b1c69',
    ],
    'tiny_wan22_cpu/jit-cache/regional': [
        '5373c75330a320ac291710b9e0342a34c72590cba3945a8d6275a3e8d3cad4b6',
        '8c99edda32f759786296e74831d3e7b1784c3b136a3fc95605465cd8803ca034',
    ],
    'tiny_wan22_cpu/aot-package/full': [
        '5591e707cd44235d2066bbf538befcdfccf32900173e0d6e7d770ed047557848',
        '87df1948b1ecc9c76a034875bfa001fdeaced23dd9f7d70c32520b96de17c31e',
    ],
    'tiny_wan22_cpu/aot-package/regional': [
        '292bb107cddceca9fe8cf964d0d209ddc93ec818cb2a222d6860c27caf2226a2',
        '618e517670858dcf55f75fd44735428de6d9079a0aac390ebc179a47e05999b5',
    ],
    'tiny_wan22_cpu/aot-compile/full': [
        'e51d1c5fd135437dd3a1f58050ccf3c389d594aeae52da44dc6ee0a0e8e9d4c6',
        '7554cbdccf17fce3eb00b5bc35466da68b95c9f0f02f78fc46bac883f13796c7',
    ],
    'tiny_wan22_cpu/aot-compile/regional': [
        '5d53cb45898dce2e0186e660ec32cfa7a8d5938736d28e7307ba929373305cae',
        '494dd952775a99aa09ec79d94165d378e232116e7ad809c7c434b081f304a70e',
    ],
    'tiny_wan22_cpu/auto/full': [
        '291b75a322f4fdd64da25fa3baf57f44c40c7f953c3a0d5077f2002ab46e0673',
        'a5304bc734f0fdf83825f6d76617ae67c08b6cff6efe801b9f2ae592ae430bd9',
    ],
    'tiny_wan22_cpu/auto/regional': [
        '7830403ac727e1bf2d63d767e1b24ee04896a34366f78ebf69b4cb7f38c53c26',
        'cc0533df727df9fa4a230ca0beb546405fff54aeebbddf5c6fa675ec0c3147f9',
    ],
    'tiny_qwenimage_cpu/jit-cache/full': [
        'ae7d2ae7ff09adff4e154eb14f6996869b9b5789056b9e61685305416e902f46',
    ],
    'tiny_qwenimage_cpu/auto/full': [
        '475fe616bd11e2d30c0e167d24f7b7ca408c08c6d8df6ab4447e3e8db5f02c32',
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


def verdict(mismatches: list[str], environ) -> tuple[str, str] | None:
    """What the pin test does when the installed libraries are not the constraints': ("skip" | "fail",
    why), or None to check the pins."""
    if not mismatches:
        return None
    constraints = CONSTRAINTS.relative_to(REPO)
    if environ.get("AOTBUILD_CI_JOB") == "newest":  # .ci/run --newest: the versions moved on purpose
        return "skip", f"the newest job: moved from {constraints}: {', '.join(mismatches)}"
    why = (f"the key pins hold for the versions of {constraints}; installed: {', '.join(mismatches)} "
           f"(pip install -e '.[test]' -c {constraints})")
    if environ.get("CI", "").lower() == "true":
        return "fail", f"CI must check the key pins: {why}"
    return "skip", why


def test_only_the_pinned_ci_job_fails_on_moved_versions():
    moved = ["transformers 5.25.0 (constraints: 5.24.0)", "torchao 0.19.0 (constraints: 0.18.0)"]
    assert verdict([], {"CI": "true"}) is None and verdict([], {"AOTBUILD_CI_JOB": "newest"}) is None
    assert verdict(moved, {"CI": "true"})[0] == "fail"
    action, why = verdict(moved, {"CI": "true", "AOTBUILD_CI_JOB": "newest"})
    assert action == "skip" and "transformers 5.25.0" in why and "torchao 0.19.0" in why
    assert verdict(moved, {})[0] == "skip"
    ci = (REPO / ".ci" / "run").read_text()
    assert "AOTBUILD_CI_JOB=newest python -m pytest" in ci  # the newest job sets it; the pinned job does not
    assert ci.count("AOTBUILD_CI_JOB=newest") == ci.split("newest() {")[1].count("AOTBUILD_CI_JOB=newest")


def test_keys_of_builtin_recipes_are_pinned(builtins_cache):
    what = verdict(version_mismatches(), os.environ)
    if what:
        action, why = what
        (pytest.fail if action == "fail" else pytest.skip)(why)
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
