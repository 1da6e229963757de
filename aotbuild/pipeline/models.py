"""Finding a recipe's model and loading its pipeline: Hub ids, local folders and built-ins alike.

Built-ins are created under ``<cache>/models/`` and then loaded from that folder, so every model
goes through the same ``from_pretrained`` call. Planning needs only ``model_index.json`` and each
component's ``config.json``; those are read as JSON, without importing diffusers.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aotbuild import builtin
from aotbuild.cache.layout import Layout
from aotbuild.errors import ModelUnavailable, ModelUnreachable, UsageError
from aotbuild.pipeline.blocks import describe_repeating
from aotbuild.recipe.schema import CompileSpec, Recipe
from aotbuild.utils import safeio
from aotbuild.utils.suggest import suggest
from aotbuild.utils.text import printable

__all__ = ["ModelUnavailable", "ResolvedModel", "resolve_model", "load_pipeline", "place_pipeline",
           "component_config", "module_config", "check_components", "check_blocks",
           "check_pipeline_components"]


@dataclass(frozen=True)
class ComponentSource:
    """A component loaded from elsewhere than the pipeline's model (``model.components``): a Hub repo or
    a local folder, the subfolder and revision there, and the diffusers class its ``config.json`` names."""

    name: str
    location: str  # a local folder (resolved), or a Hub id
    is_local: bool
    subfolder: str | None
    revision: str | None
    library: str
    class_name: str

    def config_path(self) -> str:
        return f"{self.subfolder}/config.json" if self.subfolder else "config.json"


@dataclass(frozen=True)
class ResolvedModel:
    location: str  # a local folder, or a Hub id
    is_local: bool
    model_index: dict[str, Any]
    builtin_version: int | None
    provenance: dict[str, Any]
    #: ``model.components``: each loaded from its own repository or folder, in place of (or besides) the model's
    sources: tuple[ComponentSource, ...] = ()

    @property
    def pipeline_class(self) -> str:
        return str(self.model_index.get("_class_name", "DiffusionPipeline"))

    def components(self) -> dict[str, tuple[str, str]]:
        """name -> (library, class) for every component in model_index.json (checked when it was read),
        and each of ``model.components`` (its own config's class)."""
        out = {}
        for name, value in self.model_index.items():
            if not name.startswith("_") and isinstance(value, list) and len(value) == 2 and value[1]:
                out[name] = (str(value[0]), str(value[1]))
        for source in self.sources:
            out[source.name] = (source.library, source.class_name)
        return out

    def source(self, name: str) -> ComponentSource | None:
        return next((s for s in self.sources if s.name == name), None)


#: The libraries a model_index.json may name for its components: importing any other module by a
#: name from a pull request's model folder runs that module (one such name started a GUI demo).
LIBRARIES = ("diffusers", "transformers")
#: A component's name is a folder of the model: a plain name, never a path.
COMPONENT_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
#: A model folder's JSON (model_index.json, config.json) is read with bounded work.
MAX_JSON_BYTES = 16 * 1024 * 1024
MAX_JSON_DEPTH = 64
#: Files a local model folder may hold before checking it stops (a bound on the walk).
MAX_FOLDER_ENTRIES = 100_000


def check_model_index(index: dict[str, Any], where: str) -> None:
    """Component names are plain names and their libraries diffusers or transformers: nothing else
    is ever imported by a name a model folder gives. ``_class_name`` (the pipeline class: a key factor)
    is a class name too."""
    pipeline = index.get("_class_name", "DiffusionPipeline")
    if not isinstance(pipeline, str) or not pipeline.isidentifier():
        raise ModelUnavailable(f"{printable(where)}: _class_name is {printable(repr(pipeline))[:80]}: expected a "
                               f"pipeline class name (e.g. StableDiffusionPipeline)")
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, list) or len(value) != 2 or not value[1]:
            continue
        shown = printable(name)[:80]
        if not COMPONENT_NAME.match(name):
            raise ModelUnavailable(f"{where} names a component {shown!r}: component names are plain names "
                                   f"(letters, digits, _), never paths")
        library, cls = value
        if library not in LIBRARIES or not isinstance(cls, str) or not cls.isidentifier():
            raise ModelUnavailable(f"{where}: component {shown} is {printable(str(library))[:60]}."
                                   f"{printable(str(cls))[:60]}; aotbuild loads components of "
                                   f"{' and '.join(LIBRARIES)} only")


def check_model_folder(folder: Path) -> None:
    """Every file of a local model folder is a regular file (or folder) whose real path stays inside it:
    a symlink to a file elsewhere (git keeps symlinks) would be read as the model's config or weights."""
    root = folder.resolve()
    seen = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            seen += 1
            if seen > MAX_FOLDER_ENTRIES:
                raise ModelUnavailable(f"{folder} holds more than {MAX_FOLDER_ENTRIES} files: not a model folder")
            path = Path(dirpath) / name
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                target = path.resolve()
                if not target.is_relative_to(root) or not (target.is_file() or target.is_dir()):
                    raise ModelUnavailable(f"{folder}: {printable(path.relative_to(root))} links outside the model "
                                           f"folder (or to no file): a model folder is data inside its folder")
            elif not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
                raise ModelUnavailable(f"{folder}: {printable(path.relative_to(root))} is not a regular file")


def _local_folder(recipe: Recipe) -> Path | None:
    """``model.id`` as a local folder: a relative path is looked up next to the recipe first (a
    recipe and its model move together), then in the current directory; None if neither exists."""
    path = Path(recipe.model.id).expanduser()
    candidates = [path] if path.is_absolute() else [recipe.base / path, path]
    try:
        return next((c for c in candidates if c.is_dir()), None)
    except OSError:  # a name too long for a path (a 300-character id): no folder, maybe not a Hub id either
        return None


def resolve_model(recipe: Recipe, cache_root: Path, *, reading: bool = False) -> ResolvedModel:
    """:func:`_resolve_model`, with each of ``model.components`` found and its config's class read
    (:func:`resolve_sources`); a pipeline saved for a build (``recipe.pipeline_folder``) holds them."""
    from dataclasses import replace

    model = _resolve_model(recipe, cache_root, reading=reading)
    if recipe.model.components is None or recipe.pipeline_folder:
        return model
    sources = resolve_sources(recipe)
    provenance = {**model.provenance, "components": {s.name: s.location if not s.is_local else str(
        recipe.model.components[s.name]["id"]) for s in sources}}
    return replace(model, sources=sources, provenance=provenance)


def resolve_sources(recipe: Recipe) -> tuple[ComponentSource, ...]:
    """Each of ``model.components``: a folder (absolute, or relative to the recipe's folder only: a build
    job runs in another working directory; every file inside it, :func:`check_model_folder`) or a Hub
    repo (its id checked first), and the class its ``config.json`` names: a diffusers model class only
    (``_class_name``; a transformers model there is refused: not supported yet). Errors name the key."""
    from aotbuild.pipeline.hub import repo_id_problem

    out = []
    for name, spec in (recipe.model.components or {}).items():
        key = f"model.components.{name}"
        ident, sub, revision = str(spec["id"]), spec.get("subfolder"), spec.get("revision")
        config_name = ComponentSource(name, ident, False, sub, revision, "", "").config_path()
        try:  # relative to the recipe's folder only: a build job runs in another working directory
            path = Path(ident).expanduser()
            folder = path if path.is_absolute() else recipe.base / path
            folder = folder if folder.is_dir() else None
        except (OSError, RuntimeError):  # a name too long for a path; ~user of no user
            folder = None
        if folder is not None:
            check_model_folder(folder)
            root = folder.resolve()
            try:
                config = _read_json(root / config_name, inside=root)
            except ModelUnavailable as exc:
                raise recipe.error(key, f"{ident}: {exc}") from None
            if revision:
                raise recipe.error(f"{key}.revision", f"{ident} is a local folder: it has no revisions")
            location, local = str(root), True
        else:
            if ident.startswith((".", "/", "~")):
                raise recipe.error(f"{key}.id", f"no such folder: {ident}")
            why = repo_id_problem(ident)
            if why:
                raise recipe.error(f"{key}.id", f"{ident[:100]!r}: no such folder, and {why}")
            config = _read_json(hub_file(ident, config_name, revision))
            location, local = ident, False
        class_name = config.get("_class_name")
        if not isinstance(class_name, str) or not class_name.isidentifier():
            shown = "a transformers model" if "architectures" in config else \
                f"_class_name {printable(repr(class_name))[:80]}"
            raise recipe.error(key, f"{ident}: its config.json names {shown}: model.components takes diffusers models "
                                    f"(a ControlNet, a UNet, a transformer, a VAE) only, for now")
        if not _diffusers_model(class_name):
            raise recipe.error(key, f"{ident}: {class_name} (its config.json's _class_name) is no model class of "
                                    f"this diffusers")
        out.append(ComponentSource(name, location, local, sub, revision, "diffusers", class_name))
    return tuple(out)


def _diffusers_model(class_name: str) -> bool:
    """Whether diffusers has a model class (a ``ModelMixin``) of that name (imports diffusers)."""
    import diffusers

    try:
        klass = getattr(diffusers, class_name, None)
    except Exception:  # noqa: BLE001 - a lazy module that fails to import
        return False
    return isinstance(klass, type) and issubclass(klass, diffusers.ModelMixin)


def _resolve_model(recipe: Recipe, cache_root: Path, *, reading: bool = False) -> ResolvedModel:
    """Where the recipe's model is, and its ``model_index.json``. ``reading`` (plan, a load until it has
    succeeded): a built-in model the cache lacks is made outside it (builtin.scratch), never in it:
    a command that only reads writes nothing under the cache (issue 55); :func:`store_builtin` puts it
    there once a load has succeeded."""
    spec = recipe.model
    if recipe.pipeline_folder:  # aotbuild.build(recipe, pipe=pipe): the caller's pipeline, saved for the jobs
        folder = Path(recipe.pipeline_folder)
        check_model_folder(folder)
        data = _read_json(folder / "model_index.json", inside=folder)
        check_model_index(data, str(folder / "model_index.json"))
        return ResolvedModel(str(folder.resolve()), True, data, None, {"id": spec.id, "from_pipe": True})
    if builtin.is_builtin(spec.id):
        model = builtin.lookup(spec.id)
        folder = builtin.folder_of(spec.id, Layout(cache_root).models, create=not reading)
        return ResolvedModel(str(folder), True, _read_json(folder / "model_index.json"), model.version,
                             {"id": spec.id, "builtin_version": model.version})
    folder = _local_folder(recipe)
    if folder is not None:
        index = folder / "model_index.json"
        if not index.is_file():
            raise recipe.error("model.id", f"{spec.id} is a folder without model_index.json (not a diffusers pipeline)")
        check_model_folder(folder)
        data = _read_json(index, inside=folder)
        check_model_index(data, str(index))
        return ResolvedModel(str(folder.resolve()), True, data, None, {"id": spec.id, "local": True})
    if spec.id.startswith((".", "/", "~")):
        if Path(spec.id).expanduser().is_absolute():
            raise recipe.error("model.id", f"no such folder: {spec.id}")
        tried = [(recipe.base / spec.id).resolve(), Path(spec.id).expanduser().resolve()]
        looked = " and ".join(map(str, dict.fromkeys(tried)))
        raise recipe.error("model.id", f"no such folder: {spec.id} (looked for {looked})")
    from aotbuild.pipeline.hub import repo_id_problem

    why = repo_id_problem(spec.id)
    if why:  # neither a folder nor a Hub id: the recipe's fault (exit 2), not the Hub's (issue 53)
        raise recipe.error("model.id", f"{spec.id[:100]!r}: no such folder, and {why}")
    path = hub_file(spec.id, "model_index.json", spec.revision)
    data = _read_json(path)
    check_model_index(data, f"{spec.id}'s model_index.json")
    return ResolvedModel(spec.id, False, data, None, {"id": spec.id, "revision": spec.revision})


def store_builtin(recipe: Recipe, cache_root: Path) -> None:
    """The recipe's built-in model into the cache, where it lacks it (a copy of the one a read made
    outside it, builtin.scratch): what a build and a load that succeeded leave there. Nothing for
    another model."""
    if builtin.is_builtin(recipe.model.id) and not recipe.pipeline_folder:
        builtin.ensure(recipe.model.id, Layout(cache_root).models)


def hub_file(repo_id: str, filename: str, revision: str | None) -> Path:
    """``filename`` of Hub repo ``repo_id``, fetched (or from the local Hugging Face cache). A malformed
    id is a UsageError (exit 2): callers that know the recipe check it first (hub.repo_id_problem) to
    name the key."""
    from aotbuild.pipeline import hub

    why = hub.repo_id_problem(repo_id)
    if why:
        raise UsageError(f"{printable(repo_id[:100])!r}: {why}")
    down = "" if hub.offline_mode() else hub.unreachable()
    try:
        from huggingface_hub import hf_hub_download

        # Unreachable: the local Hugging Face cache may still have it; asked without the network.
        # The endpoint probed above, read now (huggingface_hub reads HF_ENDPOINT once, at its import).
        return Path(hf_hub_download(repo_id, filename, revision=revision, local_files_only=bool(down),
                                    endpoint=hub.endpoint()))
    except Exception as exc:  # offline, gated, missing: one line says which (hub.fetch_problem)
        if down:
            raise ModelUnreachable(f"cannot fetch {filename} of {repo_id}: {down}, and the local Hugging "
                                   f"Face cache does not have it; pre-download it (hf download) or point model.id at "
                                   f"a local folder") from None
        raise ModelUnreachable(f"cannot fetch {filename} of {repo_id}: {hub.fetch_problem(exc)}") from None


def _read_json(path: Path, inside: Path | None = None) -> dict[str, Any]:
    """A JSON object from a regular file of at most MAX_JSON_BYTES, opened without blocking, nested at
    most MAX_JSON_DEPTH deep (counted before parsing), without NaN or Infinity; with ``inside``, the
    file's real path must stay in that folder (aotbuild.utils.safeio reads it)."""
    path = Path(path)
    try:
        data = safeio.read_json(path, max_bytes=MAX_JSON_BYTES, max_depth=MAX_JSON_DEPTH, within=inside)
    except safeio.LinkRefused:
        raise ModelUnavailable(f"{path} is outside its model folder {inside} (a symlink?): refused") from None
    except (safeio.NotRegularFile, safeio.FileTooLarge):
        raise ModelUnavailable(f"{path} is not a regular file of at most {MAX_JSON_BYTES} bytes") from None
    except safeio.TooDeep:
        raise ModelUnavailable(f"{path} is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except (OSError, ValueError) as exc:
        raise ModelUnavailable(f"cannot read {path}: {printable(str(exc))[:200]}") from None
    if not isinstance(data, dict):
        raise ModelUnavailable(f"{path} is not a JSON object")
    return data


#: Config keys that record where or with what a config was written, not what the module computes.
_NON_ARCHITECTURE_KEYS = {"transformers_version", "torch_dtype", "dtype", "architectures", "output_attentions",
                          "output_hidden_states", "return_dict", "use_cache"}


def architecture_config(config: dict[str, Any]) -> dict[str, Any]:
    """A component config reduced to what defines its architecture (no paths, no versions)."""
    clean = {k: v for k, v in config.items() if not k.startswith("_") and k not in _NON_ARCHITECTURE_KEYS}
    return json.loads(json.dumps(clean, sort_keys=True, default=str))


def check_components(recipe: Recipe, model: ResolvedModel) -> None:
    """Unknown components, and regional scope on a component that has no ``_repeated_blocks`` when the
    recipe names no ``compile.blocks`` (those are checked by :func:`check_blocks`)."""
    known = model.components()
    modules = [n for n, (_, cls) in known.items() if _is_module_class(cls)]
    for name in recipe.compile.components:
        if name not in known:
            hint = suggest(name, list(known))
            if recipe.compile.components == CompileSpec.components and modules:
                # The default ([unet]) names SD/SDXL's denoiser; transformer models (SD3, Flux) have none.
                denoiser = next((n for n in modules if "transformer" in n or "unet" in n), modules[0])
                hint = (f"; compile.components defaults to [{name}], which this model lacks: name what to compile, "
                        f"e.g. compile.components: [{denoiser}]")
            raise recipe.error("compile.components", f"{name!r} is not a component of {recipe.model.id}"
                                                     f"{hint} (components: {', '.join(known)})")
        if name not in modules:
            raise recipe.error("compile.components", f"{name!r} ({known[name][1]}) is not a torch module: there is "
                                                     f"nothing to compile (compilable: {', '.join(modules)})")
        if recipe.compile.scope == "regional" and recipe.compile.blocks is None:
            library, class_name = known[name]
            blocks = _repeated_blocks(library, class_name)
            if not blocks:
                module = _meta_component(model, name, recipe.model.revision)
                repeating = f" ({describe_repeating(module)})" if module is not None else ""
                raise recipe.error("compile.scope", f"regional scope needs a component with _repeated_blocks; "
                                                    f"{name} ({class_name}) has none: name its block classes in "
                                                    f"compile.blocks{repeating}, or use scope: full")


def _check_source_names(recipe: Recipe, model: ResolvedModel, pipeline_class: str, modules: set[str]) -> None:
    """Each of ``model.components`` is one of ``pipeline_class``'s components (``modules``: its ``__init__``
    arguments that are components): its name becomes a keyword of the pipeline's ``from_pretrained``, so
    any other (``trust_remote_code``, ``dtype``, ``custom_pipeline``) would set that instead."""
    for source in model.sources:
        if source.name not in modules:
            raise recipe.error("model.components", f"{source.name!r} is not a component of {pipeline_class} "
                                                   f"(its components: {', '.join(sorted(modules))})"
                                                   f"{suggest(source.name, sorted(modules))}")


def check_pipeline_components(recipe: Recipe, model: ResolvedModel, pipeline_class: str) -> None:
    """The components ``pipeline_class`` cannot be made without, against those the model's
    ``model_index.json`` names (diffusers' own rule in ``from_pretrained``: each ``__init__`` argument
    without a default that is not one of its ``_optional_components``), ``model.components`` counting.
    ``StableDiffusionControlNetPipeline`` on an SD 1.5 repository, whose ControlNet lives in another, is
    refused here, before any load, naming what is missing and the ways that serve it: ``model.components``,
    or the caller's pipeline object, ``aotbuild.build(recipe, pipe=pipe)`` (before: every strategy auto
    tried loaded the pipeline and failed with diffusers' "expected [...], but only {...} were passed")."""
    import inspect

    import diffusers

    try:
        cls = getattr(diffusers, pipeline_class, None)
        parameters = inspect.signature(cls.__init__).parameters if isinstance(cls, type) else {}
    except Exception:  # noqa: BLE001 - a lazy module that fails to import, no signature: the load will say
        return
    optional = set(getattr(cls, "_optional_components", None) or ())
    required = [n for n, p in parameters.items() if n != "self" and p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n not in optional]
    _check_source_names(recipe, model, pipeline_class, {*required, *optional})
    # a component (diffusers drops a null one: a required one then fails) or a config value
    named = {k for k, v in model.model_index.items()
             if not k.startswith("_") and not (isinstance(v, list) and (len(v) != 2 or v[1] is None))}
    named |= {s.name for s in model.sources}
    missing = [n for n in required if n not in named]
    if missing:
        named = {k for k in named if isinstance(model.model_index.get(k), list)}
        key = "model.pipeline" if recipe.model.pipeline else "model.id"
        own = model.pipeline_class
        hint = f"; the model's own class is {printable(own)[:80]}" if own != pipeline_class else ""
        names = ", ".join(sorted(named)) or "no component"
        first = missing[0]
        raise recipe.error(key, f"{pipeline_class} needs {', '.join(missing)}, which {recipe.model.id} does not have "
                                f"(its model_index.json names {names}{hint}): name where it comes from in "
                                f"model.components ({{{first}: HUB_ID_OR_FOLDER}}), or build for your pipeline "
                                f"object, aotbuild.build(recipe, pipe=pipe), and serve it with load_compiled(recipe, "
                                f"pipe=pipe) "
                                f"(docs/recipes.md, \"A component from another repository\")")


def check_blocks(recipe: Recipe, model: ResolvedModel) -> None:
    """``compile.blocks`` against each component, without loading weights: the component is built
    from its config on the meta device. Where that cannot be done here (a class this environment
    cannot import or build), nothing is checked: each build job checks the loaded module."""
    if recipe.compile.scope != "regional" or recipe.compile.blocks is None:
        return
    from aotbuild.pipeline.blocks import block_problem

    for name in recipe.compile.components:
        module = _meta_component(model, name, recipe.model.revision)
        if module is None:
            continue
        key, why = block_problem(module, recipe.compile.blocks)
        if why:
            raise recipe.error(key, f"{name}: {why}")


def _meta_component(model: ResolvedModel, name: str, revision: str | None) -> Any:
    """Component ``name`` built from its ``config.json`` on the meta device (no weights), or None.
    The config's sizes are bounded first (:func:`check_config_sizes`): a pull request's model folder
    decides how big a model plan builds."""
    from aotbuild.pipeline.blocks import meta_module

    library, class_name = model.components()[name]
    try:
        config = _component_json(model, name, revision)
    except ModelUnavailable:
        return None
    source = model.source(name)
    where = f"{model.location}/{name}/config.json" if source is None else f"{source.location}/{source.config_path()}"
    check_config_sizes(config, where)
    return _counted(lambda: meta_module(library, class_name, config), where)


#: Submodules a component built at plan time may register, per layer ``AOTBUILD_MAX_MODEL_LAYERS``
#: allows (Flux-dev, SDXL's UNet, HunyuanVideo and Wan 14B register 1,100 to 2,000 in all).
MODULES_PER_LAYER = 64


def _counted(build: Callable[[], Any], where: str) -> Any:
    """``build()`` stopped once it has registered more submodules than ``MODULES_PER_LAYER`` x
    ``AOTBUILD_MAX_MODEL_LAYERS``: each key of a config is bounded on its own, but they multiply (1,024
    ``down_block_types`` x ``layers_per_block: 1024`` is a million blocks), so the build is counted."""
    import torch

    from aotbuild.constants import LIMITS, limit

    most = MODULES_PER_LAYER * limit("model_layers")
    count = 0

    def hook(module: Any, name: str, submodule: Any) -> None:
        nonlocal count
        count += 1
        if count > most:
            raise ModelUnavailable("too many modules")  # meta_module gives up on any error

    handle = torch.nn.modules.module.register_module_module_registration_hook(hook)
    try:
        built = build()
    finally:
        handle.remove()
    if count > most:
        raise ModelUnavailable(f"{printable(where)}: builds more than {most} modules ({MODULES_PER_LAYER} per layer "
                               f"the layers bound allows: its sizes multiply; raise it with "
                               f"{LIMITS['model_layers'][0]})")
    return built


#: config.json keys that count layers or blocks (num_layers, layers_per_block, num_hidden_layers,
#: transformer_layers_per_block, num_single_layers, depth, n_layer, num_res_blocks); block_out_channels
#: and the like are sizes.
_LAYER_KEY = re.compile(r"layers|(^|_)layer$|(^|_)depth$|^num_\w*blocks$", re.IGNORECASE)
#: Integers of a config.json that are no size: ids, rope bases, seeds.
_NOT_A_SIZE = re.compile(r"(_id|_ids|theta|seed)$", re.IGNORECASE)


def check_config_sizes(config: Any, where: str) -> None:
    """Every size in a component's config (nested sections and lists included) within the bounds of a
    model built at plan time, before anything is built, even on the meta device: layer counts at most
    ``AOTBUILD_MAX_MODEL_LAYERS``, any other integer at most ``AOTBUILD_MAX_MODEL_WIDTH``; a
    ModelUnavailable naming the file and the key otherwise (issue 32: a config asking for 10,000
    layers or a 10**6-wide layer). Walks at most the JSON's depth, bounded when it was read."""
    from aotbuild.constants import LIMITS, limit

    most = {bound: limit(bound) for bound in ("model_layers", "model_width")}

    def refuse(path: str, value: int, bound: str, what: str) -> ModelUnavailable:
        return ModelUnavailable(f"{printable(where)}: {printable(path)[:120]} is {value}, over the {what} a "
                                f"component built at plan time may ask for (at most {most[bound]}; raise it with "
                                f"{LIMITS[bound][0]})")

    def visit(path: str, name: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                visit(f"{path}.{k}" if path else str(k), str(k), v)
        elif isinstance(value, list):  # one block per item of down_block_types, block_out_channels, ...
            if len(value) > most["model_layers"]:
                raise refuse(f"{path} (items)", len(value), "model_layers", "layers")
            for i, v in enumerate(value):
                visit(f"{path}[{i}]", name, v)
        elif isinstance(value, int) and not isinstance(value, bool) and not _NOT_A_SIZE.search(name):
            bound = "model_layers" if _LAYER_KEY.search(name) else "model_width"
            if value > most[bound]:
                raise refuse(path, value, bound, "layers" if bound == "model_layers" else "size")

    visit("", "", config)


def _is_module_class(class_name: str) -> bool:
    """Schedulers, tokenizers and image processors are pipeline components but not modules; told by
    their class names (diffusers and transformers name them so) to avoid importing either library."""
    return not (class_name.endswith("Scheduler") or any(w in class_name for w in ("Tokenizer", "Processor",
                                                                                    "FeatureExtractor")))


def _repeated_blocks(library: str, class_name: str) -> tuple[str, ...]:
    import importlib

    if library not in LIBRARIES:  # never import a module a model folder names (check_model_index)
        return ()
    try:
        cls = getattr(importlib.import_module(library), class_name)
    except (ImportError, AttributeError):
        return ()
    return tuple(getattr(cls, "_repeated_blocks", None) or ())


def component_config(model: ResolvedModel, name: str, revision: str | None) -> tuple[str, dict[str, Any]]:
    """(class name, architecture config) of one component, from its ``config.json``."""
    _, class_name = model.components()[name]
    return class_name, architecture_config(_component_json(model, name, revision))


def scheduler_config(model: ResolvedModel, revision: str | None) -> dict[str, Any] | None:
    """The model's ``scheduler/scheduler_config.json`` (None: it has no scheduler): what a recipe's
    ``schedulers`` are made from at plan time (aotbuild/pipeline/schedulers.py ``check_model``)."""
    if "scheduler" not in model.components():
        return None
    if model.is_local:
        return _read_json(Path(model.location) / "scheduler" / "scheduler_config.json", inside=Path(model.location))
    return _read_json(hub_file(model.location, "scheduler/scheduler_config.json", revision))


def _component_json(model: ResolvedModel, name: str, revision: str | None) -> dict[str, Any]:
    """A component's ``config.json``: in a local folder, a plain name's file inside the folder only."""
    if not COMPONENT_NAME.match(name):
        raise ModelUnavailable(f"{printable(name)[:80]!r} is not a component name")
    source = model.source(name)
    if source is not None:  # model.components: its own repository or folder
        if source.is_local:
            return _read_json(Path(source.location) / source.config_path(), inside=Path(source.location))
        return _read_json(hub_file(source.location, source.config_path(), source.revision))
    if model.is_local:
        return _read_json(Path(model.location) / name / "config.json", inside=Path(model.location))
    return _read_json(hub_file(model.location, f"{name}/config.json", revision))


def load_pipeline(recipe: Recipe, model: ResolvedModel, dtype: str, *, quiet: bool = False) -> Any:
    """``from_pretrained`` with the recipe's dtype, variant, revision and pipeline class, then the
    recipe's ``changes`` (aotbuild/pipeline/changes.py): every build job, proof and load of it gets them."""
    import diffusers
    import torch

    cls_name = recipe.model.pipeline or model.pipeline_class
    cls = getattr(diffusers, cls_name, None)
    if cls is None:
        raise recipe.error("model.pipeline", f"diffusers has no pipeline class {cls_name!r}")
    # diffusers renamed torch_dtype to dtype (the old name warns); use whichever this version has.
    try:
        from diffusers.utils.deprecation_utils import _resolve_dtype  # noqa: F401

        dtype_arg = "dtype"
    except ImportError:
        dtype_arg = "torch_dtype"
    kwargs: dict[str, Any] = {dtype_arg: getattr(torch, dtype)}
    if recipe.model.variant:
        kwargs["variant"] = recipe.model.variant
    if recipe.model.revision and not model.is_local:
        kwargs["revision"] = recipe.model.revision
    if model.sources:  # a name is a keyword of from_pretrained: only the pipeline's components (plan checked it too)
        # the class from_pretrained makes (an AutoPipeline* class makes the model's own, as plan reads it)
        check_pipeline_components(recipe, model, model.pipeline_class if cls_name.startswith("AutoPipeline")
                                  else cls_name)
    components: dict[str, Any] = {}
    for source in model.sources:  # model.components: each by its class's from_pretrained, handed to the pipeline's
        import importlib

        component_class = getattr(importlib.import_module(source.library), source.class_name)
        own: dict[str, Any] = {dtype_arg: kwargs[dtype_arg]}
        if source.subfolder:
            own["subfolder"] = source.subfolder
        if source.revision and not source.is_local:
            own["revision"] = source.revision
        components[source.name] = component_class.from_pretrained(source.location, **own)
    pipe = cls.from_pretrained(model.location, **components, **kwargs)
    if recipe.changes is not None:  # FreeU, a processor, a cache hook, a memory format: as the recipe declares
        from aotbuild.pipeline import changes

        changes.apply(pipe, recipe)
    if quiet and hasattr(pipe, "set_progress_bar_config"):  # build jobs and benchmarks; a user's pipe keeps its bar
        pipe.set_progress_bar_config(disable=True)
    return pipe


def module_config(module: Any) -> tuple[str, dict[str, Any]]:
    """(class name, architecture config) of a loaded component; equals :func:`component_config`.

    transformers writes ``config.json`` with ``to_diff_dict()``; diffusers' config is the dict itself.
    """
    config = module.config
    raw = config.to_diff_dict() if hasattr(config, "to_diff_dict") else dict(config)
    return type(module).__name__, architecture_config(raw)


def place_pipeline(pipe: Any, recipe: Recipe, device: str) -> None:
    """Move the pipeline to its device, or hand it to model CPU offload when the recipe asks."""
    if recipe.offload == "model":
        pipe.enable_model_cpu_offload(device=device)
    else:
        pipe.to(device)
